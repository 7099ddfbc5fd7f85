"""The dispatcher: which path runs a call, and why the others do not.

``backend="auto"`` walks an ordered list of paths; each answers "I can run this" or
"no, because ...", and the first that can runs. :func:`explain` returns the answers.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim;
positions ``[B', n]`` with ``B'`` 1 or ``b``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from .._memo import plain_autograd
from ..hooks import Hooks, checked_hooks, hooks_of
from . import compiled, kept, sdpa
from .blocks import _by_blocks, _mask_blocks
from .flex import _flex
from .inputs import default_scale, finite, hideable, repeat_heads, sees_any, zeroed_non_finite
from .lean_plans import (
    _plan_grid_bias,
    _plan_grid_term,
    _plan_lean,
    _plan_lean_fused,
    _plan_offset_bias,
    _plan_offset_term,
)
from .learned import own_hook, substituted
from .mask import Mask
from .plans import _CONTEXTUAL, Call, Path, Plan, _plan_materialised, materialised_size, routed
from .reference import _math
from .sdpa import _sdpa
from .twice import _reference, _TwiceDifferentiable

BACKENDS = ("auto", "math", "sdpa", "flex", "lean")


@dataclass(frozen=True)
class Explanation:
    """What :func:`posenc.explain` reports: the path taken and, for each path before it in
    the order ``backend`` walks, why it was not; and whether the route is kept, so that
    after a first call the calls of the same signature (shapes, dtypes, device, backend,
    grad flags, ...; for a few queries in no-grad mode, the key count's power of two)
    replay it without choosing the path again (:mod:`.kept`; never for a scheme that
    cannot key a weak dictionary: :func:`.kept.keyable`). Where a route kept at another
    key count of a few queries' band is replayed, ``path`` is that route's, and the
    path the dispatcher would choose says so among the reasons."""

    path: str
    reasons: dict[str, str]
    replayed: bool = False

    def __str__(self) -> str:
        lines = [f"path: {self.path}"]
        lines += [f"  not {name}: {why}" for name, why in self.reasons.items()]
        if self.replayed:
            lines.append("  replayed: after a first call, calls of this signature skip the choice")
        return "\n".join(lines)


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
    scale: float | None = None,
    finite_keys: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention with a positional scheme's hooks.

    Args:
        q: ``[b, h, n_q, d]`` queries (already rotated when the scheme rotates).
        k: ``[b, h_kv, n_k, d]`` keys (already rotated): ``h_kv = h``, or a divisor of ``h``
            (grouped-query attention: key head ``g`` serves query heads ``g * h / h_kv`` to
            ``(g + 1) * h / h_kv - 1``, repeated for them here).
        v: ``[b, h_kv, n_k, d_v]`` values.
        scheme: an object with any of the hooks ``score_bias``, ``score_term``,
            ``value_term``, ``contextual_term`` (see :mod:`posenc.hooks`), or None.
        q_pos: ``[B', n_q]`` int64 query positions.
        k_pos: ``[B', n_k]`` int64 key positions.
        mask: which keys each query may see.
        backend: ``"auto"``, ``"math"``, ``"sdpa"``, ``"flex"`` or ``"lean"`` (the order
            each walks: :data:`PATHS`).
        dropout_p: dropout on the attention weights (pass 0 in eval).
        need_weights: also return the weights ``[b, h, n_q, n_k]`` (before dropout),
            computed with the math path.
        scale: the scores' scale (default ``1 / sqrt(d)``).
        finite_keys: how many of the first keys and values are known finite (a cache's,
            checked when they were written and unchanged since), which the check for
            non-finite values a mask must hide does not read again.

    Returns:
        ``(out [b, h, n_q, d_v], weights or None)``. A query with no visible key gets 0.

    Raises:
        ValueError: keys and values whose heads differ or do not divide the queries'.
    """
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        k, v = repeat_heads(q, k, v)
    request = kept.Request(q, k, v, scheme, q_pos, k_pos, mask, backend, dropout_p, need_weights)
    out = kept.replay(request, scale)
    if out is not None:
        return out, None
    hooks = checked_hooks(hooks_of(scheme), scheme, q.shape[0], q.shape[1], v.shape[-1])
    if mask.empty or (
        not torch.compiler.is_compiling()
        and finite(*hideable(q, k, v, mask, hooks.contextual_term is not None, finite_keys))
    ):
        return _attend(
            q, k, v, hooks, scheme, q_pos, k_pos, mask, backend, dropout_p, need_weights, scale,
            request,
        )  # fmt: skip
    # NaN or inf somewhere: such tokens are zeroed, and the queries they touch made NaN after
    q, k, v, bad, bad_q = zeroed_non_finite(q, k, v)
    out, weights = _attend(
        q, k, v, hooks, scheme, q_pos, k_pos, mask, backend, dropout_p, need_weights, scale
    )
    sees = sees_any(mask, bad, q.device) | bad_q  # [b, h, n_q, 1]
    out = out.masked_fill(sees, float("nan"))
    return out, None if weights is None else weights.masked_fill(sees, float("nan"))


compiled.use_dispatcher(attend)


def _learned_mask(mask: Mask) -> bool:
    """A float ``attn_mask`` that asks for a gradient: the fast paths give it none, so the
    call takes the math path, which differentiates everything it adds."""
    return mask.bias is not None and mask.bias.requires_grad and torch.is_grad_enabled()


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
    scale: float | None,
    request: kept.Request | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`attend` for inputs whose masked keys and values are finite (``request``: the
    call as :mod:`.kept` reads it, under whose signature a route :func:`.kept.replay` runs
    is kept)."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    if need_weights or backend == "math" or _learned_mask(mask):
        out, weights = _math(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p)
        return out, (weights if need_weights else None)
    call = _prepared(Call(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p, scheme))
    name, run, _ = _walk(PATHS[backend], call, backend)
    if _unwrapped(name, call, hooks):
        route = getattr(run, "route", None)
        key = None
        if request is not None and route is not None and call.read_by is None:
            key = kept.signature(request)  # before the run: the state the choice read
        out = run()
        if key is not None:  # (no key shift folded into the keys)
            kept.record(route, request, key, name)
        return out, None
    # a probe of the hooks, for a scheme not posenc's own (the flex path takes none: on
    # CUDA it declines a call with one, on CPU it has no backward)
    histories = [] if name == "flex" else call.histories
    if not (histories or call.params or any(x.requires_grad for x in (q, k, v))):
        return run(), None
    # the fast paths' backwards are not differentiable: a gradient asked for with
    # create_graph=True is taken through the math reference instead (the path planned once
    # more on leaves of the same values inside the wrapper); and a tensor with a history
    # that the hooks read is read there through a leaf standing in for it
    fast = functools.partial(
        _fast, hooks=hooks, q_pos=q_pos, k_pos=k_pos, mask=mask, scale=scale,
        dropout_p=dropout_p, paths=PATHS[backend], name=name, scheme=scheme,
        params=call.params, originals=histories,
    )  # fmt: skip
    reference = functools.partial(
        _reference, hooks=hooks, originals=histories, q_pos=q_pos, k_pos=k_pos, mask=mask,
        scale=scale,
    )  # fmt: skip
    tensors = (q, k, v, *histories, *call.params)
    return _TwiceDifferentiable.apply(
        fast, reference, dropout_p, 3 + len(histories), scheme, *tensors
    ), None


def _unwrapped(name: str, call: Call, hooks: Hooks) -> bool:
    """Whether the dispatcher runs path ``name`` as it is, with no wrapper: no graph is
    recorded, or the path is built of autograd's ops alone (every tensor the hooks read
    gets its gradient) and needs none for a second derivative (:func:`_exact_twice`)."""
    return (
        torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or (name in _AUTOGRAD_PATHS and (not call.grad or _exact_twice(name, call, hooks)))
    )


#: the paths built of autograd's differentiable ops alone (no autograd Function of posenc's)
_AUTOGRAD_PATHS = frozenset(("math", "materialised", "sdpa"))

#: the fast forms the materialised path runs where the math path runs another form: a
#: fast hook beside its literal reference, and a key shift beside the term it folds
_TWO_FORMS = (
    ("score_term", "reference_score_term"),
    ("value_term", "reference_value_term"),
    ("key_shift", "score_term"),
)


def _exact_twice(name: str, call: Call, hooks: Hooks) -> bool:
    """Whether path ``name``'s own graph gives the definition's second derivatives, so that
    no wrapper is needed: the math path (the reference hooks, op by op), and the
    materialised path when it runs op by op too (with the fast hooks, not SDPA's kernel:
    :func:`~.plans._op_by_op`) and each fast hook it runs in place of another form is
    posenc's own (plain differentiable ops): a user's, or one set on the instance, may be
    differentiable once only. ``call`` is the call as the path ran it, ``hooks`` the
    scheme's before a key shift was folded into the keys."""
    if name == "math":
        return True
    if name not in ("materialised", "sdpa"):
        return False
    if name == "sdpa" or not call.op_by_op:
        return _kernel_alone(name, call, hooks)
    scheme = call.scheme
    for fast, other in _TWO_FORMS:
        if getattr(hooks, fast) is None or getattr(hooks, other) is None:
            continue
        if not own_hook(scheme, fast):
            return False
    return True


def _kernel_alone(name: str, call: Call, hooks: Hooks) -> bool:
    """Whether path ``name``'s SDPA route has a graph of SDPA's kernel alone on the CPU
    (whose fused kernel's node gets a second derivative where
    :func:`~.sdpa.differentiable_twice` holds, and whose math kernel is plain ops): no
    dropout, eager autograd, no tensor the hooks read that asks for a gradient, and
    nothing positional that records a graph: no key shift, term or value term, and a bias
    only on the materialised path, which has found it constant (``Call.constant_bias``,
    read once per call)."""
    if call.q.device.type != "cpu" or call.dropout_p > 0 or not plain_autograd():
        return False
    if not sdpa.differentiable_twice():
        return False
    if not (call.q.numel() and call.k.numel() and call.v.numel()):
        return False  # SDPA answers empty inputs apart, with no second derivative
    if hooks.key_shift is not None or hooks.score_term is not None:
        return False
    if hooks.value_term is not None or hooks.contextual_term is not None:
        return False
    if call.params or call.histories:
        return False
    return hooks.score_bias is None or (name == "materialised" and call.constant_bias)


def _positional(hooks: Hooks) -> bool:
    return any(
        fn is not None
        for fn in (hooks.score_bias, hooks.score_term, hooks.value_term, hooks.contextual_term)
    )


def _plan_sdpa(call: Call) -> Plan:
    if call.hooks.value_term is not None:
        return "cannot add a value term (Shaw's a^V needs the attention weights)"
    run = lambda: _sdpa(  # noqa: E731
        call.q, call.k, call.v, call.hooks, call.q_pos, call.k_pos, call.mask, call.scale,
        call.dropout_p,
    )  # fmt: skip
    return run if _positional(call.hooks) else routed(run, ())


def _plan_math(call: Call) -> Plan:
    return lambda: _math(
        call.q, call.k, call.v, call.hooks, call.q_pos, call.k_pos, call.mask, call.scale,
        call.dropout_p,
    )[0]  # fmt: skip


def _plan_flex(call: Call) -> Plan:
    if call.hooks.contextual_term is not None:
        return "cannot add a contextual term (CoPE reads each query's whole row of logits)"
    if _on_cuda(call.q) and torch.is_grad_enabled() and call.histories:
        return (
            "cannot differentiate a tensor with a history of its own that the scheme's "
            "hooks read (its score_mod reads it outside posenc's reach); make it a "
            "parameter of the scheme, or use backend='auto'"
        )
    return lambda: _flex(
        call.q, call.k, call.v, call.hooks, call.q_pos, call.k_pos, call.mask, call.scale,
        call.dropout_p, tuple(call.params),
    )  # fmt: skip


def _auto_sdpa(call: Call) -> Plan:
    """SDPA when nothing positional enters the scores (no scheme, rotary, a key shift), or
    where the lean engine cannot run: attention dropout, ``torch.compile`` (where a call
    too large for the materialised path runs the lean engine as one operator instead:
    :mod:`.compiled`). Not a contextual term: the math path computes its logits once, SDPA
    twice (it takes it as a float mask)."""
    if call.hooks.contextual_term is not None:
        return (
            "a contextual term (CoPE) reads the masked logits: SDPA would take it as a "
            "[b, h, n_q, n_k] float mask and compute the logits twice, the math path once"
        )
    if _positional(call.hooks):
        if call.dropout_p > 0:
            return _plan_sdpa(call)
        if torch.compiler.is_compiling():
            return compiled.lean_plan(call, materialised_size(call)) or _plan_sdpa(call)
        return (
            "the scheme adds a bias, term or value term: writing out [b, h, n_q, n_k] is "
            "weighed by the materialised path"
        )
    return _plan_sdpa(call)


def _auto_math(call: Call) -> Plan:
    """The reference for what no fused path runs: a contextual term (CoPE, on the ``lean``
    backend too), a value term with attention dropout or inside ``torch.compile`` (the lean
    engine's backward calls ``torch.autograd.grad``, which Dynamo does not trace; a call
    too large for the materialised path runs it as one operator instead: :mod:`.compiled`),
    and calls with nothing to attend."""
    if call.hooks.contextual_term is not None:
        return _plan_math(call)  # no lean, fused or flex path runs it
    if call.q.numel() == 0 or call.k.shape[-2] == 0:
        return _plan_math(call)  # empty: the lean engine's blocks assume a row and a key
    if torch.compiler.is_compiling():
        return compiled.lean_plan(call, materialised_size(call)) or _plan_math(call)
    if call.dropout_p > 0:
        return _plan_math(call)
    return "the lean engine can run it (no dropout, not compiling, something to attend)"


def _on_cuda(q: Tensor) -> bool:
    """Whether the call runs on a CUDA device (where FlexAttention has its fused backward)."""
    return q.device.type == "cuda"


def _auto_flex(call: Call) -> Plan:
    """FlexAttention on CUDA for what a ``score_mod`` expresses: a content-free bias with a
    ``flex_score_mod``, a query term of bounded reach (``flex_term_mod``), the masks as a
    block mask; one fused kernel with a backward, no ``[n_q, n_k]`` tensor."""
    hooks = call.hooks
    if hooks.contextual_term is not None:
        return _CONTEXTUAL + " (a score_mod reads one score at a time)"
    if not _on_cuda(call.q):
        return (
            "not on CUDA (on CPU FlexAttention has no backward in torch 2.13; the lean "
            "engine's fused CPU kernels run instead)"
        )
    if call.dropout_p > 0:
        return "attention dropout (FlexAttention has none)"
    if call.q.numel() == 0 or call.k.shape[-2] == 0:
        return "nothing to attend"
    if hooks.value_term is not None:
        return "a value term (Shaw's a^V needs the attention weights)"
    if hooks.score_term is not None and hooks.flex_term_mod is None:
        return "a query term with no bounded reach (no flex_term_mod)"
    if hooks.score_bias is not None and hooks.flex_score_mod is None:
        return "a bias with no flex_score_mod"
    return _plan_flex(call)


def _lean_dropout(call: Call) -> Plan:
    if call.dropout_p > 0:
        raise ValueError(
            "backend='lean' has no attention dropout; set dropout=0, or use backend='auto' "
            "(which takes the math or sdpa path when dropout is on)"
        )
    return "no dropout"


def _plan_mask_blocks(call: Call) -> Plan:
    if call.hooks.contextual_term is not None:
        return _CONTEXTUAL
    blocks = _mask_blocks(call.mask, call.q)
    if blocks is None:
        return (
            "no key padding, lengths, documents or causal window that leave one run of keys "
            "per document (or an attn_mask, or too many small calls: MASK_BLOCK_PAIRS)"
        )
    return lambda: _by_blocks(
        call.q, call.k, call.v, call.hooks, call.q_pos, call.k_pos, call.scale, blocks,
        functools.partial(
            _lean_blocks, scheme=call.scheme, learned=(call.params, call.histories)
        ),
    )  # fmt: skip


def _lean_blocks(
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
    learned: tuple[list[Tensor], list[Tensor]] | None = None,
) -> Tensor:
    """One block of :func:`_plan_mask_blocks`: the lean paths, blocks excepted (``learned``:
    the whole call's :attr:`Call.params` and :attr:`Call.histories`)."""
    call = Call(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p, scheme, learned)
    return _walk(LEAN_PATHS[1:], call)[1]()


#: the lean engine's paths, most specialised first
LEAN_PATHS = (
    Path("mask-blocks", _plan_mask_blocks),
    Path("offset-term", _plan_offset_term),
    Path("grid-term", _plan_grid_term),
    Path("grid-bias", _plan_grid_bias),
    Path("offset-bias", _plan_offset_bias),
    Path("lean-fused", _plan_lean_fused),
    Path("lean", _plan_lean),
)

#: the order ``backend`` walks: ``auto`` tries SDPA (nothing positional), FlexAttention
#: (CUDA), the bias or term written out where the scores are small, then the lean paths
PATHS = {
    "auto": (
        Path("sdpa", _auto_sdpa),
        Path("math", _auto_math),
        Path("flex", _auto_flex),
        Path("materialised", _plan_materialised),
        *LEAN_PATHS,
    ),
    "lean": (Path("dropout", _lean_dropout), Path("math", _auto_math), *LEAN_PATHS),
    "sdpa": (Path("sdpa", _plan_sdpa),),
    "flex": (Path("flex", _plan_flex),),
    "math": (Path("math", _plan_math),),
}


def _walk(
    paths: tuple[Path, ...], call: Call, backend: str = "lean"
) -> tuple[str, Callable[[], Tensor], dict[str, str]]:
    """``(name, run, reasons)``: the first path that can run the call, and why each before it
    could not.

    Raises:
        ValueError: no path can (only a backend of one path, e.g. ``"sdpa"`` with a value
            term: ``auto`` and ``lean`` end with a path that runs anything).
    """
    reasons: dict[str, str] = {}
    for path in paths:
        plan = path.plan(call)
        if not isinstance(plan, str):
            return path.name, plan, reasons
        reasons[path.name] = plan
    why = "; ".join(reasons.values())
    raise ValueError(f"backend={backend!r} {why}; use backend='auto' or 'math'")


def _prepared(call: Call) -> Call:
    """The call as the fast paths take it: a score term of the key alone folded into the
    keys, ``q_i . (k_j + e_j) = q_i . k_j + q_i . e_j``, so that every kernel computes it with
    no ``[n_q, n_k]`` term (the math path keeps the literal form)."""
    hooks = call.hooks
    if hooks.key_shift is not None and hooks.score_term is not None:
        shift = hooks.key_shift(call.q, call.q_pos, call.k_pos).to(call.k.dtype)  # [b, h, n_k, d]
        folded = replace(hooks, score_term=None, key_shift=None)
        # what the shift reads is the call's to differentiate: probed with the hooks as given
        return replace(call, k=call.k + shift, hooks=folded, read_by=call.read_by or hooks)
    return call


def _fast(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *stand_ins: Tensor,
    hooks: Hooks,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    scale: float,
    dropout_p: float,
    paths: tuple[Path, ...],
    name: str,
    scheme: Any,
    params: list[Tensor],
    originals: list[Tensor],
) -> Tensor:
    """The path ``name`` of ``paths`` (which :func:`_walk` chose for these values) on
    ``q, k, v``, or the first after it that takes the call: ``[b, h, n_q, d]``. The hooks
    read ``stand_ins`` in place of ``originals``, and the paths differentiate ``params``
    and the stand-ins."""
    if originals:
        hooks = substituted(hooks, originals, list(stand_ins))
    learned = (params + [x for x in stand_ins if x.requires_grad], [])
    call = Call(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p, scheme, learned)
    start = next(i for i, path in enumerate(paths) if path.name == name)
    return _walk(paths[start:], _prepared(call))[1]()


def explain_call(
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
    scale: float | None = None,
) -> Explanation:
    """The path :func:`attend` takes for these arguments, and why each path before it in
    ``PATHS[backend]`` does not (nothing is computed but what the paths' conditions read)."""
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        k, v = repeat_heads(q, k, v)
    hooks = checked_hooks(hooks_of(scheme), scheme, q.shape[0], q.shape[1], v.shape[-1])
    scale = default_scale(q.shape[-1]) if scale is None else scale
    if backend != "math" and _learned_mask(mask):
        return Explanation("math", {backend: "a float attn_mask that requires grad"})
    call = _prepared(Call(q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p, scheme))
    name, run, reasons = _walk(PATHS[backend], call, backend)
    request = kept.Request(q, k, v, scheme, q_pos, k_pos, mask, backend, dropout_p, False)
    path = kept.kept_path(request) if kept.keyable(scheme) else None
    if path is not None and path != name:  # a route kept at another key count of the band
        order = [each.name for each in PATHS[backend]]
        before = {p: reasons[p] for p in order[: order.index(path)] if p in reasons}
        before[name] = (
            "the route kept for this call's signature is replayed (few queries in no-grad "
            "mode: the signature holds the key count's power of two, and another "
            f"count of it chose {path})"
        )
        return Explanation(path, before, True)
    replayed = (
        getattr(run, "route", None) is not None
        and call.read_by is None
        and _unwrapped(name, call, hooks)
        and kept.signature(request) is not None
        and kept.keyable(scheme)
    )
    return Explanation(name, reasons, replayed)
