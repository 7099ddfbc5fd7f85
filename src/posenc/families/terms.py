"""Places 4 and 5 families: a query term ``q_i . r`` of an offset (1-D) or a factorised 2-D one.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim,
``B'`` the batch of the positions (1 when shared, else ``b``), ``S`` any shape of offsets,
``R`` rows of a table, ``H x W`` a map.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .. import _validate as check
from ..diagonals import pad_rows
from ..engine import tuning
from ..indices import (
    gather_logits,
    is_whole_map,
    relative_distance,
    run_offsets,
    score_mod_positions,
    skew_rows,
)
from .common import (
    Primitive,
    check_cells,
    check_heads,
    check_queries,
    hook_positions,
    offset_span,
    table_of,
)

__all__ = [
    "GridTerm",
    "OffsetTerm",
    "offset_term_literal",
    "offset_term_logits",
    "relative_query_term_2d",
    "table_logits",
]


def table_logits(q: Tensor, table: Tensor) -> Tensor:
    """``q @ table^T`` for a shared ``[R, d]`` or per-head ``[h, R, d]`` table.

    Args:
        q: ``[b, h, ..., d]`` (extra dims between ``h`` and ``d`` allowed, e.g. 2-D maps).
        table: ``[R, d]`` or ``[h, R, d]``.

    Returns:
        ``[b, h, ..., R]`` in ``q``'s dtype.

    Raises:
        ValueError: a per-head table for another number of heads.
    """
    table_t = table.to(q.dtype).transpose(-2, -1)  # [d, R] or [h, d, R]
    if table.ndim == 3:
        if table.shape[0] != q.shape[1]:
            raise ValueError(
                f"the per-head table has {table.shape[0]} heads but q has {q.shape[1]} heads "
                f"(q shape {tuple(q.shape)}); build the scheme with heads={q.shape[1]}"
            )
        extra = (1,) * (q.ndim - 4)  # the dims between h and the last two of q
        table_t = table_t.reshape(table.shape[0], *extra, *table_t.shape[-2:])  # [h, 1.., d, R]
    return q @ table_t  # [b, h, ..., R]


def offset_term_literal(q: Tensor, rows: Primitive, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``q_i . rows(k_pos_j - q_pos_i)`` with the rows of every pair, ``[n_q, n_k, d]``.

    The readable form of :meth:`OffsetTerm.score_term` (memory ``O(n_q n_k d)``), taken
    when the offsets cannot be bounded (inside ``torch.compile``, no ``reach``).

    Args:
        q: ``[b, h, n_q, d]``.
        rows: the primitive, offsets ``[*S]`` to ``[*S, d]`` or ``[h, *S, d]``.
        q_pos: ``[B', n_q]`` int64 positions.
        k_pos: ``[B', n_k]`` int64 positions.

    Returns:
        ``[b, h, n_q, n_k]``.
    """
    pairs = rows(relative_distance(q_pos, k_pos)).to(q.dtype)  # [(h,) B', n_q, n_k, d]
    if pairs.ndim == 5:
        pairs = pairs.transpose(0, 1)  # [h, B', n_q, n_k, d] -> [B', h, n_q, n_k, d]
    else:
        pairs = pairs.unsqueeze(1)  # [B', n_q, n_k, d] -> [B', 1, n_q, n_k, d]
    logits = q.unsqueeze(-2) @ pairs.transpose(-2, -1)  # [b, h, n_q, 1, d] @ [.., d, n_k]
    return logits.squeeze(-2)  # [b, h, n_q, 1, n_k] -> [b, h, n_q, n_k]


