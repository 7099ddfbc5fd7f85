"""What the fused lean paths share: PyTorch's CPU flash kernels, head groups, the kernel's
additive mask, a block's written-out backward, the key-gradient buffers, reused buffers.

Shape legend: ``b`` batch, ``h`` heads, ``g`` the heads of one head group, ``rows`` the
queries of one block, ``n_q`` queries, ``n_k`` keys, ``d`` head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ..hooks import Hooks
from . import tuning
from .mask import Mask

_SHARE_FLOOR = math.exp(-tuning.EXP_FLOOR)


def _exp_no_denormals(x: Tensor) -> Tensor:
    """``exp(x)`` in place, exactly 0 where ``x < -tuning.EXP_FLOOR`` (see :data:`tuning.EXP_FLOOR`)."""
    return x.masked_fill_(x < -tuning.EXP_FLOOR, float("-inf")).exp_()


def _bias_span(q: Tensor, k: Tensor, scale: float) -> float:
    """How far below its row's best a content-free bias may be raised with no visible change.

    A key whose bias is raised from below ``best - span`` to ``best - span`` has a weight at
    most ``exp(C - span)`` times that of the row's best-bias key, where ``C`` bounds how much
    the content scores ``scale * q_i . k_j`` can differ within a row:
    ``C = 2 * scale * max|q_i| * max|k_j|``. With ``span = C + log(n_k) + log(2 / eps)`` the
    weight all raised keys gain together is below ``eps`` (the dtype's resolution) of the
    row's, and the result is the definition's up to rounding. Returns ``max(tuning.BIAS_SPAN,
    that)``: usually ``tuning.BIAS_SPAN``; a larger span for large content scores (correct, and
    slower where the far keys then reach the denormal range).
    """
    n_k = k.shape[-2]
    if q.numel() == 0 or n_k == 0:
        return tuning.BIAS_SPAN
    q_norm = torch.linalg.vector_norm(q.detach(), dim=-1).amax()
    k_norm = torch.linalg.vector_norm(k.detach(), dim=-1).amax()
    reach = 2 * scale * float(q_norm * k_norm)
    margin = math.log(n_k) + math.log(2 / torch.finfo(q.dtype).eps)
    return max(tuning.BIAS_SPAN, reach + margin)


def _kernel_rows(n_q: int, causal: bool = False) -> int:
    """Query rows per fused-kernel call on the per-offset bias path: all of them (its masks
    are views of the values, of any size), or :data:`tuning.CAUSAL_ROWS` under a causal mask."""
    return max(1, min(n_q, tuning.CAUSAL_ROWS) if causal else n_q)


def _written_rows(b: int, g: int, n_q: int, n_k: int, elements: int | None = None) -> int:
    """Query rows per block of a written-out backward: about ``elements`` scores (default
    :data:`tuning.WRITTEN_BLOCK_ELEMENTS`), at most 512 rows."""
    elements = tuning.WRITTEN_BLOCK_ELEMENTS if elements is None else elements
    return max(1, min(n_q, 512, elements // max(1, b * g * n_k)))


def lean_block_rows(b: int, h: int, n_q: int, n_k: int) -> int:
    """Query rows per block: about :data:`tuning.LEAN_BLOCK_ELEMENTS` scores, 16 to 512 rows."""
    rows = tuning.LEAN_BLOCK_ELEMENTS // max(1, b * h * n_k)
    return max(1, min(n_q, 512, 1 << max(4, rows.bit_length() - 1)))


def _sum_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum ``grad`` over the dimensions that were broadcast from size 1 in ``shape``."""
    dims = [i for i, (g, s) in enumerate(zip(grad.shape, shape, strict=True)) if s == 1 and g != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def _sum_into(dest: Tensor, grad: Tensor) -> None:
    """``dest[...] = _sum_to(grad, dest.shape)``, the sum written in place (no extra pass)."""
    dims = [i for i, (g, s) in enumerate(zip(grad.shape, dest.shape, strict=True)) if s == 1 < g]
    if dims and dest.is_contiguous():
        torch.sum(grad, dim=dims, keepdim=True, out=dest)
    else:
        dest.copy_(_sum_to(grad, dest.shape))


def _add_leading_sum(dest: Tensor, x: Tensor, dims: int = 1) -> None:
    """``dest += x.sum(dim=range(dims))``, as one in-place add per slice: a sum over a
    leading dimension into a strided view is a slow reduction on CPU."""
    for part in x.flatten(0, dims - 1) if dims > 1 else x:
        dest.add_(part)


def _fused_cpu_available(q: Tensor, v: Tensor, hooks: Hooks) -> bool:
    """Whether the fused CPU flash kernels can run the lean engine for these inputs (on the
    CPU, float32 or float64, values of the queries' head dim, no value term)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and v.shape[-1] == q.shape[-1]
        and hooks.value_term is None
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
    )


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


_flash_cpu_backward = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def _head_groups(b: int, h: int) -> list[slice]:
    """Heads per fused-kernel call: as few as keep every thread busy (``b * group >= threads``):
    the CPU flash kernel over a short block of rows and many heads costs far more than the
    same rows a head at a time."""
    group = max(1, min(h, -(-torch.get_num_threads() // max(1, b))))
    return [slice(s, min(s + group, h)) for s in range(0, h, group)]


def _heads_of(x: Tensor, heads: slice) -> Tensor:
    """``x[:, heads]``, or ``x`` itself when its head dimension is a broadcast 1."""
    return x if x.shape[1] == 1 else x[:, heads]


def _kernel_mask(
    extra: Tensor | None, keep: Tensor | None, like: Tensor, span: float
) -> Tensor | None:
    """The fused kernel's additive mask for one block of rows and heads.

    Args:
        extra: ``[B'|1, g|1, rows, n_k]`` the hooks' term for these heads (no graph), or None.
        keep: ``[b|1, g|1, rows, n_k]`` visible keys, rows with no visible key set all True
            (their output is zeroed after), or None.
        like: a tensor of the kernel's dtype and device.
        span: biases more than ``span`` below the best of their row are raised to that
            level (:func:`_bias_span`; ``inf`` for a term, which is never raised).

    Returns:
        ``[B'|1, g|1, rows, n_k]`` contiguous, masked keys at -inf; None when there is
        nothing to add.
    """
    if extra is None and keep is None:
        return None
    mask = torch.zeros((), dtype=like.dtype, device=like.device) if extra is None else extra
    mask = mask.to(like.dtype)
    if extra is not None:
        low, high = torch.aminmax(mask)
        if float(high - low) > span:
            # no visible key more than span below the row's best bias (see tuning.BIAS_SPAN)
            best = mask if keep is None else mask.masked_fill(~keep, float("-inf"))
            mask = torch.maximum(mask, best.amax(dim=-1, keepdim=True) - span)
    if keep is not None:
        mask = mask.masked_fill(~keep, float("-inf"))
    # the kernel broadcasts [B'|1, g|1, rows, n_k] itself: no [b, g, rows, n_k] copy
    return mask.contiguous()


def _visible(mask: Mask, rows: slice, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """``(keep, has_key)`` for a block of rows: ``keep [b|1, h|1, rows, n_k]`` with rows that
    see no key opened to all keys, ``has_key [b|1, h|1, rows, 1]``; ``(None, None)``
    unmasked."""
    keep = mask.shared_keep(rows, device=device)
    if keep is None:
        return None, None
    has_key = keep.any(dim=-1, keepdim=True)
    return keep | ~has_key, has_key


def _group_masks(
    extra: Tensor | None, keep: Tensor | None, groups: list[slice], like: Tensor, span: float
) -> Iterator[tuple[slice, Tensor | None]]:
    """``(heads, attn_mask)`` per head group; a mask shared by the heads is built once."""
    shared: list[Tensor | None] = []
    for hs in groups:
        if (extra is not None and extra.shape[1] > 1) or (keep is not None and keep.shape[1] > 1):
            heads = [None if x is None else _heads_of(x, hs) for x in (extra, keep)]
            yield hs, _kernel_mask(heads[0], heads[1], like, span)
            continue
        if not shared:
            shared.append(_kernel_mask(extra, keep, like, span))
        yield hs, shared[0]


class _KeyGrads:
    """``dK`` and ``dV`` of the fused paths: one contiguous ``[b, g, n_k, d]`` buffer per head
    group, into which a written-out backward adds its products in place (``baddbmm_``)
    instead of adding a fresh ``[b, g, n_k, d]`` product per block.

    One head per group: the buffers are heads of one ``[h, b, n_k, d]`` tensor, and the
    result is that tensor seen as ``[b, h, n_k, d]`` (no copy). One group of every head: its
    buffers. Otherwise the buffers are concatenated at the end."""

    def __init__(self, k: Tensor, v: Tensor, groups: list[slice]) -> None:
        b, h, n_k, _ = k.shape
        self.single = all(hs.stop - hs.start == 1 for hs in groups)
        if self.single:  # [h, b, n_k, d]: head s is [b, 1, n_k, d], contiguous per batch
            self.by_head = (
                k.new_zeros(h, b, n_k, k.shape[-1]),
                v.new_zeros(h, b, n_k, v.shape[-1]),
            )
            return
        sizes = {hs.start: hs.stop - hs.start for hs in groups}
        self.k = {s: k.new_zeros(b, g, n_k, k.shape[-1]) for s, g in sizes.items()}
        self.v = {s: v.new_zeros(b, g, n_k, v.shape[-1]) for s, g in sizes.items()}

    def of(self, heads: slice, keys: int | None = None) -> tuple[Tensor, Tensor]:
        """The accumulators of a head group for its first ``keys`` keys (default all)."""
        if self.single:
            gk, gv = (x[heads].transpose(0, 1) for x in self.by_head)  # [b, 1, n_k, d]
            return gk[:, :, :keys], gv[:, :, :keys]
        return self.k[heads.start][:, :, :keys], self.v[heads.start][:, :, :keys]

    def result(self) -> tuple[Tensor, Tensor]:
        """``(dK, dV)``: ``[b, h, n_k, d]`` each."""
        if self.single:
            return self.by_head[0].transpose(0, 1), self.by_head[1].transpose(0, 1)
        if len(self.k) == 1:  # one group of every head: the buffers themselves
            return next(iter(self.k.values())), next(iter(self.v.values()))
        return torch.cat(list(self.k.values()), dim=1), torch.cat(list(self.v.values()), dim=1)


def _block_grads(
    qh: Tensor,
    kh: Tensor,
    vh: Tensor,
    gh: Tensor,
    oh: Tensor,
    lh: Tensor,
    attn_mask: Tensor | None,
    scale: float,
    grads: tuple[Tensor, Tensor],
    *,
    need_ds: bool,
    extra_dp: Tensor | None = None,
    floor: bool = False,
    fresh_mask: Callable[[], Tensor] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One block's backward on the fused paths: ``(dq, P, dS)``; ``dk`` and ``dv`` are added
    to ``grads``.

    Without ``need_ds``, the fused kernel's backward (``P`` and ``dS`` None). With it, the
    same five products written out, because they yield ``dS = P (dP - D)``, which a
    scheme's table or query term needs: ``P = exp(S + mask - lse)``, ``dP = dO v^T``
    (plus ``extra_dp``, e.g. Shaw's ``a^V`` share), ``D = dO . O``. ``dq`` is
    ``dS k * scale`` alone: a term's share of it is the caller's.

    Args:
        qh, kh, vh: ``[b, g, rows | n_k, d]``; gh, oh: ``[b, g, rows, d]`` (``oh`` the
            whole output); lh: ``[b, g, rows]`` its logsumexp.
        attn_mask: broadcastable to ``[b, g, rows, n_k]``, or None.
        scale: the scores' scale.
        grads: ``(dK, dV)`` accumulators ``[b, g, n_k, d]`` from :class:`_KeyGrads`.
        need_ds: write the products out (and return ``P`` and ``dS``).
        extra_dp: ``[b, g, rows, n_k]`` added to ``dP`` (a value term's share), or None.
        floor: ``P`` by :func:`_exp_no_denormals` (a block whose rows' weight lies
            mostly elsewhere, e.g. Shaw's strip beside its far parts).
        fresh_mask: instead of ``attn_mask``, a function giving a contiguous mask
            ``[b, g, rows, n_k]`` the caller may reuse (then ``P``, returned, is that
            buffer and lasts until the next call), into which the scores are accumulated
            (a mask built per block: one pass fewer than adding it to the scores). ``lse``
            is subtracted after: folded into the mask first, float32 would lose precision
            for a term in the hundreds.

    Returns:
        ``(dq [b, g, rows, d], P, dS)``, ``P`` and ``dS`` ``[b, g, rows, n_k]`` or None.
    """
    grad_k, grad_v = grads
    if not need_ds:
        gq, gk, gv = _flash_cpu_backward(
            gh, qh, kh, vh, oh, lh, 0.0, False, attn_mask=attn_mask, scale=scale
        )
        grad_k += gk
        grad_v += gv
        return gq, None, None
    b, g, rows, _ = qh.shape
    n_k = kh.shape[2]
    q_scaled = qh * scale  # [b, g, rows, d], with q's strides
    # no floor on exp unless asked: a bias mask is within tuning.BIAS_SPAN of its row's best, and a
    # term (never clamped) is content, as q . k is
    if fresh_mask is not None:
        probs = fresh_mask()  # [b, g, rows, n_k]
        probs.view(b * g, rows, n_k).baddbmm_(
            q_scaled.reshape(b * g, rows, -1), kh.reshape(b * g, n_k, -1).transpose(1, 2)
        )
    else:
        probs = torch.matmul(q_scaled, kh.transpose(-2, -1))  # [b, g, rows, n_k]
        if attn_mask is not None:
            probs = probs.add_(attn_mask)
    probs = probs.sub_(lh.unsqueeze(-1))
    probs = _exp_no_denormals(probs) if floor else probs.exp_()
    grad_s = gh @ vh.transpose(-2, -1)  # [b, g, rows, n_k]: dP through v
    if extra_dp is not None:
        grad_s += extra_dp
    grad_s = grad_s.sub_((gh * oh).sum(dim=-1, keepdim=True)).mul_(probs)
    gq = (grad_s @ kh).mul_(scale)
    # dK += dS^T (q scale), dV += P^T dO, in place: [b g, n_k, rows] @ [b g, rows, d]
    grad_k.view(b * g, n_k, -1).baddbmm_(
        grad_s.view(b * g, rows, n_k).transpose(1, 2), q_scaled.reshape(b * g, rows, -1)
    )  # (q scaled keeps q's strides: a view of a [b, n, h, d] projection is no batch)
    grad_v.view(b * g, n_k, -1).baddbmm_(
        probs.view(b * g, rows, n_k).transpose(1, 2), gh.reshape(b * g, rows, -1)
    )
    return gq, probs, grad_s


#: reused block buffers: tag -> (what it was made for, the buffer)
_Buffers = dict[str, tuple[tuple[Any, ...], Tensor]]


def _reused(
    buffers: _Buffers, tag: str, key: tuple[Any, ...], make: Callable[[], Tensor]
) -> Tensor:
    """The buffer ``tag`` if it was made for ``key``, else ``make()`` (which replaces it):
    one buffer per tag, so that blocks of one shape share it and memory stays one block's
    when every block differs (under a causal mask each block has its own keys: a buffer per
    shape kept them all, found by the bench, causal relative memory 1.41x -> 1.75x)."""
    if tag not in buffers or buffers[tag][0] != key:
        buffers[tag] = (key, make())
    return buffers[tag][1]


def _widen(x: Tensor, width: int, lo: int, fill: float, buffers: _Buffers) -> Tensor:
    """``x [..., c]`` as the columns ``lo .. lo + c - 1`` of ``[..., width]``, ``fill``
    elsewhere: ``x`` itself when it has every column, else a buffer reused per shape and
    place (its ``fill`` written once)."""
    if x.shape[-1] == width:
        return x
    shape = (*x.shape[:-1], width)
    tag, key = f"widen {fill} {x.shape[:2]}", (lo, x.shape[-1], *shape)  # (see _unskew)
    out = _reused(buffers, tag, key, lambda: x.new_full(shape, fill))
    out[..., lo : lo + x.shape[-1]] = x
    return out


def _dense_last(*xs: Tensor) -> tuple[Tensor, ...]:
    """The tensors with a dense last dimension, which the fused kernels read as such (a
    rotation written as a view, e.g. the channels of a 2-D RoPE re-interleaved, can leave
    it strided): a copy only where it is not."""
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)
