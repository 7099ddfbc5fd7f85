"""The SDPA path: :func:`torch.nn.functional.scaled_dot_product_attention` with the score
term and the bias folded into its ``attn_mask``; a contextual term (CoPE) too, read from
the logits that this path computes once more for it.

Where SDPA runs its fused CPU kernel with gradients asked for, whose backward is not
differentiable, the kernel's node in autograd's graph gets a hook (:func:`_kernel`): the
same forward and first-order backward as SDPA's (they are SDPA's), and a second derivative
(``create_graph=True``) from SDPA's math kernel; the dispatcher then needs no wrapper
around the path (``dispatch._exact_twice``).

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .._memo import eager, plain_autograd
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
    kept_bias: bool = False,
) -> Tensor:
    """SDPA with the hooks' terms and the mask in its ``attn_mask`` (``blocks``: a mask that
    runs in blocks, :func:`_mask_blocks`, does; False for a block itself; ``bias``: the
    scheme's bias for these positions where the caller has it; ``kept_bias``: that bias
    is the one a scheme of posenc's keeps between calls, ``kept_score_bias``'s, whose
    causal-masked form :func:`_causal_masked` keeps)."""
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
    elif keep is None:
        attn_mask = extra.to(q.dtype)
    elif kept_bias and extra is bias and mask.causal and mask.causal_at_most:
        attn_mask = _causal_masked(extra, keep, q.dtype)  # [B'|1, h|1, n_q, n_k]
    elif has_key is None:  # keep is the mask's own (a kept band may fill in one op)
        attn_mask = mask.filled(extra.to(q.dtype), keep, float("-inf"), in_place=False)
    else:
        attn_mask = extra.to(q.dtype).masked_fill(~keep, float("-inf"))
    out = _kernel(q, k, v, attn_mask, dropout_p, is_causal, scale)
    if has_key is not None:
        out = out * has_key
    return out


def _causal_masked(bias: Tensor, keep: Tensor, dtype: torch.dtype) -> Tensor:
    """``bias`` in ``dtype`` with the keys that ``keep``, the causal mask alone's (a
    function of its sizes), hides at ``-inf``: a new tensor, or the one made for the last
    call that masked this very bias, unchanged since (its version counter), over as many
    queries and keys in this dtype.

    For a causal call, replayed (:mod:`.kept`) or walked (``plans._own_kept_bias``), whose
    bias is the one a scheme of posenc's keeps between calls (``kept_score_bias``: ALiBi's, a tensor it keeps to
    itself and never writes): the same tensor call after call, masked once. One is kept,
    per process, while its bias lives (a weak reference); made outside inference mode, so
    that it serves calls in and out of it. A bias that is the last columns of a tensor
    (every row: ALiBi's for a chunk of queries at the end of a growing count of keys,
    kept for a count rounded up) is the same columns of that tensor masked once under the
    causal mask over its own width, which hides the same keys of those columns (query
    ``i`` of ``n_q`` sees key ``j`` of ``n_k`` where ``j <= i + n_k - n_q``; the column
    ``W - n_k + j`` of ``W``, where ``W - n_k + j <= i + W - n_q``). Not for a bias that
    asks for a gradient in grad mode, an inference tensor (which has no version counter),
    nor under ``torch.compile`` or a ``torch.func`` transform."""
    if (bias.requires_grad and torch.is_grad_enabled()) or not eager() or bias.is_inference():
        return bias.to(dtype).masked_fill(~keep, float("-inf"))
    whole = _columns_of(bias)
    if whole is not None:  # [.., n_q, W]: masked over its width, then its last n_k columns
        width, n_q = whole.shape[-1], whole.shape[-2]
        sizes = (*keep.shape[:-1], width)
        masked = _masked_kept(
            whole, sizes, dtype, lambda: _causal_keep(n_q, width, keep.device).expand(sizes)
        )
        return masked[..., width - bias.shape[-1] :]  # [.., n_q, n_k], a view
    return _masked_kept(bias, keep.shape, dtype, lambda: keep)


def _masked_kept(
    bias: Tensor, sizes: tuple[int, ...], dtype: torch.dtype, keep: Callable[[], Tensor]
) -> Tensor:
    """``bias`` in ``dtype`` filled with ``-inf`` where ``keep()`` (of ``sizes``) is False,
    kept for the next call of this bias, unchanged, of these sizes and dtype
    (:func:`_causal_masked`)."""
    found = _MASKED.get(bias)
    if found is not None:
        version, kept_sizes, kept_dtype, masked = found
        if version == bias._version and kept_sizes == sizes and kept_dtype == dtype:
            return masked
    with torch.inference_mode(False), torch.no_grad():
        masked = bias.to(dtype).masked_fill(~keep(), float("-inf"))
    _MASKED.clear()
    _MASKED[bias] = (bias._version, sizes, dtype, masked)
    return masked


def _columns_of(bias: Tensor) -> Tensor | None:
    """The tensor whose last columns ``bias [.., n_q, n_k]`` is, every row of it (``bias =
    whole[..., W - n_k:]``, ``n_q <= n_k <= W``), or None."""
    whole = bias._base
    if whole is None or whole.shape[:-1] != bias.shape[:-1] or whole.stride() != bias.stride():
        return None
    width, n_k = whole.shape[-1], bias.shape[-1]
    if not bias.shape[-2] <= n_k <= width or whole.stride(-1) != 1:
        return None
    if bias.storage_offset() != whole.storage_offset() + width - n_k:
        return None
    return whole


def _causal_keep(n_q: int, n_k: int, device: torch.device) -> Tensor:
    """``[n_q, n_k]`` bool: the causal mask aligned at the end (query ``i`` sees the keys
    ``j <= i + n_k - n_q``)."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)


