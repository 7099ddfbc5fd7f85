"""Attention kernels: the readable reference and the fast paths, behind one signature.

Every path computes, for queries ``q`` and keys ``k`` already rotated by the scheme,

    s = (q k^T + score_term) * scale + score_bias        (masked keys removed)
    w = softmax(s)                                        (a query with no key: w = 0)
    out = dropout(w) v + value_term(dropout(w))

and returns ``out [b, h, n_q, d]``. The paths differ only in how they get there:

- ``math``: the formula above, literally, with the scheme's reference hooks where it has
  them. The reference every other path is tested against.
- ``sdpa``: :func:`torch.nn.functional.scaled_dot_product_attention`, with the score term
  and the bias folded into its ``attn_mask``. Not for schemes with a value term.
- ``flex``: FlexAttention with the scheme's ``score_mod`` and a ``BlockMask`` for the
  masks. Content-free biases only; no backward on CPU in torch 2.13.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim.
Positions ``q_pos [B', n_q]`` and ``k_pos [B', n_k]`` have ``B'`` 1 (shared) or ``b``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["BACKENDS", "Mask", "attend", "choose_backend", "hooks_of"]

BACKENDS = ("auto", "math", "sdpa", "flex")


@dataclass(frozen=True)
class Mask:
    """Which keys each query may attend to, kept factorised so that any block of query
    rows can be built without an ``[n_q, n_k]`` tensor for the whole sequence.

    A key is visible to a query when every given condition allows it.

    Attributes:
        n_q: number of queries.
        n_k: number of keys.
        key_padding: ``[b, n_k]`` bool, True = padding (PyTorch's convention), or None.
        lengths: ``[b, n_q]`` int64: key ``j`` is visible to query ``i`` iff
            ``j < lengths[b, i]`` (d2l's ``valid_lens``), or None.
        causal: query ``i`` sees keys ``j <= i + n_k - n_q`` (aligned at the end).
        q_doc: ``[b, n_q]`` document id of each query (packed sequences), or None.
        k_doc: ``[b, n_k]`` document id of each key; a query sees only its document.
    """

    n_q: int
    n_k: int
    key_padding: Tensor | None = None
    lengths: Tensor | None = None
    causal: bool = False
    q_doc: Tensor | None = None
    k_doc: Tensor | None = None

    @property
    def empty(self) -> bool:
        """True when nothing is masked."""
        return (
            self.key_padding is None
            and self.lengths is None
            and not self.causal
            and self.q_doc is None
        )

    def keep(self, rows: slice | None = None, device: torch.device | None = None) -> Tensor | None:
        """The boolean mask ``[b or 1, 1, n_rows, n_k]`` (True = attend) for query ``rows``.

        Returns None when nothing is masked.
        """
        if self.empty:
            return None
        start, stop = (0, self.n_q) if rows is None else (rows.start or 0, rows.stop)
        keep: Tensor | None = None

        def both(a: Tensor | None, b: Tensor) -> Tensor:
            return b if a is None else a & b

        if self.causal:
            q_idx = torch.arange(start, stop, device=device)  # [n_rows]
            k_idx = torch.arange(self.n_k, device=device)  # [n_k]
            keep = (k_idx[None, :] <= q_idx[:, None] + (self.n_k - self.n_q))[None, None]
        if self.lengths is not None:
            k_idx = torch.arange(self.n_k, device=self.lengths.device)
            visible = k_idx[None, None, :] < self.lengths[:, start:stop, None]  # [b, n_rows, n_k]
            keep = both(keep, visible[:, None])
        if self.key_padding is not None:
            keep = both(keep, ~self.key_padding[:, None, None, :])  # [b, 1, 1, n_k]
        if self.q_doc is not None and self.k_doc is not None:
            same = self.q_doc[:, start:stop, None] == self.k_doc[:, None, :]  # [b, n_rows, n_k]
            keep = both(keep, same[:, None])
        return keep

    def flex_mask_mod(self) -> Callable[..., Tensor]:
        """The same mask as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``."""
        offset = self.n_k - self.n_q
        causal, lengths, padding = self.causal, self.lengths, self.key_padding
        q_doc, k_doc = self.q_doc, self.k_doc

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            keep = kv_idx >= 0
            if causal:
                keep = keep & (kv_idx <= q_idx + offset)
            if lengths is not None:
                keep = keep & (kv_idx < lengths[b, q_idx])
            if padding is not None:
                keep = keep & ~padding[b, kv_idx]
            if q_doc is not None and k_doc is not None:
                keep = keep & (q_doc[b, q_idx] == k_doc[b, kv_idx])
            return keep

        return mask_mod


@dataclass(frozen=True)
class Hooks:
    """The hooks a scheme defines (None where it defines none)."""

    rotate: Callable[..., tuple[Tensor, Tensor]] | None = None
    score_bias: Callable[..., Tensor] | None = None
    score_term: Callable[..., Tensor] | None = None
    value_term: Callable[..., Tensor] | None = None
    reference_score_term: Callable[..., Tensor] | None = None
    reference_value_term: Callable[..., Tensor] | None = None
    flex_score_mod: Callable[..., Callable[..., Tensor]] | None = None


HOOK_NAMES = ("rotate", "score_bias", "score_term", "value_term")


def hooks_of(scheme: Any) -> Hooks:
    """Collect the hooks that ``scheme`` defines (``getattr`` that is not None)."""
    if scheme is None:
        return Hooks()
    found = {name: getattr(scheme, name, None) for name in Hooks.__dataclass_fields__}
    return Hooks(**{name: fn for name, fn in found.items() if callable(fn)})


def choose_backend(hooks: Hooks, device: torch.device, *, grad: bool) -> str:
    """The path ``backend="auto"`` takes: the fastest correct one for these hooks.

    SDPA whenever the scheme has no value term (its score term and bias fold into
    ``attn_mask``); the math path otherwise. FlexAttention is never picked automatically:
    it compiles per shape, and in torch 2.13 has no backward on CPU.
    """
    del device, grad  # the choice does not depend on them yet
    return "math" if hooks.value_term is not None else "sdpa"


def _fold_scores(
    hooks: Hooks, q: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float, *, reference: bool
) -> Tensor | None:
    """``score_term * scale + score_bias`` (None when the scheme adds neither)."""
    extra: Tensor | None = None
    term = (hooks.reference_score_term if reference else None) or hooks.score_term
    if term is not None:
        extra = term(q, q_pos, k_pos) * scale  # [b, h, n_q, n_k]
    if hooks.score_bias is not None:
        bias = hooks.score_bias(q_pos, k_pos)  # [B', h or 1, n_q, n_k]
        extra = bias if extra is None else extra + bias
    return extra


def _math(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    hooks: Hooks,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    scale: float,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    scores = q @ k.transpose(-2, -1)  # [b, h, n_q, n_k]
    term = hooks.reference_score_term or hooks.score_term
    if term is not None:
        scores = scores + term(q, q_pos, k_pos)
    scores = scores * scale
    if hooks.score_bias is not None:
        scores = scores + hooks.score_bias(q_pos, k_pos)
    keep = mask.keep(device=q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    weights = scores.float().softmax(dim=-1)  # softmax in float32 at least
    if keep is not None:
        # a query with no visible key: its row was uniform over masked keys; make it 0
        weights = weights * keep.any(dim=-1, keepdim=True)
    weights = weights.to(v.dtype)
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = dropped @ v  # [b, h, n_q, d]
    value_term = hooks.reference_value_term or hooks.value_term
    if value_term is not None:
        out = out + value_term(dropped, q_pos, k_pos)
    return out, weights


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
) -> Tensor:
    if hooks.value_term is not None:
        raise ValueError(
            "backend='sdpa' cannot add a value term (Shaw's a^V needs the attention weights); "
            "use backend='auto' or 'math'"
        )
    extra = _fold_scores(hooks, q, q_pos, k_pos, scale, reference=False)
    keep = mask.keep(device=q.device)
    has_key: Tensor | None = None
    is_causal = False
    if (
        keep is not None
        and extra is None
        and mask.causal
        and mask.n_q == mask.n_k
        and (mask.key_padding is None and mask.lengths is None and mask.q_doc is None)
    ):
        keep, is_causal = None, True  # SDPA's own causal flag: its fastest path
    if keep is not None:
        has_key = keep.any(dim=-1, keepdim=True)  # [b|1, 1, n_q, 1]
        keep = keep | ~has_key  # rows with no key attend to all keys, and are zeroed below
    if extra is None:
        attn_mask = keep
    else:
        attn_mask = extra.to(q.dtype)
        if keep is not None:
            attn_mask = attn_mask.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
    if has_key is not None:
        out = out * has_key
    return out


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class _NoBackward(torch.autograd.Function):
    """Identity whose backward raises: FlexAttention has no CPU backward in torch 2.13."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise RuntimeError(
            "backend='flex' has no backward on CPU (FlexAttention in this torch version "
            "serves inference only there); train with backend='auto' (or 'sdpa'/'math') "
            "and switch to 'flex' for inference"
        )


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
) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    if hooks.score_term is not None or hooks.value_term is not None:
        raise ValueError(
            "backend='flex' supports rotary embeddings and content-free biases (places 2-3); "
            "this scheme adds a content-dependent term: use backend='auto'"
        )
    if hooks.score_bias is not None and hooks.flex_score_mod is None:
        raise ValueError(
            "backend='flex' needs the scheme to define flex_score_mod(q_pos, k_pos); "
            "use backend='auto' for this scheme"
        )
    if dropout_p > 0:
        raise ValueError("backend='flex' has no attention dropout; set dropout=0 or use 'auto'")
    b = q.shape[0]
    score_mod = None
    if hooks.flex_score_mod is not None:
        score_mod = hooks.flex_score_mod(q_pos.expand(b, -1), k_pos.expand(b, -1))
    block_mask = None
    has_key: Tensor | None = None
    if not mask.empty:
        block_mask = create_block_mask(
            mask.flex_mask_mod(), b, None, mask.n_q, mask.n_k, device=q.device
        )
        keep = mask.keep(device=q.device)
        assert keep is not None  # mask.empty is False
        has_key = keep.any(dim=-1, keepdim=True)
    out = _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
    if has_key is not None:
        out = out * has_key
    if q.device.type == "cpu" and torch.is_grad_enabled() and out.requires_grad:
        out = _NoBackward.apply(out)
    return out


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scheme: Any = None,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    backend: str = "auto",
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention with a positional scheme's hooks.

    Args:
        q: ``[b, h, n_q, d]`` queries (already rotated when the scheme rotates).
        k: ``[b, h, n_k, d]`` keys (already rotated).
        v: ``[b, h, n_k, d]`` values.
        scheme: an object with any of the hooks ``score_bias``, ``score_term``,
            ``value_term`` (see :mod:`posenc.attention`), or None.
        q_pos: ``[B', n_q]`` int64 query positions.
        k_pos: ``[B', n_k]`` int64 key positions.
        mask: which keys each query may see.
        backend: ``"auto"``, ``"math"``, ``"sdpa"`` or ``"flex"``.
        dropout_p: dropout on the attention weights (pass 0 in eval).
        need_weights: also return the weights ``[b, h, n_q, n_k]`` (before dropout),
            computed with the math path.

    Returns:
        ``(out [b, h, n_q, d], weights or None)``. A query with no visible key gets 0.
    """
    hooks = hooks_of(scheme)
    scale = q.shape[-1] ** -0.5
    if need_weights or backend == "math":
        out, weights = _math(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p)
        return out, (weights if need_weights else None)
    if backend == "auto":
        backend = choose_backend(hooks, q.device, grad=torch.is_grad_enabled())
    path = {"math": None, "sdpa": _sdpa, "flex": _flex}[backend]
    if path is None:
        return _math(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p)[0], None
    return path(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p), None
