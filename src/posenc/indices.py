"""Index arithmetic shared by places 3-5: the skew, Swin's index, clipping, T5 buckets.

Pure functions on integer tensors; nothing here holds parameters.

Shape legend: ``b`` batch (or 1, shared), ``n_q`` query length, ``n_k`` key length,
``L`` sequence length of a square relative matrix.

Relative distance is ``j - i``: key position minus query position (Shaw et al. 2018,
Raffel et al. 2020). Swin's table layout (query minus key) is kept in
:func:`relative_position_index` and :func:`window_relative_index`, where checkpoint
compatibility needs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import _validate as check
from ._memo import memo
from .diagonals import diagonal_sums, relative_to_absolute, skew_rows, toeplitz

__all__ = [
    "clipped_distance",
    "diagonal_sums",
    "gather_logits",
    "gather_rows",
    "grid_offset_index",
    "is_whole_map",
    "offset_run",
    "positions_from_documents",
    "positions_from_padding",
    "relative_distance",
    "relative_position_index",
    "relative_to_absolute",
    "run_offsets",
    "score_mod_positions",
    "select_rows",
    "skew_rows",
    "t5_bucket",
    "toeplitz",
    "window_relative_index",
    "window_size",
]


def relative_distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``k_pos[j] - q_pos[i]`` for every pair.

    Args:
        q_pos: ``[..., n_q]`` integer positions of the queries.
        k_pos: ``[..., n_k]`` integer positions of the keys (batch dims broadcast).

    Returns:
        ``[..., n_q, n_k]``.
    """
    return k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)  # [..., 1, n_k] - [..., n_q, 1]


def clipped_distance(q_pos: Tensor, k_pos: Tensor, max_distance: int) -> Tensor:
    """Shaw et al.'s row index ``clip(j - i, -k, k) + k`` in ``[0, 2k]``.

    Args:
        q_pos: ``[..., n_q]`` query positions.
        k_pos: ``[..., n_k]`` key positions.
        max_distance: the clipping distance ``k`` >= 0.

    Returns:
        ``[..., n_q, n_k]`` int64.
    """
    rel = relative_distance(q_pos, k_pos)  # [..., n_q, n_k]
    return rel.clamp(-max_distance, max_distance) + max_distance


