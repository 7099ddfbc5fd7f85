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
- ``lean``: the memory-lean engine. Queries are processed in blocks of rows; each block's
  scores are built with the scheme's hooks, soft-maxed and multiplied by ``v`` (and the
  value term), and only the block's log-sum-exp is kept. The backward recomputes each
  block from ``q, k, v`` and the log-sum-exp (as FlashAttention does) and takes the
  gradients of the hooks' tables with one local autograd call per block. Peak memory is
  O(block * n_k) instead of O(n_q * n_k); nothing of size ``b*h*n_q*n_k`` is kept for the
  backward.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim.
Positions ``q_pos [B', n_q]`` and ``k_pos [B', n_k]`` have ``B'`` 1 (shared) or ``b``.
Inside the engines: ``g`` the heads of one head group, ``rows`` the queries of one block,
``W`` the offsets ``n_q + n_k - 1`` (on the grid paths: the map's width, ``H`` its
height), ``R`` the distinct rows of a clipped table (``2k + 1`` for Shaw).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .indices import diagonal_sums, skew_rows

__all__ = ["BACKENDS", "Mask", "attend", "choose_backend", "hooks_of", "lean_block_rows"]

BACKENDS = ("auto", "math", "sdpa", "flex", "lean")


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
    offset_bias: Callable[..., Tensor | None] | None = None
    key_shift: Callable[..., Tensor] | None = None
    offset_term: Callable[..., Tensor | None] | None = None
    grid_bias: Callable[..., Tensor | None] | None = None
    grid_term: Callable[..., tuple[Tensor, Tensor] | None] | None = None
    offset_value: Callable[..., Tensor | None] | None = None
    reference_score_term: Callable[..., Tensor] | None = None
    reference_value_term: Callable[..., Tensor] | None = None
    flex_score_mod: Callable[..., Callable[..., Tensor]] | None = None


HOOK_NAMES = ("rotate", "score_bias", "score_term", "value_term")


#: each optional extra and the hook it is another form of: an extra inherited from a class
#: above the one that (re)defines its hook would compute the parent's term, so it is dropped
DERIVED_HOOKS = {
    "offset_bias": "score_bias",
    "grid_bias": "score_bias",
    "flex_score_mod": "score_bias",
    "offset_term": "score_term",
    "grid_term": "score_term",
    "key_shift": "score_term",
    "reference_score_term": "score_term",
    "offset_value": "value_term",
    "reference_value_term": "value_term",
}


def _defined_by(scheme: Any, name: str) -> type | None:
    """The class in ``scheme``'s MRO that defines ``name`` (None: the instance itself)."""
    if name in getattr(scheme, "__dict__", {}):
        return None
    for cls in type(scheme).__mro__:
        if name in cls.__dict__:
            return cls
    return None


def hooks_of(scheme: Any) -> Hooks:
    """Collect the hooks that ``scheme`` defines (``getattr`` that is not None).

    An optional extra (see :data:`DERIVED_HOOKS`) is kept only when the hook it stands for
    is defined in the same class or above: a subclass that overrides ``score_bias`` (say a
    steeper ALiBi) is not silently computed with its parent's ``offset_bias``.
    """
    if scheme is None:
        return Hooks()
    found = {name: getattr(scheme, name, None) for name in Hooks.__dataclass_fields__}
    hooks = {name: fn for name, fn in found.items() if callable(fn)}
    for extra, base in DERIVED_HOOKS.items():
        if extra in hooks and base in hooks:
            extra_cls, base_cls = _defined_by(scheme, extra), _defined_by(scheme, base)
            if extra_cls is None:  # set on the instance with its hook: trust the pair
                continue
            # the hook set on the instance, or redefined in a subclass of the extra's class
            if base_cls is None or (base_cls is not extra_cls and issubclass(base_cls, extra_cls)):
                del hooks[extra]
    return Hooks(**hooks)


def _shape_check(
    scheme: Any,
    name: str,
    fn: Callable[..., Any],
    expect: Callable[..., tuple[Any, ...]],
    heads: int,
) -> Callable[..., Any]:
    """``fn`` with its result's shape checked against ``expect(*args)``: per dimension an int,
    a set of allowed ints, or None (any). ``None`` results (an extra declining) pass."""

    def checked(*args: Any) -> Any:
        out = fn(*args)
        if out is None or not isinstance(out, Tensor):
            return out
        allowed = expect(*args)
        shape = tuple(out.shape)
        if len(shape) != len(allowed) or any(
            a is not None and (s not in a if isinstance(a, set) else s != a)
            for s, a in zip(shape, allowed, strict=False)
        ):

            def said(a: Any) -> str:
                return (
                    "any"
                    if a is None
                    else " or ".join(map(str, sorted(a)))
                    if isinstance(a, set)
                    else str(a)
                )

            raise ValueError(
                f"position={type(scheme).__name__}: its {name} hook returned shape {shape}, "
                f"expected [{', '.join(map(said, allowed))}] for the positions it was given "
                f"(heads: 1, shared, or this attention's {heads}); build the scheme for "
                f"heads={heads}"
            )
        return out

    return checked


def checked_hooks(hooks: Hooks, scheme: Any, b: int, h: int, d_v: int) -> Hooks:
    """The hooks with the shapes of their results checked (``ValueError`` naming the hook,
    the shape it returned and the shape expected), for an attention of ``b`` sequences,
    ``h`` heads and value head dim ``d_v``: every backend then fails the same way on a
    scheme built for another attention, instead of broadcasting it or reading part of it.
    Not inside ``torch.compile``/``torch.export``, where comparing symbolic sizes would
    specialise them (an eager call checks the same scheme first).
    """
    if torch.compiler.is_compiling():
        return hooks
    heads = {1, h}

    def batch_of(pos: Tensor) -> set[int]:
        return {1, pos.shape[0], b}

    expect: dict[str, Callable[..., tuple[Any, ...]]] = {
        "score_bias": lambda qp, kp: (batch_of(qp), heads, qp.shape[-1], kp.shape[-1]),
        "score_term": lambda q, qp, kp: ({1, q.shape[0]}, heads, q.shape[2], kp.shape[-1]),
        "value_term": lambda w, qp, kp: ({1, w.shape[0]}, heads, w.shape[2], d_v),
        "offset_bias": lambda qp, kp: (heads, qp.shape[-1] + kp.shape[-1] - 1),
    }
    expect["reference_score_term"] = expect["score_term"]
    expect["reference_value_term"] = expect["value_term"]
    found = {
        name: _shape_check(scheme, name, fn, expect[name], h)
        for name, fn in vars(hooks).items()
        if fn is not None and name in expect
    }
    return replace(hooks, **found) if found else hooks


def choose_backend(hooks: Hooks, q: Tensor, *, dropout_p: float = 0.0) -> str:
    """The path ``backend="auto"`` takes: the fastest correct one for these hooks.

    - no positional term in the scores (no scheme, or rotary only): ``sdpa``, PyTorch's
      fused kernel (:func:`attend` first folds a scheme's ``key_shift`` into the keys, so
      an absolute query embedding lands here too);
    - a score term, a bias or a value term: ``lean``, the memory-lean engine (linear
      memory, fused CPU kernels where it can);
    - with attention dropout in training, which ``lean`` does not do: ``sdpa``, or
      ``math`` for a value term.

    Under ``torch.compile`` the lean engine is not used (its backward calls
    ``torch.autograd.grad``, which Dynamo does not trace): ``auto`` takes ``sdpa`` (or
    ``math`` for a value term) and leaves the fusion to the compiler.

    FlexAttention is never picked automatically: it compiles per shape, and in torch 2.13
    has no backward on CPU.
    """
    del q  # the choice does not depend on the device yet
    positional = any(
        fn is not None for fn in (hooks.score_bias, hooks.score_term, hooks.value_term)
    )
    if not positional:
        return "sdpa"
    if dropout_p > 0 or torch.compiler.is_compiling():
        return "math" if hooks.value_term is not None else "sdpa"
    return "lean"


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype for softmax and accumulation: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


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
    weights = scores.to(_wide(scores.dtype)).softmax(dim=-1)  # softmax in float32 at least
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
    if extra is None and dropout_p == 0:
        blocks = _mask_blocks(mask, q, cut=False)
        if blocks is not None:  # padding at the ends, packed documents: no [n_q, n_k] mask
            return _by_blocks(q, k, v, hooks, q_pos, k_pos, scale, blocks, _sdpa)
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
    if hooks.score_bias is not None and q_pos.shape[-1] and k_pos.shape[-1]:
        hooks.score_bias(q_pos[:, :1], k_pos[:, :1])  # its shape checked: heads 1 or h
    if hooks.flex_score_mod is not None:
        score_mod = hooks.flex_score_mod(q_pos.expand(b, -1), k_pos.expand(b, -1))
    block_mask = None
    has_key: Tensor | None = None
    if not mask.empty:
        block_mask = create_block_mask(
            mask.flex_mask_mod(), b, None, mask.n_q, mask.n_k, device=q.device
        )
        keep = mask.keep(device=q.device)
        if keep is not None:
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
    hooks = checked_hooks(hooks_of(scheme), scheme, q.shape[0], q.shape[1], v.shape[-1])
    if mask.empty or (not torch.compiler.is_compiling() and _finite(q, k, v)):
        return _attend(q, k, v, hooks, scheme, q_pos, k_pos, mask, backend, dropout_p, need_weights)
    # NaN or inf somewhere: a masked key or value must not reach any query, not even as
    # 0 x NaN, nor a query's NaN the gradients of the keys it sees through a zero gradient;
    # each such token is replaced by zeros, and the queries it touches made NaN after
    bad = ~torch.isfinite(k).all(dim=-1) | ~torch.isfinite(v).all(dim=-1)  # [b, h, n_k]
    bad_q = ~torch.isfinite(q).all(dim=-1, keepdim=True)  # [b, h, n_q, 1]
    k = k.masked_fill(bad[..., None], 0.0)
    v = v.masked_fill(bad[..., None], 0.0)
    q = q.masked_fill(bad_q, 0.0)
    out, weights = _attend(
        q, k, v, hooks, scheme, q_pos, k_pos, mask, backend, dropout_p, need_weights
    )
    sees = _sees_any(mask, bad, q.device) | bad_q  # [b, h, n_q, 1]
    out = out.masked_fill(sees, float("nan"))
    return out, None if weights is None else weights.masked_fill(sees, float("nan"))


def _finite(*xs: Tensor) -> bool:
    """Whether every element of every tensor is finite (one sync with the device)."""
    return bool(torch.stack([torch.isfinite(x).all() for x in xs]).all())


def _sees_any(mask: Mask, keys: Tensor, device: torch.device) -> Tensor:
    """``[b, h, n_q, 1]`` bool: whether query ``i`` sees any of the ``keys [b, h, n_k]`` (bool)
    that the mask leaves visible to it; in blocks of rows (no ``[n_q, n_k]`` mask at once)."""
    b, h, n_k = keys.shape
    picked = keys.to(torch.float32)[..., None]  # [b, h, n_k, 1]

    def seen(rows: slice | None) -> Tensor:
        keep = mask.keep(rows, device=device)  # [b|1, 1, rows, n_k]
        count = picked.sum(dim=2, keepdim=True) if keep is None else keep.float() @ picked
        return count > 0  # [b, h, rows | 1, 1]

    if torch.compiler.is_compiling():  # one graph for any length: the whole mask at once
        return seen(None).expand(b, h, mask.n_q, 1)
    rows = lean_block_rows(b, 1, mask.n_q, n_k)
    parts = [
        seen(slice(start, min(start + rows, mask.n_q))).expand(b, h, -1, 1)
        for start in range(0, mask.n_q, rows)
    ]
    return torch.cat(parts, dim=2) if parts else keys.new_zeros(b, h, 0, 1, dtype=torch.bool)


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    hooks: Hooks,
    scheme: Any,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    backend: str,
    dropout_p: float,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """:func:`attend` for inputs whose masked keys and values are finite."""
    scale = q.shape[-1] ** -0.5
    if need_weights or backend == "math":
        out, weights = _math(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p)
        return out, (weights if need_weights else None)
    fast = functools.partial(
        _fast, hooks=hooks, q_pos=q_pos, k_pos=k_pos, mask=mask, scale=scale,
        dropout_p=dropout_p, backend=backend, scheme=scheme,
    )  # fmt: skip
    params = _scheme_parameters(scheme)
    if (
        torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and any(x.requires_grad for x in (q, k, v, *params))
    ):
        # the fast paths' backwards are not differentiable: a gradient asked for with
        # create_graph=True is taken through the math reference instead
        reference = functools.partial(
            _math, hooks=hooks, q_pos=q_pos, k_pos=k_pos, mask=mask, scale=scale, dropout_p=0.0
        )
        return _TwiceDifferentiable.apply(fast, reference, dropout_p, q, k, v, *params), None
    return fast(q, k, v), None


