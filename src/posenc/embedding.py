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
from .absolute import _size2d
from .bias import resize_relative_position_table
from .indices import (
    is_whole_map,
    offset_run,
    relative_distance,
    relative_to_absolute,
    skew_rows,
)

__all__ = [
    "AbsoluteQueryEmbedding",
    "RelativeQueryEmbedding",
    "RelativeQueryEmbedding2D",
    "absolute_query_term",
    "relative_query_logits",
    "relative_query_logits_2d",
    "relative_query_term",
    "relative_query_term_2d",
    "resize_relative_rows",
]


# ----- input checks -----------------------------------------------------------------------


def _check_q(q: object, head_dim: int, name: str = "q") -> Tensor:
    """``q`` must be a float ``[b, h, n, d]`` tensor with ``d == head_dim``."""
    check.floating(name, q)
    if q.ndim != 4:  # type: ignore[union-attr]
        raise ValueError(
            f"{name} must have shape [b, h, n, d] (split the heads first), got shape "
            f"{tuple(q.shape)}"  # type: ignore[union-attr]
        )
    check.last_dim(name, q, head_dim, what="head_dim")  # type: ignore[arg-type]
    return q  # type: ignore[return-value]


def _check_pos(name: str, pos: object, n: int, batch: int) -> Tensor:
    """A hook's positions: integer ``[n]`` or ``[B', n]`` with ``B'`` in ``{1, b}``."""
    check.tensor(name, pos)
    p: Tensor = pos  # type: ignore[assignment]
    if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
        raise TypeError(
            f"{name} must be an integer tensor of positions, got dtype {p.dtype}; pass "
            f"{name}.long() if the values are whole numbers"
        )
    if p.ndim == 1:
        p = p.unsqueeze(0)  # [n] -> [1, n]
    if p.ndim != 2 or p.shape[-1] != n or p.shape[0] not in (1, batch):
        raise ValueError(
            f"{name} must have shape [{n}] or [1 or {batch}, {n}] (one position per token, "
            f"shared by the batch or per row), got shape {tuple(pos.shape)}"  # type: ignore[union-attr]
        )
    return p.long()


