"""Attention with one positional scheme: the functional :func:`attention` on ``[b, h, n, d]``
tensors (called like :func:`torch.nn.functional.scaled_dot_product_attention`),
:func:`explain` (which path it takes, and why not the others), and
:class:`MultiHeadAttention` (projections around the same call).

Shape legend: ``b`` batch, ``n_q`` queries, ``n_k`` keys, ``dim`` model width,
``h`` heads, ``d = dim / h`` head dim. Model tensors are ``[b, n, dim]``; inside attention
``[b, h, n, d]``.

A positional scheme (places 2-5) is one object passed as ``position=``; it defines the
hooks it needs (:mod:`posenc.hooks` describes each, with its shapes): ``rotate`` (RoPE),
``score_bias`` (Swin, T5, ALiBi), ``score_term`` (relative embeddings, Shaw's keys),
``value_term`` (Shaw's values), so that attention computes
``softmax((q k^T + score_term) / sqrt(d) + score_bias) v + value_term``.

A new scheme in a few lines, a learned bias per head that decays with distance::

    class DecayBias(nn.Module):
        def __init__(self, heads):
            super().__init__()
            self.rate = nn.Parameter(torch.full((heads,), 0.1))

        def score_bias(self, q_pos, k_pos):
            distance = (k_pos[:, None, :] - q_pos[:, :, None]).abs()  # [B', n_q, n_k]
            return -self.rate[:, None, None] * distance[:, None]  # [B', h, n_q, n_k]

    attn = MultiHeadAttention(64, 4, position=DecayBias(4))

Place 1 (input encodings such as :class:`~posenc.SinusoidalEncoding`) is added to the
input before attention, not passed here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from . import _validate as check
from ._arguments import check_scheme, default_query_positions, plain_number, prepare
from ._memo import eager
from ._rotary_buffer import rotated
from .cache import KVCache
from .engine import BACKENDS, Explanation, Mask, attend, explain_call
from .engine.inputs import finite
from .engine.kept import replay_unmasked
from .indices import positions_from_documents, run_positions

__all__ = ["MultiHeadAttention", "attention", "explain"]


def _core(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    position: Any,
    q_pos: Tensor,
    k_pos: Tensor,
    key_padding: Tensor | None,
    lengths: Tensor | None,
    causal: bool,
    documents: Tensor | None,
    cache: KVCache | None,
    backend: str,
    dropout_p: float,
    need_weights: bool,
    scale: float | None,
    attn_mask: Tensor | None = None,
    window: int | None = None,
    explain_only: bool = False,
) -> tuple[Any, Tensor | None, tuple[Tensor, Tensor, Tensor, Tensor | None] | None]:
    """Rotate, append to the cache (not stored), mask and attend (which repeats grouped
    key/value heads for their query heads): ``(out [b, h, n_q, d] or an Explanation,
    weights, the cache's new entries)``."""
    scores_only = cache is None and not explain_only  # nothing keeps the rotated q, k
    q, k, lent = rotated(position, q, k, q_pos, k_pos, scores_only)
    try:
        entries = None
        if cache is not None:  # stored by the caller once the step has succeeded
            entries = cache._step(k, v, k_pos, key_padding)
            k, v, k_pos, key_padding = entries
        b, h, n_q, _ = q.shape
        n_k = k.shape[2]
        allowed, bias = check.attn_mask(attn_mask, b, h, n_q, n_k)
        mask = Mask(
            n_q,
            n_k,
            key_padding=key_padding,
            lengths=lengths,
            causal=causal,
            q_doc=documents,
            k_doc=documents,
            behind=window,
            ahead=None if causal else window,
            allowed=allowed,
            bias=bias,
        )
        args = dict(scheme=position, q_pos=q_pos, k_pos=k_pos, mask=mask, backend=backend)
        if explain_only:
            return explain_call(q, k, v, dropout_p=dropout_p, scale=scale, **args), None, None
        finite_keys = 0
        if cache is not None and not mask.causal_at_most and eager():
            # a mask that may hide cached keys (padding, a window): the check for values it
            # must hide reads the keys and values the cache has not found finite yet
            finite_keys = cache._finite_keys(k, v)
            if finite_keys < n_k and finite(k[:, :, finite_keys:], v[:, :, finite_keys:]):
                finite_keys = n_k  # [b, h_kv, n_k, d] each: all finite
                cache._found_finite(n_k)
        out, weights = attend(
            q, k, v, dropout_p=dropout_p, need_weights=need_weights, scale=scale,
            finite_keys=finite_keys, **args,
        )  # fmt: skip
        return out, weights, entries
    finally:
        if lent is not None:  # the kept buffer q and k were rotated into
            lent.__exit__(None, None, None)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    position: Any = None,
    positions: Tensor | None = None,
    key_positions: Tensor | None = None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    valid_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    attn_mask: Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """Scaled dot-product attention with a positional scheme, on ``[b, h, n, d]`` tensors.

    Called like :func:`torch.nn.functional.scaled_dot_product_attention`, and equal to it
    with no scheme: it applies the scheme's rotation, its bias, term and value hooks and
    the masks, on the fastest correct path (:func:`explain` says which).
    A query with no key left to attend to gets a zero output, never NaN.

    Args:
        q: ``[b, h, n_q, d]`` queries.
        k: ``[b, h_kv, n_k, d]`` keys: ``h_kv = h``, or a divisor of ``h`` for grouped-query
            attention (Llama, Mistral, Qwen; ``h_kv = 1`` is multi-query attention): key
            and value head ``g`` serve query heads ``g * h / h_kv`` to
            ``(g + 1) * h / h_kv - 1``, as HF's ``repeat_kv`` and SDPA's ``enable_gqa``.
        v: ``[b, h_kv, n_k, d_v]`` values.
        position: a positional scheme of places 2-5 (``Rotary``, ``ALiBi``, ``T5RelativeBias``,
            ``RelativeQueryEmbedding``, ``ShawRelativePosition``, ... or your own object
            with the hooks), or None.
        positions: integer positions ``[n_q]`` or ``[b, n_q]`` of the queries, and of the
            keys when ``n_q == n_k`` and no ``key_positions`` is given (self-attention).
            Default ``arange(n_q)``, shifted by ``n_k - n_q`` when ``causal`` and
            ``n_q < n_k`` (decoding).
        key_positions: ``[n_k]`` or ``[b, n_k]`` positions of the keys (default
            ``arange(n_k)``, or ``positions`` as above).
        causal: query ``i`` sees keys ``j <= i + n_k - n_q`` (aligned at the end).
        key_padding_mask: ``[b, n_k]`` bool, True = padding (PyTorch's convention).
        valid_lens: ``[b]`` or ``[b, n_q]`` integer lengths: keys at index >= the length
            are ignored.
        document_ids: ``[b, n]`` integer document of each token (packed sequences,
            ``n_q == n_k``): a token attends only within its document, and the default
            positions restart at 0 at each document.
        attn_mask: a mask broadcastable to ``[b, h, n_q, n_k]``, as SDPA takes it: bool with
            True = attend (SDPA's convention, the opposite of ``key_padding_mask``), or
            float, added to the scaled scores after the scheme's bias (``-inf`` masks a
            key). Combined with every other mask; a query left with no key gets 0. A float
            mask that requires grad is differentiated through the math path.
        window: a sliding window (Mistral): query ``i`` sees keys at most ``window - 1``
            tokens before it (``j > i + n_k - n_q - window``, aligned at the end as
            ``causal``), and as far after it when not ``causal``. Counted in tokens of the
            sequence (indices, not positions). On CPU a causal window over enough keys runs
            in blocks of rows that skip the keys outside it (docs/performance.md).
        scale: the scores' scale (default ``1 / sqrt(d)``).
        dropout_p: dropout on the attention weights; pass 0 in evaluation, as with SDPA.
        backend: ``"auto"``, ``"math"`` (the readable reference), ``"sdpa"``, ``"lean"``
            or ``"flex"`` (see :class:`MultiHeadAttention`).

    Returns:
        ``[b, h, n_q, d_v]``.

    Raises:
        ValueError: shapes that do not fit together, an unknown backend, a scheme built
            for other heads (each message names the argument and the fix).
        TypeError: non-float inputs or inputs of different dtypes, a scheme class instead
            of an instance, a non-bool mask, float positions.
    """
    if (
        positions is None
        and key_positions is None
        and causal is False
        and key_padding_mask is None
        and valid_lens is None
        and document_ids is None
        and attn_mask is None
        and window is None
        and plain_number(dropout_p) == 0
        and (scale is None or 0 < plain_number(scale) < float("inf"))
        and backend in BACKENDS
    ):  # q, k, v alone: the route kept for them, if any, before any check or default
        out = replay_unmasked(q, k, v, position, backend, scale, rotation=rotated)
        if out is not None:
            return out
    kwargs = prepare(
        q, k, v, position=position, positions=positions, key_positions=key_positions,
        causal=causal, key_padding_mask=key_padding_mask, valid_lens=valid_lens,
        document_ids=document_ids, scale=scale, dropout_p=dropout_p, backend=backend,
        attn_mask=attn_mask, window=window,
    )  # fmt: skip
    return _core(q, k, v, need_weights=False, **kwargs)[0]


def explain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    position: Any = None,
    positions: Tensor | None = None,
    key_positions: Tensor | None = None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    valid_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    attn_mask: Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Explanation:
    """Which path :func:`attention` takes for these arguments, and why not the others.

    Takes the arguments of :func:`attention` and runs nothing but the paths' conditions
    (as xformers' dispatcher reports ``not_supported_reasons``).

    Returns:
        an :class:`~posenc.engine.Explanation`: ``.path``, the name of the path taken
        (``"sdpa"``, ``"math"``, ``"flex"``, ``"mask-blocks"``, ``"offset-term"``,
        ``"grid-term"``, ``"grid-bias"``, ``"offset-bias"``, ``"lean-fused"`` or
        ``"lean"``), ``.reasons``, for each path tried before it, why it was not
        taken, and ``.replayed``, whether the route is kept for calls of this signature
        (in the grad mode of the call to ``explain``), which after a first call skip the
        choice of path. ``print()`` shows them.

    Raises:
        As :func:`attention`.
    """
    kwargs = prepare(
        q, k, v, position=position, positions=positions, key_positions=key_positions,
        causal=causal, key_padding_mask=key_padding_mask, valid_lens=valid_lens,
        document_ids=document_ids, scale=scale, dropout_p=dropout_p, backend=backend,
        attn_mask=attn_mask, window=window,
    )  # fmt: skip
    return _core(q, k, v, need_weights=False, explain_only=True, **kwargs)[0]


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention with one positional scheme.

    Vaswani et al. 2017, section 3.2.2, with the positional scheme's hooks (see the module
    docstring). Self-attention (``query`` only) and cross-attention (``query, key, value``
    of other lengths) both work. A query that has no key left to attend to (every key
    masked) gets a zero attention output before ``out_proj``, on every backend, never NaN.

    Args:
        dim: model width.
        heads: number of heads; must divide ``dim``.
        position: a positional scheme from places 2-5 (``Rotary``, ``ALiBi``,
            ``RelativePositionBias``, ``RelativeQueryEmbedding``, ``ShawRelativePosition``,
            ...) or your own object with the hooks, or None for no positions.
        dropout: dropout probability on the attention weights (training only).
        bias: whether the four projections have a bias.
        kv_heads: key/value heads for grouped-query attention (Llama, Mistral, Qwen; 1 is
            multi-query attention): ``k_proj`` and ``v_proj`` map ``dim`` to
            ``kv_heads * head_dim``, each key/value head serves ``heads / kv_heads``
            consecutive query heads, and a :class:`~posenc.KVCache` holds ``kv_heads``
            heads. Default ``heads``.
        backend: ``"auto"`` (the fastest correct path for the scheme, see
            :func:`explain`), ``"math"`` (the readable reference),
            ``"sdpa"`` (PyTorch's fused kernel, positional terms in its ``attn_mask``),
            ``"lean"`` (blocks of queries, linear memory, no attention dropout) or
            ``"flex"`` (FlexAttention, biases and rotary only; inference only on CPU).

    Raises:
        ValueError: ``dim % heads != 0``, ``kv_heads`` that does not divide ``heads``, an
            unknown backend, or a scheme built for another number of heads or head dim.
        TypeError: ``position`` defines no hook (e.g. a place-1 input encoding).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        position: Any = None,
        dropout: float = 0.0,
        bias: bool = True,
        backend: str = "auto",
        kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        check.positive_int("dim", dim)
        check.positive_int("heads", heads)
        if dim % heads:
            divisors = [h for h in range(1, dim + 1) if dim % h == 0 and abs(h - heads) <= heads]
            raise ValueError(
                f"dim must be divisible by heads, got dim={dim}, heads={heads}; pick heads "
                f"from {divisors} or change dim to a multiple of {heads}"
            )
        self.backend = check.backend(backend, BACKENDS)
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.kv_heads = check.kv_heads(kv_heads, heads)
        self.dropout = check.probability("dropout", dropout)
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.kv_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        check_scheme(position)
        if position is not None:
            validate = getattr(position, "validate_attention", None)
            if callable(validate):
                validate(heads=heads, head_dim=self.head_dim)
        self.position = position

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        valid_lens: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        positions: Tensor | None = None,
        key_positions: Tensor | None = None,
        document_ids: Tensor | None = None,
        cache: KVCache | None = None,
        attn_mask: Tensor | None = None,
        window: int | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend.

        Args:
            query: ``[b, n_q, dim]``.
            key: ``[b, n_k, dim]`` for cross-attention; None for self-attention.
            value: ``[b, n_k, dim]``; defaults to ``key``.
            valid_lens: ``[b]`` or ``[b, n_q]`` integer lengths (d2l): keys at index >= the
                length are ignored.
            key_padding_mask: ``[b, n_k]`` bool, True = padding (PyTorch's convention).
            causal: query ``i`` sees keys ``j <= i``, aligned at the end when
                ``n_q < n_k`` (the queries are the last ``n_q`` positions, as in decoding).
            positions: integer positions ``[n_q]`` or ``[b, n_q]`` of the queries (and of
                the keys in self-attention). Default ``arange(n_q)``, shifted by
                ``n_k - n_q`` when ``causal`` and ``n_q < n_k``. Relative schemes use only
                differences, so a shifted range gives the same output.
            key_positions: ``[n_k]`` or ``[b, n_k]`` positions of the keys in
                cross-attention (default ``arange(n_k)``).
            document_ids: ``[b, n]`` integer document of each token, for packed
                sequences (self-attention): a token attends only within its document,
                and the default positions restart at 0 at each document.
            cache: a :class:`~posenc.KVCache` for decoding (self-attention). The new
                tokens' keys and values are appended to it, the queries attend to
                everything cached, and their default positions follow the cached ones.
                ``key_padding_mask`` then covers the new tokens only (``[b, n_q]``) and is
                remembered; ``causal=True`` as for the full sequence.
            attn_mask: bool (True = attend) or float (added to the scores) mask
                broadcastable to ``[b, heads, n_q, n_k]``, ``n_k`` counting the cached keys
                too; see :func:`attention`.
            window: a sliding window of ``window`` keys per query (Mistral); see
                :func:`attention`. With a cache it counts the cached keys too.
            need_weights: also return the attention weights ``[b, h, n_q, n_k]``
                (before dropout), computed with the math path.

        Returns:
            ``[b, n_q, dim]``, and the weights when ``need_weights``.

        Raises:
            ValueError: shapes that do not fit together (each message names the argument).
            TypeError: a non-float input, a non-bool padding mask, float positions.
        """
        query, key, value = self._check_inputs(query, key, value)
        causal = check.causal_flag(causal)
        b, n_q, _ = query.shape
        # query, key, value alone: the route kept for them, if any, before any default
        alone = (
            cache is None
            and positions is None
            and key_positions is None
            and document_ids is None
            and not causal
            and key_padding_mask is None
            and valid_lens is None
            and attn_mask is None
            and window is None
            and not need_weights
            and not (self.training and self.dropout)
        )
        self_attention = key is query
        if cache is not None or document_ids is not None:
            self._check_cache_and_documents(cache, document_ids, self_attention, b, n_q)
        if document_ids is not None and positions is None:
            positions = positions_from_documents(document_ids)
        if cache is not None and positions is None and len(cache):
            positions = cache._following(n_q, query.device)  # [b or 1, n_q]
        n_k = key.shape[1]
        key_padding = check.key_padding_mask(key_padding_mask, b, n_k)
        q = self.q_proj(query).view(b, n_q, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(key).view(b, n_k, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(value).view(b, n_k, self.kv_heads, self.head_dim).transpose(1, 2)
        # [b, n, dim | h_kv * d] -> [b, n, h | h_kv, d] -> [b, h | h_kv, n, d]
        if alone:
            out = replay_unmasked(
                q, k, v, self.position, self.backend, None, validate=False, rotation=rotated
            )
            if out is not None:  # [b, h, n_q, d] -> [b, n_q, h, d] -> [b, n_q, dim]
                return self.out_proj(out.transpose(1, 2).reshape(b, n_q, self.dim))
        q_pos, k_pos = self._positions(positions, key_positions, b, n_q, n_k, causal, query, key)
        try:
            out, weights, entries = _core(
                q, k, v, position=self.position, q_pos=q_pos, k_pos=k_pos,
                key_padding=key_padding, lengths=check.valid_lens(valid_lens, b, n_q),
                causal=causal, documents=document_ids, cache=cache, backend=self.backend,
                dropout_p=self.dropout if self.training else 0.0, need_weights=need_weights,
                scale=None, attn_mask=attn_mask, window=check.window(window),
            )  # fmt: skip
            out = self.out_proj(out.transpose(1, 2).reshape(b, n_q, self.dim))
            # [b, h, n_q, d] -> [b, n_q, h, d] -> [b, n_q, dim]
        except BaseException:
            if cache is not None:  # the step failed: a buffer it made is let go
                cache._discard()
            raise
        if cache is not None and entries is not None:
            cache.store(*entries)  # all or nothing: only once the step has succeeded
        return (out, weights) if need_weights else out

    # ----- input checks --------------------------------------------------------------------

    def _check_inputs(
        self, query: Tensor, key: Tensor | None, value: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        check.floating("query", query)
        weight = self.q_proj.weight
        if query.dtype != weight.dtype and not (
            weight.device.type != "meta" and torch.is_autocast_enabled(query.device.type)
        ):
            raise TypeError(
                f"query has dtype {query.dtype} but this module's parameters are "
                f"{weight.dtype}; convert the input (query.to({weight.dtype})) or the module "
                f"(module.to({query.dtype})), or run under torch.autocast"
            )
        if query.ndim != 3:
            raise ValueError(
                f"query must have shape [batch, seq, dim={self.dim}], got shape "
                f"{tuple(query.shape)}; add a batch dimension with query.unsqueeze(0)"
            )
        check.last_dim("query", query, self.dim)
        if key is None:
            if value is not None:
                raise ValueError("value was given without key; pass key too (or neither)")
            return query, query, query
        value = key if value is None else value
        for name, x in (("key", key), ("value", value)):
            check.floating(name, x)
            if x.dtype != query.dtype:
                raise TypeError(
                    f"{name} has dtype {x.dtype} but query has {query.dtype}; they must "
                    f"match: convert with {name}.to({query.dtype})"
                )
            if x.ndim != 3:
                raise ValueError(
                    f"{name} must have shape [batch, seq, dim={self.dim}], got shape "
                    f"{tuple(x.shape)}"
                )
            check.last_dim(name, x, self.dim)
            if x.shape[0] != query.shape[0]:
                raise ValueError(
                    f"{name} has batch size {x.shape[0]} but query has {query.shape[0]}; "
                    f"they must match"
                )
        if key.shape[1] != value.shape[1]:
            raise ValueError(
                f"key and value must have the same length, got {key.shape[1]} and {value.shape[1]}"
            )
        return query, key, value

    def _check_cache_and_documents(
        self,
        cache: KVCache | None,
        document_ids: Tensor | None,
        self_attention: bool,
        b: int,
        n: int,
    ) -> None:
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be a posenc.KVCache, got {type(cache).__name__}")
            if not self_attention:
                raise ValueError("cache is for self-attention decoding; do not pass key/value")
            if document_ids is not None:
                raise ValueError(
                    "document_ids (packed sequences) cannot be combined with a cache; decode "
                    "each document with its own KVCache"
                )
            if getattr(self.position, "supports_cache", True) is False:
                raise ValueError(
                    f"{type(self.position).__name__} cannot decode incrementally with a cache; "
                    f"run the full sequence at each step instead"
                )
        if document_ids is not None:
            if not self_attention:
                raise ValueError("document_ids is for self-attention over packed sequences")
            check.document_ids(document_ids, b, n)

    def _positions(
        self,
        positions: Tensor | None,
        key_positions: Tensor | None,
        b: int,
        n_q: int,
        n_k: int,
        causal: bool,
        query: Tensor,
        key: Tensor,
    ) -> tuple[Tensor, Tensor]:
        device = query.device
        self_attention = key is query
        if positions is None:
            q_pos = default_query_positions(n_q, n_k, causal, device)
        else:
            q_pos = check.positions(positions, n=n_q, batch=b, device=device)
        if key_positions is not None:
            if self_attention:
                raise ValueError(
                    "key_positions is for cross-attention; in self-attention pass positions"
                )
            k_pos = check.positions(
                key_positions, n=n_k, batch=b, name="key_positions", device=device
            )
        elif self_attention:
            k_pos = q_pos
        else:
            k_pos = run_positions(0, n_k, device)  # [1, n_k]
        return q_pos, k_pos

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, heads={self.heads}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, dropout={self.dropout}, backend={self.backend!r}"
        )