class _TwiceDifferentiable(torch.autograd.Function):
    """A fast path whose gradient is itself differentiable.

    The forward runs ``fast`` and keeps its graph. A first-order backward is that graph's
    (the fast path's own backward). A backward with ``create_graph=True`` (gradient
    penalties, Hessian-vector products, MAML) recomputes the output with the math reference
    on the saved inputs and differentiates it with a graph, so that the second derivative
    is the definition's: exact, with the reference's ``[b, h, n_q, n_k]`` memory.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        fast: Callable[..., Tensor],
        reference: Callable[..., tuple[Tensor, Tensor]],
        dropout_p: float,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *params: Tensor,
    ) -> Tensor:
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(x.requires_grad) for x in (q, k, v)]
            out = fast(*leaves)
        ctx.graph = (out, leaves, params)
        ctx.reference, ctx.dropout_p = reference, dropout_p
        ctx.save_for_backward(q, k, v)
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        out, leaves, params = ctx.graph
        if not out.requires_grad:  # nothing the output depends on asks for a gradient
            return (None,) * (6 + len(params))
        if torch.is_grad_enabled():  # create_graph=True: the gradient needs a graph
            if ctx.dropout_p > 0:
                raise RuntimeError(
                    "a gradient with create_graph=True through attention dropout needs the "
                    "same dropout mask twice; use backend='math' (its dropout is part of the "
                    "graph) or set dropout=0"
                )
            inputs = [*ctx.saved_tensors, *params]
            wrt = [x for x in inputs if x.requires_grad]
            ref = ctx.reference(*ctx.saved_tensors)[0]
            grads = iter(
                torch.autograd.grad(ref, wrt, grad_out, create_graph=True, allow_unused=True)
            )
        else:
            inputs = [*leaves, *params]
            wrt = [x for x in inputs if x.requires_grad]
            grads = iter(
                torch.autograd.grad(out, wrt, grad_out, retain_graph=True, allow_unused=True)
            )
        return None, None, None, *(next(grads) if x.requires_grad else None for x in inputs)


def _fast(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    hooks: Hooks,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    scale: float,
    dropout_p: float,
    backend: str,
    scheme: Any,
) -> Tensor:
    """Every path but the math reference (``backend`` ``"auto"``, ``"sdpa"``, ``"flex"`` or
    ``"lean"``): ``[b, h, n_q, d]``."""
    if hooks.key_shift is not None and hooks.score_term is not None and backend != "flex":
        # a term of the key alone: q_i . (k_j + e_j) = q_i . k_j + q_i . e_j, so every kernel
        # computes it, with no [n_q, n_k] term (the math path keeps the literal form)
        k = k + hooks.key_shift(q, q_pos, k_pos).to(k.dtype)  # [b, h, n_k, d]
        hooks = replace(hooks, score_term=None, key_shift=None)
    if backend == "auto":
        backend = choose_backend(hooks, q, dropout_p=dropout_p)
    path = {"math": None, "sdpa": _sdpa, "flex": _flex, "lean": _lean}[backend]
    if path is _lean and (q.numel() == 0 or k.shape[-2] == 0):
        # nothing to attend (an empty batch, no query, no key): the math path's empty
        # products give the empty (or zero) output and its gradients; the lean engine's
        # blocks and head groups assume at least one of each
        path = None
    if path is None:
        return _math(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p)[0]
    if path is _lean:
        return _lean(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p, scheme=scheme)
    return path(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p)


# ----- the memory-lean engine -------------------------------------------------------------

#: a probability ``exp(x)`` with ``x < -EXP_FLOOR`` is taken as exactly 0: below -87,
#: float32's ``exp`` gives denormal numbers (1e-45 to 1e-38), on which x86 arithmetic is
#: tens of times slower, for a probability that a float32 row summing to 1 cannot show.
#: Masked keys (at the most negative float) get exactly 0, as before.
EXP_FLOOR = 80.0
_SHARE_FLOOR = math.exp(-EXP_FLOOR)


def _exp_no_denormals(x: Tensor) -> Tensor:
    """``exp(x)`` in place, exactly 0 where ``x < -EXP_FLOOR`` (see :data:`EXP_FLOOR`)."""
    return x.masked_fill_(x < -EXP_FLOOR, float("-inf")).exp_()


#: in the fused CPU kernel, whose ``exp`` posenc cannot reach, a content-free bias more
#: than a span below the best bias of its row is raised to that level. A strong bias
#: (ALiBi's ``-slope * |j - i|`` reaches -1000 at 2048 tokens) otherwise sends most of a
#: row into the denormal range, where the kernel is several times slower. The span is
#: ``BIAS_SPAN``, or more when the content scores could make up the difference (see
#: :func:`_bias_span`), so that raising a bias never changes the result beyond rounding.
BIAS_SPAN = 60.0


def _bias_span(q: Tensor, k: Tensor, scale: float) -> float:
    """How far below its row's best a content-free bias may be raised with no visible change.

    A key whose bias is raised from below ``best - span`` to ``best - span`` has a weight at
    most ``exp(C - span)`` times that of the row's best-bias key, where ``C`` bounds how much
    the content scores ``scale * q_i . k_j`` can differ within a row:
    ``C = 2 * scale * max|q_i| * max|k_j|``. With ``span = C + log(n_k) + log(2 / eps)`` the
    weight all raised keys gain together is below ``eps`` (the dtype's resolution) of the
    row's, and the result is the definition's up to rounding. Returns ``max(BIAS_SPAN,
    that)``: usually ``BIAS_SPAN``; a larger span for large content scores (correct, and
    slower where the far keys then reach the denormal range).
    """
    n_k = k.shape[-2]
    if q.numel() == 0 or n_k == 0:
        return BIAS_SPAN
    q_norm = torch.linalg.vector_norm(q.detach(), dim=-1).amax()
    k_norm = torch.linalg.vector_norm(k.detach(), dim=-1).amax()
    reach = 2 * scale * float(q_norm * k_norm)
    margin = math.log(n_k) + math.log(2 / torch.finfo(q.dtype).eps)
    return max(BIAS_SPAN, reach + margin)


#: elements of one block of scores ``[b, h, rows, n_k]`` the lean engine aims for
LEAN_BLOCK_ELEMENTS = 1 << 22


#: elements of one block's scores ``[b, g, rows, n_k]`` when its backward is written out
#: (its five products and the passes over ``P`` and ``dS`` then stay in the caches; measured
#: here, n = 4096: 64 rows 1.5x the fused backward, 256 rows 1.75x)
WRITTEN_BLOCK_ELEMENTS = 1 << 19

#: query rows per kernel call on the per-offset bias path under a causal mask: a block
#: computes the keys its last query sees, so short blocks skip more of the hidden half
CAUSAL_ROWS = 256


def _kernel_rows(n_q: int, causal: bool = False) -> int:
    """Query rows per fused-kernel call on the per-offset bias path: all of them (its masks
    are views of the values, of any size), or :data:`CAUSAL_ROWS` under a causal mask."""
    return max(1, min(n_q, CAUSAL_ROWS) if causal else n_q)


def _hankel(values_rev: Tensor, start: int, count: int, keys: slice) -> Tensor:
    """The mask of a per-offset bias for queries ``start .. start + count - 1`` and the keys
    reversed ``keys`` (key ``j' = n_k - 1 - j``): ``[1, g|1, count, len(keys)]``, a view.

    The pair ``(i, j)`` takes column ``j - i + n_q - 1`` of ``values [g|1, W]``: with the keys
    reversed, column ``W - 1 - (i + j')``, so ``values_rev`` (the columns reversed) holds
    it at ``i + j'``, and the mask is a view with strides ``(1, 1)``: no buffer, and reads
    that stay in the caches (measured here, n = 2048: the kernel over 512-row blocks with
    such a view took 1.05x the floor, with a skewed buffer 1.23x, reversing k and v 0.02x).
    """
    width = values_rev.shape[-1]
    return values_rev.as_strided(
        (1, values_rev.shape[0], count, keys.stop - keys.start),
        (values_rev.numel(), width, 1, 1),
        values_rev.storage_offset() + start + keys.start,
    )


#: :data:`WRITTEN_BLOCK_ELEMENTS` for the 2-D term's written-out backward, whose blocks
#: carry more fixed work (the term rebuilt, four small products, two sums): measured here
#: (interleaved runs), relative-2d fwd+bwd at n = 2048 with 2^19 / 2^20 / 2^21 / 2^22
#: scores: 1.68x / 1.59x / 1.48x / 1.49x; at 4096 (2^20 / 2^21 / 2^22) 1.56x / 1.50x /
#: 1.53x. (The 1-D paths gain nothing from longer blocks, and their memory grows: T5 at
#: 2048 with 2^21, 1.35x time and 1.93x memory, against 1.37x and 1.07x.)
GRID_TERM_WRITTEN_ELEMENTS = 1 << 21


def _written_rows(b: int, g: int, n_q: int, n_k: int, elements: int | None = None) -> int:
    """Query rows per block of a written-out backward: about ``elements`` scores (default
    :data:`WRITTEN_BLOCK_ELEMENTS`), at most 512 rows."""
    elements = WRITTEN_BLOCK_ELEMENTS if elements is None else elements
    return max(1, min(n_q, 512, elements // max(1, b * g * n_k)))


def lean_block_rows(b: int, h: int, n_q: int, n_k: int) -> int:
    """Query rows per block: about :data:`LEAN_BLOCK_ELEMENTS` scores, 16 to 512 rows."""
    rows = LEAN_BLOCK_ELEMENTS // max(1, b * h * n_k)
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
    leading dimension is a slow reduction on CPU (measured here, ``[2, 128, 2048]`` summed
    into a strided view: 159 us, against 45 us as two adds)."""
    for part in x.flatten(0, dims - 1) if dims > 1 else x:
        dest.add_(part)


def _scheme_parameters(scheme: Any) -> list[Tensor]:
    if isinstance(scheme, torch.nn.Module):
        return [p for p in scheme.parameters() if p.requires_grad]
    return []


def _block_scores(
    q_blk: Tensor,
    k: Tensor,
    extra: Tensor | None,
    keep: Tensor | None,
    scale: float,
) -> Tensor:
    """``(q k^T) * scale + extra`` for one block, masked keys at the most negative value.

    ``extra`` is the block's ``score_term * scale + score_bias`` (float32 or wider).
    """
    scores = ((q_blk * scale) @ k.transpose(-2, -1)).to(_wide(q_blk.dtype))  # [b, h, rows, n_k]
    if extra is not None:
        scores = scores.add_(extra)
    if keep is not None:
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    return scores


class _LeanAttention(torch.autograd.Function):
    """Blocked attention that keeps only the log-sum-exp for the backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        hooks: Hooks,
        q_pos: Tensor,
        k_pos: Tensor,
        mask: Mask,
        scale: float,
        rows: int,
        span: float,
        *params: Tensor,
    ) -> Tensor:
        out = torch.empty_like(q)  # [b, h, n_q, d]
        lse = torch.empty(q.shape[:-1], dtype=_wide(q.dtype), device=q.device)  # [b, h, n_q]
        for start in range(0, q.shape[2], rows):
            blk = slice(start, min(start + rows, q.shape[2]))
            q_blk, qp = q[:, :, blk], q_pos[:, blk]
            extra = _fold_scores(hooks, q_blk, qp, k_pos, scale, reference=False)
            keep = mask.keep(blk, device=q.device)
            scores = _block_scores(q_blk, k, extra, keep, scale)
            block_lse = scores.logsumexp(dim=-1, keepdim=True)  # [b, h, rows, 1]
            probs = _exp_no_denormals(scores.sub_(block_lse))
            if keep is not None:
                probs = probs.mul_(keep.any(dim=-1, keepdim=True))
            probs = probs.to(v.dtype)
            out_blk = probs @ v
            if hooks.value_term is not None:
                out_blk = out_blk + hooks.value_term(probs, qp, k_pos)
            out[:, :, blk] = out_blk
            lse[:, :, blk] = block_lse.squeeze(-1)
        ctx.save_for_backward(q, k, v, out, q_pos, k_pos, lse, *params)
        ctx.hooks, ctx.mask, ctx.scale, ctx.rows = hooks, mask, scale, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, q_pos, k_pos, lse, *params = ctx.saved_tensors
        hooks, mask, scale, rows = ctx.hooks, ctx.mask, ctx.scale, ctx.rows
        grad_q = torch.zeros_like(q)
        grad_k = torch.zeros(k.shape, dtype=_wide(k.dtype), device=k.device)
        grad_v = torch.zeros(v.shape, dtype=_wide(v.dtype), device=v.device)
        grad_params = [torch.zeros_like(p) for p in params]
        has_hooks = hooks.score_term is not None or hooks.score_bias is not None
        for start in range(0, q.shape[2], rows):
            blk = slice(start, min(start + rows, q.shape[2]))
            qp, g_out = q_pos[:, blk], grad_out[:, :, blk]
            q_blk = q[:, :, blk].detach().requires_grad_(hooks.score_term is not None)
            with torch.enable_grad():
                extra = _fold_scores(hooks, q_blk, qp, k_pos, scale, reference=False)
            keep = mask.keep(blk, device=q.device)
            scores = _block_scores(
                q_blk.detach(), k, None if extra is None else extra.detach(), keep, scale
            )
            probs = _exp_no_denormals(scores.sub_(lse[:, :, blk, None]))
            if keep is not None:
                probs = probs.mul_(keep.any(dim=-1, keepdim=True))
            wide = _wide(q.dtype)
            grad_probs = (g_out @ v.transpose(-2, -1)).to(wide)  # [b, h, rows, n_k]
            value_out = None
            if hooks.value_term is not None:
                probs_leaf = probs.to(v.dtype).requires_grad_()
                with torch.enable_grad():
                    value_out = hooks.value_term(probs_leaf, qp, k_pos)
                outputs, wrt = [value_out], [probs_leaf, *params]
                grads = torch.autograd.grad(outputs, wrt, [g_out], allow_unused=True)
                grad_probs = grad_probs + grads[0].to(wide)
                for acc, g in zip(grad_params, grads[1:], strict=True):
                    if g is not None:
                        acc += g
            grad_v += probs.transpose(-2, -1) @ g_out.to(wide)
            # sum_j P_ij dP_ij = dO_i . O_i (FlashAttention's D), O(rows * d) not O(rows * n_k)
            row_dot = (g_out.to(wide) * out[:, :, blk].to(wide)).sum(dim=-1, keepdim=True)
            grad_scores = probs.mul_(grad_probs.sub_(row_dot))  # dL/d(scaled scores)
            gs = grad_scores.to(q.dtype)
            grad_q[:, :, blk] = (gs @ k) * scale
            grad_k += (gs.transpose(-2, -1) @ q_blk.detach()).to(wide) * scale
            if has_hooks and extra is not None and extra.requires_grad:
                wrt = ([q_blk] if hooks.score_term is not None else []) + list(params)
                grad_extra = _sum_to(grad_scores, extra.shape)  # undo the broadcast of [B', h|1]
                grads = torch.autograd.grad([extra], wrt, [grad_extra], allow_unused=True)
                if hooks.score_term is not None:
                    grad_q[:, :, blk] += grads[0]
                    grads = grads[1:]
                for acc, g in zip(grad_params, grads, strict=True):
                    if g is not None:
                        acc += g
        return (
            grad_q,
            grad_k.to(k.dtype),
            grad_v.to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            *grad_params,
        )


def _fused_cpu_available(q: Tensor, hooks: Hooks) -> bool:
    """Whether the fused CPU flash kernels can run the lean engine for these inputs."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and hooks.value_term is None
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
    )


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def _head_groups(b: int, h: int) -> list[slice]:
    """Heads per fused-kernel call: as few as keep every thread busy (``b * group >= threads``).

    Measured here (2 cores, n = 2048): the CPU flash backward over a block of 128 query rows
    and all 8 heads took 1.7x as long as the whole sequence in one call, over the same rows
    one head at a time 1.1x; with 512 rows, 1.14x and 0.98x.
    """
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
        keep: ``[b|1, 1, rows, n_k]`` visible keys, rows with no visible key set all True
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
            # no visible key more than span below the row's best bias (see BIAS_SPAN)
            best = mask if keep is None else mask.masked_fill(~keep, float("-inf"))
            mask = torch.maximum(mask, best.amax(dim=-1, keepdim=True) - span)
    if keep is not None:
        mask = mask.masked_fill(~keep, float("-inf"))
    # the kernel broadcasts [B'|1, g|1, rows, n_k] itself: no [b, g, rows, n_k] copy
    return mask.contiguous()


def _visible(mask: Mask, rows: slice, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """``(keep, has_key)`` for a block of rows: ``keep [b|1, 1, rows, n_k]`` with rows that
    see no key opened to all keys, ``has_key [b|1, 1, rows, 1]``; ``(None, None)`` unmasked."""
    keep = mask.keep(rows, device=device)
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
        if extra is not None and extra.shape[1] > 1:
            yield hs, _kernel_mask(extra[:, hs], keep, like, span)
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
            (a mask built per block: one pass fewer than adding it to the scores). ``lse`` is subtracted
            after: folded into the mask first, float32 lost precision (a term in the
            hundreds: dq 3x further from float64, found in review).

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
    # no floor on exp unless asked: a bias mask is within BIAS_SPAN of its row's best, and a
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


class _LeanFusedAttention(torch.autograd.Function):
    """The lean engine on PyTorch's fused CPU flash kernels, a block of rows and heads at a time.

    For each block of query rows the hooks' term is built once for all heads; the fused
    kernel then runs head group by head group with it as the additive mask. The backward of
    a scheme with nothing to differentiate (ALiBi) is the fused backward. When the term has
    a gradient (a learned table, or a score term that depends on ``q``), the block's
    backward is written out instead (the same five products as the kernel's), because it
    yields ``dS = P (dP - D)``, which one autograd call through the hooks turns into the
    table's and ``q``'s gradients.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        hooks: Hooks,
        q_pos: Tensor,
        k_pos: Tensor,
        mask: Mask,
        scale: float,
        rows: int,
        span: float,
        *params: Tensor,
    ) -> Tensor:
        out = torch.empty_like(q)  # [b, h, n_q, d]
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)  # [b, h, n_q]
        groups = _head_groups(q.shape[0], q.shape[1])
        for start in range(0, q.shape[2], rows):
            blk = slice(start, min(start + rows, q.shape[2]))
            keep, has_key = _visible(mask, blk, q.device)
            extra = _fold_scores(hooks, q[:, :, blk], q_pos[:, blk], k_pos, scale, reference=False)
            for hs, attn_mask in _group_masks(extra, keep, groups, q, span):
                out_blk, lse_blk = _flash_cpu(
                    q[:, hs, blk], k[:, hs], v[:, hs], 0.0, False, attn_mask=attn_mask, scale=scale
                )  # [b, g, rows, d], [b, g, rows]
                out[:, hs, blk] = out_blk if has_key is None else out_blk * has_key
                lse[:, hs, blk] = lse_blk
        ctx.save_for_backward(q, k, v, out, q_pos, k_pos, lse, *params)
        ctx.hooks, ctx.mask, ctx.scale, ctx.rows, ctx.span = hooks, mask, scale, rows, span
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, q_pos, k_pos, lse, *params = ctx.saved_tensors
        hooks, mask, scale, rows, span = ctx.hooks, ctx.mask, ctx.scale, ctx.rows, ctx.span
        grad_q = torch.empty_like(q)
        grad_params = [torch.zeros_like(p) for p in params]
        grad_out = grad_out.contiguous()
        groups = _head_groups(q.shape[0], q.shape[1])
        key_grads = _KeyGrads(k, v, groups)
        for start in range(0, q.shape[2], rows):
            blk = slice(start, min(start + rows, q.shape[2]))
            qp = q_pos[:, blk]
            q_blk = q[:, :, blk].detach().requires_grad_(hooks.score_term is not None)
            keep, has_key = _visible(mask, blk, q.device)
            with torch.enable_grad():
                extra = _fold_scores(hooks, q_blk, qp, k_pos, scale, reference=False)
            g_out = grad_out[:, :, blk]
            if has_key is not None:
                g_out = g_out * has_key  # rows with no key contribute nothing
            learn = extra is not None and extra.requires_grad
            # every head group writes its heads of dS once (or, for a term shared by the
            # heads, adds to it): no zero fill needed
            grad_extra = torch.empty_like(extra) if learn else None
            term = None if extra is None else extra.detach()
            for hs, attn_mask in _group_masks(term, keep, groups, q, span):
                qh, kh, vh = q[:, hs, blk], k[:, hs], v[:, hs]  # [b, g, rows | n_k, d]
                gh, oh, lh = g_out[:, hs], out[:, hs, blk], lse[:, hs, blk]
                gq, _, grad_s = _block_grads(
                    qh, kh, vh, gh, oh, lh, attn_mask, scale, key_grads.of(hs),
                    need_ds=grad_extra is not None,
                )  # fmt: skip
                grad_q[:, hs, blk] = gq
                if grad_extra is None:  # the fused backward: nothing more to add
                    continue
                # dS summed over what the term broadcast: [B'|1, g|1, rows, n_k]
                if grad_extra.shape[1] == 1 and hs.start > 0:
                    grad_extra.add_(_sum_to(grad_s, grad_extra.shape))
                else:
                    _sum_into(_heads_of(grad_extra, hs), grad_s)
            if grad_extra is None:
                continue
            wrt = ([q_blk] if hooks.score_term is not None else []) + list(params)
            grads = torch.autograd.grad([extra], wrt, [grad_extra], allow_unused=True)
            if hooks.score_term is not None:
                grad_q[:, :, blk] += grads[0]
                grads = grads[1:]
            for acc, g in zip(grad_params, grads, strict=True):
                if g is not None:
                    acc += g
        grad_k, grad_v = key_grads.result()
        return (grad_q, grad_k, grad_v, None, None, None, None, None, None, None, *grad_params)


def _offset_kernel_values(
    values: Tensor, n_q: int, n_k: int, span: float, *, causal: bool = False
) -> Tensor | None:
    """A per-offset bias ready for the fused kernel: ``[h|1, n_q + n_k - 1]``, detached.

    Far biases are raised to ``span`` below the best (see :func:`_bias_span`). The
    general path does this row by row; per offset it is the same when every row meets the
    best offset (self-attention meets offset 0, ALiBi's best), so that the rows' bests are
    the overall best. None when a head spans more than ``BIAS_SPAN`` and some row misses
    its best: then the general path must raise them row by row.

    A causal mask (aligned at the end, ``n_q <= n_k``) hides the columns ``n_k ..`` (key
    index minus query index above ``n_k - n_q``): they are set to ``-inf``, every row keeps
    at least its diagonal.
    """
    values = values.detach()
    visible = values[..., :n_k] if causal else values
    low, high = torch.aminmax(visible, dim=-1, keepdim=True)  # [h|1, 1]
    if float((high - low).max()) > span:
        seen_by_all = values[..., n_q - 1 : n_k]  # offsets every row meets (none if n_q > n_k)
        if seen_by_all.shape[-1] == 0 or not torch.equal(seen_by_all.amax(-1, keepdim=True), high):
            return None
        values = torch.maximum(values, high - span)
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
    :data:`CAUSAL_ROWS` that stop at the last key their queries see: it skips about half
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
    ) -> Tensor:
        n_q, n_k = q.shape[2], k.shape[2]
        out = torch.empty_like(q)  # [b, h, n_q, d]
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)  # [b, h, n_q]
        values_rev = kernel_values.flip(-1).contiguous()  # [h|1, W]
        k_rev, v_rev = k.flip(2), v.flip(2)  # [b, h, n_k, d], keys reversed
        for blk, keys in _kernel_blocks(n_q, n_k, causal):
            out[:, :, blk], lse[:, :, blk] = _flash_cpu(
                q[:, :, blk], k_rev[:, :, keys], v_rev[:, :, keys], 0.0, False,
                attn_mask=_hankel(values_rev, blk.start, blk.stop - blk.start, keys), scale=scale,
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
            )
        b, h, n_q, _ = q.shape
        n_k = k.shape[2]
        grad_q = torch.empty_like(q)
        grad_values = torch.zeros_like(kernel_values)  # [h|1, W]
        groups = _head_groups(b, h)
        key_grads = _KeyGrads(k, v, groups)
        rows = _written_rows(b, groups[0].stop - groups[0].start, n_q, n_k)
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
        return grad_q, grad_k, grad_v, grad_values, None, None, None


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
    keys and their gradients are the group's: peak memory stays the floor's); no gradient
    for the values."""
    b, h = q.shape[:2]
    values_rev = kernel_values.flip(-1).contiguous()  # [h|1, W]
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    blocks = list(_kernel_blocks(q.shape[2], k.shape[2], causal))
    for hs in _head_groups(b, h):
        k_rev, v_rev = k[:, hs].flip(2), v[:, hs].flip(2)  # [b, g, n_k, d], keys reversed
        rev = _heads_of(values_rev[None], hs)[0]  # [g|1, W]
        grad_k_rev = grad_v_rev = None
        for blk, keys in blocks:
            gq, gk, gv = _flash_cpu_backward(
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
            grad_k[:, hs], grad_v[:, hs] = grad_k_rev.flip(2), grad_v_rev.flip(2)
    return grad_q, grad_k, grad_v


def _keys_seen(blk: slice, n_q: int, n_k: int, causal: bool) -> int:
    """How many keys the queries ``blk`` see: all, or under a causal mask aligned at the end
    up to key ``blk.stop - 1 + n_k - n_q``."""
    return min(n_k, blk.stop + n_k - n_q) if causal else n_k


def _clipped_runs(idx: Tensor) -> tuple[int, int] | None:
    """``(lead, tail)`` when ``idx [W]`` is a clipped run: ``lead`` times its first row, each
    row between once, ``tail`` times its last (``tail`` 0 when all rows are the first), as
    ``clip(offset, -k, k) + k`` over increasing offsets is; else None."""
    first, last = int(idx[0]), int(idx[-1])
    if last < first:  # clipped runs increase
        return None
    lead, tail = int((idx == first).sum()), int((idx == last).sum())
    parts = [torch.full((lead,), first, dtype=idx.dtype, device=idx.device)]
    if first != last:  # a run of first, first + 1 .. last - 1 once each, a run of last
        parts.append(torch.arange(first + 1, last, dtype=idx.dtype, device=idx.device))
        parts.append(torch.full((tail,), last, dtype=idx.dtype, device=idx.device))
    clipped = torch.cat(parts)
    if clipped.shape != idx.shape or not torch.equal(clipped, idx):
        return None
    return lead, tail if first != last else 0


class _Rows:
    """The rows ``r_m`` of the offsets a block of queries meets, for :class:`_OffsetTermAttention`.

    Given as rows ``[(h,) W, d]``, or as a table ``[(h,) R, d]`` with an index per offset
    (``r_m = table[index[m]]``). A clipped index (Shaw: ``clip(offset, -k, k) + k``: a run
    of the first row, single rows, a run of the last row) is kept as its ``R`` distinct rows
    and the runs' lengths: ``x @ r^T`` is then a product with ``R`` rows spread over the
    runs, and ``x @ r`` the runs' sums times ``R`` rows, not products over all ``W`` offsets.
    """

    def __init__(self, table: Tensor, index: Tensor | None, cols: slice) -> None:
        self.runs: tuple[int, int] | None = None
        self.target: slice | Tensor = cols
        self.width = cols.stop - cols.start  # W: the offsets (columns) covered
        if index is None:
            self.rows = table[..., cols, :]  # [(h,) W, d]
            return
        idx = index[cols]  # [W] rows of the table
        self.runs = _clipped_runs(idx)
        if self.runs is None:  # any index: the rows themselves
            self.rows, self.target = table[..., idx, :], idx
            return
        first, last = int(idx[0]), int(idx[-1])
        self.rows, self.target = table[..., first : last + 1, :], slice(first, last + 1)
        if self.runs[0] == 1 and self.runs[1] <= 1:  # one row per offset: nothing to spread
            self.runs = None

    def of(self, heads: slice) -> Tensor:
        """``[(g,) R | W, d]``: the rows of these heads (all of a shared table)."""
        return self.rows if self.rows.ndim == 2 else self.rows[heads]

    def spread(self, x: Tensor) -> Tensor:
        """``[..., R]`` per distinct row -> ``[..., W]`` per offset (a copy)."""
        if self.runs is None:
            return x
        lead, tail = self.runs
        if tail == 0:  # one row for every offset
            return x.expand(*x.shape[:-1], lead).contiguous()
        left = x[..., :1].expand(*x.shape[:-1], lead)
        right = x[..., -1:].expand(*x.shape[:-1], tail)
        return torch.cat((left, x[..., 1:-1], right), dim=-1)

    def gather(self, x: Tensor) -> Tensor:
        """``[..., W]`` per offset -> ``[..., R]`` summed per distinct row (the adjoint)."""
        if self.runs is None:
            return x
        lead, tail = self.runs
        if tail == 0:
            return x.sum(dim=-1, keepdim=True)
        width = x.shape[-1]
        left = x[..., :lead].sum(dim=-1, keepdim=True)
        right = x[..., width - tail :].sum(dim=-1, keepdim=True)
        return torch.cat((left, x[..., lead : width - tail], right), dim=-1)

    def logits(self, x: Tensor, heads: slice) -> Tensor:
        """``x @ r^T``: ``[b, g, rows, d] -> [b, g, rows, W]``."""
        return self.spread(x @ self.of(heads).transpose(-2, -1))

    def combine(self, x: Tensor, heads: slice) -> Tensor:
        """``x @ r``: ``[b, g, rows, W] -> [b, g, rows, d]``."""
        return self.gather(x) @ self.of(heads)

    def add_grad(self, grad: Tensor, heads: slice, x: Tensor, y: Tensor, scale: float) -> None:
        """Add ``scale * x^T @ y`` (``x [b, g, rows, W]``, ``y [b, g, rows, d]``) to the
        whole table's gradient ``grad``, summed over the batch (and the heads, if shared)."""
        rows = (self.gather(x).transpose(-2, -1) @ y).sum(dim=0).mul_(scale)  # [g, R | W, d]
        if grad.ndim == 2:
            rows = rows.sum(dim=0)  # [R | W, d]
            if isinstance(self.target, slice):
                grad[self.target] += rows
            else:
                grad.index_add_(0, self.target, rows)
        elif isinstance(self.target, slice):
            grad[heads, self.target] += rows
        else:
            grad[heads].index_add_(1, self.target, rows)


#: query-key pairs (per head) from which a clipped table's far pairs take the fused kernels
#: (:class:`_FarPart`): below it their fixed costs (copies of q, k, v reversed, merges, two
#: more calls) exceed what they save. Measured here for Shaw (k = 16, batch 2, 8 heads),
#: fwd+bwd against the floor, without / with: n = 1024 2.48x / 2.75x, 1536 2.48x / 2.18x,
#: 2048 2.37x / 1.93x.
FAR_PAIRS = 1 << 21


def _lead_pieces(n_q: int, n_k: int, delta: int) -> list[tuple[slice, slice, bool]]:
    """``(query rows, keys, causal)`` calls of the fused kernel covering exactly the pairs
    ``j <= i + delta - 1`` (query ``i``, key ``j``), with the kernel's causal mask, which is
    top-left (query ``i'`` of a call sees its keys ``j' <= i'``): rows from the first with
    such a key; keys that all those rows see in one call without a mask, the rest causal."""
    first = max(0, 1 - delta)  # the first row with a key
    if first >= n_q or n_k == 0:
        return []
    last_of_first = first + delta - 1  # the first row's last key (>= 0)
    rows = slice(first, n_q)
    pieces = []
    if last_of_first > 0:  # keys every row from the first sees: no mask
        pieces.append((rows, slice(0, min(last_of_first, n_k)), False))
    if last_of_first < n_k:
        pieces.append((rows, slice(last_of_first, n_k), True))
    return pieces


class _FarPart:
    """The keys of one constant end of a clipped table (Shaw's first or last row): pairs
    ``j <= i + delta - 1`` (the lead), or, on the sequences reversed, ``j >= i + delta'``
    (the tail). Their term is one number per query, ``q_i . a^K``, and their value term one
    row, ``a^V``: the fused kernel runs over them without a mask (:func:`_lead_pieces`)."""

    def __init__(
        self, table: Tensor, value_table: Tensor | None, row: int, delta: int, flip: bool
    ) -> None:
        self.row, self.delta, self.flip = row, delta, flip
        self.keys = table[..., row, :]  # [(h,) d]
        self.values = None if value_table is None else value_table[..., row, :]

    @staticmethod
    def broadcast(x: Tensor | None, heads: slice) -> Tensor | None:
        """A row ``[(h,) d]`` of these heads, broadcastable to ``[b, g, n, d]``."""
        if x is None:
            return None
        return (x if x.ndim == 1 else x[heads]).unsqueeze(-2)  # [(g,) 1, d]

    def term(self, q: Tensor, heads: slice, scale: float) -> Tensor:
        """``scale * q_i . a^K``: ``[b, g, n_q]`` for ``q [b, g, n_q, d]`` of these heads."""
        row = self.broadcast(self.keys, heads)  # [(g,) 1, d]
        return (q @ row.transpose(-2, -1)).squeeze(-1).mul_(scale)

    def _seq(self, x: Tensor) -> Tensor:
        return x.flip(2) if self.flip else x

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, heads: slice, scale: float
    ) -> tuple[Tensor, Tensor]:
        """``(out, lse)``: ``[b, g, n_q, d]``, ``[b, g, n_q]`` over the part's keys for the
        heads ``heads`` (``q``, ``k``, ``v`` theirs), ``lse`` with the term added, ``-inf``
        (and ``out`` 0) for rows with no key here."""
        n_q, n_k = q.shape[2], k.shape[2]
        term = self.term(q, heads, scale)  # [b, g, n_q]
        q, k, v = self._seq(q), self._seq(k), self._seq(v)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        lse = q.new_full(q.shape[:-1], float("-inf"))
        for rows, keys, causal in _lead_pieces(n_q, n_k, self.delta):
            o, l = _flash_cpu(q[:, :, rows], k[:, :, keys], v[:, :, keys], 0.0, causal, scale=scale)
            merged = torch.logaddexp(lse[:, :, rows], l)
            out[:, :, rows] = out[:, :, rows] * (lse[:, :, rows] - merged).exp().unsqueeze(
                -1
            ) + o * (l - merged).exp().unsqueeze(-1)
            lse[:, :, rows] = merged
        return self._seq(out), self._seq(lse) + term

    def backward(
        self, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """The kernel's gradients ``(dq, dk, dv)`` over the part's keys given the merged
        ``out`` (less the part's value row) and ``lse`` (less the part's term)."""
        n_q, n_k = q.shape[2], k.shape[2]
        g, q, k, v, out, lse = (self._seq(x) for x in (grad_out, q, k, v, out, lse))
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows, keys, causal in _lead_pieces(n_q, n_k, self.delta):
            gq, gk, gv = _flash_cpu_backward(
                g[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                lse[:, :, rows], 0.0, causal, scale=scale,
            )  # fmt: skip
            grad_q[:, :, rows] += gq
            grad_k[:, :, keys] += gk
            grad_v[:, :, keys] += gv
        return self._seq(grad_q), self._seq(grad_k), self._seq(grad_v)


def _far_parts(
    table: Tensor, value_table: Tensor | None, index: Tensor | None, n_q: int, n_k: int,
    causal: bool,
) -> tuple[list[_FarPart], int | None, int | None]:  # fmt: skip
    """The far parts of a clipped index and the band left between them: ``(parts, low,
    high)``, query ``i`` meeting keys ``i + low .. i + high`` in the strip (None: unbounded).

    Offset column ``m = j - i + n_q - 1``: columns below ``lead`` hold the first row, from
    ``W - tail`` the last. Under a causal mask (aligned at the end) keys after
    ``i + n_k - n_q`` are hidden: the lead stops there, and there is no tail part (the strip
    takes its visible keys up to the causal bound). No far parts below
    :data:`FAR_PAIRS` pairs: the strip then covers every key, as for any term.
    """
    runs = None if index is None or n_q * n_k < FAR_PAIRS else _clipped_runs(index)
    high = n_k - n_q if causal else None
    if runs is None:
        return [], None, high
    lead, tail = runs
    low = lead - n_q + 1  # lead keys: j <= i + low - 1
    if causal:
        low = min(low, n_k - n_q + 1)
    parts = [_FarPart(table, value_table, int(index[0]), low, flip=False)]
    if not causal and tail:
        high = n_k - tail - 1  # tail keys: j >= i + high + 1
        # reversed: i* = n_q - 1 - i, j* = n_k - 1 - j: j* <= i* + (tail - n_q + 1) - 1
        parts.append(_FarPart(table, value_table, int(index[-1]), tail - n_q + 1, flip=True))
    return parts, low, high


def _strip(
    blk: slice, n_q: int, n_k: int, low: int | None, high: int | None
) -> tuple[slice, slice, int, int | None]:
    """A block's strip: ``(keys, offset columns, first hidden logit column from the left
    (0: none), first hidden logit column on the right (None: none))``; keys ``a .. c - 1``,
    logits column ``col`` of the block is offset ``col - (rows - 1) + a - start``."""
    rows = blk.stop - blk.start
    a = 0 if low is None else min(max(blk.start + low, 0), n_k)
    c = n_k if high is None else min(max(blk.stop + high, a), n_k)
    cols = slice(a - blk.stop + n_q, c - blk.start + n_q - 1)
    left = 0 if low is None else max(low + rows - 1 - a + blk.start, 0)
    right = None if high is None else high + rows - a + blk.start
    return slice(a, c), cols, left, right


class _OffsetTermAttention(torch.autograd.Function):
    """The lean engine for a query term ``q_i . r_(j-i)`` (relative embedding, Huang et al.;
    Shaw's keys), with Shaw's value term ``sum_j P_ij a^V_(j-i)`` when given its rows.

    For consecutive positions with no mask and no bias, each block's term is the skew of
    ``q_blk @ r^T`` over the offsets it meets, handed to the fused kernel as a strided view
    (no ``[rows, n_k]`` copy). The value term is ``unskew(P) @ a^V`` with ``P`` recomputed
    from the kernel's ``logsumexp`` over the block's keys. Backward: ``dS`` (and ``P``) go
    back through the skew into zero-padded buffers (one per tag, :func:`_reused`); small products
    give the gradients of ``q`` and of the rows. Rows given as a clipped table (see :class:`_Rows`) make every product
    with them ``R`` rows wide instead of ``W``.

    A clipped table (Shaw) is also constant far from the diagonal: keys ``k`` or more before
    a query meet only its first row, ``k`` or more after only its last. Those pairs take the
    fused kernels over the whole sequence without a mask (:class:`_FarPart`: a causal call
    shifted by ``k``, and one on the sequences reversed): their term is one number per
    query, added to the part's logsumexp, their value term the part's weight times one row.
    Only the band of ``2k - 1`` offsets around the diagonal is handled as above, block by
    block (keys outside it ``-inf`` in the block's logits; its value term normalised within
    the band, as its output). The parts are merged by their logsumexps (split-key flash
    attention), which scales the band's output and value term by its share; the backward
    runs the fused kernel on each far part with the merged ``logsumexp`` and output, the
    output less the part's value row so that the kernel's ``D = dO . O`` misses exactly
    that row's share of ``dP``. Only from :data:`FAR_PAIRS` query-key pairs per head: below
    it the band covers every key.

    Under a causal mask each block stops at the last key it sees, and the offsets its
    queries may not see are ``-inf`` in its logits.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        table: Tensor,
        value_table: Tensor | None,
        index: Tensor | None,
        scale: float,
        rows: int,
        causal: bool,
    ) -> Tensor:
        b, h, n_q, _ = q.shape
        n_k = k.shape[2]
        table = table.detach()
        value_table = None if value_table is None else value_table.detach()
        parts, low, high = _far_parts(table, value_table, index, n_q, n_k, causal)
        groups = _strip_groups(b, h, parts)
        rows = _strip_rows(rows, low, high)
        # the strip's share so far: rows with no strip key keep -inf
        out = torch.zeros_like(q)  # [b, h, n_q, d]
        lse = q.new_full(q.shape[:-1], float("-inf"))  # [b, h, n_q]
        padded: _Buffers = {}
        tables: dict[tuple[Any, ...], _Rows] = {}
        for blk, keys_of, cols, lo, hi in _strips(n_q, n_k, rows, low, high):
            if keys_of.stop <= keys_of.start or hi <= lo:  # no strip key for any query
                continue
            keys = _rows_cached(tables, table, index, cols)
            values = None if value_table is None else _rows_cached(tables, value_table, index, cols)
            has_key = _band_rows(blk, keys_of, low, high)  # [rows] rows with a strip key
            for hs in groups:
                qh, kh = q[:, hs, blk], k[:, hs, keys_of]  # [b, g, rows | c - a, d]
                attn_mask = _term_mask(qh, keys, hs, scale, kh.shape[2], lo, padded)
                o, l = _flash_cpu(qh, kh, v[:, hs, keys_of], attn_mask=attn_mask, scale=scale)
                if values is not None:  # normalized within the strip, as o: the merge
                    # below scales both by the strip's share (rows with no strip key: 0)
                    l_seen = l if has_key is None else l.masked_fill(~has_key, float("inf"))
                    o = o + _strip_values(qh, kh, attn_mask, l_seen, values, hs, scale, lo, padded)
                if has_key is not None:
                    o = torch.where(has_key[:, None], o, 0.0)  # (whatever the kernel gave)
                    l = l.masked_fill(~has_key, float("-inf"))
                out[:, hs, blk], lse[:, hs, blk] = o, l
        weights = mixed = None
        if parts:  # merged into the strip's share, a head group at a time (their copies)
            weights = q.new_empty(len(parts), b, h, n_q)  # each part's share of each row
            mixed = q.new_empty(len(parts), b, h, n_q, v.shape[-1])  # share * its output
            for hs in _head_groups(b, h):
                qh, kh, vh = q[:, hs], k[:, hs], v[:, hs]  # [b, g, n, d]
                far = [part.forward(qh, kh, vh, hs, scale) for part in parts]
                total = torch.logsumexp(torch.stack([lse[:, hs], *(l for _, l in far)]), dim=0)
                out_h = out[:, hs] * (lse[:, hs] - total).exp_().unsqueeze(-1)  # [b, g, n, d]
                for i, (part, (o, l)) in enumerate(zip(parts, far, strict=True)):
                    w = (l - total).exp_()  # [b, g, n_q]
                    weights[i, :, hs] = w
                    mixed[i, :, hs] = o.mul_(w.unsqueeze(-1))
                    out_h += o
                    value_row = _FarPart.broadcast(part.values, hs)
                    if value_row is not None:
                        out_h += w.unsqueeze(-1) * value_row
                out[:, hs], lse[:, hs] = out_h, total
        ctx.save_for_backward(q, k, v, out, lse, table, value_table, index, weights, mixed)
        ctx.scale, ctx.rows, ctx.causal = scale, rows, causal
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, table, value_table, index, weights, mixed = ctx.saved_tensors
        scale, rows, causal = ctx.scale, ctx.rows, ctx.causal
        b, h, n_q, _ = q.shape
        n_k = k.shape[2]
        grad_q = torch.zeros_like(q)
        grad_table = torch.zeros_like(table)  # [(h,) R | n_q + n_k - 1, d]
        grad_values = None if value_table is None else torch.zeros_like(value_table)
        grad_out = grad_out.contiguous()
        parts, low, high = _far_parts(table, value_table, index, n_q, n_k, causal)
        groups = _strip_groups(b, h, parts)  # (rows: the forward's, already for the strip)
        key_grads = _KeyGrads(k, v, groups)
        padded: _Buffers = {}  # through the skew, zero outside
        tables: dict[tuple[Any, ...], _Rows] = {}
        for blk, keys_of, cols, lo, hi in _strips(n_q, n_k, rows, low, high):
            if keys_of.stop <= keys_of.start or hi <= lo:  # no strip key for any query
                continue
            keys = _rows_cached(tables, table, index, cols)
            values = None if value_table is None else _rows_cached(tables, value_table, index, cols)
            has_key = _band_rows(blk, keys_of, low, high)  # [rows] rows with a strip key
            width = keys_of.stop - keys_of.start
            for hs in groups:
                qh = q[:, hs, blk]  # [b, g, rows, d]
                gh, oh, lh = grad_out[:, hs, blk], out[:, hs, blk], lse[:, hs, blk]
                if has_key is not None:  # rows with no strip key: no share here
                    gh = gh * has_key[:, None]
                grad_k, grad_v = key_grads.of(hs)
                attn_mask = _term_mask(qh, keys, hs, scale, width, lo, padded)
                # dP through a^V too; D = dO . O with O the whole output (a^V included); 0
                # off the finite columns, where P is 0
                extra_dp = None
                if values is not None:
                    extra_dp = _widen(
                        values.logits(gh, hs), qh.shape[2] + width - 1, lo, 0.0, padded
                    )
                    extra_dp = skew_rows(extra_dp, width)
                gq, probs, grad_s = _block_grads(
                    qh, k[:, hs, keys_of], v[:, hs, keys_of], gh, oh, lh, attn_mask, scale,
                    (grad_k[:, :, keys_of], grad_v[:, :, keys_of]), need_ds=True,
                    extra_dp=extra_dp, floor=bool(parts),
                )  # fmt: skip
                if values is not None and grad_values is not None:
                    by_offset = _unskew(probs, padded, "p")  # [b, g, rows, rows + c - a - 1]
                    values.add_grad(grad_values, hs, by_offset[..., lo:hi], gh, 1.0)
                grad_logits = _unskew(grad_s, padded, "s")[..., lo:hi]  # 0 elsewhere (P is)
                grad_q[:, hs, blk] += gq.add_(keys.combine(grad_logits, hs).mul_(scale))
                keys.add_grad(grad_table, hs, grad_logits, qh, scale)
        grad_k, grad_v = key_grads.result()
        for hs in _head_groups(b, h) if parts else []:  # the far parts, a head group at a time
            qh, kh, vh = q[:, hs], k[:, hs], v[:, hs]  # [b, g, n, d]
            gh, oh, lh = grad_out[:, hs], out[:, hs], lse[:, hs]
            for i, part in enumerate(parts):
                key_row = _FarPart.broadcast(part.keys, hs)  # [(g,) 1, d]
                value_row = _FarPart.broadcast(part.values, hs)
                # the kernel's D = dO . O' must miss the value row's share of dP
                o_seen = oh if value_row is None else oh - value_row
                part_lse = lh - part.term(qh, hs, scale)
                share = weights[i, :, hs]  # [b, g, n_q]
                if q.dtype == torch.float32:  # a part whose share underflows: exactly 0, no
                    # denormal exp over its keys (found in review: 8x slower kernel backward)
                    part_lse = part_lse.masked_fill(share < _SHARE_FLOOR, float("inf"))
                gq, gk, gv = part.backward(gh, qh, kh, vh, o_seen, part_lse, scale)
                grad_k[:, hs] += gk
                grad_v[:, hs] += gv
                # the part's dS summed over its keys, one per query: sum_j P (dP - D)
                d_term = (gh * mixed[i, :, hs]).sum(dim=-1) - share * (gh * o_seen).sum(dim=-1)
                grad_q[:, hs] += gq.add_(d_term.unsqueeze(-1) * key_row * scale)
                _add_row(grad_table, part.row, hs, torch.einsum("bgn,bgnd->gd", d_term * scale, qh))
                if grad_values is not None:
                    _add_row(grad_values, part.row, hs, torch.einsum("bgn,bgnd->gd", share, gh))
        return grad_q, grad_k, grad_v, grad_table, grad_values, None, None, None, None


def _strip_values(
    qh: Tensor,
    kh: Tensor,
    attn_mask: Tensor,
    lse: Tensor,
    values: _Rows,
    heads: slice,
    scale: float,
    lo: int,
    padded: _Buffers,
) -> Tensor:
    """A strip block's value term ``sum_j P_ij a^V_(j-i)``: ``[b, g, rows, d]``, ``P``
    recomputed from the strip's own ``lse [b, g, rows]`` (+inf: a row without a key);
    ``values`` the rows of the finite logits columns, from ``lo``."""
    probs = torch.matmul(qh * scale, kh.transpose(-2, -1)).add_(attn_mask).sub_(lse[..., None])
    probs = probs.exp_()
    by_offset = _unskew(probs, padded, "p")  # [b, g, rows, rows + c - a - 1]
    return values.combine(by_offset[..., lo : lo + values.width], heads)


def _strip_rows(rows: int, low: int | None, high: int | None) -> int:
    """Query rows per strip block: a block's strip is ``rows + band - 1`` keys wide, so with
    far parts (a band of ``high - low + 1`` offsets) its work grows as ``rows^2``: at most
    ``max(64, band)`` rows (found in review: 512 rows at n = 1024 made the strip half of
    all pairs, 1.7x the time of 64 rows)."""
    if low is None or high is None:
        return rows
    return min(rows, max(64, high - low + 1))


def _strip_groups(b: int, h: int, parts: list[_FarPart]) -> list[slice]:
    """Heads per block on the term path: with far parts the strip is narrow (``rows + 2k -
    2`` keys), and all heads at once save the per-call overhead that dominates it; else
    :func:`_head_groups`."""
    return [slice(0, h)] if parts else _head_groups(b, h)


def _add_row(grad: Tensor, row: int, heads: slice, rows: Tensor) -> None:
    """Add ``rows [g, d]`` of the heads ``heads`` to row ``row`` of a table's gradient
    ``[(h,) R, d]`` (summed over the heads for a shared table)."""
    if grad.ndim == 2:
        grad[row] += rows.sum(dim=0)
    else:
        grad[heads, row] += rows


def _band_rows(blk: slice, keys_of: slice, low: int | None, high: int | None) -> Tensor | None:
    """``[rows]`` bool: the rows of a block that meet a key of its strip (query ``i`` meets
    keys ``i + low .. i + high``); None when all do. A row that meets none must not take the
    kernel's output and logsumexp (0, not -inf) for it."""
    i = torch.arange(blk.start, blk.stop)
    first = torch.full_like(i, keys_of.start) if low is None else (i + low).clamp(min=keys_of.start)
    last = (
        torch.full_like(i, keys_of.stop - 1)
        if high is None
        else (i + high).clamp(max=keys_of.stop - 1)
    )
    seen = first <= last
    return None if bool(seen.all()) else seen


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


def _unskew(x: Tensor, padded: _Buffers, tag: str) -> Tensor:
    """``x [b, g, rows, n_k]`` back through the skew: ``[b, g, rows, rows + n_k - 1]``, row
    ``i`` shifted right by ``rows - 1 - i``, zero elsewhere (a buffer reused per shape)."""
    shape = (*x.shape[:-1], x.shape[-2] + x.shape[-1] - 1)
    # (a tag per head-group size: groups of two sizes would otherwise remake it each time)
    out = _reused(padded, f"{tag} {x.shape[:2]}", shape, lambda: x.new_zeros(shape))
    skew_rows(out, x.shape[-1]).copy_(x)
    return out


def _strips(
    n_q: int, n_k: int, rows: int, low: int | None, high: int | None
) -> Iterator[tuple[slice, slice, slice, int, int]]:
    """``(query rows, keys, offset columns, lo, hi)`` per block of ``rows`` queries: the
    block's strip (:func:`_strip`) with only its finite logits columns, ``lo .. hi - 1`` of
    the ``rows + n_keys - 1`` (the others ``-inf``: keys met elsewhere or hidden), and
    their offset columns. With far parts they are the band's ``2k - 1`` of ``rows + 2k - 2``
    columns: the term is computed, and its gradient reduced, over them alone."""
    for start in range(0, n_q, rows):
        blk = slice(start, min(start + rows, n_q))
        keys, cols, left, right = _strip(blk, n_q, n_k, low, high)
        width = cols.stop - cols.start
        hi = width if right is None else min(max(right, 0), width)
        lo = min(left, hi)
        yield blk, keys, slice(cols.start + lo, cols.start + hi), lo, hi


def _rows_cached(
    cache: dict[tuple[Any, ...], _Rows], table: Tensor, index: Tensor | None, cols: slice
) -> _Rows:
    """``_Rows(table, index, cols)``, made once per table and columns (the strips of a
    sequence's inner blocks meet the same offsets)."""
    key = (id(table), cols.start, cols.stop)
    if key not in cache:
        cache[key] = _Rows(table, index, cols)
    return cache[key]


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


def _term_mask(
    q_blk: Tensor,
    keys: _Rows,
    heads: slice,
    scale: float,
    n_k: int,
    lo: int,
    buffers: _Buffers,
) -> Tensor:
    """A block's query term as the fused kernel's mask: ``[b, g, rows, n_k]``, a strided view
    of ``scale * q_blk @ r^T`` through the skew, with ``keys`` the rows of its finite logits
    columns, from ``lo`` (see :func:`_strips`); the other columns (offsets) are ``-inf``:
    keys the block's queries meet elsewhere (far parts) or may not see (a causal mask).
    Never clamped (unlike a content-free bias, see :data:`BIAS_SPAN`): the term is content,
    as ``q . k`` is, and a clamp could change a weight that ``q . k`` makes count."""
    logits = keys.logits(q_blk * scale, heads)  # [b, g, rows, hi - lo]
    logits = _widen(logits, q_blk.shape[-2] + n_k - 1, lo, float("-inf"), buffers)
    return skew_rows(logits, n_k)  # [b, g, rows, n_k], a view


def _grid_kernel_values(grid: Tensor, span: float) -> Tensor | None:
    """A 2-D per-offset bias ``[h, 2H-1, 2W-1]`` ready for the fused kernel, detached.

    As :func:`_offset_kernel_values`: far biases raised to ``span`` below a head's best
    when every query meets that best, which on a whole map only the offset ``(0, 0)`` is;
    None when a head spans more than ``span`` and its best is elsewhere.
    """
    grid = grid.detach()
    flat = grid.flatten(1)  # [h, (2H-1)(2W-1)]
    low, high = torch.aminmax(flat, dim=-1, keepdim=True)  # [h, 1]
    if float((high - low).max()) <= span:
        return grid
    centre = grid[:, grid.shape[1] // 2, grid.shape[2] // 2, None]  # [h, 1]: offset (0, 0)
    if not torch.equal(centre, high):
        return None
    return torch.maximum(grid, high[..., None] - span)


#: query rows per fused-kernel call on the grid paths, in whole map rows (at least one):
#: measured here (n = 2048, a 32 x 64 map), the forward over 1, 2, 4 and 8 map rows a call
#: took 1.38x, 1.30x, 1.23x and 1.24x the floor (a dense mask in one call: 1.19x)
GRID_KERNEL_ROWS = 256

#: query-key pairs (per head) from which a 2-D bias over a whole map takes its grid path;
#: below it the general engine (one block of every head) is faster. Measured here, fwd+bwd
#: against the floor, general / grid: 7 x 7 windows (b = 256, h = 4) 1.30x / 1.82x,
#: 14 x 14 1.34x / 1.49x, 16 x 16 2.29x / 2.44x, 16 x 32 (n = 512) 2.00x / 1.84x. The 2-D
#: term takes its grid path at any size (same cases: 2.83x / 2.18x, 3.68x / 1.77x, 3.40x
#: / 2.25x, 3.34x / 1.76x).
GRID_BIAS_PAIRS = 1 << 18

#: elements of one :class:`_GridBias` buffer, and of one forward block's term on the 2-D
#: term path (16 MiB in float32): a buffer holds a head group's copies of the table,
#: refilled per head group; kept below glibc's largest mmap threshold (32 MiB), a larger
#: block is a fresh mapping, page-faulted on every call. At least one map row of one head
#: is always taken, whatever it costs.
GRID_BUFFER_ELEMENTS = 1 << 22


def _grid_step(height: int, width: int, rows: int, heads: int) -> int:
    """Map rows per block on the 2-D bias path: ``rows`` queries in whole map rows, as many
    as ``heads`` heads' copies fit :data:`GRID_BUFFER_ELEMENTS` (at least one)."""
    copies = GRID_BUFFER_ELEMENTS // (heads * _GridBias.copy_size(height, width))
    return max(1, min(height, rows // width, copies))


def _grid_steps(h: int, height: int, width: int, rows: int) -> tuple[int, list[slice]]:
    """``(map rows per block, head groups)`` of the 2-D bias path's forward: ``rows``
    queries in whole map rows, then as many heads per buffer as
    :data:`GRID_BUFFER_ELEMENTS` holds (at least one map row, at least one head)."""
    step = _grid_step(height, width, rows, 1)
    group = max(1, min(h, GRID_BUFFER_ELEMENTS // (step * _GridBias.copy_size(height, width))))
    return step, [slice(s, min(s + group, h)) for s in range(0, h, group)]


class _GridBias:
    """The masks of a 2-D relative bias over a whole ``H x W`` map, ``m`` map rows at a time.

    A table ``[W, 2H-1, W]`` per head holds, for each query column ``c_i``, the bias of every
    (row offset, key column): ``table[c_i, dr, c_j] = grid[dr, c_j - c_i + W - 1]``. For the
    queries of map row ``r``, reading ``H * W`` values from row offset ``H - 1 - r`` gives
    the keys in order: a map row's mask ``[W, H * W]`` is a strided view, row stride
    ``P = (2H-1) W``. The next map row starts ``W`` values earlier, so ``m`` map rows are no
    view of one table; the buffer holds ``m`` copies, copy ``i`` at ``i (W P + W)``: map
    row ``r + i`` read from copy ``i`` starts ``i W P`` after map row ``r``, and the block's
    ``m W`` queries are the rows of one view, stride ``P``. The buffer is ``m`` times
    ``g W P`` values (``g`` heads, about ``2 m g n W``), not ``h n^2``; the masks' gradient
    accumulates in a buffer of the same layout and is mapped back to the table once.
    """

    def __init__(self, height: int, width: int, heads: int, copies: int, like: Tensor) -> None:
        self.height, self.width, self.copies = height, width, copies
        self.plane = (2 * height - 1) * width  # P: one query column's values
        self.copy = width * self.plane + width  # a copy and a gap of W (never read)
        self.buffer = like.new_empty(heads, copies * self.copy)  # [g, m (W P + W)]

    @staticmethod
    def copy_size(height: int, width: int) -> int:
        """Values of one copy (and its gap) per head."""
        return width * (2 * height - 1) * width + width

    @staticmethod
    def per_group(
        grid: Tensor, groups: list[slice], copies: int
    ) -> Iterator[tuple[slice, _GridBias]]:
        """``(heads, masks)`` per head group of ``grid [h, 2H-1, 2W-1]``: one buffer, refilled
        with each group's heads when the group comes (the kernel calls are synchronous); a
        new one for a last group of another size."""
        height, width = (grid.shape[1] + 1) // 2, (grid.shape[2] + 1) // 2
        masks = None
        for hs in groups:
            g = hs.stop - hs.start
            if masks is None or masks.buffer.shape[0] != g:
                masks = _GridBias(height, width, g, copies, grid)
            masks.fill(grid[hs])
            yield hs, masks

    def fill(self, grid: Tensor) -> None:
        """Hold ``grid [g, 2H-1, 2W-1]``: copy 0 a slice of columns per query column, the
        others copies of copy 0."""
        w, first = self.width, self.table(self.buffer, 0)  # [g, W, 2H-1, W]
        for c in range(w):  # query column c: column offsets -c .. W-1-c
            first[:, c] = grid[:, :, w - 1 - c : 2 * w - 1 - c]
        for i in range(1, self.copies):
            self.table(self.buffer, i).copy_(first)

    def table(self, buffer: Tensor, i: int) -> Tensor:
        """Copy ``i`` of ``buffer``'s table: ``[g, W, 2H-1, W]``, a view."""
        start = i * self.copy
        return buffer[:, start : start + self.copy - self.width].view(
            buffer.shape[0], self.width, 2 * self.height - 1, self.width
        )

    def block(self, row: int, count: int, buffer: Tensor | None = None) -> Tensor:
        """``[1, g, count * W, H * W]``: the bias of the queries of map rows ``row`` to
        ``row + count - 1`` (``count`` at most the copies), a view of the buffer (or of a
        gradient buffer of the same layout)."""
        buffer = self.buffer if buffer is None else buffer
        h, w = self.height, self.width
        return buffer.as_strided(
            (1, buffer.shape[0], count * w, h * w),
            (buffer.numel(), buffer.stride(0), self.plane, 1),
            buffer.storage_offset() + (h - 1 - row) * w,
        )

    def table_grad(self, grad_buffer: Tensor) -> Tensor:
        """The gradient of the grid ``[g, 2H-1, 2W-1]`` from its masks' (``grad_buffer``, the
        layout of the buffer, zero in the gaps): the copies summed, then the column diagonals
        of each row offset."""
        total = self.table(grad_buffer, 0)
        for i in range(1, self.copies):
            total = total + self.table(grad_buffer, i)  # [g, W, 2H-1, W]
        return diagonal_sums(total.transpose(1, 2))  # [g, 2H-1, W, W] -> [g, 2H-1, 2W-1]


class _GridFusedAttention(torch.autograd.Function):
    """The lean engine for a 2-D relative bias over a whole map (Swin's table, global).

    Whole map rows of queries per block: forward :data:`GRID_KERNEL_ROWS` queries and as
    many heads as a buffer holds (:func:`_grid_steps`); backward per head group of
    :func:`_head_groups`, over :func:`_written_rows` queries for a learned table (as many
    map rows as the group's buffer holds, :func:`_grid_step`). The masks are views of a
    :class:`_GridBias` buffer, and so is ``dS`` summed over the batch when added to the
    gradient buffer; the table's gradient is read from that buffer once per head group.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, grid: Tensor, kernel_grid: Tensor, scale: float
    ) -> Tensor:
        h = q.shape[1]
        out = torch.empty_like(q)  # [b, h, n, d]
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)  # [b, h, n]
        height, w = (kernel_grid.shape[1] + 1) // 2, (kernel_grid.shape[2] + 1) // 2
        step, groups = _grid_steps(h, height, w, GRID_KERNEL_ROWS)
        for hs, masks in _GridBias.per_group(kernel_grid, groups, step):
            for row in range(0, height, step):
                count = min(step, height - row)
                blk = slice(row * w, (row + count) * w)
                out[:, hs, blk], lse[:, hs, blk] = _flash_cpu(
                    q[:, hs, blk], k[:, hs], v[:, hs], 0.0, False,
                    attn_mask=masks.block(row, count), scale=scale,
                )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, kernel_grid)
        ctx.scale, ctx.learn = scale, grid.requires_grad
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, kernel_grid = ctx.saved_tensors
        scale, learn = ctx.scale, ctx.learn
        b, h, n = q.shape[:3]
        groups = _head_groups(b, h)
        g = groups[0].stop - groups[0].start
        grad_q = torch.empty_like(q)
        key_grads = _KeyGrads(k, v, groups)
        grad_grid = torch.empty_like(kernel_grid) if learn else None  # [h, 2H-1, 2W-1]
        grad_out = grad_out.contiguous()
        height, w = (kernel_grid.shape[1] + 1) // 2, (kernel_grid.shape[2] + 1) // 2
        step = _grid_step(height, w, _written_rows(b, g, n, n) if learn else GRID_KERNEL_ROWS, g)
        for hs, masks in _GridBias.per_group(kernel_grid, groups, step):
            grad_masks = torch.zeros_like(masks.buffer) if learn else None  # [g, m (W P + W)]
            for row in range(0, height, step):
                count = min(step, height - row)
                blk = slice(row * w, (row + count) * w)
                qh, kh, vh = q[:, hs, blk], k[:, hs], v[:, hs]  # [b, g, m W | n, d]
                gh, oh, lh = grad_out[:, hs, blk], out[:, hs, blk], lse[:, hs, blk]
                gq, _, grad_s = _block_grads(
                    qh, kh, vh, gh, oh, lh, masks.block(row, count), scale,
                    key_grads.of(hs), need_ds=learn,
                )  # fmt: skip
                grad_q[:, hs, blk] = gq
                if grad_masks is not None and grad_s is not None:  # [b, g, m W, n]
                    _add_leading_sum(masks.block(row, count, grad_masks)[0], grad_s)
            if grad_grid is not None and grad_masks is not None:
                grad_grid[hs] = masks.table_grad(grad_masks)
        grad_k, grad_v = key_grads.result()
        return grad_q, grad_k, grad_v, grad_grid, None, None


def _rows_of(table: Tensor, heads: slice) -> Tensor:
    """A shared ``[R, d]`` table, or the heads' rows ``[g, R, d]`` of a per-head one."""
    return table if table.ndim == 2 else table[heads]


def _grid_term_steps(b: int, h: int, n: int, width: int, rows: int) -> tuple[int, list[slice]]:
    """``(map rows per block, head groups)`` of the forward on the grid term path: ``rows``
    queries in whole map rows (at least one), as many heads per call as keep a block's term
    ``[b, g, rows, n]`` within :data:`GRID_BUFFER_ELEMENTS` (at least one)."""
    step = max(1, min(n // width, rows // width))
    group = max(1, min(h, GRID_BUFFER_ELEMENTS // (b * step * width * n)))
    return step, [slice(s, min(s + group, h)) for s in range(0, h, group)]


class _GridTermAttention(torch.autograd.Function):
    """The lean engine for a 2-D relative embedding over a whole map (SASA / BoTNet).

    Whole map rows ``r .. r + m - 1`` of queries per block: ``q @ height^T`` gives one logit
    per row offset, read per map row as one per key row (:func:`_by_key_row`), and
    ``q @ width^T`` skewed one per key column; their broadcast sum ``[b, g, m W, H, W]`` is
    the block's mask. Backward: ``dS`` summed over key columns is the height logits'
    gradient, summed over key rows and sent back through the skew the width logits'; four
    small products give ``q``'s and the tables' gradients.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, height: Tensor, width: Tensor, scale: float
    ) -> Tensor:
        b, h, n = q.shape[:3]
        out = torch.empty_like(q)  # [b, h, n, d]
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)  # [b, h, n]
        height, width = height.detach(), width.detach()
        rows, cols = (height.shape[-2] + 1) // 2, (width.shape[-2] + 1) // 2
        step, groups = _grid_term_steps(b, h, n, cols, GRID_KERNEL_ROWS)
        buffers: _Buffers = {}  # the masks, reused while the block's shape is
        for hs in groups:
            for r in range(0, rows, step):
                blk = slice(r * cols, min(r + step, rows) * cols)
                attn_mask = _grid_term_mask(q[:, hs, blk], height, width, hs, r, scale, buffers)
                out[:, hs, blk], lse[:, hs, blk] = _flash_cpu(
                    q[:, hs, blk], k[:, hs], v[:, hs], 0.0, False, attn_mask=attn_mask, scale=scale
                )  # [b, g, m W, d], [b, g, m W]
        ctx.save_for_backward(q, k, v, out, lse, height, width)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, height, width = ctx.saved_tensors
        scale = ctx.scale
        b, h, n = q.shape[:3]
        rows, cols = (height.shape[-2] + 1) // 2, (width.shape[-2] + 1) // 2
        groups = _head_groups(b, h)
        g = groups[0].stop - groups[0].start
        step = max(1, min(rows, _written_rows(b, g, n, n, GRID_TERM_WRITTEN_ELEMENTS) // cols))
        grad_q = torch.empty_like(q)
        key_grads = _KeyGrads(k, v, groups)
        grad_height, grad_width = torch.zeros_like(height), torch.zeros_like(width)
        grad_out = grad_out.contiguous()
        padded: _Buffers = {}  # the width skew's adjoint, zero outside
        buffers: _Buffers = {}  # the masks (then P), reused while the block's shape is
        for r in range(0, rows, step):
            m = min(step, rows - r)
            blk = slice(r * cols, (r + m) * cols)
            for hs in groups:
                qh, kh, vh = q[:, hs, blk], k[:, hs], v[:, hs]  # [b, g, m W | n, d]
                gh, oh, lh = grad_out[:, hs, blk], out[:, hs, blk], lse[:, hs, blk]
                gq, _, grad_s = _block_grads(
                    qh, kh, vh, gh, oh, lh, None, scale, key_grads.of(hs), need_ds=True,
                    fresh_mask=functools.partial(
                        _grid_term_mask, qh, height, width, hs, r, scale, buffers
                    ),
                )  # fmt: skip
                per_cell = grad_s.view(*grad_s.shape[:2], m, cols, rows, cols)  # [b, g, m, W, H, W]
                # [b, g, m, W, 2H-1]: zero off the rows used (which move with r: a new buffer)
                grad_rows = per_cell.new_zeros(*per_cell.shape[:4], 2 * rows - 1)
                torch.sum(per_cell, dim=-1, out=_by_key_row(grad_rows, r))  # [b, g, m, W, H]
                grad_rows = grad_rows.flatten(2, 3)  # [b, g, m W, 2H-1]
                grad_cols = _unskew(per_cell.sum(dim=-2), padded, "w").flatten(2, 3)  # [.., 2W-1]
                term_q = (grad_rows @ _rows_of(height, hs)).add_(grad_cols @ _rows_of(width, hs))
                grad_q[:, hs, blk] = gq.add_(term_q.mul_(scale))
                d_height = (grad_rows.transpose(-2, -1) @ qh).sum(dim=0).mul_(scale)
                d_width = (grad_cols.transpose(-2, -1) @ qh).sum(dim=0).mul_(scale)
                if height.ndim == 2:  # a table shared by the heads: [2H-1 | 2W-1, d]
                    grad_height += d_height.sum(dim=0)
                    grad_width += d_width.sum(dim=0)
                else:
                    grad_height[hs] += d_height
                    grad_width[hs] += d_width
        grad_k, grad_v = key_grads.result()
        return grad_q, grad_k, grad_v, grad_height, grad_width, None


def _by_key_row(by_offset: Tensor, first: int) -> Tensor:
    """``[b, g, m, W, 2H-1]`` (one logit per row offset, contiguous) read per key row for the
    queries of map rows ``first .. first + m - 1``: ``[b, g, m, W, H]``, a view; map row
    ``first + i`` reads offsets ``-(first + i) .. H - 1 - first - i``, so each map row
    starts one column earlier (stride ``W (2H - 1) - 1``)."""
    b, g, m, w, span = by_offset.shape
    s = by_offset.stride()
    return by_offset.as_strided(
        (b, g, m, w, (span + 1) // 2),
        (s[0], s[1], s[2] - 1, s[3], 1),
        by_offset.storage_offset() + (span - 1) // 2 - first,
    )


def _grid_term_mask(
    q_blk: Tensor,
    height: Tensor,
    width: Tensor,
    heads: slice,
    r: int,
    scale: float,
    buffers: _Buffers,
) -> Tensor:
    """The 2-D term of the queries of map rows ``r .. r + m - 1``: ``[b, g, m W, H * W]``,
    contiguous, written into a reused buffer of ``buffers`` (:func:`_reused`): a
    buffer reused while it is in the caches, not a new one per block (measured here, the
    kernel over 256-row blocks with a new mask each took 1.39x the floor's forward, with
    one reused 1.35x)."""
    rows, cols = (height.shape[-2] + 1) // 2, (width.shape[-2] + 1) // 2
    b, g, count = q_blk.shape[:3]
    q_scaled = q_blk * scale  # [b, g, m W, d]
    # [b, g, m W, 2H-1] (contiguous: _by_key_row reads it with strides)
    by_offset = (q_scaled @ _rows_of(height, heads).transpose(-2, -1)).contiguous()
    by_row = _by_key_row(by_offset.view(b, g, -1, cols, 2 * rows - 1), r)  # [b, g, m, W, H]
    by_col = q_scaled @ _rows_of(width, heads).transpose(-2, -1)  # [b, g, m W, 2W-1]
    by_col = skew_rows(by_col.view(b, g, -1, cols, 2 * cols - 1), cols)  # [b, g, m, W, W]
    # never clamped: content, as q . k is (see _term_mask)
    by_row = by_row.contiguous()  # small: read through its skewed strides, the sum was 3x slower
    shape = (b, g, count // cols, cols, rows, cols)
    out = _reused(buffers, f"mask {g}", shape, lambda: q_blk.new_empty(shape))  # [b, g, m, W, H, W]
    mask = torch.add(by_row[..., :, None], by_col[..., None, :], out=out)
    return mask.view(b, g, count, rows * cols)  # [b, g, m W, H * W]


def _offset_rows(
    rows: Tensor | tuple[Tensor, Tensor] | None,
) -> tuple[Tensor, Tensor | None] | None:
    """An ``offset_term`` / ``offset_value`` result as ``(table, index or None)``."""
    if rows is None or isinstance(rows, tuple):
        return rows
    return rows, None


def _same_index(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and torch.equal(a, b)


def _expand_rows(table: Tensor, index: Tensor | None) -> Tensor:
    """The rows ``[(h,) W, d]`` themselves: ``table[..., index, :]``."""
    return table if index is None else table[..., index, :]


def _dense_last(*xs: Tensor) -> tuple[Tensor, ...]:
    """The tensors with a dense last dimension, which the fused kernels read as such (a
    rotation written as a view, e.g. the channels of a 2-D RoPE re-interleaved, can leave
    it strided): a copy only where it is not."""
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)


def _lean(
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
    scheme: Any = None,
) -> Tensor:
    if dropout_p > 0:
        raise ValueError(
            "backend='lean' has no attention dropout; set dropout=0, or use backend='auto' "
            "(which takes the math or sdpa path when dropout is on)"
        )
    blocks = _mask_blocks(mask, q)
    if blocks is not None:  # padding at the ends, packed documents: blocks with no mask
        path = functools.partial(_lean, scheme=scheme)
        return _by_blocks(q, k, v, hooks, q_pos, k_pos, scale, blocks, path)
    b, h, n_q, _ = q.shape
    # a block holds the hooks' term [B', h, rows, n_k]: B' = 1 for a bias shared by the batch
    per_batch = hooks.score_term is not None or hooks.value_term is not None
    rows = lean_block_rows(b if per_batch else q_pos.shape[0], h, n_q, k.shape[2])
    params = _scheme_parameters(scheme)
    engine = _LeanAttention
    # a causal mask alone hides the offsets above n_k - n_q: the per-offset paths take it
    causal_only = replace(mask, causal=False).empty and (not mask.causal or n_q <= k.shape[2])
    if (
        _fused_cpu_available(q, replace(hooks, value_term=None))
        and hooks.offset_term is not None
        and hooks.score_bias is None
        and causal_only
        and (hooks.value_term is None or hooks.offset_value is not None)
    ):
        term = _offset_rows(hooks.offset_term(q_pos, k_pos))
        value = None
        if hooks.value_term is not None and hooks.offset_value is not None:
            value = _offset_rows(hooks.offset_value(q_pos, k_pos))
        if term is not None and (hooks.value_term is None or value is not None):
            q, k, v = _dense_last(q, k, v)
            (table, index), value_table = term, None
            if value is not None:
                value_table, value_index = value
                if not _same_index(index, value_index):  # use the rows themselves
                    table, value_table = _expand_rows(table, index), _expand_rows(*value)
                    index = None
            table = table.to(q.dtype)  # [(h,) R | n_q + n_k - 1, d]
            value_table = None if value_table is None else value_table.to(q.dtype)
            return _OffsetTermAttention.apply(
                q, k, v, table, value_table, index, scale, rows, mask.causal
            )
    # the grid paths: no mask (the bias's from GRID_BIAS_PAIRS pairs)
    grid_ok = _fused_cpu_available(q, hooks) and mask.empty
    if grid_ok and hooks.grid_term is not None and hooks.score_bias is None:
        tables = hooks.grid_term(q_pos, k_pos)
        if tables is not None:
            q, k, v = _dense_last(q, k, v)
            height, width = (t.to(q.dtype) for t in tables)
            return _GridTermAttention.apply(q, k, v, height, width, scale)
    big = n_q * k.shape[2] >= GRID_BIAS_PAIRS
    if grid_ok and big and hooks.grid_bias is not None and hooks.score_term is None:
        grid = hooks.grid_bias(q_pos, k_pos)
        if grid is not None:
            grid = grid.to(q.dtype)  # [h, 2H-1, 2W-1]
            kernel_grid = _grid_kernel_values(grid, _bias_span(q, k, scale))
            if kernel_grid is not None:
                q, k, v = _dense_last(q, k, v)
                return _GridFusedAttention.apply(q, k, v, grid, kernel_grid, scale)
    if _fused_cpu_available(q, hooks) and hooks.score_term is None and causal_only:
        values = None if hooks.offset_bias is None else hooks.offset_bias(q_pos, k_pos)
        if values is not None:
            values = values.to(q.dtype)  # [h|1, n_q + n_k - 1]
            span = _bias_span(q, k, scale)
            kernel_values = _offset_kernel_values(values, n_q, k.shape[2], span, causal=mask.causal)
            if kernel_values is not None:
                q, k, v = _dense_last(q, k, v)
                return _OffsetFusedAttention.apply(
                    q, k, v, values, kernel_values, scale, mask.causal
                )
    span = math.inf  # a term is content: never raised
    if _fused_cpu_available(q, hooks):
        engine = _LeanFusedAttention
        q, k, v = _dense_last(q, k, v)
        if hooks.score_term is None:
            span = _bias_span(q, k, scale)
    return engine.apply(q, k, v, hooks, q_pos, k_pos, mask, scale, rows, span, *params)


def _runs(x: Tensor) -> list[tuple[int, int, int]]:
    """``(value, start, stop)`` of each run of equal values of ``x [n]`` (integers)."""
    if x.shape[0] == 0:
        return []
    bounds = [0, *(x[1:] != x[:-1]).nonzero().flatten().add(1).tolist(), x.shape[0]]
    values = x[bounds[:-1]].tolist()
    return list(zip(values, bounds[:-1], bounds[1:], strict=True))


#: a mask is split into blocks (:func:`_mask_blocks`) only when it makes at most one call per
#: this many query-key pairs of the masked call (``b * n_q * n_k``): each call has a fixed
#: cost. Measured here, causal documents of L tokens, fwd+bwd, blocks against one masked
#: call: n = 2048, L = 4 / 8 / 16 / 32, T5 2.35x / 1.21x / 0.62x / 0.35x, SDPA (no
#: positions) 2.50x / 1.29x / 0.70x / 0.41x; n = 512, L = 16 / 32 / 64, T5 1.83x / 1.06x /
#: 0.68x, SDPA 1.00x / 0.67x / 0.51x. 2^15: documents from 16 tokens at n = 2048, 64 at 512.
MASK_BLOCK_PAIRS = 1 << 15


def _mask_blocks(
    mask: Mask, q: Tensor, *, cut: bool = True
) -> list[list[tuple[slice, slice, bool]]] | None:
    """Per batch element, its ``(query rows, keys, causal)`` calls (:func:`_block_pieces`)
    when the mask is key padding, lengths the same for a sequence's queries and packed
    documents (each document's queries a run, its keys a run) that leave one run of keys
    per document: padding at the ends, documents side by side; rows in no call see no key.
    Else None (also with nothing of the kind, with no call at all, or with more calls than
    :data:`MASK_BLOCK_PAIRS` allows). ``cut``: rows cut for a strong bias (see
    :func:`_block_pieces`; SDPA has no use for it).

    Each call is attention with no mask but the causal one (:func:`_by_blocks`), on
    the fused paths that a mask keeps it from (``posenc bench --padding 0.25`` and
    ``--documents 4 --causal`` at n = 2048, fwd+bwd against SDPA with the same mask, at
    fcbd843, with the blocks / without: ALiBi 1.02x / 2.24x and 0.33x / 1.68x, T5 1.26x /
    2.42x and 0.52x / 2.59x, relative 2.04x / 3.78x and 0.71x / 3.51x, Shaw 1.93x / 5.77x
    and 0.89x / 6.91x; docs/performance.md, masks table). The gate is for the whole batch:
    at most ``b * n_q * n_k / MASK_BLOCK_PAIRS`` calls, else every sequence takes the
    masked path (so a decoding step, ``n_q = 1``, splits only from 2^15 keys). On CPU only (reading the runs syncs with the device), and
    not under ``torch.compile`` (the blocks depend on the mask's values: one graph each).
    """
    documents = mask.q_doc is not None and mask.k_doc is not None
    if (
        q.device.type != "cpu"
        or torch.compiler.is_compiling()
        or not (documents or mask.key_padding is not None or mask.lengths is not None)
    ):
        return None
    b, n_q, n_k = q.shape[0], mask.n_q, mask.n_k
    if b == 0:
        return None
    visible = torch.ones(b, n_k, dtype=torch.bool)
    if mask.key_padding is not None:
        visible &= ~mask.key_padding.to("cpu", torch.bool).expand(b, n_k)
    if mask.lengths is not None:
        lengths = mask.lengths.to("cpu").expand(b, n_q)
        if n_q == 0 or bool((lengths != lengths[:, :1]).any()):
            return None  # lengths that change with the query: not one run of keys
        visible &= torch.arange(n_k)[None, :] < lengths[:, :1]
    blocks = []
    for i in range(b):
        if documents:
            q_runs = _runs(mask.q_doc[i if mask.q_doc.shape[0] > 1 else 0].to("cpu"))
            k_runs = _runs(mask.k_doc[i if mask.k_doc.shape[0] > 1 else 0].to("cpu"))
        else:
            q_runs, k_runs = [(0, 0, n_q)], [(0, 0, n_k)]
        keys_of = {doc: (a, c) for doc, a, c in k_runs}
        if len(keys_of) < len(k_runs):
            return None  # a document's keys in two runs
        mine = []
        for doc, r0, r1 in q_runs:
            if doc not in keys_of:
                continue  # no key of its document: 0
            a, c = keys_of[doc]
            seen = visible[i, a:c]
            count = int(seen.sum())
            if count == 0:
                continue
            first = a + int(seen.int().argmax())
            if not bool(visible[i, first : first + count].all()):
                return None  # visible keys with gaps between them
            end = first + count
            mine += _block_pieces(slice(r0, r1), first, end, n_k - n_q, mask.causal, cut=cut)
        blocks.append(mine)
    calls = sum(map(len, blocks))
    if calls == 0:  # no query sees a key: the masked path (its zeros keep their gradients)
        return None
    if calls * MASK_BLOCK_PAIRS > b * n_q * n_k:
        return None  # small documents: one masked call costs less than their calls
    return blocks


def _block_pieces(
    rows: slice, first: int, end: int, delta: int, causal: bool, *, cut: bool = True
) -> list[tuple[slice, slice, bool]]:
    """``(query rows, keys, causal)`` calls covering the visible pairs of a block whose
    queries ``rows`` see the keys ``first .. end - 1`` (and, causal, ``j <= i + delta``,
    ``delta = n_k - n_q``): rows that see part of the run take a causal call whose last key
    is their last row's bound (so aligned at its end, as the fused paths align it), rows
    that see all of it a call without a mask; under the causal mask rows before
    ``first - delta`` see no key (none of the calls).

    Without a causal mask (and with ``cut``) the rows are cut where their aligned key (``i + delta``) enters
    and leaves the run: the rows of the run's own tokens then meet offset 0, where a strong
    bias (ALiBi) is best, and take the per-offset path; the others (the padding's queries)
    take whatever path they allow (measured here, ALiBi, 2048 queries: over 1536 keys in
    one call 59.6 ms, against 38.0 ms over 2048 keys)."""
    if end <= first or rows.stop <= rows.start:
        return []
    keys = slice(first, end)
    if not causal and not cut:
        return [(rows, keys, False)]
    if not causal:
        cuts = {rows.start, rows.stop}
        cuts |= {min(max(x, rows.start), rows.stop) for x in (first - delta, end - delta)}
        bounds = sorted(cuts)
        return [(slice(a, c), keys, False) for a, c in itertools.pairwise(bounds) if c > a]
    start = min(max(rows.start, first - delta), rows.stop)  # the first row that sees a key
    split = min(max(start, end - delta), rows.stop)  # rows from here see the whole run
    pieces = []
    if split > start:
        pieces.append((slice(start, split), slice(first, split + delta), True))
    if split < rows.stop:
        pieces.append((slice(split, rows.stop), keys, False))
    return pieces


def _by_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    hooks: Hooks,
    q_pos: Tensor,
    k_pos: Tensor,
    scale: float,
    blocks: list[list[tuple[slice, slice, bool]]],
    path: Callable[..., Tensor],
) -> Tensor:
    """``path`` (the lean engine, or SDPA) block by block (:func:`_mask_blocks`), each with
    no mask but a causal one: ``[b, h, n_q, d_v]``, 0 for a query that sees no key.

    Each sequence is taken apart once: its query rows split at the calls' rows (disjoint),
    its keys and values at the runs the calls' keys make (a call narrows its run), and the
    output put together by one ``cat``, so that autograd's backward writes each input's
    gradient once, not one full-size gradient per call (as ``q[i : i + 1, :, rows]`` per
    call did: 0.9-6 ms a call whatever its size, found in review)."""
    h, n_q = q.shape[1:3]
    n_k = k.shape[2]
    outs = []
    for i, (qi, ki, vi) in enumerate(zip(q.unbind(0), k.unbind(0), v.unbind(0), strict=True)):
        pieces = blocks[i]  # (qi, ki, vi: [h, n_q | n_k, d], one sequence)
        qp, kp = q_pos[i if q_pos.shape[0] > 1 else 0], k_pos[i if k_pos.shape[0] > 1 else 0]
        q_parts = _split_runs(qi, [(r.start, r.stop) for r, _, _ in pieces], n_q)
        runs = _merged([(keys.start, keys.stop) for _, keys, _ in pieces])
        starts = [a for a, _ in runs]
        k_runs, v_runs = _split_runs(ki, runs, n_k), _split_runs(vi, runs, n_k)
        parts: list[Tensor] = []
        done = 0  # rows so far
        for (rows, keys, causal), q_part in zip(pieces, q_parts, strict=True):
            if rows.start > done:  # rows that see no key: 0
                parts.append(v.new_zeros(1, h, rows.start - done, v.shape[-1]))
            run = bisect.bisect_right(starts, keys.start) - 1  # the run holding these keys
            at, count = keys.start - starts[run], keys.stop - keys.start
            sub = Mask(rows.stop - rows.start, count, causal=causal)
            parts.append(
                path(
                    q_part[None], k_runs[run].narrow(1, at, count)[None],
                    v_runs[run].narrow(1, at, count)[None], hooks, qp[rows][None],
                    kp[keys][None], sub, scale, 0.0,
                )
            )  # fmt: skip
            done = rows.stop
        if done < n_q:
            parts.append(v.new_zeros(1, h, n_q - done, v.shape[-1]))
        outs.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])  # [1, h, n_q, d_v]
    return torch.cat(outs, dim=0)  # [b, h, n_q, d_v]


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of ``[a, c)`` runs as disjoint runs, in order."""
    out: list[tuple[int, int]] = []
    for a, c in sorted(runs):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], c))
        else:
            out.append((a, c))
    return out


def _split_runs(x: Tensor, runs: list[tuple[int, int]], size: int) -> list[Tensor]:
    """The parts ``x[:, a:c]`` of disjoint runs in order, from one ``split`` of ``x [h, size,
    d]`` (whose backward writes one gradient for all of them)."""
    sizes, picked, at = [], [], 0
    for a, c in runs:
        if a > at:
            sizes.append(a - at)
        picked.append(len(sizes))
        sizes.append(c - a)
        at = c
    if at < size:
        sizes.append(size - at)
    parts = x.split(sizes, dim=1)
    return [parts[j] for j in picked]