def offset_term_logits(
    q: Tensor, rows: Primitive, q_pos: Tensor, k_pos: Tensor, reach: int | None = None
) -> Tensor:
    """``q_i . rows(k_pos_j - q_pos_i)`` for any positions, never an ``[n_q, n_k, d]`` tensor.

    A run of consecutive positions: ``q @ rows(offsets)^T`` for its ``n_q + n_k - 1``
    offsets, then the skew (a view; Huang et al. 2018). Other positions: ``q @ table^T``
    over the offsets they meet (:func:`offset_span`), gathered per pair. Either table is
    padded with zero rows to a multiple of :data:`~posenc.engine.tuning.GEMM_COLUMNS` for
    the product where that adds at most an eighth (:func:`~posenc.diagonals.padded_count`:
    CPU GEMMs run an odd count of output columns slowly); the skew and the gather read
    only the offsets' columns. Inside
    ``torch.compile`` with no ``reach``: :func:`offset_term_literal`.

    Args:
        q: ``[b, h, n_q, d]``.
        rows: offsets ``[*S]`` to ``[*S, d]`` (shared) or ``[h, *S, d]`` (per head).
        q_pos: ``[B', n_q]`` int64 positions.
        k_pos: ``[B', n_k]`` int64 positions.
        reach: offsets beyond ``+-reach`` share the rows of ``+-reach``; None: no bound.

    Returns:
        ``[b, h, n_q, n_k]``.
    """
    n_q, n_k = q_pos.shape[-1], k_pos.shape[-1]
    offsets = run_offsets(q_pos, k_pos)
    if offsets is not None and (reach is None or n_q + n_k - 1 <= 2 * reach + 1):
        # consecutive positions: the rows of the offsets met, then the skew (a view)
        table = pad_rows(rows(offsets), tuning.GEMM_COLUMNS)  # [(h,) W', d], W' >= W
        return skew_rows(table_logits(q, table), n_k)  # [b, h, n_q, W'] -> [b, h, n_q, n_k]
    span = offset_span(q_pos, k_pos, reach)
    if span is None and check._can_inspect(q_pos) and check._can_inspect(k_pos):
        span = offset_span(q_pos.cpu(), k_pos.cpu(), reach)  # no bound: read the offsets
    if span is None:  # inside torch.compile, no reach: the rows of every pair
        return offset_term_literal(q, rows, q_pos, k_pos)
    low, high = span
    table = pad_rows(table_of(rows, low, high, q.device), tuning.GEMM_COLUMNS)  # [(h,) R', d]
    index = relative_distance(q_pos, k_pos).clamp(low, high) - low  # [B', n_q, n_k] in [0, R)
    return gather_logits(table_logits(q, table), index)