#: the last causal-masked kept bias, by the bias it was made from (:func:`_causal_masked`)
_MASKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


#: the node of SDPA's fused CPU kernel in autograd's graph (its backward is the kernel's,
#: which is not differentiable: :func:`_second_derivative` makes it so)
_FLASH_CPU_NODE = "ScaledDotProductFlashAttentionForCpuBackward0"

#: the node whose backward runs now, where this torch tells (None: the fused kernel's
#: graph is differentiable once, and the dispatcher wraps its route)
_current_node = getattr(torch._C, "_current_autograd_node", None)

#: the saved-tensor hooks in force (activation checkpointing, offloading), where this torch
#: tells
_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
) -> Tensor:
    """:func:`~torch.nn.functional.scaled_dot_product_attention`: ``[b, h, n_q, d_v]``. Where
    its graph is the fused CPU kernel's (gradients asked for of ``q``, ``k`` or ``v``, no
    dropout, no mask that asks for one), whose backward is not differentiable, and
    :func:`differentiable_twice` holds, the node gets :func:`_second_derivative` as a hook:
    SDPA's own values and gradients, and in a backward with ``create_graph=True`` the
    gradients of SDPA's math kernel (equal to rounding), with a graph."""
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
    if (
        dropout_p == 0
        and out.requires_grad
        and out.is_cpu
        and plain_autograd()  # (nor under torch.compile, which cannot read a grad_fn)
        and differentiable_twice()
    ):
        node = out.grad_fn
        if type(node).__name__ == _FLASH_CPU_NODE:
            node.register_hook(_second_derivative)
    return out


def fused_cpu_runs(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether SDPA takes its fused CPU kernel for these ``q, k, v`` with a float mask of
    their dtype and no dropout, so that it writes no ``[b, h, n_q, n_k]`` scores: on the
    CPU, flash enabled (``torch.backends.cuda.enable_flash_sdp``, or ``sdpa_kernel``,
    which governs the CPU too), values of the queries' head dim and each last dimension
    dense (otherwise SDPA runs its math kernel)."""
    return (
        q.device.type == "cpu"
        and torch.backends.cuda.flash_sdp_enabled()
        and v.shape[-1] == q.shape[-1]
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and v.stride(-1) == 1
    )


def differentiable_twice() -> bool:
    """Whether :func:`_kernel`'s graph of the fused CPU kernel is differentiable twice by
    itself, so that the dispatcher needs no wrapper around the route: this torch tells a
    hook which node runs and which saved-tensor hooks are in force, and none are (the
    hook reads the node's saved tensors after its own backward has: activation
    checkpointing lets them be unpacked once)."""
    if _current_node is None or _saved_tensor_hooks is None:
        return False
    return _saved_tensor_hooks(False) is None


def _second_derivative(
    grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]
) -> tuple[Tensor | None, ...] | None:
    """The hook :func:`_kernel` sets on the fused CPU kernel's node: nothing in a first-order
    backward (the kernel's own gradients stand); in one with ``create_graph=True``
    (gradient penalties, Hessian-vector products) the gradients the engine asks of the
    node (those of ``grad_inputs`` not None) from SDPA's math kernel on the node's saved
    ``q, k, v`` and mask, with a graph, so that the second derivative is the definition's
    (the fused kernel's backward has run too, its answer replaced). Where the backward
    does not say which node runs (compiled autograd), the kernel's own gradients stand,
    and differentiating them again raises torch's error that their derivative is not
    implemented."""
    if not torch.is_grad_enabled() or grad_outputs[0] is None:
        return None
    if not any(g is not None for g in grad_inputs):
        return None  # nothing asked of the node
    node = _current_node()  # the kernel's node: its saved tensors, through the unpack hooks
    if node is None:
        return None
    saved = (node._saved_query, node._saved_key, node._saved_value)
    slots = [x.view_as(x) for x in saved]  # one per argument: q is k is v too
    # the kernel itself: sdpa_kernel() would set the process's SDPA flags
    ref, _ = torch.ops.aten._scaled_dot_product_attention_math(
        *slots, node._saved_attn_mask, 0.0, node._saved_is_causal, scale=node._saved_scale
    )
    wanted = [x for x, g in zip(slots, grad_inputs, strict=True) if g is not None]
    found = iter(torch.autograd.grad(ref, wanted, grad_outputs[0], create_graph=True))
    return tuple(None if g is None else next(found) for g in grad_inputs)
