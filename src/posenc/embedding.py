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
paths read).

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
from .bias import resize_relative_position_table
from .families import (
    GridTerm,
    OffsetTerm,
    check_queries,
    hook_positions,
    map_size,
    offset_term_logits,
    relative_query_term_2d,
    table_logits,
)
from .indices import (
    _known_run,
    offset_run,
    position_extremes,
    relative_to_absolute,
    select_rows,
    value_range,
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
    "relative_rows",
    "resize_relative_rows",
]


# ----- input checks -----------------------------------------------------------------------


def _check_range(name: str, pos: Tensor, low: int, high: int, fix: str) -> Tensor:
    """Raise unless ``low <= pos < high`` (when the values can be read); clamp otherwise.

    Under ``torch.compile`` (or on meta tensors) the values are not inspected: they are
    clamped into the range so that a table lookup can never read out of bounds.
    """
    if check._can_inspect(pos):
        lo, hi = value_range(pos)
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
    (q_low, q_high), (k_low, k_high) = position_extremes(q_pos), position_extremes(k_pos)
    largest, smallest = k_high - q_low, k_low - q_high  # [B'] tensors, or ints
    if isinstance(largest, Tensor):
        largest = int(largest.max())
    if isinstance(smallest, Tensor):
        smallest = int(smallest.min())
    if largest >= max_len or smallest <= -max_len:
        raise ValueError(
            f"offsets k_pos - q_pos range from {smallest} to {largest}, but this table has rows "
            f"for offsets -{max_len - 1}..{max_len - 1} (max_len={max_len}); build {scheme} "
            f"with max_len >= {max(largest, -smallest) + 1}"
        )


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
    return relative_to_absolute(table_logits(q, rows))  # [b, h, n, 2n-1] -> [b, h, n, n]


def relative_rows(weight: Tensor, offsets: Tensor) -> Tensor:
    """The rows of a table of offsets ``-(L-1) .. L-1`` for offsets ``j - i``.

    Args:
        weight: ``[2L-1, d]`` (shared) or ``[h, 2L-1, d]`` (per head), row ``j - i + L - 1``.
        offsets: integer ``[*S]``; beyond ``+-(L-1)`` they read the first or last row.

    Returns:
        ``[*S, d]`` or ``[h, *S, d]``, a new tensor: for a run of offsets within the table
        that :func:`~posenc.indices.run_offsets` built, a copy of its rows' slice (no
        clamp nor gather).
    """
    length = (weight.shape[-2] + 1) // 2
    run = _known_run(offsets) if offsets.ndim == 1 else None
    if run is not None and 1 - length <= run[0] and run[1] <= length - 1:
        # a run of offsets within the table: its rows are a slice, copied (no gather; the
        # caller and a graph get their own rows, as from the gather)
        return weight[..., run[0] + length - 1 : run[1] + length, :].clone()  # [(h,) W, d]
    return select_rows(weight, offsets.clamp(1 - length, length - 1) + (length - 1))


def relative_query_term(q: Tensor, weight: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``q_i . weight[k_pos_j - q_pos_i + L - 1]`` for any positions.

    A run of consecutive positions: ``q`` against the rows of the offsets it meets, then
    the skew. Others: ``q @ weight^T`` over the offsets the positions meet (``[b, h, n_q,
    <= 2L-1]``, one logit per offset) gathered by the offset of each pair: memory
    ``O(n_q (2L + n_k))``, never ``[n_q, n_k, d]`` (see
    :func:`~posenc.families.offset_term_logits`).

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
    return offset_term_logits(
        q, lambda offsets: relative_rows(weight, offsets), q_pos, k_pos, reach=length - 1
    )


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
    width_term = table_logits(grid, width)  # [b, h, H, W, 2W-1]
    width_term = relative_to_absolute(width_term)  # [b, h, H, W, W]: key column
    by_col = grid.transpose(2, 3)  # [b, h, W, H, d]
    height_term = table_logits(by_col, height)  # [b, h, W, H, 2H-1]
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
