"""The maths of place 4's query terms (:mod:`posenc.embedding`, whose docstring gives the
papers and the shape legend): pure functions of the queries and the tables, and the checks
of their inputs, which the modules there call."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from . import _validate as check
from .bias import resize_relative_position_table
from .families import offset_term_logits, table_logits
from .indices import (
    _known_run,
    position_extremes,
    relative_to_absolute,
    select_rows,
    value_range,
)

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