class _GatherRows(torch.autograd.Function):
    """``table.t()[:, index]`` with a backward by ``index_add_`` (no sorting scatter)."""

    @staticmethod
    def forward(ctx: Any, table: Tensor, index: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.rows = table.shape[0]
        return _gathered(table, index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        heads = grad.shape[1]
        flat = grad.transpose(0, 1).reshape(heads, -1)  # [h, B' * n_q * n_k]
        table_grad = grad.new_zeros(heads, ctx.rows).index_add_(1, index.flatten(), flat)
        return table_grad.t(), None  # [rows, h]


def _gathered(table: Tensor, index: Tensor) -> Tensor:
    """:class:`_GatherRows`'s forward: ``[B', h, n_q, n_k]``."""
    # each head's column made contiguous once ([rows, h] is small), then one
    # index_select along it: about half the time of advanced indexing of table.t()
    columns = table.t().contiguous()  # [h, rows]
    rows = index.flatten().to(table.device)  # [B' * n_q * n_k] (positions on the host)
    out = columns.index_select(1, rows)  # [h, B' * n_q * n_k]
    return out.view(table.shape[1], *index.shape).transpose(0, 1)  # [h, B', ..] -> [B', h, ..]


def gather_rows(table: Tensor, index: Tensor) -> Tensor:
    """A per-pair bias read from a table: ``out[b, h, i, j] = table[index[b, i, j], h]``.

    The same as ``table[index].permute(0, 3, 1, 2)``, but its gradient is accumulated
    with ``index_add_``, several times faster on CPU than the sorting scatter that
    advanced indexing and ``F.embedding`` use in their backward (the lean engine calls
    this once per block of queries).

    Args:
        table: ``[rows, h]``, e.g. a Swin table or T5's bias per clipped offset.
        index: ``[B', n_q, n_k]`` int64 rows.

    Returns:
        ``[B', h, n_q, n_k]``.
    """
    if torch.is_grad_enabled() and table.requires_grad:
        return _GatherRows.apply(table, index)
    return _gathered(table, index)  # no graph to record: the forward alone


def select_rows(table: Tensor, index: Tensor) -> Tensor:
    """The rows of a table of vectors at an index: ``table[..., index, :]``.

    One ``index_select`` over the flattened index (advanced indexing of the same rows
    costs about three times as long on CPU for a few hundred rows); differentiable, with
    the gradient accumulated by ``index_add``.

    Args:
        table: ``[R, d]`` or ``[h, R, d]``.
        index: integer ``[*S]`` in ``[0, R)`` (no negative rows), on any device.

    Returns:
        ``[*S, d]`` or ``[h, *S, d]``.
    """
    rows = table.index_select(-2, index.flatten().to(table.device))  # [(h,) S, d]
    return rows.view(*table.shape[:-2], *index.shape, table.shape[-1])


def gather_logits(logits: Tensor, index: Tensor) -> Tensor:
    """A logit per pair read from one logit per table row: ``logits[b, h, i, index[b', i, j]]``.

    A query term ``q_i . r_(i,j)`` with ``r`` drawn from a table of ``R`` rows is
    ``q @ table^T`` (``[b, h, n_q, R]``, one logit per row) read at each pair's row: no
    ``[n_q, n_k, d]`` tensor.

    Args:
        logits: ``[b, h, n_q, R]``.
        index: ``[B', n_q, n_k]`` int64 rows in ``[0, R)`` (``B'`` 1 or ``b``).

    Returns:
        ``[b, h, n_q, n_k]``.
    """
    b, h, n_q, _ = logits.shape
    # [B', n_q, n_k] -> [b, h, n_q, n_k] (a view: no copy)
    index = index.unsqueeze(1).expand(b, h, n_q, index.shape[-1])
    return logits.gather(-1, index)


def grid_offset_index(q_pos: Tensor, k_pos: Tensor, size: tuple[int, int]) -> Tensor:
    """The row of a 2-D offset grid for every pair of token indices, key minus query.

    Token ``p`` of a row-major ``H x W`` map is the cell ``(p // W, p % W)``; the pair
    ``(i, j)`` has the offset ``(dr, dc) = (r_j - r_i, c_j - c_i)`` and the row
    ``(dr + H - 1) * (2W - 1) + (dc + W - 1)`` of a ``[2H-1, 2W-1]`` grid flattened
    row-major. (Swin's :func:`window_relative_index` is the same grid read backwards:
    query minus key.)

    Args:
        q_pos: ``[..., n_q]`` token indices in ``[0, H*W)``.
        k_pos: ``[..., n_k]`` token indices in ``[0, H*W)``.
        size: ``(H, W)``.

    Returns:
        ``[..., n_q, n_k]`` int64 in ``[0, (2H-1)(2W-1))``.
    """
    height, width = size
    dr = relative_distance(q_pos // width, k_pos // width)  # [..., n_q, n_k]
    dc = relative_distance(q_pos % width, k_pos % width)  # [..., n_q, n_k]
    return (dr + height - 1) * (2 * width - 1) + (dc + width - 1)


def run_positions(start: int, n: int, device: torch.device | str | None = None) -> Tensor:
    """The positions ``start .. start + n - 1`` of one sequence, ``[1, n]`` int64, marked as
    a run: :func:`offset_run`, :func:`position_extremes` and :func:`value_range` (the
    schemes' range checks) then know them without reading them, until an in-place op
    writes into them (their version counter moves). For the default positions that
    posenc builds and hands to the hooks, and keeps in a :class:`~posenc.KVCache` (a write
    that bypasses the version counter, through ``.data`` or a NumPy view, would not be
    seen: neither by the runs nor by the range checks). Built outside inference mode (a
    tensor with a version counter) where that is on.

    Args:
        start: the first position.
        n: how many.
        device: where to build them.

    Returns:
        ``[1, n]`` int64.
    """
    if torch.compiler.is_compiling():  # traced: offset_run does not read positions there
        return torch.arange(start, start + n, device=device)[None]  # [1, n]
    pos = _counted_arange(start, start + n, device)[None]  # [1, n]
    pos._posenc_run = (pos._version, start)
    return pos


def _counted_arange(start: int, stop: int, device: torch.device | str | None) -> Tensor:
    """``arange(start, stop)`` with a version counter: built outside inference mode where
    that is on (an inference tensor has none), so that it can be marked as a run."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return torch.arange(start, stop, device=device)
    return torch.arange(start, stop, device=device)


def _known_run(pos: Tensor) -> tuple[int, int] | None:
    """``(first, last)`` of positions (``[..., n]``) that :func:`run_positions` or offsets
    that :func:`run_offsets` built and nothing has written into since (their version
    counter unchanged), else None: known without reading them."""
    if torch.compiler.is_compiling() or torch._C._is_tracing():  # (torch.jit.is_tracing)
        return None  # traced: the graph must not depend on a mark
    mark = getattr(pos, "_posenc_run", None)
    if mark is None or pos.is_inference() or mark[0] != pos._version:
        return None
    return mark[1], mark[1] + pos.shape[-1] - 1


def offset_run(q_pos: Tensor, k_pos: Tensor) -> int | None:
    """The first offset when the positions make a Toeplitz pattern, else None.

    When ``q_pos [1, n_q]`` and ``k_pos [1, n_k]`` are each a run of consecutive integers
    (the usual case: a sequence, or a block of its queries), the offset ``k_pos_j - q_pos_i``
    is ``first + (j - i) + n_q - 1`` with ``first = k_pos_0 - q_pos_(n_q-1)``, and a
    relative scheme needs only the ``n_q + n_k - 1`` offsets from ``first`` on: see
    :func:`toeplitz` and :func:`skew_rows`. Checking reads the positions, so it is done only
    where that is free: on CPU, outside ``torch.compile``, for a batch dimension of 1.

    Args:
        q_pos: ``[B', n_q]`` int64 query positions.
        k_pos: ``[B', n_k]`` int64 key positions.

    Returns:
        ``k_pos_0 - q_pos_(n_q-1)``, or None when the pattern does not hold or cannot be
        checked cheaply.
    """
    q_first = run_start(q_pos)
    if q_first is None:
        return None
    q_last = q_first + q_pos.shape[1] - 1
    if k_pos is q_pos:
        return q_first - q_last
    k_first = run_start(k_pos)
    return None if k_first is None else k_first - q_last  # k_pos_0 - q_pos_(n_q-1)


def run_start(pos: Tensor) -> int | None:
    """The first position when ``pos [1, n]`` is one run of consecutive integers, checked
    only where that is free (see :func:`offset_run`: on CPU, outside ``torch.compile``),
    else None. Positions :func:`run_positions` built are known without reading them.

    Args:
        pos: ``[B', n]`` int64 positions.

    Returns:
        ``pos[0, 0]``, or None when ``pos`` is not one such run or cannot be read cheaply.
    """
    if torch.compiler.is_compiling():
        return None
    if pos.ndim != 2 or pos.shape[0] != 1 or pos.shape[1] == 0 or not pos.is_cpu:
        return None  # (a CPU tensor with elements, not compiling: check._can_inspect)
    if pos.is_floating_point() or pos.dtype == torch.bool:
        return None
    if torch._C._are_functorch_transforms_active():  # vmap: positions per batch entry
        return None
    known = _known_run(pos)  # built as a run: no need to read it
    if known is not None:
        return known[0]
    row = host_row(pos)  # [n] on the host, no copy
    if row is None:
        if pos.shape[1] > 1 and not bool((pos[0, 1:] - pos[0, :-1] == 1).all()):
            return None
        return int(pos[0, 0])
    first, last = int(row[0]), int(row[-1])
    if last - first != row.size - 1 or (row.size > 2 and not (row[1:] - row[:-1] == 1).all()):
        return None
    return first


def position_extremes(pos: Tensor) -> tuple[Tensor, Tensor] | tuple[int, int]:
    """``(min, max)`` of each row of ``pos [B', n]`` (``n >= 1``): ints for one row on the
    CPU (read through NumPy, or known without reading for positions :func:`run_positions`
    built), else ``[B']`` tensors."""
    known = _known_run(pos) if pos.shape[-1] else None
    if known is not None:
        return known
    row = (
        host_row(pos) if pos.ndim == 2 and pos.shape[0] == 1 and pos.device.type == "cpu" else None
    )
    if row is not None:
        return int(row.min()), int(row.max())
    return pos.amin(-1), pos.amax(-1)


def value_range(pos: Tensor) -> tuple[int, int]:
    """``(min, max)`` over every position of a non-empty ``pos`` as ints: known without
    reading them for positions :func:`run_positions` built (and nothing has written into
    since, as the version counter sees it), else one ``aminmax``."""
    known = _known_run(pos) if pos.ndim == 2 and pos.shape[0] == 1 else None
    if known is not None:
        return known
    low, high = torch.aminmax(pos)
    return int(low), int(high)


def host_row(pos: Tensor) -> np.ndarray | None:
    """Row 0 of an integer CPU tensor ``[1, n]`` as a NumPy view (no copy), or None where
    NumPy cannot view it (a tensor subclass, a functorch wrapper). NumPy reads a short row
    in a fraction of the time of the tensor ops that would check it."""
    try:
        return pos.numpy()[0]
    except (RuntimeError, TypeError):
        return None


def run_offsets(q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
    """The ``n_q + n_k - 1`` offsets of a run of consecutive positions, in increasing order.

    Args:
        q_pos: ``[B', n_q]`` int64 query positions.
        k_pos: ``[B', n_k]`` int64 key positions.

    Returns:
        ``[n_q + n_k - 1]`` int64, ``first .. first + n_q + n_k - 2`` with ``first`` from
        :func:`offset_run`, marked as a run (:func:`_known_run`: known without reading it,
        as :func:`run_positions` marks positions, until an in-place op moves its version
        counter; a write past the counter, through ``.data`` or a NumPy view, is not
        seen); None when :func:`offset_run` gives None.
    """
    first = offset_run(q_pos, k_pos)
    if first is None:
        return None
    count = q_pos.shape[-1] + k_pos.shape[-1] - 1
    offsets = _counted_arange(first, first + count, q_pos.device)  # [count]
    offsets._posenc_run = (offsets._version, first)
    return offsets


def is_whole_map(q_pos: Tensor, k_pos: Tensor, cells: int) -> bool:
    """Whether queries and keys are both every token of a map in order, ``[[0 .. cells-1]]``
    (checked only where :func:`offset_run` can check)."""
    shapes = q_pos.shape == (1, cells) and k_pos.shape == (1, cells)
    if not shapes:
        return False
    # both runs of `cells` consecutive integers from 0
    return run_start(q_pos) == 0 and (k_pos is q_pos or run_start(k_pos) == 0)


#: the most cells of a map whose pairs' rows :func:`whole_map_offset_index` keeps between
#: calls (256: an int64 [1, N, N] of 0.5 MiB; larger maps take the lean engine's grid path)
_KEPT_CELLS = 256


def whole_map_offset_index(height: int, width: int, device: torch.device) -> Tensor:
    """:func:`grid_offset_index` of every token of an ``H x W`` map against every token, in
    order: ``[1, H*W, H*W]`` int64; kept per map size and device for maps of at most
    :data:`_KEPT_CELLS` cells (shared: posenc reads it, never writes it, and keeps it
    only for autograd's backward of :func:`gather_rows`; write into it and every later
    call reads what you wrote), else built in each call."""
    if height * width > _KEPT_CELLS:
        return _whole_map_offset_index.__wrapped__(height, width, device)
    return _whole_map_offset_index(height, width, device)


@memo(maxsize=16)
def _whole_map_offset_index(height: int, width: int, device: torch.device) -> Tensor:
    tokens = torch.arange(height * width, device=device)[None]  # [1, N]
    return grid_offset_index(tokens, tokens, (height, width))


def _flex_reader(
    name: str, pos: object
) -> tuple[Tensor | None, Callable[[Tensor, Tensor], Tensor]]:
    """One argument of :func:`score_mod_positions`: ``(pos [B', n], read)``.

    Args:
        name: the argument's name, for messages.
        pos: ``[n]`` or ``[1, n]`` (shared by the batch) or ``[b, n]`` (per sequence) integer
            positions, or None (the token indices: ``read(b, idx) = idx``).

    Returns:
        ``(pos [B', n], read)`` with ``read(b, idx)`` the position of token ``idx`` of
        sequence ``b``: ``pos[0, idx]`` when shared, else ``pos[b, idx]``.

    Raises:
        TypeError: not an integer tensor.
        ValueError: not ``[n]`` or ``[B', n]``.
    """
    if pos is None:

        def read_index(b: Tensor, idx: Tensor) -> Tensor:
            return idx

        return None, read_index
    check.tensor(name, pos)
    p: Tensor = pos  # type: ignore[assignment]
    if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
        raise TypeError(
            f"{name} must be an integer tensor of positions, got dtype {p.dtype}; pass "
            f"{name}.long() if the values are whole numbers"
        )
    if p.ndim == 1:
        p = p.unsqueeze(0)  # [n] -> [1, n]
    if p.ndim != 2:
        raise ValueError(
            f"{name} must have shape [n], [1, n] (shared by the batch) or [batch, n] (per "
            f"sequence), got shape {tuple(p.shape)}"
        )
    if p.shape[0] == 1:
        shared = p[0]  # [n]

        def read_shared(b: Tensor, idx: Tensor) -> Tensor:
            return shared[idx]

        return p, read_shared

    def read_row(b: Tensor, idx: Tensor) -> Tensor:
        return p[b, idx]

    return p, read_row


def score_mod_positions(
    q_pos: object, k_pos: object
) -> tuple[
    Tensor | None,
    Tensor | None,
    Callable[[Tensor, Tensor], Tensor],
    Callable[[Tensor, Tensor], Tensor],
]:
    """How a FlexAttention ``score_mod`` reads query and key positions, for any batch.

    FlexAttention calls a ``score_mod`` with the batch index ``b`` of every sequence, so
    positions shared by the batch (``[n]`` or ``[1, n]``) cannot be read as ``pos[b, idx]``
    (out of range for ``b >= 1``). The reader is chosen here, once, from the shape: a
    ``score_mod`` must not branch on tensor values.

    Args:
        q_pos: ``[n_q]`` or ``[1, n_q]`` (shared by the batch) or ``[b, n_q]`` (per sequence)
            integer positions, or None: the token indices.
        k_pos: ``[n_k]``, ``[1, n_k]`` or ``[b, n_k]``, likewise.

    Returns:
        ``(q_pos [B', n_q], k_pos [B', n_k], read_q, read_k)`` with ``read_q(b, q_idx)`` the
        position of query ``q_idx`` of sequence ``b`` (``q_pos[0, q_idx]`` when shared, else
        ``q_pos[b, q_idx]``, ``q_idx`` itself for None positions), and ``read_k`` the same
        for the keys.

    Raises:
        TypeError: positions that are not integers.
        ValueError: positions not ``[n]`` or ``[B', n]``, or per-sequence query and key
            positions of different batch sizes.
    """
    q_pos, read_q = _flex_reader("q_pos", q_pos)
    k_pos, read_k = _flex_reader("k_pos", k_pos)
    if q_pos is None or k_pos is None:
        return q_pos, k_pos, read_q, read_k
    if 1 not in (q_pos.shape[0], k_pos.shape[0]) and q_pos.shape[0] != k_pos.shape[0]:
        raise ValueError(
            f"q_pos has batch size {q_pos.shape[0]} but k_pos has batch size {k_pos.shape[0]}; "
            f"pass positions shared by the batch ([n] or [1, n]) or one row per sequence for both"
        )
    return q_pos, k_pos, read_q, read_k


def window_size(window: object, name: str = "window") -> tuple[int, ...]:
    """Normalise a window to ``(W,)`` or ``(Wh, Ww)`` and check it."""
    if isinstance(window, int) and not isinstance(window, bool):
        return (check.positive_int(name, window),)
    if isinstance(window, (tuple, list)) and len(window) in (1, 2):
        return tuple(check.positive_int(f"{name}[{i}]", w) for i, w in enumerate(window))
    raise ValueError(f"{name} must be an int W or a pair (Wh, Ww), got {window!r}")


def window_relative_index(q_pos: Tensor, k_pos: Tensor, window: tuple[int, ...]) -> Tensor:
    """Swin's table row for every (query, key) pair of token indices in a window.

    Tokens are numbered row-major, ``p = r * Ww + c``. The row is
    ``(r_i - r_j + Wh - 1) * (2Ww - 1) + (c_i - c_j + Ww - 1)`` (query minus key: Swin's
    layout, so that Swin checkpoints load as they are); in 1-D it is ``i - j + W - 1``.

    Args:
        q_pos: ``[..., n_q]`` token indices in ``[0, N)``.
        k_pos: ``[..., n_k]`` token indices in ``[0, N)``.
        window: ``(W,)`` or ``(Wh, Ww)``.

    Returns:
        ``[..., n_q, n_k]`` int64 rows of a table with ``prod(2w - 1)`` rows.
    """
    if len(window) == 1:
        return q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2) + (window[0] - 1)
    wh, ww = window
    dr = (q_pos // ww).unsqueeze(-1) - (k_pos // ww).unsqueeze(-2)  # [..., n_q, n_k]
    dc = (q_pos % ww).unsqueeze(-1) - (k_pos % ww).unsqueeze(-2)  # [..., n_q, n_k]
    return (dr + wh - 1) * (2 * ww - 1) + (dc + ww - 1)


def relative_position_index(window: int | tuple[int, int]) -> Tensor:
    """Swin's relative position index for a window (Liu et al. 2021, section 3.2).

    Args:
        window: ``W`` (1-D) or ``(Wh, Ww)`` (2-D).

    Returns:
        ``[N, N]`` int64 with ``N = Wh * Ww``: the row of the ``[(2Wh-1)*(2Ww-1), heads]``
        bias table for each (query, key) pair. For ``(2, 2)``:
        ``[[4,3,1,0],[5,4,2,1],[7,6,4,3],[8,7,5,4]]``.

    Raises:
        ValueError: a bad window.
    """
    size = window_size(window)
    tokens = torch.arange(math.prod(size))  # [N]
    return window_relative_index(tokens, tokens, size)


def t5_bucket(
    relative_position: Tensor,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Tensor:
    """T5's log-spaced bucket of a relative position ``j - i`` (Raffel et al. 2020).

    Half the buckets (of each direction, when bidirectional) hold exact distances
    ``0 .. max_exact - 1`` with ``max_exact = buckets // 2``; the rest are spaced
    logarithmically up to ``max_distance``, beyond which everything shares the last
    bucket. Bidirectional: positive offsets (key after query) use the upper half.
    Unidirectional (decoders): only ``j <= i`` is distinguished; future keys fall in
    bucket 0. The float32 arithmetic matches Mesh TensorFlow's and HF's
    ``_relative_position_bucket`` exactly.

    Args:
        relative_position: integer tensor of ``j - i``, any shape.
        bidirectional: encoder (True) or decoder (False) bucketing.
        num_buckets: the number of buckets.
        max_distance: the distance from which all offsets share the last bucket.

    Returns:
        int64 buckets in ``[0, num_buckets)``, same shape.

    Raises:
        TypeError: float relative positions.
        ValueError: too few buckets for the log range, or ``max_distance`` too small.
    """
    check.tensor("relative_position", relative_position)
    if relative_position.is_floating_point():
        raise TypeError(
            f"relative_position must be an integer tensor, got {relative_position.dtype}"
        )
    check.positive_int("num_buckets", num_buckets)
    check.positive_int("max_distance", max_distance)
    half = num_buckets // 2 if bidirectional else num_buckets
    max_exact = half // 2
    if max_exact < 1:
        raise ValueError(
            f"num_buckets={num_buckets} is too small for bidirectional={bidirectional}: it needs "
            f"at least {4 if bidirectional else 2} buckets"
        )
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance must exceed the exact range {max_exact} (num_buckets={num_buckets}), "
            f"got {max_distance}"
        )
    rel = relative_position.long()
    buckets = torch.zeros_like(rel)
    if bidirectional:
        buckets = buckets + (rel > 0).long() * half
        distance = rel.abs()
    else:
        distance = (-rel).clamp(min=0)
    is_small = distance < max_exact
    # log-spaced bucket for distances >= max_exact; log(0) = -inf on the small side is
    # discarded by the where below. Float32, as the reference implementation.
    scaled = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(
        max_distance / max_exact
    )
    large = max_exact + (scaled * (half - max_exact)).long()
    large = large.clamp(max=half - 1)
    return buckets + torch.where(is_small, distance, large)


def positions_from_padding(key_padding_mask: Tensor) -> Tensor:
    """Positions that skip padding: the first real token of each row is at position 0.

    For a left-padded batch ``[[pad, pad, a, b], [c, d, e, f]]`` this gives
    ``[[0, 0, 0, 1], [0, 1, 2, 3]]``, so the row ``a b`` is encoded exactly as ``a b`` alone.
    Padding slots get the position of the next real token (they are masked as keys; their
    own outputs are meaningless). Right padding gives ``arange`` on the real tokens.

    Args:
        key_padding_mask: ``[b, n]`` bool, True = padding (PyTorch's convention).

    Returns:
        ``[b, n]`` int64 positions.

    Raises:
        TypeError: the mask is not bool.
    """
    check.tensor("key_padding_mask", key_padding_mask)
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(
            f"key_padding_mask must be a bool tensor (True = padding), got dtype "
            f"{key_padding_mask.dtype}; convert with key_padding_mask.bool()"
        )
    real = (~key_padding_mask).long()
    return (real.cumsum(dim=-1) - real).long()  # real tokens before each slot


def positions_from_documents(document_ids: Tensor) -> Tensor:
    """Positions that restart at 0 at each new document of a packed row.

    ``[[0, 0, 0, 1, 1, 2]] -> [[0, 1, 2, 0, 1, 0]]``: a document starts wherever the id
    differs from the previous token's.

    Args:
        document_ids: ``[b, n]`` (or ``[n]``) integer document id of each token.

    Returns:
        int64 positions, same shape.
    """
    check.tensor("document_ids", document_ids)
    if document_ids.is_floating_point() or document_ids.dtype == torch.bool:
        raise TypeError(f"document_ids must be an integer tensor, got dtype {document_ids.dtype}")
    n = document_ids.shape[-1]
    index = torch.arange(n, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - start_index