def _hook_positions(x: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
    """Check the positions a hook receives against ``x [b, h, n_q, *]``.

    For a score term ``x`` is ``q [b, h, n_q, d]`` and ``k_pos`` may have any length;
    for a value term ``x`` is the weights ``[b, h, n_q, n_k]`` and ``k_pos`` must cover
    ``n_k`` (checked by the caller).

    Returns:
        ``(q_pos [B', n_q], k_pos [B', n_k])`` int64.
    """
    q_pos = _check_pos("q_pos", q_pos, x.shape[-2], x.shape[0])
    check.tensor("k_pos", k_pos)
    k_pos = _check_pos("k_pos", k_pos, k_pos.shape[-1], x.shape[0])
    return q_pos, k_pos


def _check_range(name: str, pos: Tensor, low: int, high: int, fix: str) -> Tensor:
    """Raise unless ``low <= pos < high`` (when the values can be read); clamp otherwise.

    Under ``torch.compile`` (or on meta tensors) the values are not inspected: they are
    clamped into the range so that a table lookup can never read out of bounds.
    """
    if check._can_inspect(pos):
        lo, hi = int(pos.min()), int(pos.max())
        if lo < low or hi >= high:
            raise ValueError(
                f"{name} must lie in [{low}, {high}), got values from {lo} to {hi}; {fix}"
            )
    return pos.clamp(low, high - 1)


def _check_offsets(q_pos: Tensor, k_pos: Tensor, max_len: int, scheme: str) -> None:
    """Raise when some ``|k_pos_j - q_pos_i| >= max_len`` (skipped when not inspectable).

    Costs ``O(n_q + n_k)``: the extreme offsets of each row are ``max k - min q`` and
    ``min k - max q``.
    """
    if not (check._can_inspect(q_pos) and check._can_inspect(k_pos)):
        return
    largest = int((k_pos.amax(-1) - q_pos.amin(-1)).max())  # [B'] -> scalar
    smallest = int((k_pos.amin(-1) - q_pos.amax(-1)).min())  # [B'] -> scalar
    if largest >= max_len or smallest <= -max_len:
        raise ValueError(
            f"offsets k_pos - q_pos range from {smallest} to {largest}, but this table has rows "
            f"for offsets -{max_len - 1}..{max_len - 1} (max_len={max_len}); build {scheme} "
            f"with max_len >= {max(largest, -smallest) + 1}"
        )


def _gather(logits: Tensor, index: Tensor) -> Tensor:
    """``logits[b, h, i, index[b', i, j]]``: ``[b, h, n_q, R]`` by ``[B', n_q, n_k]``.

    Returns:
        ``[b, h, n_q, n_k]``.
    """
    b, h, n_q, _ = logits.shape
    # [B', n_q, n_k] -> [b, h, n_q, n_k] (a view: no copy)
    index = index.unsqueeze(1).expand(b, h, n_q, index.shape[-1])
    return logits.gather(-1, index)


def _table_logits(q: Tensor, table: Tensor) -> Tensor:
    """``q @ table^T`` for a shared ``[R, d]`` or per-head ``[h, R, d]`` table.

    Args:
        q: ``[b, h, ..., d]`` (extra dims between ``h`` and ``d`` allowed, e.g. 2-D maps).
        table: ``[R, d]`` or ``[h, R, d]``.

    Returns:
        ``[b, h, ..., R]`` in ``q``'s dtype.
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


def _heads(heads: object) -> int | None:
    if heads is None:
        return None
    return check.positive_int("heads", heads, hint=" (or None for a table shared by all heads)")


def _check_heads_and_dim(
    scheme: str, built_heads: int | None, built_dim: int, heads: int, head_dim: int
) -> None:
    if head_dim != built_dim:
        raise ValueError(
            f"{scheme} was built for head_dim={built_dim} but the attention has "
            f"head_dim={head_dim} (dim / heads); build it with head_dim={head_dim}"
        )
    if built_heads is not None and heads != built_heads:
        raise ValueError(
            f"{scheme} was built with a per-head table for heads={built_heads} but the "
            f"attention has heads={heads}; build it with heads={heads} (or heads=None to "
            f"share one table)"
        )


# ----- pure functions ---------------------------------------------------------------------


def absolute_query_term(q: Tensor, weight: Tensor, k_pos: Tensor) -> Tensor:
    """``q_i . R[k_pos_j]``: the query against the learned embedding of each key's position.

    Args:
        q: ``[b, h, n_q, d]``.
        weight: ``[L, d]`` the position table ``R``.
        k_pos: ``[B', n_k]`` int64 key positions in ``[0, L)``.

    Returns:
        ``[b, h, n_q, n_k]`` in ``q``'s dtype.
    """
    keys = F.embedding(k_pos, weight).to(q.dtype)  # [B', n_k, d]
    return q @ keys.unsqueeze(1).transpose(-2, -1)  # [b, h, n_q, d] @ [B', 1, d, n_k]


def relative_query_logits(q: Tensor, weight: Tensor) -> Tensor:
    """``out[..., i, j] = q_i . weight[j - i + L - 1]`` for a whole sequence, with the skew.

    Computes ``q @ rows^T`` with the ``2n - 1`` rows of offsets ``-(n-1) .. n-1``
    (``[b, h, n, 2n-1]``), then :func:`~posenc.relative_to_absolute` (Huang et al. 2018):
    no ``[n, n]`` index and no ``[n, n, d]`` tensor.

    Args:
        q: ``[b, h, n, d]`` with ``n <= L``.
        weight: ``[2L-1, d]`` (shared) or ``[h, 2L-1, d]`` (per head).

    Returns:
        ``[b, h, n, n]``.
    """
    n = q.shape[-2]
    length = (weight.shape[-2] + 1) // 2
    rows = weight[..., length - n : length + n - 1, :]  # [(h,) 2n-1, d]: offsets -(n-1)..n-1
    return relative_to_absolute(_table_logits(q, rows))  # [b, h, n, 2n-1] -> [b, h, n, n]


def relative_query_term(q: Tensor, weight: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``q_i . weight[k_pos_j - q_pos_i + L - 1]`` for any positions.

    ``q @ weight^T`` (``[b, h, n_q, 2L-1]``, one logit per offset) gathered by the offset
    of each pair: memory ``O(n_q (2L + n_k))``, never ``[n_q, n_k, d]``.

    Args:
        q: ``[b, h, n_q, d]``.
        weight: ``[2L-1, d]`` or ``[h, 2L-1, d]``.
        q_pos: ``[B', n_q]`` int64.
        k_pos: ``[B', n_k]`` int64. Offsets with ``|k_pos_j - q_pos_i| >= L`` have no row
            of their own and read the first or last row (clamped; the module raises
            instead, see :meth:`RelativeQueryEmbedding.score_term`).

    Returns:
        ``[b, h, n_q, n_k]``.
    """
    length = (weight.shape[-2] + 1) // 2
    first = offset_run(q_pos, k_pos)
    n_q, n_k = q_pos.shape[-1], k_pos.shape[-1]
    if first is not None and -length < first and first + n_q + n_k - 2 < length:
        # consecutive positions: the rows of offsets first .. first + n_q + n_k - 2, then
        # the skew (a view) instead of a gather
        used = weight[..., first + length - 1 : first + length - 1 + n_q + n_k - 1, :]
        return skew_rows(_table_logits(q, used), n_k)  # [b, h, n_q, n_q + n_k - 1] -> [.., n_k]
    rows = relative_distance(q_pos, k_pos) + (length - 1)  # [B', n_q, n_k]
    rows = rows.clamp(0, 2 * length - 2)  # offsets beyond L-1 share the last row
    if rows.device.type == "cpu" and check._can_inspect(rows):
        # only the offsets these positions meet: a block of queries of the lean engine
        # meets n_k + rows - 1 of the 2L - 1, about half of them (on CPU only: reading the
        # range is a device sync elsewhere)
        first, last = int(rows.min()), int(rows.max())
        weight = weight[..., first : last + 1, :]  # [(h,) used offsets, d]
        rows = rows - first
    return _gather(_table_logits(q, weight), rows)


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
    ``q @ width^T`` by the column offset.

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
    return _gather(_table_logits(q, height), dr) + _gather(_table_logits(q, width), dc)


def relative_query_logits_2d(
    q: Tensor, height: Tensor, width: Tensor, size: tuple[int, int]
) -> Tensor:
    """The 2-D term for a whole ``H x W`` map, factorised (SASA / BoTNet ``rel_logits_1d``).

    Width logits: ``q @ width^T`` on ``q [b, h, H, W, d]``, skewed along ``W``. Height
    logits: the same along ``H`` after swapping ``H`` and ``W``, then swapped back, so that
    both are indexed ``[query row, query col, key row or col]``. The two are broadcast-added
    into ``[b, h, H, W, H, W]``: ``out[r_i, c_i, r_j, c_j] = height_term[r_i, c_i, r_j] +
    width_term[r_i, c_i, c_j]``, flattened row-major to ``[b, h, HW, HW]``.

    Args:
        q: ``[b, h, H*W, d]``.
        height: ``[2H-1, d]`` or ``[h, 2H-1, d]``.
        width: ``[2W-1, d]`` or ``[h, 2W-1, d]``.
        size: ``(H, W)``.

    Returns:
        ``[b, h, HW, HW]``.
    """
    rows, cols = size
    b, h, n, d = q.shape
    grid = q.reshape(b, h, rows, cols, d)  # [b, h, HW, d] -> [b, h, H, W, d]
    width_term = _table_logits(grid, width)  # [b, h, H, W, 2W-1]
    width_term = relative_to_absolute(width_term)  # [b, h, H, W, W]: key column
    by_col = grid.transpose(2, 3)  # [b, h, W, H, d]
    height_term = _table_logits(by_col, height)  # [b, h, W, H, 2H-1]
    height_term = relative_to_absolute(height_term)  # [b, h, W, H, H]: key row
    # back to token order: [b, h, H (query row), W (query col), H (key row)]
    height_term = height_term.transpose(2, 3)
    out = height_term.unsqueeze(-1) + width_term.unsqueeze(-2)  # [b, h, H, W, H, W]
    return out.reshape(b, h, n, n)  # [b, h, H, W, H, W] -> [b, h, HW, HW]


def resize_relative_rows(table: Tensor, new_len: int) -> Tensor:
    """Interpolate a table of offset rows ``[(h,) 2L-1, d]`` to ``[(h,) 2L'-1, d]``.

    Row ``m`` embeds the offset ``m - (L - 1)``; each channel (and head) is resampled
    linearly over the offsets with ``F.interpolate(align_corners=False)``, the convention of
    :func:`~posenc.resize_relative_position_table` for a 1-D window (and of the decomposed
    relative embeddings of ViTDet / SAM, Li et al. 2022). Offset 0 sits at the centre of
    both grids and keeps its row (up to the rounding of the sampling coordinate); the same
    length returns ``table`` unchanged.

    Args:
        table: ``[2L-1, d]`` (shared) or ``[h, 2L-1, d]`` (per head), ``L >= 1``.
        new_len: ``L'``, the new number of offsets on each side (``2L'-1`` rows).

    Returns:
        ``[(h,) 2L'-1, d]`` in ``table``'s dtype.

    Raises:
        ValueError: ``table`` is not ``[(h,) odd rows, d]``, or ``new_len`` < 1.
        TypeError: ``new_len`` is not an int.
    """
    check.tensor("table", table)
    check.positive_int("new_len", new_len)
    if table.ndim not in (2, 3) or table.shape[-2] % 2 == 0:
        raise ValueError(
            f"table must have shape [2L-1, d] or [heads, 2L-1, d] (one row per offset "
            f"-(L-1)..L-1, an odd number), got shape {tuple(table.shape)}"
        )
    rows, dim = table.shape[-2], table.shape[-1]
    lead = table.shape[:-2]  # () or (h,)
    flat = table.movedim(-2, 0).reshape(rows, -1)  # [(h,) 2L-1, d] -> [2L-1, h * d]
    resized = resize_relative_position_table(flat, (rows + 1) // 2, new_len)  # [2L'-1, h * d]
    if resized is flat:
        return table
    # [2L'-1, h * d] -> [2L'-1, (h,) d] -> [(h,) 2L'-1, d]
    return resized.reshape(2 * new_len - 1, *lead, dim).movedim(0, -2).contiguous()


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
        q = _check_q(q, self.head_dim)
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
        q = _check_q(q, self.head_dim)
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
        q = _check_q(q, self.head_dim)
        k_pos = self._key_positions(q, q_pos, k_pos)
        return F.embedding(k_pos, self.weight).to(q.dtype).unsqueeze(1)  # [B', 1, n_k, d]

    def _key_positions(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        _, k_pos = _hook_positions(q, q_pos, k_pos)
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


class RelativeQueryEmbedding(nn.Module):
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

    def _check(self, q: object) -> Tensor:
        q = _check_q(q, self.head_dim)
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
        q = self._check(q)
        n = q.shape[-2]
        if n > self.max_len:
            raise ValueError(
                f"sequence length {n} exceeds max_len={self.max_len}: offsets up to {n - 1} "
                f"need a row; build RelativeQueryEmbedding with max_len >= {n}"
            )
        return relative_query_logits(q, self.weight)

    def score_term(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The hook (place 4): ``q_i . weight[k_pos_j - q_pos_i + L - 1]``.

        Args:
            q: ``[b, h, n_q, d]``.
            q_pos: ``[B', n_q]`` query positions (any integers).
            k_pos: ``[B', n_k]`` key positions, within ``max_len - 1`` of every query.

        Returns:
            ``[b, h, n_q, n_k]``.

        Raises:
            ValueError: an offset ``|j - i| >= max_len`` (checked when the values can be
                read; under ``torch.compile`` offsets are clamped to the last row).
        """
        q = self._check(q)
        q_pos, k_pos = _hook_positions(q, q_pos, k_pos)
        _check_offsets(q_pos, k_pos, self.max_len, "RelativeQueryEmbedding")
        return relative_query_term(q, self.weight, q_pos, k_pos)

    def offset_term(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """The table rows the term uses when the positions are one consecutive run.

        Returns:
            ``[(heads,) n_q + n_k - 1, head_dim]``: row ``m`` embeds offset
            ``k_pos[0, 0] - q_pos[0, -1] + m`` (see :func:`~posenc.indices.offset_run`), so
            that ``score_term(q) == skew_rows(q @ rows^T, n_k)``; None for other positions
            (the lean engine then takes :meth:`score_term`).

        Raises:
            ValueError: an offset ``|j - i| >= max_len``.
        """
        first = offset_run(q_pos, k_pos)
        if first is None:
            return None
        _check_offsets(q_pos, k_pos, self.max_len, "RelativeQueryEmbedding")
        start = first + self.max_len - 1
        return self.weight[..., start : start + q_pos.shape[-1] + k_pos.shape[-1] - 1, :]

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention with another head dim (or heads, for a per-head table)."""
        _check_heads_and_dim("RelativeQueryEmbedding", self.heads, self.head_dim, heads, head_dim)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, head_dim={self.head_dim}, heads={self.heads}"


class RelativeQueryEmbedding2D(nn.Module):
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
        self.size = _size2d(size)
        self.head_dim = check.positive_int("head_dim", head_dim)
        self.heads = _heads(heads)
        lead = () if self.heads is None else (self.heads,)
        rows, cols = self.size
        self.height = nn.Parameter(torch.empty(*lead, 2 * rows - 1, head_dim))
        self.width = nn.Parameter(torch.empty(*lead, 2 * cols - 1, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw both tables from ``N(0, 1/head_dim)``."""
        nn.init.normal_(self.height, std=self.head_dim**-0.5)
        nn.init.normal_(self.width, std=self.head_dim**-0.5)

    def _check(self, q: object) -> Tensor:
        q = _check_q(q, self.head_dim)
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
        q = self._check(q)
        rows, cols = self.size
        if q.shape[-2] != rows * cols:
            raise ValueError(
                f"q must hold the {rows}x{cols} map as {rows * cols} row-major tokens, got "
                f"n={q.shape[-2]}; build RelativeQueryEmbedding2D with the feature map's "
                f"size=(H, W)"
            )
        return relative_query_logits_2d(q, self.height, self.width, self.size)

    def score_term(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The hook (place 4) for flat token indices (any subset, any order).

        Args:
            q: ``[b, h, n_q, d]``.
            q_pos: ``[B', n_q]`` token indices in ``[0, H*W)``.
            k_pos: ``[B', n_k]`` token indices in ``[0, H*W)``.

        Returns:
            ``[b, h, n_q, n_k]``.

        Raises:
            ValueError: an index outside ``[0, H*W)`` (checked when the values can be read;
                under ``torch.compile`` indices are clamped into the map).
        """
        q = self._check(q)
        q_pos, k_pos = _hook_positions(q, q_pos, k_pos)
        cells = math.prod(self.size)
        fix = (
            f"positions are row-major token indices of the {self.size[0]}x{self.size[1]} map; "
            f"build RelativeQueryEmbedding2D with the feature map's size"
        )
        q_pos = _check_range("q_pos", q_pos, 0, cells, fix)
        k_pos = _check_range("k_pos", k_pos, 0, cells, fix)
        return relative_query_term_2d(q, self.height, self.width, self.size, q_pos, k_pos)

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
        new = _size2d(new_size, "new_size")
        for name, new_len in zip(("height", "width"), new, strict=True):
            table: nn.Parameter = getattr(self, name)
            resized = resize_relative_rows(table.detach(), new_len)
            setattr(self, name, nn.Parameter(resized, requires_grad=table.requires_grad))
        self.size = new
        return self

    def grid_term(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor] | None:
        """The two tables when queries and keys are the whole map in order (``0 .. H*W-1``,
        shared by the batch): then the lean engine builds the term a few map rows at a time.

        Returns:
            ``(height [(h,) 2H-1, d], width [(h,) 2W-1, d])``, row ``dr + H - 1`` and
            ``dc + W - 1`` for a key ``dr`` rows and ``dc`` columns from its query; None for
            other positions (the engine then takes :meth:`score_term`).
        """
        cells = math.prod(self.size)
        return (self.height, self.width) if is_whole_map(q_pos, k_pos, cells) else None

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention with another head dim (or heads, for per-head tables)."""
        _check_heads_and_dim("RelativeQueryEmbedding2D", self.heads, self.head_dim, heads, head_dim)

    def extra_repr(self) -> str:
        return f"size={self.size}, head_dim={self.head_dim}, heads={self.heads}"
