"""The FlexAttention path: a scheme's ``flex_score_mod`` (a bias) and ``flex_term_mod`` (a
query term of bounded reach) and a ``BlockMask`` for the masks; no backward on CPU in
torch 2.13.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from ..hooks import Hooks
from .mask import Mask


@functools.cache
def _compiled_flex(device_type: str = "cpu") -> Callable[..., Tensor]:
    """FlexAttention compiled for ``device_type``: on CUDA with torch's automatic dynamic
    shapes (one graph for the lengths after a second one is seen), on CPU one graph per
    shape (torch 2.13's CPU lowering of FlexAttention fails on symbolic lengths)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=None if device_type == "cuda" else False)


class _NoBackward(torch.autograd.Function):
    """``x`` (computed without a graph) as a result of ``inputs`` whose backward raises:
    FlexAttention has no CPU backward in torch 2.13."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, *inputs: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, ...]:
        raise RuntimeError(
            "backend='flex' has no backward on CPU (FlexAttention in this torch version "
            "serves inference only there); train with backend='auto' (or 'sdpa'/'math') "
            "and switch to 'flex' for inference"
        )


def _chain(mods: list[Callable[..., Tensor] | None]) -> Callable[..., Tensor] | None:
    """The ``score_mod`` that applies each of ``mods`` (None ones skipped) in turn."""
    present = [m for m in mods if m is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def chained(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        for mod in present:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    return chained


@functools.lru_cache(maxsize=32)
def _shape_block_mask(
    n_q: int, n_k: int, causal: bool, behind: int | None, ahead: int | None, device: str
) -> Any:
    """A ``BlockMask`` of a mask of the shape alone, built once per shape and device."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask = Mask(n_q, n_k, causal=causal, behind=behind, ahead=ahead)
    return create_block_mask(mask.flex_mask_mod(), None, None, n_q, n_k, device=device)


def _block_mask(mask: Mask, batch: int | None, heads: int | None, device: Any) -> Any:
    """``mask`` as a ``BlockMask`` for ``batch`` sequences and ``heads`` heads (None: any,
    when the mask does not depend on them); cached when it depends on the shape alone."""
    from torch.nn.attention.flex_attention import create_block_mask

    shape_only = replace(mask, causal=False, behind=None, ahead=None).empty
    if shape_only:
        place = torch.device(device)
        if place.type == "cuda" and place.index is None:  # the current device, by its index
            place = torch.device("cuda", torch.cuda.current_device())
        return _shape_block_mask(
            mask.n_q, mask.n_k, mask.causal, mask.behind, mask.ahead, str(place)
        )
    return create_block_mask(mask.flex_mask_mod(), batch, heads, mask.n_q, mask.n_k, device=device)


def _plus_bias(score_mod: Callable[..., Tensor] | None, bias: Tensor) -> Callable[..., Tensor]:
    """``score_mod`` (or the identity) followed by adding ``bias [b|1, h|1, n_q, n_k]`` (a
    float ``attn_mask``)."""
    per_batch, per_head = bias.shape[0] > 1, bias.shape[1] > 1

    def plus_bias(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if score_mod is not None:
            score = score_mod(score, b, h, q_idx, kv_idx)
        return score + bias[b if per_batch else 0, h if per_head else 0, q_idx, kv_idx]

    return plus_bias


def _flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    hooks: Hooks,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    scale: float,
    dropout_p: float,
    params: tuple[Tensor, ...] = (),
) -> Tensor:
    """FlexAttention with the hooks' score_mods and the mask's block mask: ``[b, h, n_q, d]``
    (``params``: the scheme's parameters, for the error a CPU backward raises)."""
    if hooks.value_term is not None:
        raise ValueError(
            "backend='flex' cannot add a value term (Shaw's a^V needs the attention weights); "
            "use backend='auto'"
        )
    if hooks.contextual_term is not None:
        raise ValueError(
            "backend='flex' cannot add a contextual term (CoPE reads each query's whole row "
            "of masked logits, which a score_mod, one score at a time, cannot); use "
            "backend='auto', 'math' or 'sdpa'"
        )
    if hooks.score_term is not None and hooks.flex_term_mod is None:
        raise ValueError(
            "backend='flex' takes a query term only with a bounded reach (flex_term_mod: "
            "Shaw's keys, a relative embedding of max_len); use backend='auto' for this scheme"
        )
    if hooks.score_bias is not None and hooks.flex_score_mod is None:
        raise ValueError(
            "backend='flex' needs the scheme to define flex_score_mod(q_pos, k_pos); "
            "use backend='auto' for this scheme"
        )
    if dropout_p > 0:
        raise ValueError("backend='flex' has no attention dropout; set dropout=0 or use 'auto'")
    # on CPU there is no backward: no graph at all (FlexAttention refuses an input that
    # requires grad, and a captured table that requires grad fails to compile), and a result
    # whose backward says so
    on_cpu = q.device.type == "cpu"
    with torch.no_grad() if on_cpu else contextlib.nullcontext():
        inputs = (q.detach(), k.detach(), v.detach()) if on_cpu else (q, k, v)
        out = _flex_forward(*inputs, hooks, q_pos, k_pos, mask, scale)
    graph = (q, k, v, *params)
    if on_cpu and torch.is_grad_enabled() and any(x.requires_grad for x in graph):
        out = _NoBackward.apply(out, *graph)
    return out


#: the channels of q and k, at least, that the compiled CPU kernel is given (fewer are
#: padded with zeros: see _flex_forward)
_CPU_HEAD_DIM = 32


def _flex_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    hooks: Hooks,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    scale: float,
) -> Tensor:
    """The score_mods, the block mask and the compiled FlexAttention call of :func:`_flex`."""
    b = q.shape[0]
    if hooks.score_bias is not None and q_pos.shape[-1] and k_pos.shape[-1]:
        hooks.score_bias(q_pos[:, :1], k_pos[:, :1])  # its shape checked: heads 1 or h
    mods = []
    if hooks.score_term is not None:
        mods.append(hooks.flex_term_mod(q, q_pos.expand(b, -1), k_pos.expand(b, -1), scale))
    if hooks.flex_score_mod is not None:
        mods.append(hooks.flex_score_mod(q_pos.expand(b, -1), k_pos.expand(b, -1)))
    if mask.bias is not None:
        mods.append(_plus_bias(None, mask.added().to(q.dtype)))
    score_mod = _chain(mods)
    block_mask = None
    has_key: Tensor | None = None
    if not replace(mask, bias=None).empty:
        # a mask per head is classified block by block for every head (None: head 0's)
        heads = q.shape[1] if mask.allowed is not None and mask.allowed.shape[1] > 1 else None
        block_mask = _block_mask(mask, b, heads, q.device)
        shape_only = replace(mask, causal=False, behind=None, ahead=None, bias=None).empty
        # a mask of the shape alone, queries no more than keys: each sees its aligned key
        if not (shape_only and 0 < mask.n_q <= mask.n_k):
            keep = mask.shared_keep(device=q.device)
            if keep is not None:
                has_key = keep.any(dim=-1, keepdim=True)
    flex = _compiled_flex(q.device.type)
    if q.device.type == "cpu" and q.shape[-1] < _CPU_HEAD_DIM:
        # torch 2.13's compiled CPU kernel gives NaN or wrong rows for q and k of 8 or 16
        # channels where both lengths are 8 more than a multiple of 16 (4, 12, 24 and
        # 32-128 channels were right): zero channels change no score (the score_mods read
        # their own q, and the scale is given)
        widen = (0, _CPU_HEAD_DIM - q.shape[-1])
        q, k = torch.nn.functional.pad(q, widen), torch.nn.functional.pad(k, widen)
    out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
    if has_key is not None:
        out = out * has_key
    return out
