"""A posenc scheme inside a Hugging Face transformers model.

- :func:`use`: the one-liner. It points a model's attention (Llama, Mistral, Qwen2, ...: any
  model whose attention goes through transformers' ``AttentionInterface`` and whose RoPE
  is a ``rotary_emb`` module) at posenc, with one scheme:

  - a :class:`~posenc.Rotary` replaces the model's ``rotary_emb`` (a
    :class:`RotaryEmbedding`): HF rotates queries and keys with posenc's cos and sin before
    its KV cache, exactly where it applies its own. :func:`use` first checks that the
    model's own ``rotary_emb`` gives the same cos and sin, and raises where it does not;
  - any other scheme (:class:`~posenc.ALiBi`, :class:`~posenc.T5RelativeBias`, your own
    object with the hooks) removes the model's RoPE (its ``rotary_emb`` then gives
    ``cos = 1, sin = 0``) and enters through :func:`attention_function`.

- :class:`RotaryEmbedding`: a drop-in for a model's ``rotary_emb``, built on
  :meth:`posenc.Rotary.hf_cos_sin`.
- :func:`attention_function`: :func:`posenc.attention` with a scheme, as a function with
  the signature of transformers' attention interface, to register yourself.
- :func:`use_t5_bias`: a T5 model whose ``compute_bias`` is posenc's
  :class:`~posenc.T5RelativeBias`, reading the checkpoint's own table.

Positions inside :func:`attention_function` are indices: query ``i`` of ``n_q`` sits at
index ``offset + i`` of the ``n_k`` keys, ``offset = n_k - n_q`` (the queries are the last
tokens, as in decoding with a ``DynamicCache``), or, when transformers' mask shows unused
key slots after the queries (a preallocated ``StaticCache``), just before those slots.
The model's ``position_ids`` are not read. For the relative schemes this is what the
positions mean: under left padding the padded keys are masked and the distance between two
real tokens is their distance in the sequence; in packed sequences (``position_ids`` that
restart at 0, no ``attention_mask``, and ``use_cache=False``: with a cache transformers does
not build the mask) transformers' mask keeps each document to itself, and within a document
index distances are position distances. A scheme that reads absolute
positions (:class:`~posenc.AbsoluteQueryEmbedding`) sees each token's index in the row,
not its position in its document, and ``position_ids`` with gaps are not honoured.

Nothing here imports transformers when ``posenc.hf`` is imported: each function imports
it when called.

Shape legend: ``b`` batch, ``h`` query heads, ``h_kv`` key/value heads (``h_kv`` divides
``h``: grouped-query attention), ``n_q`` queries, ``n_k`` keys (the cached ones included),
``d`` head dim, ``r`` rotated channels, ``B'`` 1 or ``b``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor, nn

from .. import _validate as check
from .._arguments import check_scheme
from ..engine import BACKENDS
from ..rotary import Rotary
from .attention_interface import _SCHEME_ATTRIBUTE, attention_function
from .checkpoints import t5_relative_bias
from .rope import HALF_LAYOUT_INTERLEAVED_MODEL_TYPES
from .rotary_embedding import (
    RotaryEmbedding,
    _check_cos_sin,
    _check_rotary_emb,
    _NoRotation,
    _original,
    _probe,
    _rotary_slots,
    _rotated_channels,
    _takes_layer_type,
)

__all__ = ["use", "use_t5_bias"]

#: numbers the names :func:`use` registers (``posenc_1``, ``posenc_2``, ...)
_NAMES = itertools.count(1)

# ----- use -----------------------------------------------------------------------------------


def _transformers() -> Any:
    try:
        import transformers
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as error:
        raise ImportError(
            "posenc.hf.use needs transformers with AttentionInterface and "
            "AttentionMaskInterface (transformers >= 4.53): pip install -U transformers"
        ) from error
    return transformers, AttentionMaskInterface, sdpa_mask


def _check_model(model: Any, transformers: Any) -> Any:
    """The model's text config, once the model is one :func:`use` can patch."""
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(
            f"model must be a transformers PreTrainedModel (e.g. LlamaForCausalLM), got "
            f"{type(model).__name__}; for your own attention pass position= to "
            f"posenc.MultiHeadAttention or posenc.attention"
        )
    name = type(model).__name__
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        raise ValueError(
            f"{name}'s attention does not go through transformers' AttentionInterface, so "
            f"posenc.hf.use cannot replace it; models that do: Llama, Mistral, Qwen2, Phi-3, "
            f"Gemma, GPT-NeoX, ..."
        )
    config = model.config
    parts = getattr(type(config), "sub_configs", None)
    if parts:
        raise ValueError(
            f"{name} holds several models ({', '.join(parts)}); pass its language model "
            f"(e.g. model.language_model), whose attention posenc replaces"
        )
    # each attention module keeps the value it was built with (Gemma 2: the config's, copied)
    held = [(path, m) for path, m in model.named_modules() if hasattr(m, "attn_logit_softcapping")]
    capped = [(path, m.attn_logit_softcapping) for path, m in held]
    if not held:
        capped = [("config", getattr(config, "attn_logit_softcapping", None))]
    capped = [(path, value) for path, value in capped if value is not None]
    if capped:
        path, value = capped[0]
        raise ValueError(
            f"{name} soft-caps its attention logits ({path}.attn_logit_softcapping={value}, in "
            f"{len(capped)} module(s)), which posenc's attention does not do; if the model is to "
            f"run without it, build or load it with attn_logit_softcapping=None, e.g. "
            f"{name}.from_pretrained(..., attn_logit_softcapping=None) or {name}(config) with "
            f"config.attn_logit_softcapping = None (a built model's attention modules keep "
            f"their own copy of the value)"
        )
    return config


