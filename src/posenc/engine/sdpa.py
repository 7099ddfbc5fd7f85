"""The SDPA path: :func:`torch.nn.functional.scaled_dot_product_attention` with the score
term and the bias folded into its ``attn_mask``; a contextual term (CoPE) too, read from
the logits that this path computes once more for it.

Where SDPA would run its fused CPU kernel with gradients asked for, the path runs that
kernel through :class:`_CPUFlash`: the same forward and first-order backward, and a
second derivative (``create_graph=True``) from SDPA's math kernel, which the fused
kernel's backward lacks; the dispatcher then needs no wrapper around the path
(``dispatch._exact_twice``).

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend

from .._memo import plain_autograd
from ..hooks import Hooks
from .blocks import _by_blocks, _mask_blocks
from .mask import Mask
from .reference import _contextual_extra, _fold_scores


def _sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    hooks: Hooks,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    scale: float,
    dropout_p: float,
    *,
    blocks: bool = True,
    bias: Tensor | None = None,
) -> Tensor:
    """SDPA with the hooks' terms and the mask in its ``attn_mask`` (``blocks``: a mask that
    runs in blocks, :func:`_mask_blocks`, does; False for a block itself; ``bias``: the
    scheme's bias for these positions where the caller has it)."""
    if hooks.value_term is not None:
        raise ValueError(
            "backend='sdpa' cannot add a value term (Shaw's a^V needs the attention weights); "
            "use backend='auto' or 'math'"
        )
    if hooks.contextual_term is not None:  # the logits once more, and the term read from them
        extra = _contextual_extra(hooks, q, k, q_pos, k_pos, mask, scale)
    else:
        extra = _fold_scores(hooks, q, q_pos, k_pos, scale, reference=False, mask=mask, bias=bias)
    if extra is None and dropout_p == 0 and blocks:
        pieces = _mask_blocks(mask, q, cut=False)
        if pieces is not None:  # padding at the ends, documents, a window: no [n_q, n_k] mask
            block = functools.partial(_sdpa, blocks=False)
            return _by_blocks(q, k, v, hooks, q_pos, k_pos, scale, pieces, block)
    keep = mask.shared_keep(device=q.device)
    has_key: Tensor | None = None
    is_causal = False
    if (
        keep is not None
        and extra is None
        and mask.causal
        and mask.n_q == mask.n_k
        and mask.causal_at_most
    ):
        keep, is_causal = None, True  # SDPA's own causal flag: its fastest path
    if keep is not None and not (mask.causal_at_most and mask.n_q <= mask.n_k):
        # a causal mask aligned at the end leaves every query key 0 when n_q <= n_k
        has_key = keep.any(dim=-1, keepdim=True)  # [b|1, 1, n_q, 1]
        keep = keep | ~has_key  # rows with no key attend to all keys, and are zeroed below
    if extra is None:
        attn_mask = keep
    else:
        attn_mask = extra.to(q.dtype)
        if keep is not None:
            attn_mask = attn_mask.masked_fill(~keep, float("-inf"))
    out = _kernel(q, k, v, attn_mask, dropout_p, is_causal, scale)
    if has_key is not None:
        out = out * has_key
    return out


#: :func:`torch._fused_sdp_choice`'s answer for the fused (flash) kernel
_FLASH = int(SDPBackend.FLASH_ATTENTION)


def _kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
) -> Tensor:
    """:func:`~torch.nn.functional.scaled_dot_product_attention`, or where it would run its
    fused CPU kernel with a gradient asked for (of ``q``, ``k`` or ``v``; a mask that asks
    for one, or dropout, makes SDPA take its math kernel), that kernel through
    :class:`_CPUFlash`: ``[b, h, n_q, d_v]``, the same values and gradients."""
    if (
        dropout_p == 0
        and q.device.type == "cpu"
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and q.numel() > 0
        and k.numel() > 0
        and v.numel() > 0  # SDPA answers empty inputs apart
        and (attn_mask is None or not attn_mask.requires_grad)
        and plain_autograd()
        and torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale) == _FLASH
    ):
        return _flash(q, k, v, attn_mask, is_causal, scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )


def _flash(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float
) -> Tensor:
    """:class:`_CPUFlash` with SDPA's mask: a boolean one (True = attend) made the float
    mask SDPA makes of it (0, ``-inf``): ``[b, h, n_q, d_v]``."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        hidden = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
        attn_mask = hidden.masked_fill_(~attn_mask, float("-inf"))
    return _CPUFlash.apply(q, k, v, attn_mask, is_causal, scale)


class _CPUFlash(torch.autograd.Function):
    """SDPA's fused CPU kernel with a second derivative.

    The forward and a first-order backward are the kernel's own
    (``_scaled_dot_product_flash_attention_for_cpu`` and its backward: the values and
    gradients SDPA gives). A backward with ``create_graph=True`` (gradient penalties,
    Hessian-vector products) differentiates SDPA's math kernel on the saved inputs with a
    graph, so that the second derivative is the definition's. The mask is a constant
    (float, ``-inf`` where a key is hidden).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        is_causal: bool,
        scale: float,
    ) -> Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )  # out [b, h, n_q, d_v], lse [b, h, n_q]
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the math kernel, with a graph
            slots = [x.view_as(x) for x in (q, k, v)]  # one per argument: q is k is v too
            # the kernel itself: sdpa_kernel() would set the process's SDPA flags
            ref, _ = torch.ops.aten._scaled_dot_product_attention_math(
                *slots, attn_mask, 0.0, ctx.is_causal, scale=ctx.scale
            )
            wrt = [x for x in slots if x.requires_grad]
            found = iter(torch.autograd.grad(ref, wrt, grad_out, create_graph=True))
            grads = [next(found) if x.requires_grad else None for x in slots]
        else:
            backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
            args = (grad_out, q, k, v, out, lse, 0.0, ctx.is_causal)
            grads = list(backward(*args, attn_mask=attn_mask, scale=ctx.scale))
        return (*grads, None, None, None)
