"""The per-offset bias path: a bias that depends on ``j - i`` only (ALiBi, T5, 1-D Swin),
given as one value per offset, with no ``[n_q, n_k]`` bias written.

With the keys reversed the bias is a Hankel matrix, a strided view of the values.

Shape legend: ``b`` batch, ``h`` heads, ``g`` a head group, ``rows`` a block's queries,
``n_q`` queries, ``n_k`` keys, ``d`` head dim, ``W = n_q + n_k - 1`` offsets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from . import common, tuning
from .common import (
    _add_leading_sum,
    _block_grads,
    _heads_of,
    _kernel_rows,
    _KeyGrads,
)
from .workspace import borrowed


def _hankel(values_rev: Tensor, start: int, count: int, keys: slice) -> Tensor:
    """The mask of a per-offset bias for queries ``start .. start + count - 1`` and the keys
    reversed ``keys`` (key ``j' = n_k - 1 - j``): ``[1, g|1, count, len(keys)]``, a view.

    The pair ``(i, j)`` takes column ``j - i + n_q - 1`` of ``values [g|1, W]``: with the keys
    reversed, column ``W - 1 - (i + j')``, so ``values_rev`` (the columns reversed) holds
    it at ``i + j'``, and the mask is a view with strides ``(1, 1)``: no buffer, and reads
    that stay in the caches.
    """
    width = values_rev.shape[-1]
    return values_rev.as_strided(
        (1, values_rev.shape[0], count, keys.stop - keys.start),
        (values_rev.numel(), width, 1, 1),
        values_rev.storage_offset() + start + keys.start,
    )


def _offset_kernel_values(
    values: Tensor, n_q: int, n_k: int, span: Callable[[], float], *, causal: bool = False
) -> Tensor | None:
    """A per-offset bias ready for the fused kernel: ``[h|1, n_q + n_k - 1]``, detached.

    Far biases are raised to ``span()`` below the best (see :func:`_bias_span`), which is
    asked for only when a head's values spread over more than ``tuning.BIAS_SPAN`` (the
    least it returns: it reads every query and key). The
    general path does this row by row; per offset it is the same when every row meets the
    best offset (self-attention meets offset 0, ALiBi's best), so that the rows' bests are
    the overall best. None when a head spans more than ``tuning.BIAS_SPAN`` and some row misses
    its best: then the general path must raise them row by row.

    A causal mask (aligned at the end, ``n_q <= n_k``) hides the columns ``n_k ..`` (key
    index minus query index above ``n_k - n_q``): they are set to ``-inf``, every row keeps
    at least its diagonal.
    """
    values = values.detach()
    visible = values[..., :n_k] if causal else values
    low, high = torch.aminmax(visible, dim=-1, keepdim=True)  # [h|1, 1]
    spread = float((high - low).max())
    if spread > tuning.BIAS_SPAN and spread > (reach := span()):
        seen_by_all = values[..., n_q - 1 : n_k]  # offsets every row meets (none if n_q > n_k)
        if seen_by_all.shape[-1] == 0 or not torch.equal(seen_by_all.amax(-1, keepdim=True), high):
            return None
        values = torch.maximum(values, high - reach)
    if causal:
        hidden = torch.arange(n_k, values.shape[-1], device=values.device)
        values = values.index_fill(-1, hidden, float("-inf"))  # a copy: values stay intact
    return values


class _SkewedBias:
    """Every block's mask of a per-offset bias as a view of one buffer (no copy per block).

    The buffer ``[g|1, rows, W]`` (``W = n_q + n_k - 1``, ``g`` the heads of one block of
    the written-out backward, 1 for values shared by the heads) holds the values once per
    row; read with row stride ``W - 1`` from column ``n_q - 1 - start``, row ``i`` of the
    view is shifted left by ``start + i``: ``view[i, j] = values[j - (start + i) + n_q -
    1]``, the bias of query ``start + i`` and key ``j``. A gradient buffer of the same
    layout, written through the same views (their rows never overlap), holds ``dS`` per
    offset. (The forward and the fused backward need no buffer: see :func:`_hankel`.)
    """

    def __init__(self, values: Tensor, n_q: int, n_k: int, rows: int) -> None:
        heads, width = values.shape
        self.buffer = values.new_empty(heads, rows, width)  # [g|1, rows, W]
        self.n_q, self.n_k, self.rows, self.width = n_q, n_k, rows, width
        self.fill(values)

    def fill(self, values: Tensor) -> None:
        """Hold ``values [g|1, W]`` (another head group's), in the same buffer when it fits."""
        if values.shape[0] != self.buffer.shape[0]:
            self.buffer = values.new_empty(values.shape[0], self.rows, self.width)
        self.buffer.copy_(values[:, None].expand_as(self.buffer))

    def block(
        self, start: int, count: int, keys: int | None = None, buffer: Tensor | None = None
    ) -> Tensor:
        """``[1, g|1, count, keys]``: the bias of queries ``start .. start + count - 1`` for
        the first ``keys`` keys (default all); a view of the buffer, or of ``buffer`` (a
        gradient buffer of its shape, whose rows summed give the gradient per offset)."""
        buffer, w = self.buffer if buffer is None else buffer, self.width
        return buffer.as_strided(
            (1, buffer.shape[0], count, self.n_k if keys is None else keys),
            (buffer.numel(), self.rows * w, w - 1, 1),
            buffer.storage_offset() + self.n_q - 1 - start,
        )

    @staticmethod
    def per_group(
        values: Tensor, groups: list[slice], n_q: int, n_k: int, rows: int
    ) -> Iterator[tuple[slice, _SkewedBias]]:
        """``(heads, buffer)`` per head group: one buffer refilled with each group's heads
        when the group comes (the kernel calls are synchronous), or once with values shared
        by the heads."""
        shared = values.shape[0] == 1
        skewed = _SkewedBias(values if shared else values[groups[0]], n_q, n_k, rows)
        for i, hs in enumerate(groups):
            if i and not shared:
                skewed.fill(values[hs])
            yield hs, skewed


class _OffsetFusedAttention(torch.autograd.Function):
    """The lean engine for a bias that depends on the offset ``j - i`` only.

    For consecutive positions with no mask, a relative bias (ALiBi, T5, 1-D relative table)
    is ``toeplitz(values)``. With the keys (and values) reversed it is a Hankel matrix, a
    view of the values themselves (:func:`_hankel`): the forward runs the kernel over all
    queries and heads in one call, as the floor does, and the fused backward (nothing to
    learn) over all queries a head group at a time (the reversed keys and their gradients
    are the group's). A learned table
    needs ``dS``: its backward is written out over short blocks (:func:`_written_rows`) in
    key order, with masks that are views of one :class:`_SkewedBias` buffer per head group,
    and ``dS`` summed over the batch into a buffer of the same layout, whose rows summed
    give the gradient per offset: no ``[rows, n_k]`` bias is written, clamped or summed.
    Under a causal mask (folded into the values as ``-inf``) the kernel runs over blocks of
    :data:`tuning.CAUSAL_ROWS` that stop at the last key their queries see: it skips about half
    the work, as with its own causal flag.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        values: Tensor,
        kernel_values: Tensor,
        scale: float,
        causal: bool,
        keep: bool,
    ) -> Tensor:
        n_q, n_k = q.shape[2], k.shape[2]
        values_rev = kernel_values.flip(-1).contiguous()  # [h|1, W]
        blocks = list(_kernel_blocks(n_q, n_k, causal))
        # [b, h, n_k, d] each, keys reversed: in the kept buffer where ``keep`` (no backward
        # to come: with one, its peak would hold the buffer too)
        with _reversed(k, v, keep=keep) as (k_rev, v_rev):
            if len(blocks) == 1:  # every query in one call: the kernel's own output
                out, lse = common._flash_cpu(
                    q, k_rev, v_rev, 0.0, False,
                    attn_mask=_hankel(values_rev, 0, n_q, blocks[0][1]), scale=scale,
                )  # fmt: skip
            else:
                out = torch.empty_like(q)  # [b, h, n_q, d]
                lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)  # [b, h, n_q]
                for blk, keys in blocks:
                    out[:, :, blk], lse[:, :, blk] = common._flash_cpu(
                        q[:, :, blk], k_rev[:, :, keys], v_rev[:, :, keys], 0.0, False,
                        attn_mask=_hankel(values_rev, blk.start, blk.stop - blk.start, keys),
                        scale=scale,
                    )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, kernel_values)
        ctx.scale, ctx.learn, ctx.causal = scale, values.requires_grad, causal
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, kernel_values = ctx.saved_tensors
        scale, causal = ctx.scale, ctx.causal
        grad_out = grad_out.contiguous()
        if not ctx.learn:  # the fused backward, on the keys reversed as the forward
            return (
                *_offset_fused_backward(grad_out, q, k, v, out, lse, kernel_values, scale, causal),
                None,
                None,
                None,
                None,
                None,
            )
        b, h, n_q, _ = q.shape
        n_k = k.shape[2]
        grad_q = torch.empty_like(q)
        grad_values = torch.zeros_like(kernel_values)  # [h|1, W]
        groups = common._head_groups(b, h)
        key_grads = _KeyGrads(k, v, groups)
        rows = common._written_rows(b, groups[0].stop - groups[0].start, n_q, n_k)
        shared = kernel_values.shape[0] == 1  # one bias for every head
        for hs, skewed in _SkewedBias.per_group(kernel_values, groups, n_q, n_k, rows):
            # dS summed over the batch (and heads, if shared) at its mask's place
            grad_masks = torch.zeros_like(skewed.buffer)  # [g|1, rows, W]
            for start in range(0, n_q, rows):
                blk = slice(start, min(start + rows, n_q))
                count = blk.stop - start
                seen = _keys_seen(blk, n_q, n_k, causal)
                attn_mask = skewed.block(start, count, seen)  # [1, g|1, rows, seen]
                qh, kh, vh = q[:, hs, blk], k[:, hs, :seen], v[:, hs, :seen]  # [b, g, ., d]
                gh, oh, lh = grad_out[:, hs, blk], out[:, hs, blk], lse[:, hs, blk]
                gq, _, grad_s = _block_grads(
                    qh, kh, vh, gh, oh, lh, attn_mask, scale, key_grads.of(hs, seen),
                    need_ds=True,
                )  # fmt: skip
                grad_q[:, hs, blk] = gq
                if grad_s is not None:  # [b, g, count, seen]
                    view = skewed.block(start, count, seen, grad_masks)[0]  # [g|1, count, seen]
                    _add_leading_sum(view, grad_s, 2 if shared else 1)
            grad_values[0 if shared else hs] += grad_masks.sum(dim=1).squeeze(0)
        grad_k, grad_v = key_grads.result()
        return grad_q, grad_k, grad_v, grad_values, None, None, None, None


@contextmanager
def _reversed(k: Tensor, v: Tensor, *, keep: bool = True) -> Iterator[tuple[Tensor, Tensor]]:
    """``(k_rev, v_rev)``: ``k`` and ``v [b, g, n_k, d]`` with their keys in reverse order,
    valid inside the block only, written into the thread's kept buffer where ``keep``
    (:class:`~.workspace.borrowed`): a new tensor of this size in each call is
    page-faulted as it is written whenever the C library has handed the last one back to
    the system."""
    count = k.numel()
    with borrowed(count + v.numel(), k.dtype, k.device, keep=keep) as flat:
        k_rev = _rows_reversed(k, flat[:count].view(k.shape))
        v_rev = _rows_reversed(v, flat[count : count + v.numel()].view(v.shape))
        yield k_rev, v_rev


def _rows_reversed(x: Tensor, out: Tensor) -> Tensor:
    """``out [b, g, n, d]``, written with the rows of ``x [b, g, n, d]`` in reverse order
    (``out[:, :, i] = x[:, :, n - 1 - i]``): one ``index_select`` of whole rows of ``d``
    values, a copy of each row at about the cost of a plain copy, where each row of ``x`` is
    dense and starts a multiple of ``d`` values after its first and ``out`` is contiguous;
    else ``flip``, whose element-wise strided copy costs about twice as much."""
    b, g, n, d = x.shape
    strides = x.stride()
    rows_of_d = d and strides[3] == 1 and not any(s % d for s in strides[:3])
    if not rows_of_d or x.numel() == 0 or not out.is_contiguous():
        return torch.ops.aten.flip.out(x, [2], out=out)
    sb, sg, sn = (s // d for s in strides[:3])
    device = x.device
    # [b, g, n]: the row of x (counted in rows of d from x's first value) of each output row
    rows = (
        (torch.arange(b, device=device) * sb)[:, None, None]
        + (torch.arange(g, device=device) * sg)[None, :, None]
        + (torch.arange(n - 1, -1, -1, device=device) * sn)[None, None, :]
    )
    last = (b - 1) * sb + (g - 1) * sg + (n - 1) * sn
    source = x.as_strided((last + 1, d), (d, 1))  # [rows, d], every row of x
    torch.index_select(source, 0, rows.view(-1), out=out.view(-1, d))
    return out


def _kernel_blocks(n_q: int, n_k: int, causal: bool) -> Iterator[tuple[slice, slice]]:
    """``(query rows, keys seen reversed)`` per fused-kernel call on the per-offset bias path
    (:func:`_kernel_rows` rows a call)."""
    rows = _kernel_rows(n_q, causal)
    for start in range(0, n_q, rows):
        blk = slice(start, min(start + rows, n_q))
        yield blk, slice(n_k - _keys_seen(blk, n_q, n_k, causal), n_k)


def _offset_fused_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    kernel_values: Tensor,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of the per-offset bias path by the fused kernel's backward, on the keys
    reversed (:func:`_hankel` masks) as its forward, a head group at a time (the reversed
    keys, in the thread's kept buffer, and their gradients are the group's: peak memory
    stays the floor's); no gradient for the values."""
    b, h = q.shape[:2]
    values_rev = kernel_values.flip(-1).contiguous()  # [h|1, W]
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    blocks = list(_kernel_blocks(q.shape[2], k.shape[2], causal))
    for hs in common._head_groups(b, h):
        rev = _heads_of(values_rev[None], hs)[0]  # [g|1, W]
        grad_k_rev = grad_v_rev = None
        with _reversed(k[:, hs], v[:, hs]) as (k_rev, v_rev):  # [b, g, n_k, d], keys reversed
            for blk, keys in blocks:
                gq, gk, gv = common._flash_cpu_backward(
                    grad_out[:, hs, blk], q[:, hs, blk], k_rev[:, :, keys], v_rev[:, :, keys],
                    out[:, hs, blk], lse[:, hs, blk], 0.0, False,
                    attn_mask=_hankel(rev, blk.start, blk.stop - blk.start, keys), scale=scale,
                )  # fmt: skip
                grad_q[:, hs, blk] = gq
                if len(blocks) == 1:  # every key: the kernel's own gradients
                    grad_k_rev, grad_v_rev = gk, gv
                    continue
                if grad_k_rev is None or grad_v_rev is None:
                    grad_k_rev, grad_v_rev = torch.zeros_like(k_rev), torch.zeros_like(v_rev)
                grad_k_rev[:, :, keys] += gk
                grad_v_rev[:, :, keys] += gv
        if grad_k_rev is not None and grad_v_rev is not None:
            _rows_reversed(grad_k_rev, grad_k[:, hs])
            _rows_reversed(grad_v_rev, grad_v[:, hs])
    return grad_q, grad_k, grad_v


def _keys_seen(blk: slice, n_q: int, n_k: int, causal: bool) -> int:
    """How many keys the queries ``blk`` see: all, or under a causal mask aligned at the end
    up to key ``blk.stop - 1 + n_k - n_q``."""
    return min(n_k, blk.stop + n_k - n_q) if causal else n_k
