"""posenc's attention as a function of transformers' attention interface
(``AttentionInterface``): :func:`attention_function`.

Positions are indices: query ``i`` of ``n_q`` sits at index ``offset + i`` of the ``n_k``
keys, ``offset = n_k - n_q`` (the queries are the last tokens, as in decoding with a
``DynamicCache``), or, when transformers' mask shows unused key slots after the queries (a
preallocated ``StaticCache``), just before those slots. :mod:`posenc.hf.models` says what
this means for padded and packed batches.

Shape legend: ``b`` batch, ``h`` query heads, ``h_kv`` key/value heads (``h_kv`` divides
``h``: grouped-query attention), ``n_q`` queries, ``n_k`` keys (the cached ones included),
``d`` head dim.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import _validate as check
from .._arguments import check_scheme
from ..attention import attention
from ..engine import BACKENDS

__all__ = ["attention_function"]

#: numbers the functions :func:`attention_function` makes, each reading the schemes left
#: for its number (a number, not the function itself, so that a patched model pickles)
_NUMBERS = itertools.count(1)

#: the attribute in which :func:`use` leaves ``(number of the attention function, scheme)``
#: on each attention module (outside its submodules), read by that function
_SCHEME_ATTRIBUTE = "posenc_scheme"

#: attention-interface arguments that change the computation in ways posenc does not do
_UNSUPPORTED = {
    "softcap": "logit soft-capping (Gemma 2)",
    "s_aux": "attention sinks (gpt-oss)",
    "sinks": "attention sinks",
}


def _posenc_mask(mask: Tensor | None, position_bias: Tensor | None) -> Tensor | None:
    """transformers' ``attention_mask`` (bool, True = attend; or float, added, with
    ``finfo.min`` for masked keys) and a ``position_bias`` (T5) as one posenc ``attn_mask``:
    bool, or float with ``-inf`` where masked."""
    if mask is not None and mask.is_floating_point():
        mask = mask.masked_fill(mask <= torch.finfo(mask.dtype).min, float("-inf"))
    if position_bias is None:
        return mask
    if mask is None:
        return position_bias
    if mask.dtype == torch.bool:
        return position_bias.masked_fill(~mask, float("-inf"))
    return position_bias + mask


def _query_offset(mask: Tensor | None, n_q: int, n_k: int) -> Tensor | int:
    """The index of the first query among the keys: ``n_k - n_q``, or, when the mask leaves
    the last keys unseen by every query of every row (the free slots of a preallocated
    cache), the index after the last seen key minus ``n_q``. A tensor, so no sync."""
    if mask is None or n_q == n_k or mask.shape[-1] != n_k:
        return n_k - n_q
    seen = mask if mask.dtype == torch.bool else mask != float("-inf")
    seen = seen.reshape(-1, n_k).any(0)  # [n_k]: some query of some row sees the key
    index = torch.arange(n_k, device=mask.device)
    last = torch.where(seen, index, -1).amax()  # the last key seen
    return (last + 1 - n_q).clamp(min=0)


def attention_function(position: Any = None, *, backend: str = "auto") -> Callable[..., Any]:
    """:func:`posenc.attention` with ``position``, as a transformers attention function.

    The result has the signature of transformers' attention interface (as its
    ``sdpa_attention_forward``) and can be registered under a name of your own::

        transformers.AttentionInterface.register("alibi", attention_function(ALiBi(heads)))
        transformers.AttentionMaskInterface.register("alibi", sdpa_mask)  # padding masks
        model.set_attn_implementation("alibi")

    (:func:`use` does this and handles the model's RoPE.) What it does with transformers'
    arguments:

    - ``attention_mask``: bool ``[b, 1, n_q, n_k]`` (True = attend) or float (added;
      ``finfo.min`` or ``-inf`` masks a key) becomes :func:`posenc.attention`'s
      ``attn_mask``; None with a causal module (``module.is_causal``, or an ``is_causal``
      argument) becomes ``causal=True``. A query with no key to attend to gets zeros.
      Register the name in ``AttentionMaskInterface`` too: a name missing there makes
      transformers pass no mask at all, padding included.
    - grouped-query attention: ``key`` and ``value`` keep their ``h_kv`` heads.
    - ``scaling`` becomes ``scale``; ``dropout`` applies in training (``module.training``).
    - ``sliding_window`` becomes ``window`` in causal modules wherever the keys end at
      the queries (no mask, or ``n_q == n_k``); otherwise transformers' mask, which
      holds the window, does it alone.
    - ``position_bias`` (T5) is added to the scores, as transformers' own functions do.
    - positions: indices, the queries aligned at the end of the keys in use (see the module
      docstring: left padding and packed sequences).
    - the scheme: the one :func:`use` left on ``module`` for this function
      (``module.posenc_scheme``: a deep copy of the model holds its own copy), else
      ``position``.

    Args:
        position: a posenc scheme applied inside attention (places 2-5), or None for plain
            attention (the model's own positions, e.g. its RoPE, stay as they are). A
            :class:`~posenc.Rotary` here rotates after the KV cache, every step; give it to
            :func:`use` instead, which rotates before the cache as the model does.
        backend: :func:`posenc.attention`'s backend: ``"auto"``, ``"math"``, ``"sdpa"``,
            ``"lean"`` or ``"flex"``.

    Returns:
        ``fn(module, query [b, h, n_q, d], key [b, h_kv, n_k, d], value [b, h_kv, n_k, d],
        attention_mask, scaling=None, dropout=0.0, **kwargs) -> (attn_output [b, n_q, h, d],
        None)``: no attention weights, as transformers' SDPA function. It raises
        ``ValueError`` for ``softcap`` or attention sinks (``s_aux``), which it does not
        compute.

    Raises:
        TypeError: ``position`` is a class, or an object with no attention hook.
        ValueError: an unknown ``backend``.
    """
    check_scheme(position)
    backend = check.backend(backend, BACKENDS)
    number = next(_NUMBERS)

    def posenc_attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        unsupported = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
        if unsupported:
            what = ", ".join(f"{name} ({_UNSUPPORTED[name]})" for name in unsupported)
            raise ValueError(
                f"posenc's attention function does not compute {what}; keep this model on "
                f"an attention implementation that does (eager) instead of posenc"
            )
        # the scheme use() left on the module for this function (a deep copy's own), else
        # the one given
        tag = getattr(module, "__dict__", {}).get(_SCHEME_ATTRIBUTE)
        scheme = tag[1] if tag is not None and tag[0] == number else position
        n_q, n_k = query.shape[2], key.shape[2]
        is_causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        bias = kwargs.get("position_bias")
        if attention_mask is None and causal and 1 < n_q < n_k:
            # the prefill of a preallocated cache: the keys after the queries are free
            # slots, which transformers' SDPA function drops as well
            key, value = key[:, :, :n_q], value[:, :, :n_q]
            bias = None if bias is None else bias[..., :n_q]
            n_k = n_q
        mask = _posenc_mask(attention_mask, bias)
        positions = key_positions = None
        if scheme is not None:
            offset = _query_offset(mask if attention_mask is not None else None, n_q, n_k)
            positions = offset + torch.arange(n_q, device=query.device)  # [n_q]
            key_positions = torch.arange(n_k, device=query.device)  # [n_k]
        window = kwargs.get("sliding_window")
        if not (causal and (attention_mask is None or n_q == n_k)):
            window = None
        out = attention(
            query,
            key,
            value,
            position=scheme,
            positions=positions,
            key_positions=key_positions,
            causal=causal and attention_mask is None,
            attn_mask=mask,
            window=window,
            scale=scaling,
            dropout_p=dropout if getattr(module, "training", False) else 0.0,
            backend=backend,
        )  # [b, h, n_q, d]
        return out.transpose(1, 2).contiguous(), None  # [b, n_q, h, d]

    posenc_attention.posenc_number = number  # type: ignore[attr-defined]
    return posenc_attention
