"""The ``peer`` variant of ``posenc bench``: each scheme the way other code computes it.

The same attention as posenc's (the same table, the same scaling; the tests check the
outputs agree), computed the way a model without posenc does:

- T5 (:class:`~posenc.T5RelativeBias`): Hugging Face ``transformers``'
  ``T5Attention.compute_bias(n, n)`` (the bucket of every ``[n, n]`` offset, then the
  embedding), sharing posenc's table, as SDPA's ``attn_mask``;
- Swin's 1-D table (:class:`~posenc.bias.RelativePositionBias1D`): the table gathered by
  the relative index ``i - j + W - 1`` (built once per length, as Swin's
  ``relative_position_index`` buffer) into ``[1, h, n, n]``, as SDPA's ``attn_mask``;
- Swin's 2-D table (:class:`~posenc.bias.RelativePositionBias2D`): timm's
  ``WindowAttention``: the ``[N, N]`` relative position index of the window built once
  (``coords_i - coords_j``, shifted and folded into one row number), the table gathered
  by it into ``[1, h, N, N]`` in each call, as SDPA's ``attn_mask``;
- ALiBi (:class:`~posenc.ALiBi`): the bias written out, ``-slope_h * |j - i|``
  ``[1, h, n, n]``, as SDPA's ``attn_mask``; with the paper's slopes kept from one call
  to the next for each length (x-transformers' ``AlibiPositionalBias`` keeps it in a
  buffer), with learned slopes built in each call;
- Shaw (:class:`~posenc.ShawRelativePosition`): the relation tensors ``a^K``, ``a^V``
  ``[n, n, d]`` gathered from the clipped offsets, ``q.a^K`` added to ``q k^T``, a plain
  softmax, ``weights @ a^V`` added to ``weights @ v`` (Shaw et al. 2018, eqs. 3-4);
- the relative query embedding (:class:`~posenc.RelativeQueryEmbedding`): ``q R^T``
  against every offset ``-(n-1) .. n-1`` ``[b, h, n, 2n-1]``, then the skew of Huang et
  al. 2018 (Music Transformer, section 3.4: pad, reshape, slice) to ``[b, h, n, n]``,
  added to ``q k^T`` before a plain softmax;
- rotary (:class:`~posenc.Rotary`, no scaling, every channel rotated):
  ``rotary_embedding_torch.RotaryEmbedding(d).rotate_queries_or_keys`` on ``q`` and ``k``,
  then SDPA. That package rotates interleaved channel pairs ``(2i, 2i+1)``: it is
  posenc's ``rotary-interleaved`` as it is, and posenc's half-split ``rotary`` with the
  channels of ``q`` and ``k`` in the interleaved order (a fixed permutation that a model
  folds into its query and key projections; :func:`peer_layout` gives it).

The bench's mask (causal, key padding, a window) is folded into the extra logits as
``-inf`` (SDPA's float mask, or before the softmax). Packed documents (positions
restarting in each) have no peer: :func:`peer_problem` says so, and why a scheme has none.

Shape legend: ``b`` batch, ``h`` heads, ``n`` length, ``d`` head dim.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..bias import ALiBi, RelativePositionBias1D, RelativePositionBias2D, T5RelativeBias
from ..embedding import RelativeQueryEmbedding
from ..rotary import Rotary
from ..shaw import ShawRelativePosition

#: the peer of each scheme class, as the table's note names it
PEERS = {
    T5RelativeBias: "HF T5Attention.compute_bias + SDPA",
    RelativePositionBias1D: "the table gathered by relative index as attn_mask + SDPA",
    RelativePositionBias2D: "timm's relative_position_index gather as attn_mask + SDPA",
    ALiBi: "the [h, n, n] bias written out (kept per length) as attn_mask + SDPA",
    ShawRelativePosition: "a^K, a^V [n, n, d] gathered, einsum, softmax",
    RelativeQueryEmbedding: "q R^T and the skew (Music Transformer), softmax",
    Rotary: "rotary-embedding-torch + SDPA",
}

Run = Callable[[Tensor, Tensor, Tensor], Tensor]
Keep = Callable[[Tensor], "Tensor | None"]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def peer_problem(scheme: Any, documents: int = 1) -> str | None:
    """Why ``scheme`` has no peer in this run (none written for it, a package missing,
    packed documents), or None."""
    kind = next((cls for cls in PEERS if isinstance(scheme, cls)), None)
    if kind is None:
        return f"no peer is written for {type(scheme).__name__}"
    if documents > 1:
        return "the peers take positions 0 .. n-1, not positions restarting in each document"
    if kind is T5RelativeBias and not _installed("transformers"):
        return "transformers is not installed (pip install transformers)"
    if kind is Rotary:
        if not _installed("rotary_embedding_torch"):
            return "rotary-embedding-torch is not installed (pip install rotary-embedding-torch)"
        if scheme.scaling is not None or scheme.rotary_dim != scheme.head_dim:
            return "rotary-embedding-torch's peer takes plain RoPE on every channel"
    return None


def peer_layout(scheme: Any, x: Tensor) -> Tensor:
    """``x [..., d]`` with its channels in the order the peer of ``scheme`` takes them: a
    half-split :class:`~posenc.Rotary`'s pairs ``(i, i + d/2)`` moved next to each other
    (``(2i, 2i+1)``, rotary-embedding-torch's pairs); any other scheme's as they are."""
    if isinstance(scheme, Rotary) and not scheme.interleaved:
        half = x.shape[-1] // 2
        return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)  # [..., d]
    return x


def _t5_peer(scheme: T5RelativeBias, keep: Keep) -> Run:
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = T5Config(
        d_model=scheme.heads,
        d_kv=1,
        num_heads=scheme.heads,
        relative_attention_num_buckets=scheme.num_buckets,
        relative_attention_max_distance=scheme.max_distance,
        is_decoder=not scheme.bidirectional,
        dropout_rate=0.0,
    )
    hf = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    # posenc's table itself: its gradient is posenc's
    hf.relative_attention_bias.weight = scheme.embedding.weight

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = q.shape[2]
        bias = hf.compute_bias(n, n, device=q.device).to(q.dtype)  # [1, h, n, n]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_fold(bias, keep(q)))

    return run


def _swin_peer(scheme: RelativePositionBias1D, keep: Keep) -> Run:
    width = scheme.window[0]
    index: dict[tuple[int, torch.device], Tensor] = {}

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = q.shape[2]
        if (n, q.device) not in index:
            i = torch.arange(n, device=q.device)
            index[n, q.device] = (i[:, None] - i[None, :] + width - 1).flatten()  # [n n]
        rows = scheme.table[index[n, q.device]]  # [n n, h]
        bias = rows.view(n, n, -1).permute(2, 0, 1)[None].to(q.dtype)  # [1, h, n, n]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_fold(bias, keep(q)))

    return run


def _swin_2d_peer(scheme: RelativePositionBias2D, keep: Keep) -> Run:
    wh, ww = scheme.window
    index: dict[torch.device, Tensor] = {}

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = wh * ww
        if q.device not in index:  # timm's relative_position_index buffer
            rows, cols = torch.meshgrid(
                torch.arange(wh, device=q.device), torch.arange(ww, device=q.device), indexing="ij"
            )
            coords = torch.stack((rows.flatten(), cols.flatten()))  # [2, N]
            relative = coords[:, :, None] - coords[:, None, :]  # [2, N, N]: query minus key
            index[q.device] = (
                (relative[0] + wh - 1) * (2 * ww - 1) + relative[1] + ww - 1
            ).flatten()  # [N N]
        rows = scheme.table[index[q.device]]  # [N N, h]
        bias = rows.view(n, n, -1).permute(2, 0, 1).contiguous()[None].to(q.dtype)  # [1, h, N, N]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_fold(bias, keep(q)))

    return run


def _alibi_peer(scheme: ALiBi, keep: Keep) -> Run:
    kept: dict[tuple[int, torch.device], Tensor] = {}

    def written(n: int, device: torch.device) -> Tensor:
        i = torch.arange(n, device=device)
        distance = (i[None, :] - i[:, None]).abs()  # [n, n]
        slopes = scheme.slopes(device)  # [h]
        return -slopes[:, None, None] * distance  # [h, n, n]

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = q.shape[2]
        if scheme.learned:
            bias = written(n, q.device)
        else:
            if (n, q.device) not in kept:
                kept[n, q.device] = written(n, q.device)
            bias = kept[n, q.device]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=_fold(bias[None].to(q.dtype), keep(q))
        )

    return run


def _shaw_peer(scheme: ShawRelativePosition, keep: Keep) -> Run:
    reach = scheme.max_distance

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n, d = q.shape[2], q.shape[3]
        i = torch.arange(n, device=q.device)
        row = (i[None, :] - i[:, None]).clamp(-reach, reach) + reach  # [n, n]: clip(j-i)+k
        a_k = scheme.keys[row].to(q.dtype)  # [n, n, d]
        logits = q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, a_k)
        weights = _softmax(logits / math.sqrt(d), keep(q))  # [b, h, n, n]
        out = weights @ v
        if scheme.has_values:
            a_v = scheme.values[row].to(q.dtype)  # [n, n, d]
            out = out + torch.einsum("bhij,ijd->bhid", weights, a_v)
        return out

    return run


def skew(rel: Tensor) -> Tensor:
    """``S[..., i, j] = rel[..., i, j - i + n - 1]``: the term of each (query, key) from the
    query's term of each offset, column ``m`` of ``rel`` the offset ``m - (n - 1)`` (Huang
    et al. 2018's skew, both directions: pad one column, reshape, slice).

    Args:
        rel: ``[..., n, 2n-1]``.

    Returns:
        ``[..., n, n]``.
    """
    n = rel.shape[-2]
    padded = F.pad(rel, (0, 1))  # [..., n, 2n]: row i starts at i * 2n
    flat = padded.flatten(-2)  # [..., 2n^2]
    # (i, j) is at i * 2n + (j - i + n - 1) = i * (2n - 1) + (n - 1) + j
    window = flat[..., n - 1 : n - 1 + n * (2 * n - 1)]  # [..., n (2n-1)]
    return window.unflatten(-1, (n, 2 * n - 1))[..., :n]  # [..., n, n]


def _relative_peer(scheme: RelativeQueryEmbedding, keep: Keep) -> Run:
    longest = scheme.max_len

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n, d = q.shape[2], q.shape[3]
        table = scheme.weight[..., longest - n : longest + n - 1, :].to(q.dtype)  # [(h,) 2n-1, d]
        if table.dim() == 2:
            rel = q @ table.t()  # [b, h, n, 2n-1]
        else:
            rel = q @ table.transpose(-1, -2)  # [b, h, n, d] @ [h, d, 2n-1]
        logits = q @ k.transpose(-1, -2) + skew(rel)  # [b, h, n, n]
        return _softmax(logits / math.sqrt(d), keep(q)) @ v

    return run


def _rotary_peer(scheme: Rotary, keep: Keep) -> Run:
    from rotary_embedding_torch import RotaryEmbedding

    rotary = RotaryEmbedding(scheme.head_dim, theta=scheme.base)

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if rotary.freqs.device != q.device:
            rotary.to(q.device)
        q, k = rotary.rotate_queries_or_keys(q), rotary.rotate_queries_or_keys(k)
        mask = keep(q)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return run


def _fold(bias: Tensor, keep: Tensor | None) -> Tensor:
    return bias if keep is None else bias.masked_fill(~keep, float("-inf"))  # [b|1, h, n, n]


def _softmax(logits: Tensor, keep: Tensor | None) -> Tensor:
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits.softmax(-1)


_BUILDERS: dict[type, Callable[[Any, Keep], Run]] = {
    T5RelativeBias: _t5_peer,
    RelativePositionBias1D: _swin_peer,
    RelativePositionBias2D: _swin_2d_peer,
    ALiBi: _alibi_peer,
    ShawRelativePosition: _shaw_peer,
    RelativeQueryEmbedding: _relative_peer,
    Rotary: _rotary_peer,
}


def peer_of(scheme: Any, keep: Keep) -> Run:
    """The peer of ``scheme`` (see the module's list), masked by ``keep(q)`` (the floor's
    boolean mask ``[b|1, 1, n|1, n]``, True = attend, or None).

    Raises:
        ValueError: ``scheme`` has no peer (:func:`peer_problem` says why).
    """
    problem = peer_problem(scheme)
    if problem is not None:
        raise ValueError(f"scheme {type(scheme).__name__} has no peer: {problem}")
    kind = next(cls for cls in _BUILDERS if isinstance(scheme, cls))
    return _BUILDERS[kind](scheme, keep)