def relative_query_term_2d(
    q: Tensor,
    height: Tensor,
    width: Tensor,
    size: tuple[int, int],
    q_pos: Tensor,
    k_pos: Tensor,
) -> Tensor:
    """``q_i . (height[r_j - r_i + H - 1] + width[c_j - c_i + W - 1])`` for flat token indices.

    A token index ``p`` is the cell ``(r, c) = (p // W, p % W)`` of a row-major ``H x W``
    map. Each axis is gathered on its own: ``q @ height^T`` by the row offset plus
    ``q @ width^T`` by the column offset (SASA, Ramachandran et al. 2019; BoTNet,
    Srinivas et al. 2021).

    Args:
        q: ``[b, h, n_q, d]``.
        height: ``[2H-1, d]`` or ``[h, 2H-1, d]``.
        width: ``[2W-1, d]`` or ``[h, 2W-1, d]``.
        size: ``(H, W)``.
        q_pos: ``[B', n_q]`` int64 token indices in ``[0, H*W)``.
        k_pos: ``[B', n_k]`` int64 token indices in ``[0, H*W)``.

    Returns:
        ``[b, h, n_q, n_k]``.
    """
    rows, cols = size
    dr = relative_distance(q_pos // cols, k_pos // cols) + (rows - 1)  # [B', n_q, n_k]
    dc = relative_distance(q_pos % cols, k_pos % cols) + (cols - 1)  # [B', n_q, n_k]
    return gather_logits(table_logits(q, height), dr) + gather_logits(table_logits(q, width), dc)


# ----- the families ----------------------------------------------------------------------------


class _QueryTerm(nn.Module):
    """What both term families share: the query check and ``validate_attention``."""

    head_dim: int

    def check_queries(self, q: object) -> Tensor:
        """``q`` must be ``[b, h, n, head_dim]`` float (a subclass adds its own checks)."""
        return check_queries(q, self.head_dim)

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention with another head dim, or (per-head rows) number of heads."""
        if head_dim != self.head_dim:
            raise ValueError(
                f"{type(self).__name__} was built for head_dim={self.head_dim} but the "
                f"attention has head_dim={head_dim} (dim / heads); build it with "
                f"head_dim={head_dim}"
            )
        check_heads(self, heads)


class OffsetTerm(_QueryTerm):
    """A content-dependent term of the offset: ``s_ij += q_i . r(k_pos_j - q_pos_i)``.

    The family of relative embeddings dotted with the query (Shaw et al. 2018's key term,
    Huang et al. 2018's Music Transformer, Dai et al. 2019's Transformer-XL term). A
    subclass sets ``head_dim`` and writes :meth:`rows`; this base derives
    :meth:`score_term` (for any positions: the skew of ``q @ rows^T`` for a run, else
    ``q @ table^T`` over the offsets met, gathered per pair) and :meth:`offset_term` (the
    rows of a run, which the lean engine multiplies and skews block by block). Inside
    attention the term is scaled by ``1/sqrt(d)`` together with ``q k^T``.
    """

    #: offsets beyond ``+-reach`` share the rows of ``+-reach`` (None: no such bound)
    reach: int | None = None

    def rows(self, offsets: Tensor) -> Tensor:
        """The primitive: the embedding ``r`` of each offset.

        Args:
            offsets: integer ``[*S]``, key position minus query position.

        Returns:
            ``[*S, d]`` shared by the heads, or ``[h, *S, d]`` per head.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must define rows(offsets) -> [*offsets.shape, head_dim] "
            f"(or [heads, *offsets.shape, head_dim]), the embedding of each offset"
        )

    def check_positions(self, q_pos: Tensor, k_pos: Tensor) -> None:
        """Raise ``ValueError`` for positions the scheme has no rows for (default: none)."""

    def offset_form(
        self, rows: Primitive, q_pos: Tensor, k_pos: Tensor
    ) -> Tensor | tuple[Tensor, Tensor] | None:
        """The per-offset form of a run of positions for any per-offset embedding ``rows``
        (:meth:`rows`, or another table indexed like it, such as Shaw's ``a^V``).

        Returns:
            ``[(h,) n_q + n_k - 1, d]``, row ``m`` for offset ``k_pos[0, 0] - q_pos[0, -1]
            + m``; or, with a ``reach`` that leaves fewer rows than offsets, ``(table
            [(h,) 2 reach + 1, d], index [n_q + n_k - 1])`` with ``table[..., index, :]``
            those rows (the engine then skips the repeated ones); None for other positions.

        Raises:
            ValueError: positions :meth:`check_positions` rejects.
        """
        offsets = run_offsets(q_pos, k_pos)
        if offsets is None:
            return None
        self.check_positions(q_pos, k_pos)
        reach = self.reach
        if reach is not None and 2 * reach + 1 < offsets.numel():
            table = table_of(rows, -reach, reach, offsets.device)  # [(h,) 2 reach + 1, d]
            return table, offsets.clamp(-reach, reach) + reach
        return rows(offsets)  # [(h,) W, d]

    def offset_term(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | tuple[Tensor, Tensor] | None:
        """The rows the term uses when the positions are one consecutive run, so that
        ``score_term(q) == skew_rows(q @ rows^T, n_k)`` (see :meth:`offset_form`)."""
        return self.offset_form(self.rows, q_pos, k_pos)

    def flex_term_mod(
        self, q: Tensor, q_pos: Tensor | None, k_pos: Tensor | None, scale: float
    ) -> Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor] | None:
        """``score + scale * q_i . rows(k_pos_j - q_pos_i)`` as a FlexAttention ``score_mod``,
        for a term with a ``reach``: the logits ``q @ rows^T`` over the ``2 reach + 1``
        offsets, ``[b, h, n_q, 2 reach + 1]``, read per pair (no ``[n_q, n_k]`` term). On
        CUDA, FlexAttention differentiates the logits, so ``q`` and the table get their
        gradients. With both positions known (and readable: not while compiling) only the
        offsets they meet are tabulated, ``n_q + n_k - 1`` at most.

        Args:
            q: ``[b, h, n_q, d]`` the queries the attention uses.
            q_pos: ``[n_q]``, ``[1, n_q]`` or ``[b, n_q]`` positions, or None (the token
                indices).
            k_pos: ``[n_k]``, ``[1, n_k]`` or ``[b, n_k]``, or None, likewise.
            scale: the scores' scale (the term is scaled with ``q k^T``).

        Returns:
            ``score_mod(score, b, h, q_idx, kv_idx)``, or None without a ``reach``.

        Raises:
            ValueError: bad shapes, or positions :meth:`check_positions` rejects.
        """
        reach = self.reach
        if reach is None:
            return None
        q = self.check_queries(q)
        q_pos, k_pos, read_q, read_k = score_mod_positions(q_pos, k_pos)
        low, high = -reach, reach
        if q_pos is not None and k_pos is not None:
            self.check_positions(q_pos, k_pos)
            if check._can_inspect(q_pos) and check._can_inspect(k_pos):
                # only the offsets these positions meet (a reach far past the sequence
                # would make the logits wider than the scores); one read of two numbers
                low = max(low, min(high, int((k_pos.amin(-1) - q_pos.amax(-1)).min())))
                high = min(high, max(low, int((k_pos.amax(-1) - q_pos.amin(-1)).max())))
        rows = table_of(self.rows, low, high, q.device)  # [(h,) R, d]
        logits = table_logits(q, rows) * scale  # [b, h, n_q, R]

        def term_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            column = (read_k(b, kv_idx) - read_q(b, q_idx)).clamp(low, high) - low
            return score + logits[b, h, q_idx, column]

        return term_mod

    def score_term(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The hook: ``q_i . rows(k_pos_j - q_pos_i)``.

        Args:
            q: ``[b, h, n_q, d]``.
            q_pos: ``[B', n_q]`` query positions.
            k_pos: ``[B', n_k]`` key positions.

        Returns:
            ``[b, h, n_q, n_k]`` (the attention scales it with ``q k^T``).

        Raises:
            ValueError: bad shapes, or positions :meth:`check_positions` rejects.
        """
        q = self.check_queries(q)
        q_pos, k_pos = hook_positions(q, q_pos, k_pos)
        self.check_positions(q_pos, k_pos)
        return offset_term_logits(q, self.rows, q_pos, k_pos, self.reach)


class GridTerm(_QueryTerm):
    """A factorised 2-D term: ``s_ij += q_i . (r_0(r_j - r_i) + r_1(c_j - c_i))``.

    The family of SASA (Ramachandran et al. 2019), BoTNet (Srinivas et al. 2021) and
    ViTDet's decomposed relative positions (Li et al. 2022): the embedding of a 2-D offset
    on a row-major ``H x W`` map is the sum of an embedding of the row offset and one of the
    column offset, so the term needs one ``[(h,) 2H-1, d]`` and one ``[(h,) 2W-1, d]``
    table. A subclass sets ``size = (H, W)`` and ``head_dim`` and writes
    :meth:`axis_rows`; this base derives :meth:`score_term` and :meth:`grid_term` (the
    two tables, which the lean engine combines a few map rows at a time).
    """

    #: ``(H, W)``, the map the token indices number
    size: tuple[int, int]

    def axis_rows(self, axis: int, offsets: Tensor) -> Tensor:
        """The primitive: the embedding of an offset along one axis of the map.

        Args:
            axis: 0 for row offsets ``r_j - r_i`` (in ``[-(H-1), H-1]``), 1 for column
                offsets ``c_j - c_i`` (in ``[-(W-1), W-1]``).
            offsets: integer ``[*S]``.

        Returns:
            ``[*S, d]`` shared by the heads, or ``[h, *S, d]`` per head.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must define axis_rows(axis, offsets) -> [*offsets.shape, "
            f"head_dim], the embedding of a row (axis 0) or column (axis 1) offset"
        )

    def check_positions(self, q_pos: Tensor, k_pos: Tensor) -> None:
        """Raise ``ValueError`` unless the positions are token indices of the map."""
        check_cells(self.size, q_pos, k_pos)

    def axis_tables(self, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        """Every row and column offset: ``([(h,) 2H-1, d], [(h,) 2W-1, d])``, row
        ``dr + H - 1`` and ``dc + W - 1``."""
        height, width = self.size
        rows = self.axis_rows(0, torch.arange(1 - height, height, device=device))
        return rows, self.axis_rows(1, torch.arange(1 - width, width, device=device))

    def grid_term(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor] | None:
        """The two tables when queries and keys are the whole map in order (``0 .. H*W-1``,
        shared by the batch): then the lean engine builds the term a few map rows at a time.

        Returns:
            :meth:`axis_tables`; None for other positions (the engine then takes
            :meth:`score_term`).
        """
        if not is_whole_map(q_pos, k_pos, math.prod(self.size)):
            return None
        return self.axis_tables(q_pos.device)

    def score_term(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The hook for flat token indices (any subset, any order).

        Args:
            q: ``[b, h, n_q, d]``.
            q_pos: ``[B', n_q]`` token indices in ``[0, H*W)``.
            k_pos: ``[B', n_k]`` token indices in ``[0, H*W)``.

        Returns:
            ``[b, h, n_q, n_k]``.

        Raises:
            ValueError: bad shapes, or positions :meth:`check_positions` rejects.
        """
        q = self.check_queries(q)
        q_pos, k_pos = hook_positions(q, q_pos, k_pos)
        self.check_positions(q_pos, k_pos)
        cells = math.prod(self.size)  # outside eager checks: clamped into the map
        q_pos, k_pos = q_pos.clamp(0, cells - 1), k_pos.clamp(0, cells - 1)
        height, width = self.axis_tables(q.device)
        return relative_query_term_2d(q, height, width, self.size, q_pos, k_pos)
