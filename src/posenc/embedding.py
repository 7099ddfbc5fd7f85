"""Place 4: content-dependent score terms, ``s_ij += q_i . r_(i,j)``.

A learned embedding ``r`` of the key's position (absolute) or of the offset ``j - i``
(relative) is dotted with the query, so the position term depends on the content of the
query. Shaw et al. 2018 (section 3, keys only); Huang et al. 2018, "Music Transformer"
(the skew); Ramachandran et al. 2019, "Stand-Alone Self-Attention in Vision Models" (SASA)
and Srinivas et al. 2021, "Bottleneck Transformers for Visual Recognition" (BoTNet) for
the 2-D factorised form ``r = height[dr] + width[dc]``.

Scaling: every term here is part of the logits. On its own, ``forward`` returns the term
to add to ``q k^T`` unscaled; inside :class:`~posenc.MultiHeadAttention` it is divided by
``sqrt(head_dim)`` together with ``q k^T`` (the attention does that, not the scheme).

The relative classes write one primitive each, the embedding of an offset
(:class:`~posenc.families.OffsetTerm`) or of a row and a column offset
(:class:`~posenc.families.GridTerm`), from which the family derives the hooks
``score_term`` and ``offset_term`` / ``grid_term`` (the forms the lean engine's fast
paths read). The pure functions of the queries and the tables live in
:mod:`posenc._query_terms` and are exported here.

Shape legend: ``b`` batch, ``h`` heads, ``n`` sequence length (``n_q`` queries, ``n_k``
keys), ``d`` head dim, ``B'`` the batch of the positions (1 when shared, else ``b``),
``L`` ``max_len``, ``H, W`` feature-map height and width (``n = H * W`` tokens, row-major).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _validate as check
from ._query_terms import (
    _check_heads_and_dim,
    _check_offsets,
    _check_range,
    _heads,
    absolute_query_term,
    relative_query_logits,
    relative_query_logits_2d,
    relative_query_term,
    relative_rows,
    resize_relative_rows,
)
from .families import (
    GridTerm,
    OffsetTerm,
    check_queries,
    hook_positions,
    map_size,
    relative_query_term_2d,
)
from .indices import offset_run

__all__ = [
    "AbsoluteQueryEmbedding",
    "RelativeQueryEmbedding",
    "RelativeQueryEmbedding2D",
    "absolute_query_term",
    "relative_query_logits",
    "relative_query_logits_2d",
    "relative_query_term",
    "relative_query_term_2d",
    "relative_rows",
    "resize_relative_rows",
]


# ----- modules ----------------------------------------------------------------------------


class AbsoluteQueryEmbedding(nn.Module):
    """``s_ij += q_i . R_j``: the query against a learned embedding of the key's position.

    The absolute counterpart of :class:`RelativeQueryEmbedding`. It is the
    content-to-position term (b) of the expanded absolute-position score in Dai et al.
    2019 (Transformer-XL, section 3.3), ``E_xi^T W_q^T W_k U_j``, with ``W_k U_j`` learned
    directly as one table ``weight [max_len, head_dim]`` shared by all heads, initialised from
    ``N(0, head_dim**-1)`` (std ``head_dim**-0.5``, as the relative embeddings of SASA and
    BoTNet), so that ``q . R`` starts at the scale of ``q . k``.

    Standalone, ``forward`` returns the term to add to ``q k^T``, unscaled; inside
    :class:`~posenc.MultiHeadAttention` it is scaled by ``1/sqrt(head_dim)`` together with
    ``q k^T`` (the attention does that).

    Args:
        max_len: the number of positions the table holds.
        head_dim: the per-head width ``d``.

    Raises:
        ValueError: ``max_len`` or ``head_dim`` < 1.
    """

    def __init__(self, max_len: int, head_dim: int) -> None:
        super().__init__()
        self.max_len = check.positive_int("max_len", max_len)
        self.head_dim = check.positive_int("head_dim", head_dim)
        self.weight = nn.Parameter(torch.empty(max_len, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the table from ``N(0, 1/head_dim)``."""
        nn.init.normal_(self.weight, std=self.head_dim**-0.5)

    def forward(self, q: Tensor) -> Tensor:
        """The term ``q_i . R_j`` for positions ``0 .. n-1``.

        Args:
            q: ``[b, h, n, d]`` queries, ``n <= max_len``.

        Returns:
            ``[b, h, n, n]``, unscaled.

        Raises:
            ValueError: ``n > max_len``, or ``q`` is not ``[b, h, n, head_dim]``.
        """
        q = check_queries(q, self.head_dim)
        n = q.shape[-2]
        if n > self.max_len:
            raise ValueError(
                f"sequence length {n} exceeds max_len={self.max_len} of this position table; "
                f"build AbsoluteQueryEmbedding with max_len >= {n}, or use a relative scheme"
            )
        return q @ self.weight[:n].to(q.dtype).transpose(-2, -1)  # [b, h, n, d] @ [d, n]

    def score_term(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The hook (place 4): ``q_i . R[k_pos_j]`` (the query position is not used).

        Args:
            q: ``[b, h, n_q, d]``.
            q_pos: ``[B', n_q]`` query positions (checked, unused).
            k_pos: ``[B', n_k]`` key positions in ``[0, max_len)``.

        Returns:
            ``[b, h, n_q, n_k]``.

        Raises:
            ValueError: a key position outside ``[0, max_len)`` (checked when the values
                can be read; under ``torch.compile`` they are clamped into the table).
        """
        q = check_queries(q, self.head_dim)
        return absolute_query_term(q, self.weight, self._key_positions(q, q_pos, k_pos))

    def key_shift(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The same term folded into the keys: ``q_i . k_j + q_i . R_j = q_i . (k_j + R_j)``.

        The attention adds this to ``k`` on its fast paths (any kernel computes the term,
        with no ``[n_q, n_k]`` tensor); ``backend="math"`` keeps :meth:`score_term`.

        Args:
            q: ``[b, h, n_q, d]`` (checked; sets the dtype).
            q_pos: ``[B', n_q]`` query positions (checked, unused).
            k_pos: ``[B', n_k]`` key positions in ``[0, max_len)``.

        Returns:
            ``[B', 1, n_k, d]`` in ``q``'s dtype.

        Raises:
            ValueError: as :meth:`score_term`.
        """
        q = check_queries(q, self.head_dim)
        k_pos = self._key_positions(q, q_pos, k_pos)
        return F.embedding(k_pos, self.weight).to(q.dtype).unsqueeze(1)  # [B', 1, n_k, d]

    def _key_positions(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        _, k_pos = hook_positions(q, q_pos, k_pos)
        return _check_range(
            "k_pos",
            k_pos,
            0,
            self.max_len,
            f"this absolute table has max_len={self.max_len}; build it with a larger max_len",
        )

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention whose head dim differs from ``head_dim``."""
        _check_heads_and_dim("AbsoluteQueryEmbedding", None, self.head_dim, heads, head_dim)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, head_dim={self.head_dim}"


#: what :meth:`RelativeQueryEmbedding.offset_term` reads, set on an instance instead
_ROWS_ATTRIBUTES = frozenset({"rows", "check_positions", "reach", "offset_form"})


class RelativeQueryEmbedding(OffsetTerm):
    """``s_ij += q_i . R_(j - i)``: the query against a learned embedding of the offset.

    Shaw et al. 2018's key term without clipping, computed with the skew of Huang et al.
    2018 (Music Transformer). The table ``weight`` has one row per offset ``-(L-1) .. L-1``,
    row ``j - i + L - 1`` (``L = max_len``): ``[2L-1, head_dim]`` shared by all heads, or
    ``[heads, 2L-1, head_dim]`` with a separate table per head (really one per head: each
    head's queries meet only its own table). Initialised from ``N(0, 1/head_dim)`` (std
    ``head_dim**-0.5``, as BoTNet and SASA).

    Standalone, ``forward`` returns the term to add to ``q k^T``, unscaled; inside
    :class:`~posenc.MultiHeadAttention` it is scaled by ``1/sqrt(head_dim)`` together with
    ``q k^T`` (the attention does that).

    Args:
        max_len: the longest sequence; offsets up to ``max_len - 1`` have a row.
        head_dim: the per-head width ``d``.
        heads: None for one shared table, or the number of heads for one table each.

    Raises:
        ValueError: ``max_len``, ``head_dim`` or ``heads`` < 1.
    """

    def __init__(self, max_len: int, head_dim: int, *, heads: int | None = None) -> None:
        super().__init__()
        self.max_len = check.positive_int("max_len", max_len)
        self.head_dim = check.positive_int("head_dim", head_dim)
        self.heads = _heads(heads)
        lead = () if self.heads is None else (self.heads,)
        self.weight = nn.Parameter(torch.empty(*lead, 2 * max_len - 1, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the table from ``N(0, 1/head_dim)``."""
        nn.init.normal_(self.weight, std=self.head_dim**-0.5)

    def check_queries(self, q: object) -> Tensor:
        """``q`` must be ``[b, h, n, head_dim]`` float, with ``h == heads`` per head."""
        q = check_queries(q, self.head_dim)
        if self.heads is not None and q.shape[1] != self.heads:
            raise ValueError(
                f"q has {q.shape[1]} heads but this RelativeQueryEmbedding has a per-head "
                f"table for heads={self.heads}; build it with heads={q.shape[1]}"
            )
        return q

    def forward(self, q: Tensor) -> Tensor:
        """The term ``q_i . weight[j - i + L - 1]`` for positions ``0 .. n-1``.

        Args:
            q: ``[b, h, n, d]`` queries, ``n <= max_len``.

        Returns:
            ``[b, h, n, n]``, unscaled.

        Raises:
            ValueError: ``n > max_len``, wrong head dim, or wrong number of heads for a
                per-head table.
        """
        q = self.check_queries(q)
        n = q.shape[-2]
        if n > self.max_len:
            raise ValueError(
                f"sequence length {n} exceeds max_len={self.max_len}: offsets up to {n - 1} "
                f"need a row; build RelativeQueryEmbedding with max_len >= {n}"
            )
        return relative_query_logits(q, self.weight)

    @property
    def reach(self) -> int:  # type: ignore[override]
        """Offsets up to ``max_len - 1`` have a row (further ones are rejected)."""
        return self.max_len - 1

    def rows(self, offsets: Tensor) -> Tensor:
        """``weight[j - i + L - 1]``: the embedding of each offset (the family's primitive;
        :class:`~posenc.families.OffsetTerm` derives ``score_term`` and ``offset_term``).

        Args:
            offsets: integer ``[*S]`` in ``[-(L-1), L-1]`` (clamped into it).

        Returns:
            ``[*S, head_dim]`` (shared table) or ``[heads, *S, head_dim]``.
        """
        return relative_rows(self.weight, offsets)

    def offset_term(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | tuple[Tensor, Tensor] | None:
        """The rows the term uses when the positions are one consecutive run, so that
        ``score_term(q) == skew_rows(q @ rows^T, n_k)`` (the hook of
        :class:`~posenc.families.OffsetTerm`): the table's rows of the offsets ``k_pos[0, 0]
        - q_pos[0, -1]`` on, ``[(h,) n_q + n_k - 1, head_dim]``; None for other positions.
        Where no graph is recorded (grad mode off) they are a view of ``weight``, which the
        engine reads at once and never writes into; in grad mode a copy of that view, as
        :meth:`rows` gives (a graph may save them while the table changes); where
        :meth:`rows`, :meth:`check_positions` or :attr:`reach` is another class's or the
        instance's, the family's form (:meth:`~posenc.families.OffsetTerm.offset_form`).

        Raises:
            ValueError: an offset ``|j - i| >= max_len``.
        """
        if not self._own_rows():
            return super().offset_term(q_pos, k_pos)
        first = offset_run(q_pos, k_pos)
        if first is None:
            return None
        width = q_pos.shape[-1] + k_pos.shape[-1] - 1
        start = first + self.max_len - 1  # the row of the first offset
        if start < 0 or start + width > self.weight.shape[-2]:
            return super().offset_term(q_pos, k_pos)  # an offset with no row: raises
        rows = self.weight[..., start : start + width, :]  # [(h,) W, d]
        return rows.clone() if torch.is_grad_enabled() else rows  # (as rows() copies them)

    def _own_rows(self) -> bool:
        """Whether the rows of an offset are this class's: :meth:`rows`,
        :meth:`check_positions`, :attr:`reach` and ``offset_form`` as defined here (none
        replaced by a subclass or set on the instance)."""
        cls = type(self)
        return (
            cls.rows is RelativeQueryEmbedding.rows
            and cls.check_positions is RelativeQueryEmbedding.check_positions
            and cls.reach is RelativeQueryEmbedding.reach
            and cls.offset_form is OffsetTerm.offset_form
            and _ROWS_ATTRIBUTES.isdisjoint(vars(self))
        )

    def check_positions(self, q_pos: Tensor, k_pos: Tensor) -> None:
        """Raise for an offset ``|j - i| >= max_len`` (checked when the values can be read;
        under ``torch.compile`` offsets are clamped to the last row)."""
        _check_offsets(q_pos, k_pos, self.max_len, "RelativeQueryEmbedding")

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention with another head dim (or heads, for a per-head table)."""
        _check_heads_and_dim("RelativeQueryEmbedding", self.heads, self.head_dim, heads, head_dim)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, head_dim={self.head_dim}, heads={self.heads}"


class RelativeQueryEmbedding2D(GridTerm):
    """``s_ij += q_i . (height[r_j - r_i + H - 1] + width[c_j - c_i + W - 1])`` on an H x W map.

    The 2-D relative position embedding of SASA (Ramachandran et al. 2019) and BoTNet
    (Srinivas et al. 2021): the embedding of a 2-D offset is the sum of a row-offset
    embedding and a column-offset embedding, so the logits factorise into one 1-D skew
    per axis. Tokens are numbered row-major: token ``p`` is cell ``(p // W, p % W)``.
    Tables ``height [2H-1, d]`` and ``width [2W-1, d]`` (``[heads, ., d]`` per head),
    initialised from ``N(0, 1/head_dim)`` (std ``head_dim**-0.5``, as BoTNet and SASA).

    Standalone, ``forward`` returns the term to add to ``q k^T``, unscaled; inside
    :class:`~posenc.MultiHeadAttention` it is scaled by ``1/sqrt(head_dim)`` together with
    ``q k^T`` (the attention does that).

    Args:
        size: ``(H, W)``, the feature map.
        head_dim: the per-head width ``d``.
        heads: None for tables shared by all heads, or the number of heads.

    Raises:
        ValueError: a bad ``size``, ``head_dim`` or ``heads``.
    """

    def __init__(self, size: tuple[int, int], head_dim: int, *, heads: int | None = None) -> None:
        super().__init__()
        self._size = map_size(size)
        self.head_dim = check.positive_int("head_dim", head_dim)
        self.heads = _heads(heads)
        lead = () if self.heads is None else (self.heads,)
        rows, cols = self.size
        self.height = nn.Parameter(torch.empty(*lead, 2 * rows - 1, head_dim))
        self.width = nn.Parameter(torch.empty(*lead, 2 * cols - 1, head_dim))
        self.reset_parameters()

    @property
    def size(self) -> tuple[int, int]:  # type: ignore[override]
        """``(H, W)``: the map its tables cover; :meth:`resize` changes it with them."""
        return self._size

    def reset_parameters(self) -> None:
        """Draw both tables from ``N(0, 1/head_dim)``."""
        nn.init.normal_(self.height, std=self.head_dim**-0.5)
        nn.init.normal_(self.width, std=self.head_dim**-0.5)

    def check_queries(self, q: object) -> Tensor:
        """``q`` must be ``[b, h, n, head_dim]`` float, with ``h == heads`` per head."""
        q = check_queries(q, self.head_dim)
        if self.heads is not None and q.shape[1] != self.heads:
            raise ValueError(
                f"q has {q.shape[1]} heads but this RelativeQueryEmbedding2D has per-head "
                f"tables for heads={self.heads}; build it with heads={q.shape[1]}"
            )
        return q

    def forward(self, q: Tensor) -> Tensor:
        """The term for the whole map (factorised: one skew per axis).

        Args:
            q: ``[b, h, H*W, d]`` queries of the map, row-major.

        Returns:
            ``[b, h, HW, HW]``, unscaled.

        Raises:
            ValueError: ``n != H * W``, wrong head dim or number of heads.
        """
        q = self.check_queries(q)
        rows, cols = self.size
        if q.shape[-2] != rows * cols:
            raise ValueError(
                f"q must hold the {rows}x{cols} map as {rows * cols} row-major tokens, got "
                f"n={q.shape[-2]}; build RelativeQueryEmbedding2D with the feature map's "
                f"size=(H, W)"
            )
        return relative_query_logits_2d(q, self.height, self.width, self.size)

    def axis_rows(self, axis: int, offsets: Tensor) -> Tensor:
        """``height[dr + H - 1]`` (axis 0) or ``width[dc + W - 1]`` (axis 1): the family's
        primitive (:class:`~posenc.families.GridTerm` derives ``score_term`` and
        ``grid_term``).

        Args:
            axis: 0 for row offsets, 1 for column offsets.
            offsets: integer ``[*S]`` in ``[-(H-1), H-1]`` or ``[-(W-1), W-1]`` (clamped).

        Returns:
            ``[*S, head_dim]`` (shared tables) or ``[heads, *S, head_dim]``.
        """
        return relative_rows(self.width if axis else self.height, offsets)

    def check_positions(self, q_pos: Tensor, k_pos: Tensor) -> None:
        """Raise for an index outside ``[0, H*W)`` (checked when the values can be read;
        under ``torch.compile`` indices are clamped into the map)."""
        cells = math.prod(self.size)
        fix = (
            f"positions are row-major token indices of the {self.size[0]}x{self.size[1]} map; "
            f"build RelativeQueryEmbedding2D with the feature map's size"
        )
        _check_range("q_pos", q_pos, 0, cells, fix)
        _check_range("k_pos", k_pos, 0, cells, fix)

    @torch.no_grad()
    def resize(self, new_size: tuple[int, int]) -> RelativeQueryEmbedding2D:
        """Interpolate both tables to an ``(H', W')`` feature map (fine-tuning at another size).

        Each axis's table is resampled on its own over its offsets, linearly
        (:func:`resize_relative_rows`: ``align_corners=False``, as a 1-D Swin table and
        ViTDet's decomposed relative embeddings): ``height [(h,) 2H-1, d]`` becomes
        ``[(h,) 2H'-1, d]`` and ``width [(h,) 2W-1, d]`` becomes ``[(h,) 2W'-1, d]``. Offset 0
        keeps its row (up to rounding); the same size keeps the tables. The parameters are
        replaced (same dtype, device and ``requires_grad``): build the optimizer after
        resizing.

        Args:
            new_size: ``(H', W')``, the new feature map.

        Returns:
            ``self``.

        Raises:
            ValueError: ``new_size`` is not a pair of ints >= 1.
            TypeError: an entry of ``new_size`` is not an int.
        """
        new = map_size(new_size, "new_size")
        for name, new_len in zip(("height", "width"), new, strict=True):
            table: nn.Parameter = getattr(self, name)
            resized = resize_relative_rows(table.detach(), new_len)
            setattr(self, name, nn.Parameter(resized, requires_grad=table.requires_grad))
        self._size = new
        return self

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention with another head dim (or heads, for per-head tables)."""
        _check_heads_and_dim("RelativeQueryEmbedding2D", self.heads, self.head_dim, heads, head_dim)

    def extra_repr(self) -> str:
        return f"size={self.size}, head_dim={self.head_dim}, heads={self.heads}"