def _tag_attention(model: nn.Module, number: int | None, scheme: Any) -> None:
    """Leave ``(number, scheme)`` on each attention module of ``model`` (a module with
    ``is_causal`` or ``layer_idx``) for the attention function of that number, outside its
    submodules (None: none), and take earlier ones off."""
    for module in model.modules():
        vars(module).pop(_SCHEME_ATTRIBUTE, None)
        if number is not None and (hasattr(module, "is_causal") or hasattr(module, "layer_idx")):
            object.__setattr__(module, _SCHEME_ATTRIBUTE, (number, scheme))


def use(model: Any, position: Any, *, backend: str = "auto") -> Any:
    """Run a transformers model with a posenc positional scheme, in place.

    Registers :func:`attention_function` under a new name (``posenc_1``, ``posenc_2``, ...:
    ``model.config._attn_implementation`` says which) in transformers'
    ``AttentionInterface`` and ``AttentionMaskInterface`` (transformers' SDPA masks: bool,
    True = attend), switches the model to it with ``set_attn_implementation``, and handles
    the model's RoPE (its ``rotary_emb`` modules). Before it changes anything it calls each
    ``rotary_emb`` that is called ``(x, position_ids)`` once (float32 ``x``, positions ``0 ..
    P-1``, ``P = 16`` or ``max_position_embeddings`` if smaller) and raises if what it gives
    is not what the scheme needs:

    - ``position`` a :class:`~posenc.Rotary`: each ``rotary_emb`` becomes a
      :class:`RotaryEmbedding`; transformers rotates queries and keys with it before its KV
      cache, as with its own, and the attention adds nothing. The model's own ``rotary_emb``
      must give cos and sin of the shape of the :class:`RotaryEmbedding`'s and equal to them
      within the rounding of its angles (``4 * eps * P * max|cos|``, ``eps`` float32's or
      that of a coarser buffer such as ``inv_freq``): the same layout (``interleaved``),
      frequencies, ``rotary_dim`` and attention factor; a RoPE posenc does not reproduce
      raises (GPT-J's and CodeGen's ``(sin, cos)`` of ``r/2`` angles, a Rotary of another
      base or layout). So with
      ``rotary_from_config(model.config)`` the model computes what it did, with angles in
      float64 instead of float32 (the length-dependent types: see :class:`RotaryEmbedding`).
      For the model types of ``posenc.hf.rope.HALF_LAYOUT_INTERLEAVED_MODEL_TYPES`` (GLM,
      Helium, Ernie 4.5) the Rotary must be interleaved, and its cos and sin take the
      ``"half"`` layout those models read. To rotate otherwise than the model on purpose,
      set ``rotary_emb`` to a :class:`RotaryEmbedding` by hand.
    - any other scheme (:class:`~posenc.ALiBi`, :class:`~posenc.T5RelativeBias`, your own
      object with the hooks): each ``rotary_emb`` gives ``cos = 1, sin = 0`` of its own
      width (the model's RoPE is gone; one that does not give ``(cos, sin)``, with ``sin =
      0`` at position 0, raises) and the scheme is applied inside attention, at index
      positions (the module docstring says what that means for padding and packing). Each
      attention module (a module with ``is_causal`` or ``layer_idx``) holds ``(number of
      the registered attention function, scheme)`` as ``posenc_scheme``, outside its
      submodules, which that function reads: ``copy.deepcopy(model)`` gives a model that
      reads, and trains, its own copy of the scheme. A scheme that is a module becomes
      ``model.posenc_position`` (on the model's device): ``model.to``,
      ``model.parameters()`` and ``state_dict()`` include it.

    Each replaced ``rotary_emb`` keeps the one it replaced as ``original`` (outside its
    submodules), which the next call checks against. The weights are untouched, and the
    state dict only gains the parameters of a learned scheme. Call it again to change the
    scheme. ``save_pretrained`` saves neither the attention implementation nor the RoPE
    (``from_pretrained`` gives the stock model back); docs/interop.md says how to reload.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention goes through
            ``AttentionInterface`` and whose RoPE is a ``rotary_emb`` module called
            ``(x, position_ids) -> (cos, sin)`` (Llama, Mistral, Qwen2, Phi-3, Gemma,
            GPT-NeoX, Cohere, ...). A composite model (vision-language): pass its language
            model.
        position: a posenc scheme of places 2-5.
        backend: :func:`posenc.attention`'s backend (``"auto"``, ``"math"``, ``"sdpa"``,
            ``"lean"``, ``"flex"``).

    Returns:
        ``model``, patched.

    Raises:
        TypeError: ``model`` is not a ``PreTrainedModel``; ``position`` is None, a class, or
            an object with no attention hook.
        ValueError: a model whose attention or RoPE cannot be replaced (no ``rotary_emb``,
            another call signature or return value, several kinds, attention outside
            ``AttentionInterface``, logit soft-capping, a composite model; a non-rotary
            scheme in an encoder-decoder, whose cross-attention would get it too); a
            :class:`~posenc.Rotary` whose cos and sin differ from the model's (shape,
            layout or frequencies), or for a model with one RoPE per layer type; a scheme
            built for other heads; an unknown ``backend``. Each message names the fix.
    """
    transformers, mask_interface, sdpa_mask = _transformers()
    config = _check_model(model, transformers)
    if position is None:
        raise TypeError(
            "position must be a posenc scheme (posenc.hf.rotary_from_config(model.config), "
            "posenc.ALiBi(heads), ...), got None; to keep the model's own positions, do not "
            "call use"
        )
    check_scheme(position)
    backend = check.backend(backend, BACKENDS)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    name = type(model).__name__
    device = next(iter(model.parameters()), torch.empty(0)).device
    # (parent, path, the model's own rotary_emb): the one a posenc replacement replaced
    slots = [(parent, path, _original(module)) for parent, path, module in _rotary_slots(model)]
    if not slots:
        raise ValueError(
            f"{name} has no rotary_emb module: its positions come from elsewhere (learned "
            f"position embeddings, ALiBi or a bias inside its attention), which posenc.hf.use "
            f"does not know how to remove"
        )
    kinds = {type(m) for _, _, m in slots}
    if len(kinds) > 1:
        where = ", ".join(f"{path} ({type(m).__name__})" for _, path, m in slots)
        raise ValueError(
            f"{name} has rotary embeddings of several kinds: {where}; pass the submodel "
            f"whose attention to change"
        )
    layer_types = [_takes_layer_type(m, path) for _, path, m in slots]
    rotary = isinstance(position, Rotary)
    layout, widths = None, []
    if rotary:
        if any(layer_types):
            raise ValueError(
                f"{name} has one RoPE per layer type (its rotary_emb takes layer_type), and "
                f"posenc.hf.use installs one Rotary for all layers; give the model a "
                f"non-rotary scheme, or replace its rotary embedding by hand"
            )
        if position.head_dim != head_dim:
            raise ValueError(
                f"the Rotary has head_dim={position.head_dim} but {name} has head_dim="
                f"{head_dim}; build it from the model's config: "
                f"posenc.hf.rotary_from_config(model.config)"
            )
        for _, path, original in slots:
            channels = _rotated_channels(original)
            if channels is not None and channels != position.rotary_dim:
                raise ValueError(
                    f"the Rotary rotates rotary_dim={position.rotary_dim} channels but "
                    f"{path} rotates {channels}; build it from the model's config: "
                    f"posenc.hf.rotary_from_config(model.config)"
                )
        model_type = getattr(config, "model_type", None)
        if model_type in HALF_LAYOUT_INTERLEAVED_MODEL_TYPES:
            if not position.interleaved:
                raise ValueError(
                    f"{name} (model_type {model_type!r}) rotates channel pairs (2i, 2i+1): its "
                    f"apply_rotary_pos_emb interleaves the cos and sin it is given, but the "
                    f"Rotary has interleaved=False; build it with interleaved=True: "
                    f"posenc.hf.rotary_from_config(model.config)"
                )
            layout = "half"  # what its apply_rotary_pos_emb reads
        for _, path, original in slots:
            stock = _probe(original, path, config, device)
            _check_rotary_emb(stock, position, layout, path, original, name)
        scheme = None
    else:
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(
                f"{name} is an encoder-decoder: a scheme inside attention would reach its "
                f"cross-attention too, where query and key positions are unrelated; "
                f"posenc.hf.use puts only a Rotary into such a model"
            )
        validate = getattr(position, "validate_attention", None)
        if callable(validate):
            validate(heads=heads, head_dim=head_dim)
        for (_, path, original), per_layer_type in zip(slots, layer_types, strict=True):
            if per_layer_type:  # called with a layer_type: its width as the module says
                widths.append(_rotated_channels(original) or head_dim)
                continue
            cos, sin, _ = _probe(original, path, config, device)
            _check_cos_sin(cos, sin, path, original)
            widths.append(cos.shape[-1])
        scheme = position
    registered = f"posenc_{next(_NAMES)}"
    function = attention_function(scheme, backend=backend)
    transformers.AttentionInterface.register(registered, function)
    mask_interface.register(registered, sdpa_mask)
    model.set_attn_implementation(registered)
    for index, (parent, _, original) in enumerate(slots):
        if rotary:
            replacement: nn.Module = RotaryEmbedding(position, layout=layout)
        else:
            replacement = _NoRotation(widths[index], layer_types[index])
        object.__setattr__(replacement, "original", original)
        parent.rotary_emb = replacement
    if "posenc_position" in model._modules:
        del model.posenc_position
    if isinstance(scheme, nn.Module):
        model.posenc_position = scheme = scheme.to(device)
    _tag_attention(model, None if scheme is None else function.posenc_number, scheme)
    return model


