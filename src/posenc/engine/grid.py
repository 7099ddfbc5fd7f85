"""The grid paths: a 2-D bias (Swin) or 2-D query term (SASA/BoTNet) over queries and keys
that are one whole ``H x W`` map in row-major order, in blocks of whole map rows.

Shape legend: ``b`` batch, ``h`` heads, ``g`` a head group, ``H x W`` the map (``W`` its
width), ``n = H * W`` tokens, ``d`` head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ..diagonals import diagonal_sums, pad_rows, skew_rows
from . import common, tuning
from .common import _add_leading_sum, _block_grads, _Buffers, _KeyGrads, _reused
from .offset_term import _unskew


def _grid_kernel_values(grid: Tensor, span: Callable[[], float]) -> Tensor | None:
    """A 2-D per-offset bias ``[h, 2H-1, 2W-1]`` ready for the fused kernel, detached.

    As :func:`_offset_kernel_values`: far biases raised to ``span()`` below a head's best
    (asked for only when a head spreads over more than ``tuning.BIAS_SPAN``) when every
    query meets that best, which on a whole map only the offset ``(0, 0)`` is; None when
    a head spans more than the span and its best is elsewhere.
    """
    grid = grid.detach()
    flat = grid.flatten(1)  # [h, (2H-1)(2W-1)]
    low, high = torch.aminmax(flat, dim=-1, keepdim=True)  # [h, 1]
    spread = float((high - low).max())
    if spread <= tuning.BIAS_SPAN or spread <= (reach := span()):
        return grid
    centre = grid[:, grid.shape[1] // 2, grid.shape[2] // 2, None]  # [h, 1]: offset (0, 0)
    if not torch.equal(centre, high):
        return None
    return torch.maximum(grid, high[..., None] - reach)


def _grid_step(height: int, width: int, rows: int, heads: int) -> int:
    """Map rows per block on the 2-D bias path: ``rows`` queries in whole map rows, as many
    as ``heads`` heads' copies fit :data:`tuning.GRID_BUFFER_ELEMENTS` (at least one)."""
    copies = tuning.GRID_BUFFER_ELEMENTS // (heads * _GridBias.copy_size(height, width))
    return max(1, min(height, rows // width, copies))


def _grid_steps(h: int, height: int, width: int, rows: int) -> tuple[int, list[slice]]:
    """``(map rows per block, head groups)`` of the 2-D bias path's forward: ``rows``
    queries in whole map rows, then as many heads per buffer as
    :data:`tuning.GRID_BUFFER_ELEMENTS` holds (at least one map row, at least one head)."""
    step = _grid_step(height, width, rows, 1)
    group = max(
        1, min(h, tuning.GRID_BUFFER_ELEMENTS // (step * _GridBias.copy_size(height, width)))
    )
    return step, [slice(s, min(s + group, h)) for s in range(0, h, group)]


class _GridBias:
    """The masks of a 2-D relative bias over a whole ``H x W`` map, ``m`` map rows at a time.

    A table ``[W, 2H-1, W]`` per head holds, for each query column ``c_i``, the bias of every
    (row offset, key column): ``table[c_i, dr, c_j] = grid[dr, c_j - c_i + W - 1]``. For the
    queries of map row ``r``, reading ``H * W`` values from row offset ``H - 1 - r`` gives
    the keys in order: a map row's mask ``[W, H * W]`` is a strided view, row stride
    ``P = (2H-1) W``. The next map row starts ``W`` values earlier, so ``m`` map rows are no
    view of one table; the buffer holds ``m`` copies, copy ``i`` at ``i (W P + W)``: map
    row ``r + i`` read from copy ``i`` starts ``i W P`` after map row ``r``, and the block's
    ``m W`` queries are the rows of one view, stride ``P``. The buffer is ``m`` times
    ``g W P`` values (``g`` heads, about ``2 m g n W``), not ``h n^2``; the masks' gradient
    accumulates in a buffer of the same layout and is mapped back to the table once.
    """

    def __init__(self, height: int, width: int, heads: int, copies: int, like: Tensor) -> None:
        self.height, self.width, self.copies = height, width, copies
        self.plane = (2 * height - 1) * width  # P: one query column's values
        self.copy = width * self.plane + width  # a copy and a gap of W (never read)
        self.buffer = like.new_empty(heads, copies * self.copy)  # [g, m (W P + W)]

    @staticmethod
    def copy_size(height: int, width: int) -> int:
        """Values of one copy (and its gap) per head."""
        return width * (2 * height - 1) * width + width

    @staticmethod
    def per_group(
        grid: Tensor, groups: list[slice], copies: int
    ) -> Iterator[tuple[slice, _GridBias]]:
        """``(heads, masks)`` per head group of ``grid [h, 2H-1, 2W-1]``: one buffer, refilled
        with each group's heads when the group comes (the kernel calls are synchronous); a
        new one for a last group of another size."""
        height, width = (grid.shape[1] + 1) // 2, (grid.shape[2] + 1) // 2
        masks = None
        for hs in groups:
            g = hs.stop - hs.start
            if masks is None or masks.buffer.shape[0] != g:
                masks = _GridBias(height, width, g, copies, grid)
            masks.fill(grid[hs])
            yield hs, masks

    def fill(self, grid: Tensor) -> None:
        """Hold ``grid [g, 2H-1, 2W-1]``: copy 0 a slice of columns per query column, the
        others copies of copy 0."""
        w, first = self.width, self.table(self.buffer, 0)  # [g, W, 2H-1, W]
        for c in range(w):  # query column c: column offsets -c .. W-1-c
            first[:, c] = grid[:, :, w - 1 - c : 2 * w - 1 - c]
        for i in range(1, self.copies):
            self.table(self.buffer, i).copy_(first)

    def table(self, buffer: Tensor, i: int) -> Tensor:
        """Copy ``i`` of ``buffer``'s table: ``[g, W, 2H-1, W]``, a view."""
        start = i * self.copy
        return buffer[:, start : start + self.copy - self.width].view(
            buffer.shape[0], self.width, 2 * self.height - 1, self.width
        )

    def block(self, row: int, count: int, buffer: Tensor | None = None) -> Tensor:
        """``[1, g, count * W, H * W]``: the bias of the queries of map rows ``row`` to
        ``row + count - 1`` (``count`` at most the copies), a view of the buffer (or of a
        gradient buffer of the same layout)."""
        buffer = self.buffer if buffer is None else buffer
        h, w = self.height, self.width
        return buffer.as_strided(
            (1, buffer.shape[0], count * w, h * w),
            (buffer.numel(), buffer.stride(0), self.plane, 1),
            buffer.storage_offset() + (h - 1 - row) * w,
        )

    def table_grad(self, grad_buffer: Tensor) -> Tensor:
        """The gradient of the grid ``[g, 2H-1, 2W-1]`` from its masks' (``grad_buffer``, the
        layout of the buffer, zero in the gaps): the copies summed, then the column diagonals
        of each row offset."""
        total = self.table(grad_buffer, 0)
        for i in range(1, self.copies):
            total = total + self.table(grad_buffer, i)  # [g, W, 2H-1, W]
        return diagonal_sums(total.transpose(1, 2))  # [g, 2H-1, W, W] -> [g, 2H-1, 2W-1]


class _GridFusedAttention(torch.autograd.Function):
    """The lean engine for a 2-D relative bias over a whole map (Swin's table, global).

    Whole map rows of queries per block: forward :data:`tuning.GRID_KERNEL_ROWS` queries and as
    many heads as a buffer holds (:func:`_grid_steps`); backward per head group of
    :func:`common._head_groups`, over :func:`_written_rows` queries for a learned table (as many
    map rows as the group's buffer holds, :func:`_grid_step`). The masks are views of a
    :class:`_GridBias` buffer, and so is ``dS`` summed over the batch when added to the
    gradient buffer; the table's gradient is read from that buffer once per head group.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, grid: Tensor, kernel_grid: Tensor, scale: float
    ) -> Tensor:
        h = q.shape[1]
        out = torch.empty_like(q)  # [b, h, n, d]
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)  # [b, h, n]
        height, w = (kernel_grid.shape[1] + 1) // 2, (kernel_grid.shape[2] + 1) // 2
        step, groups = _grid_steps(h, height, w, tuning.GRID_KERNEL_ROWS)
        for hs, masks in _GridBias.per_group(kernel_grid, groups, step):
            for row in range(0, height, step):
                count = min(step, height - row)
                blk = slice(row * w, (row + count) * w)
                out[:, hs, blk], lse[:, hs, blk] = common._flash_cpu(
                    q[:, hs, blk], k[:, hs], v[:, hs], 0.0, False,
                    attn_mask=masks.block(row, count), scale=scale,
                )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, kernel_grid)
        ctx.scale, ctx.learn = scale, grid.requires_grad
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, kernel_grid = ctx.saved_tensors
        scale, learn = ctx.scale, ctx.learn
        b, h, n = q.shape[:3]
        groups = common._head_groups(b, h)
        g = groups[0].stop - groups[0].start
        grad_q = torch.empty_like(q)
        key_grads = _KeyGrads(k, v, groups)
        grad_grid = torch.empty_like(kernel_grid) if learn else None  # [h, 2H-1, 2W-1]
        grad_out = grad_out.contiguous()
        height, w = (kernel_grid.shape[1] + 1) // 2, (kernel_grid.shape[2] + 1) // 2
        step = _grid_step(
            height, w, common._written_rows(b, g, n, n) if learn else tuning.GRID_KERNEL_ROWS, g
        )
        for hs, masks in _GridBias.per_group(kernel_grid, groups, step):
            grad_masks = torch.zeros_like(masks.buffer) if learn else None  # [g, m (W P + W)]
            for row in range(0, height, step):
                count = min(step, height - row)
                blk = slice(row * w, (row + count) * w)
                qh, kh, vh = q[:, hs, blk], k[:, hs], v[:, hs]  # [b, g, m W | n, d]
                gh, oh, lh = grad_out[:, hs, blk], out[:, hs, blk], lse[:, hs, blk]
                gq, _, grad_s = _block_grads(
                    qh, kh, vh, gh, oh, lh, masks.block(row, count), scale,
                    key_grads.of(hs), need_ds=learn,
                )  # fmt: skip
                grad_q[:, hs, blk] = gq
                if grad_masks is not None and grad_s is not None:  # [b, g, m W, n]
                    _add_leading_sum(masks.block(row, count, grad_masks)[0], grad_s)
            if grad_grid is not None and grad_masks is not None:
                grad_grid[hs] = masks.table_grad(grad_masks)
        grad_k, grad_v = key_grads.result()
        return grad_q, grad_k, grad_v, grad_grid, None, None


def _rows_of(table: Tensor, heads: slice) -> Tensor:
    """A shared ``[R, d]`` table, or the heads' rows ``[g, R, d]`` of a per-head one."""
    return table if table.ndim == 2 else table[heads]


def _grid_term_steps(b: int, h: int, n: int, width: int, rows: int) -> tuple[int, list[slice]]:
    """``(map rows per block, head groups)`` of the forward on the grid term path: ``rows``
    queries in whole map rows (at least one), as many heads per call as keep a block's term
    ``[b, g, rows, n]`` within :data:`tuning.GRID_BUFFER_ELEMENTS` (at least one)."""
    step = max(1, min(n // width, rows // width))
    group = max(1, min(h, tuning.GRID_BUFFER_ELEMENTS // (b * step * width * n)))
    return step, [slice(s, min(s + group, h)) for s in range(0, h, group)]


class _GridTermAttention(torch.autograd.Function):
    """The lean engine for a 2-D relative embedding over a whole map (SASA / BoTNet).

    Whole map rows ``r .. r + m - 1`` of queries per block: ``q @ height^T`` gives one logit
    per row offset, read per map row as one per key row (:func:`_by_key_row`), and
    ``q @ width^T`` skewed one per key column; their broadcast sum ``[b, g, m W, H, W]`` is
    the block's mask. Backward: ``dS`` summed over key columns is the height logits'
    gradient, summed over key rows and sent back through the skew the width logits'; four
    small products give ``q``'s and the tables' gradients.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, height: Tensor, width: Tensor, scale: float
    ) -> Tensor:
        b, h, n = q.shape[:3]
        out = torch.empty_like(q)  # [b, h, n, d]
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)  # [b, h, n]
        height, width = height.detach(), width.detach()
        rows, cols = (height.shape[-2] + 1) // 2, (width.shape[-2] + 1) // 2
        step, groups = _grid_term_steps(b, h, n, cols, tuning.GRID_KERNEL_ROWS)
        buffers: _Buffers = {}  # the masks, reused while the block's shape is
        for hs in groups:
            for r in range(0, rows, step):
                blk = slice(r * cols, min(r + step, rows) * cols)
                attn_mask = _grid_term_mask(q[:, hs, blk], height, width, hs, r, scale, buffers)
                out[:, hs, blk], lse[:, hs, blk] = common._flash_cpu(
                    q[:, hs, blk], k[:, hs], v[:, hs], 0.0, False, attn_mask=attn_mask, scale=scale
                )  # [b, g, m W, d], [b, g, m W]
        ctx.save_for_backward(q, k, v, out, lse, height, width)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, height, width = ctx.saved_tensors
        scale = ctx.scale
        b, h, n = q.shape[:3]
        rows, cols = (height.shape[-2] + 1) // 2, (width.shape[-2] + 1) // 2
        groups = common._head_groups(b, h)
        g = groups[0].stop - groups[0].start
        step = max(
            1,
            min(rows, common._written_rows(b, g, n, n, tuning.GRID_TERM_WRITTEN_ELEMENTS) // cols),
        )
        grad_q = torch.empty_like(q)
        key_grads = _KeyGrads(k, v, groups)
        grad_height, grad_width = torch.zeros_like(height), torch.zeros_like(width)
        grad_out = grad_out.contiguous()
        padded: _Buffers = {}  # the width skew's adjoint, zero outside
        buffers: _Buffers = {}  # the masks (then P), reused while the block's shape is
        for r in range(0, rows, step):
            m = min(step, rows - r)
            blk = slice(r * cols, (r + m) * cols)
            for hs in groups:
                qh, kh, vh = q[:, hs, blk], k[:, hs], v[:, hs]  # [b, g, m W | n, d]
                gh, oh, lh = grad_out[:, hs, blk], out[:, hs, blk], lse[:, hs, blk]
                gq, _, grad_s = _block_grads(
                    qh, kh, vh, gh, oh, lh, None, scale, key_grads.of(hs), need_ds=True,
                    fresh_mask=functools.partial(
                        _grid_term_mask, qh, height, width, hs, r, scale, buffers
                    ),
                )  # fmt: skip
                per_cell = grad_s.view(*grad_s.shape[:2], m, cols, rows, cols)  # [b, g, m, W, H, W]
                # [b, g, m, W, 2H-1]: zero off the rows used (which move with r: a new buffer)
                grad_rows = per_cell.new_zeros(*per_cell.shape[:4], 2 * rows - 1)
                torch.sum(per_cell, dim=-1, out=_by_key_row(grad_rows, r))  # [b, g, m, W, H]
                grad_rows = grad_rows.flatten(2, 3)  # [b, g, m W, 2H-1]
                grad_cols = _unskew(per_cell.sum(dim=-2), padded, "w").flatten(2, 3)  # [.., 2W-1]
                term_q = (grad_rows @ _rows_of(height, hs)).add_(grad_cols @ _rows_of(width, hs))
                grad_q[:, hs, blk] = gq.add_(term_q.mul_(scale))
                d_height = (grad_rows.transpose(-2, -1) @ qh).sum(dim=0).mul_(scale)
                d_width = (grad_cols.transpose(-2, -1) @ qh).sum(dim=0).mul_(scale)
                if height.ndim == 2:  # a table shared by the heads: [2H-1 | 2W-1, d]
                    grad_height += d_height.sum(dim=0)
                    grad_width += d_width.sum(dim=0)
                else:
                    grad_height[hs] += d_height
                    grad_width[hs] += d_width
        grad_k, grad_v = key_grads.result()
        return grad_q, grad_k, grad_v, grad_height, grad_width, None


def _by_key_row(by_offset: Tensor, first: int) -> Tensor:
    """``[b, g, m, W, 2H-1]`` (one logit per row offset, contiguous) read per key row for the
    queries of map rows ``first .. first + m - 1``: ``[b, g, m, W, H]``, a view; map row
    ``first + i`` reads offsets ``-(first + i) .. H - 1 - first - i``, so each map row
    starts one column earlier (stride ``W (2H - 1) - 1``)."""
    b, g, m, w, span = by_offset.shape
    s = by_offset.stride()
    return by_offset.as_strided(
        (b, g, m, w, (span + 1) // 2),
        (s[0], s[1], s[2] - 1, s[3], 1),
        by_offset.storage_offset() + (span - 1) // 2 - first,
    )


def _grid_term_mask(
    q_blk: Tensor,
    height: Tensor,
    width: Tensor,
    heads: slice,
    r: int,
    scale: float,
    buffers: _Buffers,
) -> Tensor:
    """The 2-D term of the queries of map rows ``r .. r + m - 1``: ``[b, g, m W, H * W]``,
    contiguous, written into a reused buffer of ``buffers`` (:func:`_reused`): a
    buffer reused while it is in the caches, not a new one per block."""
    rows, cols = (height.shape[-2] + 1) // 2, (width.shape[-2] + 1) // 2
    b, g, count = q_blk.shape[:3]
    q_scaled = q_blk * scale  # [b, g, m W, d]
    # [b, g, m W, 2H-1] (contiguous: _by_key_row reads it with strides)
    by_offset = (q_scaled @ _rows_of(height, heads).transpose(-2, -1)).contiguous()
    by_row = _by_key_row(by_offset.view(b, g, -1, cols, 2 * rows - 1), r)  # [b, g, m, W, H]
    # [b, g, m W, C >= 2W-1]: the rows padded for the GEMM (tuning.GEMM_COLUMNS), the skew
    # reads the first 2W - 1 columns
    wide = pad_rows(_rows_of(width, heads), tuning.GEMM_COLUMNS)  # [(g,) C, d]
    by_col = q_scaled @ wide.transpose(-2, -1)  # [b, g, m W, C]
    by_col = skew_rows(by_col.view(b, g, -1, cols, wide.shape[-2]), cols)  # [b, g, m, W, W]
    # never clamped: content, as q . k is (see _term_mask)
    by_row = by_row.contiguous()  # small: read through its skewed strides, the sum was 3x slower
    shape = (b, g, count // cols, cols, rows, cols)
    out = _reused(buffers, f"mask {g}", shape, lambda: q_blk.new_empty(shape))  # [b, g, m, W, H, W]
    mask = torch.add(by_row[..., :, None], by_col[..., None, :], out=out)
    return mask.view(b, g, count, rows * cols)  # [b, g, m W, H * W]