# ----- T5 ------------------------------------------------------------------------------------


def _t5_compute_bias(
    self: nn.Module,
    query_length: int,
    key_length: int,
    device: torch.device | None = None,
    past_seen_tokens: int | Tensor = 0,
) -> Tensor:
    """``T5Attention.compute_bias`` by posenc: ``[1, h, query_length, key_length]``."""
    offset = int(past_seen_tokens)
    return self.posenc_bias(int(query_length), int(key_length), offset)[None]


def use_t5_bias(model: nn.Module) -> nn.Module:
    """A T5 model (T5, mT5, Flan-T5, UMT5, ...) whose relative position bias is posenc's.

    Each attention with a ``relative_attention_bias`` (the self-attention of block 0 of the
    encoder and of the decoder in T5, of every block in UMT5) gets a
    :class:`~posenc.T5RelativeBias` built by :func:`posenc.hf.t5_relative_bias` (buckets,
    distance and side read from the module), as ``module.posenc_bias``, and its
    ``compute_bias`` becomes that module's bias. The bias reads the checkpoint's own
    embedding (the same parameter, not a copy), so training, ``model.to`` and
    ``save_pretrained`` see one table and the state dict is unchanged.

    Args:
        model: a transformers T5-style model, or any module holding T5 attentions.

    Returns:
        ``model``, patched in place.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: no module with a ``relative_attention_bias`` embedding and a
            ``compute_bias`` method in it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a T5 model (an nn.Module, e.g. T5ForConditionalGeneration), got "
            f"{type(model).__name__}"
        )
    found = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "relative_attention_bias", None), nn.Embedding)
        and callable(getattr(m, "compute_bias", None))
    ]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no T5 attention (a module with a "
            f"relative_attention_bias embedding and compute_bias); for a model with another "
            f"positional scheme see posenc.hf.use"
        )
    for module in found:
        bias = t5_relative_bias(module)
        bias.embedding = module.relative_attention_bias  # the checkpoint's table itself
        # kept out of the module's children, so that the state dict holds the table once
        object.__setattr__(module, "posenc_bias", bias)
        module.compute_bias = _t5_compute_bias.__get__(module)
    return model
