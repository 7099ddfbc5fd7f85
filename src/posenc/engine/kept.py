"""Kept routes: the route the dispatcher chose for a call's signature, replayed without the
walk, for calls whose route is one SDPA call (or, without gradients, the forward of a term
in one buffer).

For a call without dropout or weights asked for, unmasked or with the causal mask alone
over at most as many queries as keys, aligned at the end (a decoder's call, or its chunk
over a cache: no padding, documents, window nor ``attn_mask``), the paths up to the
materialised one (``sdpa``, ``math``, ``flex``, ``materialised``: :data:`.dispatch.PATHS`)
decide on the mask's kind (none or causal), the scheme's hooks (which it defines, and
where), the queries' shape, dtype and device, the keys' count (for a few queries without
gradients, its power of two: below), the backend, the modes of torch (``torch.compile``,
``torch.jit.trace``, a dispatch or function mode, a ``torch.func`` transform, a
forward-mode AD level), the thread count and the tuning constants (:mod:`.tuning`) alone;
in grad mode also on which of ``q, k, v`` and of the scheme's parameters and buffers ask
for a gradient, and on what the scheme's hooks may read that asks for one, which the key
holds only for a scheme that can read nothing but its parameters (posenc's own modules:
:func:`_grad_flags`). The :func:`signature` of the call holds all of them, and the shapes
of ``k``, ``v`` and the positions and the dtypes of ``k`` and ``v`` besides. (The lean
paths after them read the positions' and the bias's values, and keep no route; a path
placed before the materialised one must read nothing the signature does not hold.) Where
that choice was one of

- SDPA's kernel on ``q, k, v`` (nothing positional in the scores: no scheme, or a
  rotation applied before the call), or
- SDPA's kernel with the scheme's ``score_bias`` (the tensor it keeps between calls where
  its ``kept_score_bias`` gives one) as the float mask (the materialised path's route for
  a bias alone; past the scores' budget, where the path chose it because the scheme keeps
  that bias, its route reads ``kept_score_bias`` alone, and a call for which the scheme
  keeps none, or whose inputs SDPA's fused CPU kernel does not take, takes the
  dispatcher: :func:`~.plans._kept_bias_fused`), or
- without gradients (grad mode off), the materialised path's forward in one buffer
  (:func:`~.reference._forward_in_place`: a score or value term op by op; its choice
  reads the shapes, the device, the thread count and the tuning constants alone), with
  the scheme's hooks checked as the dispatcher checks them (:data:`~.plans._IN_PLACE_ROUTE`),
  or
- the materialised path's formula op by op with the fast hooks (:func:`~.reference._math`:
  a learned table's or term's call with gradients, whose choice reads which of the
  scheme's parameters and buffers ask for one, which the key holds), its hooks checked likewise
  (:data:`~.plans._MATH_ROUTE`),

(but neither of the last two where a clipped term's crossover chose the path: that reads
the offsets the positions meet, :func:`~.plans._clipped_term`) run by the dispatcher with
no wrapper (with gradients: where the path's own graph is differentiable twice), the route
is kept per scheme and signature (:func:`record`), and a later call of the same signature
runs it at once (:func:`replay`): the hooks are called on the call's positions as the path
calls them, and the bias's shape is checked as :func:`~posenc.hooks.checked_hooks` checks
it (a bias of another shape, or none, or in grad mode one that asks for a gradient, takes
the dispatcher, which calls the hooks again and raises where it must; the forward in one
buffer calls the checked hooks themselves, which raise the dispatcher's error). A causal
call runs the path's own SDPA call with its mask (:func:`~.sdpa._sdpa`: the mask folded
into the bias, or SDPA's ``is_causal``) after the dispatcher's check that ``q``, ``k`` and
``v`` are finite (:func:`~.inputs.hideable`: for a chunk without gradients, ``q`` and the
last ``n_q`` keys and values; a value that is not takes the dispatcher, which zeroes the
tokens the mask hides), or the forward in one buffer with it, after that check of ``v``
alone: it reads ``q``'s and ``k``'s in the sum of its logits (:func:`replay`). A replay
computes what the path computes, with the same call, so it gives the same values: only the
walk's Python is saved.

A few queries in no-grad mode over more keys (at most :data:`.tuning.KEPT_BAND_QUERIES`,
fewer than the least key count of the band: a decoding step, or a speculative decoder's
drafts checked at once, whose cache grows from one call to the next) are keyed by the key
count's power of two, ``n_k`` in ``[2^(m-1), 2^m)``, not by the count itself, so that the
calls of a growing cache replay the route the first call of the band kept. Any route
computes the call's attention (the hooks are called on the call's positions and the bias
checked), so this changes only which path runs, and the last bits of its values, which
then depend on the count that chose the route. The choice for few queries moves with
their key count only at limits of scores and pairs: the materialised path below them (with
the bias alone through SDPA's fused kernel past the scores' budget, a route not kept; one
buffer or SDPA by the ``OPS_IN_PLACE_*`` limits), the lean paths above, which keep no
route. So a band replays a materialised route at up to twice the key count of a limit it
crosses, where what it writes per call (its scores and weights, a term's logits per
offset) is a few ``[b, h, n_q, n_k]`` tensors, against the keys' and values' ``[b, h,
n_k, d]`` each. :func:`posenc.explain` reports the route replayed.

:func:`posenc.attention` and :class:`~posenc.MultiHeadAttention`, called with ``q, k, v``
alone (default positions, nothing masked, no dropout, cache nor weights), look the route
up before anything else (:func:`replay_unmasked`): the call's checks that the key does
not hold are made on the tensors, and the hooks of a route that calls them get default
positions kept with the scheme's routes (at most :data:`.tuning.KEPT_ROUTES` pairs of
``[1, n]`` int64 tensors per scheme, built anew once written into), not positions built
for the call. A scheme whose rotation is posenc's own, and whose route is SDPA's kernel on
``q, k, v`` (no bias read), is rotated at those positions by the caller's rotation first
(which keeps the shapes, dtypes, device and grad flags the key holds).

The signature does not hold the engine's own functions: code that replaces one of them
(a test's spy, a patched path) calls :func:`clear` first, or its calls may replay a route
chosen before.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim,
``d_v`` value head dim; positions ``[B', n]`` with ``B'`` 1 or ``b``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._memo import eager
from ..hooks import (
    HOOK_NAMES,
    attribute,
    bias_fits,
    checked_hooks,
    hooks_of,
    hooks_signature,
    signature_defines,
)
from ..indices import run_positions
from . import plans, sdpa, tuning
from .inputs import default_scale, finite, hideable
from .learned import own_hook, own_learning
from .mask import Mask
from .reference import _forward_in_place, _math

#: a route: the bias hooks to read in turn, ``()`` for none (SDPA's kernel on q, k, v),
#: ``("score_bias",)`` or ``("kept_score_bias", "score_bias")`` (the first that gives a
#: tensor); or :data:`~.plans._IN_PLACE_ROUTE` (the forward op by op in one buffer), or
#: :data:`~.plans._MATH_ROUTE` (the formula op by op)
Route = tuple[str, ...]

#: the rotation of ``posenc.attention`` (``posenc._rotary_buffer.rotated``): ``(scheme, q,
#: k, q_pos, k_pos, scores_only) -> (q, k, the kept buffer lent for them or None)``
Rotation = Callable[..., tuple[Tensor, Tensor, Any]]


class Request(NamedTuple):
    """An attention call as :func:`signature` reads it (the arguments of
    :func:`~posenc.engine.attend` but the scale, with grouped heads already repeated)."""

    q: Tensor
    k: Tensor
    v: Tensor
    scheme: Any
    q_pos: Tensor
    k_pos: Tensor
    mask: Mask
    backend: str
    dropout_p: float
    need_weights: bool


class _Routes(dict[tuple[Any, ...], Route]):
    """A scheme's routes by signature, the name of the path that chose each (``paths``,
    for :func:`posenc.explain`), and the default positions kept for its calls of
    :func:`replay_unmasked` (``positions``, per sizes and device)."""

    __slots__ = ("paths", "positions")

    def __init__(self) -> None:
        super().__init__()
        self.paths: dict[tuple[Any, ...], str] = {}
        self.positions: dict[tuple[int, int, torch.device], tuple[Tensor, Tensor]] = {}

    def clear(self) -> None:
        super().clear()
        self.paths.clear()


#: each scheme's routes by signature
_ROUTES: weakref.WeakKeyDictionary[Any, _Routes] = weakref.WeakKeyDictionary()
#: the routes of calls without a scheme
_UNSCHEMED = _Routes()


def signature(call: Request) -> tuple[Any, ...] | None:
    """What the dispatcher's choice of a kept route reads for this call (see the module
    docstring), as a key; None for a call whose route is not kept: a mask other than the
    causal mask alone over at most as many queries as keys (:func:`_causal_alone`), dropout,
    weights asked for, a mode of torch that changes what runs (``torch.compile``,
    ``torch.jit.trace``, a dispatch or function mode, a ``torch.func`` transform, a
    forward-mode AD level), a scheme whose hooks have no key
    (:func:`~posenc.hooks.hooks_signature`), no route kept at all
    (:data:`.tuning.KEPT_ROUTES` 0), and in grad mode a choice that reads more than the key
    (:func:`_grad_flags`)."""
    q, k, v, scheme, q_pos, k_pos, mask, backend, dropout_p, need_weights = call
    if need_weights or dropout_p:
        return None
    if mask.empty:
        return _key(q, k, v, scheme, q_pos.shape, k_pos.shape, backend)
    if _causal_alone(mask):
        return _key(q, k, v, scheme, q_pos.shape, k_pos.shape, backend, causal=True)
    return None


def _causal_alone(mask: Mask) -> bool:
    """Whether ``mask`` is the causal mask alone over at most as many queries as keys,
    aligned at the end (query ``i`` sees the keys up to ``i + n_k - n_q``: self-attention,
    or a decoder's chunk over its cache; no padding, documents, window nor
    ``attn_mask``): a mask whose paths read its kind and the sizes alone, which the key
    holds."""
    return mask.causal and mask.n_q <= mask.n_k and mask.causal_at_most


def _key(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scheme: Any,
    q_pos_shape: tuple[int, ...],
    k_pos_shape: tuple[int, ...],
    backend: str,
    causal: bool = False,
) -> tuple[Any, ...] | None:
    """:func:`signature` of a call without dropout nor weights, unmasked or ``causal``
    (:func:`_causal_alone`), with positions of these shapes (their values are not
    read)."""
    if tuning.KEPT_ROUTES <= 0 or not eager():
        return None
    grad = None
    if torch.is_grad_enabled():
        grad = _grad_flags(q, k, v, scheme)
        if grad is None:
            return None
    if scheme is None:
        hooks = None
    else:
        hooks = hooks_signature(scheme)
        if hooks is None:
            return None
    k_shape, v_shape = k.shape, v.shape
    n_k = k_shape[2]
    n_q = q.shape[2]
    # few queries below the band's least key count: the key count's band
    if grad is None and n_q <= tuning.KEPT_BAND_QUERIES and n_q < (1 << n_k.bit_length()) >> 1:
        band = ("band", n_k.bit_length())  # n_k in [2^(m-1), 2^m)
        k_shape = (k_shape[0], k_shape[1], band, k_shape[3])
        v_shape = (v_shape[0], v_shape[1], band if v_shape[2] == n_k else v_shape[2], v_shape[3])
        k_pos_shape = (*k_pos_shape[:-1], band if k_pos_shape[-1] == n_k else k_pos_shape[-1])
    return (
        hooks, backend, q.shape, k_shape, v_shape, q_pos_shape, k_pos_shape, q.dtype, k.dtype,
        v.dtype, q.device, grad, plans._threads(), tuning.key, causal,
    )  # fmt: skip


def _grad_flags(
    q: Tensor, k: Tensor, v: Tensor, scheme: Any
) -> tuple[bool, bool, bool, tuple[bool, ...]] | None:
    """In grad mode, the grad flags of ``q, k, v`` and of the scheme's parameters and buffers
    (:func:`~.learned.own_learning`) that the
    choice reads besides what :func:`signature` holds (whether the call computes
    gradients, whether a bias or term asks for one, and whether the path's own graph is
    differentiable twice, so that the dispatcher runs it with no wrapper; a thawed
    table's call must not replay the route kept while it was frozen: a learned bias or
    term keeps the formula op by op, :data:`~.plans._MATH_ROUTE`, a learned rotation's
    wrapper no route); None where the choice reads more than the key could hold: a
    scheme that may read a tensor requiring grad other than its parameters (the
    dispatcher probes its hooks in every call: :func:`~.learned.learned_inputs`), a call where SDPA's fused
    kernel has no second derivative of its own (saved-tensor hooks in force:
    :func:`~.sdpa.differentiable_twice`, which the dispatcher reads), and a constant bias
    that the limit of :data:`.tuning.OPS_GRAD_BIAS_SCORES` may run op by op (that choice
    weighs the bias the scheme keeps against SDPA's)."""
    learning = own_learning(scheme)  # which of its parameters and buffers require grad
    if learning is None:
        return None
    if not sdpa.differentiable_twice():  # saved-tensor hooks: the dispatcher wraps the route
        return None
    b, h, n_q, d = q.shape
    if d == v.shape[-1] and b * h * n_q * k.shape[2] <= tuning.OPS_GRAD_BIAS_SCORES:
        return None
    return q.requires_grad, k.requires_grad, v.requires_grad, learning


def _routes(scheme: Any) -> _Routes | None:
    """The scheme's routes (None: none kept, or a scheme that cannot key a weak dictionary)."""
    if scheme is None:
        return _UNSCHEMED
    try:
        return _ROUTES.get(scheme)
    except Exception:  # unhashable, no weak reference to it, a __hash__ that raises
        return None


def record(route: Route, call: Request, key: tuple[Any, ...], path: str) -> None:
    """Keep ``route``, which the dispatcher chose for this call, under ``key``, the call's
    :func:`signature` read before the route ran (a hook that changes what the key holds
    while it runs must not file the route under the state it left), at most
    :data:`.tuning.KEPT_ROUTES` per scheme (with ``path``, the name of the path that chose
    it: :func:`kept_path`): a new signature past them empties the scheme's
    routes first. A scheme that cannot key a weak dictionary keeps none
    (:func:`keyable`)."""
    routes = _routes(call.scheme)
    if routes is None:
        try:
            routes = _ROUTES.setdefault(call.scheme, _Routes())
        except Exception:  # as _routes
            return
    if key not in routes and len(routes) >= tuning.KEPT_ROUTES:
        routes.clear()
    routes[key] = route
    routes.paths[key] = path


def kept_path(call: Request) -> str | None:
    """The name of the path whose route a call of this signature replays, or None where
    none is kept (for a few queries in no-grad mode, a route another key count of their
    band chose: :func:`_key`)."""
    routes = _routes(call.scheme)
    if not routes:
        return None
    key = signature(call)
    return None if key is None or key not in routes else routes.paths.get(key)


def keyable(scheme: Any) -> bool:
    """Whether routes can be kept for ``scheme``: None, or an object that can key a weak
    dictionary (hashable, weakly referable)."""
    if scheme is None:
        return True
    try:
        weakref.ref(scheme)
        hash(scheme)
    except Exception:  # unhashable, no weak reference to it, a __hash__ that raises
        return False
    return True


def replay(call: Request, scale: float | None) -> Tensor | None:
    """The route kept for the scheme and this call's :func:`signature`, run on this call:
    ``[b, h, n_q, d_v]``; None where none is kept, or where the scheme's bias has a shape
    the route does not take, or none, or where a causal call's ``q``, ``k`` or ``v`` holds
    a value that is not finite (the dispatcher then runs the call: such tokens are zeroed
    where the mask hides them, :func:`~.inputs.finite`; of a chunk without gradients, the
    tensors the dispatcher checks: ``q`` and the last ``n_q`` keys and values,
    :func:`~.inputs.hideable`). On the route of the forward in one buffer, with a scale
    that is a normal number of the queries' dtype (the GEMM then reads ``q`` and ``k``),
    ``v`` (of a chunk, its last ``n_q`` tokens) alone is checked first, and ``q`` and
    ``k`` through the
    logits' sum that its fill takes where the scores are many (at least
    :data:`~.tuning.FILLED_ELEMENTS`; below, one sum of its own):
    :func:`~.reference._forward_in_place` returns None where it is not finite, after
    calling the hooks, which the dispatcher calls again."""
    if torch.compiler.is_compiling():
        return None  # no key while compiling (signature): nothing for Dynamo to trace
    routes = _routes(call.scheme)
    if not routes:
        return None
    key = signature(call)
    route = None if key is None else routes.get(key)
    if route is None:
        return None
    q, k, v, scheme, q_pos, k_pos, mask = call[:7]
    if mask.empty:
        return _run(route, q, k, v, scheme, q_pos, k_pos, scale)
    # the forward in one buffer reads q's and k's in the logits' sum, which its fill takes
    # (where its GEMM reads them: BLAS may skip A and B when alpha, the scale, is 0)
    checks_logits = (
        route == plans._IN_PLACE_ROUTE
        and not torch.is_grad_enabled()
        and (scale is None or abs(scale) >= torch.finfo(q.dtype).tiny)
    )
    # (what the dispatcher checks: a chunk's hidden keys and values alone, :func:`hideable`;
    # no route is kept for a contextual term, whose paths keep none)
    q_c, k_c, v_c = hideable(q, k, v, mask)
    if not (finite(v_c) if checks_logits else finite(q_c, k_c, v_c)):
        return None
    return _run(route, q, k, v, scheme, q_pos, k_pos, scale, mask, checked=not checks_logits)


def _run(
    route: Route,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scheme: Any,
    q_pos: Tensor | None,
    k_pos: Tensor | None,
    scale: float | None,
    mask: Mask | None = None,
    checked: bool = True,
) -> Tensor | None:
    """``route`` run on this call (see :func:`replay`; positions None for a route that
    reads no hook; ``mask`` the call's causal mask, or None; ``checked`` False where the
    caller left ``q`` and ``k`` to the forward in one buffer's logits): ``[b, h, n_q,
    d_v]``, or None where the scheme's bias does not fit it (or, unchecked, where those
    logits are not finite). A causal call runs the path's own SDPA
    call (:func:`~.sdpa._sdpa`, which folds the mask into the bias, or takes SDPA's
    ``is_causal`` where there is none)."""
    if route in (plans._IN_PLACE_ROUTE, plans._MATH_ROUTE):  # the path's call, op by op
        # (its hooks checked as the path checks them)
        hooks = checked_hooks(hooks_of(scheme), scheme, q.shape[0], q.shape[1], v.shape[-1])
        mask = Mask(q.shape[2], k.shape[2]) if mask is None else mask
        scale = default_scale(q.shape[-1]) if scale is None else scale
        if route == plans._MATH_ROUTE:
            return _math(q, k, v, hooks, q_pos, k_pos, mask, scale, 0.0, reference=False)[0]  # type: ignore[arg-type]
        # (None where q or k is not finite and replay left them to the logits' sum)
        return _forward_in_place(
            q, k, v, hooks, q_pos, k_pos, mask, scale, 0.0, checked=checked,  # type: ignore[arg-type]
        )  # fmt: skip
    bias = None
    kept_bias = False
    if route:
        for name in route:
            bias = getattr(scheme, name)(q_pos, k_pos)
            if bias is not None:
                # posenc's own kept bias: a tensor the scheme keeps to itself, so that its
                # causal-masked form may be kept too (sdpa._causal_masked)
                kept_bias = name == "kept_score_bias" and own_hook(scheme, name)
                break
        if not (isinstance(bias, Tensor) and bias_fits(bias, q.shape[0], q.shape[1], q_pos, k_pos)):
            return None
        if bias.requires_grad and torch.is_grad_enabled():
            return None  # not constant: the materialised path runs it op by op
        if route == plans._KEPT_FUSED_ROUTE and not (
            bias.dtype == q.dtype and sdpa.fused_cpu_runs(q, k, v)
        ):
            return None  # past the scores' budget only through SDPA's fused kernel
    scale = default_scale(q.shape[-1]) if scale is None else scale
    if mask is not None:  # the path's call: the mask folded into the bias, or is_causal
        hooks = hooks_of(scheme)  # (a route reads a bias alone: no term to fold)
        return sdpa._sdpa(
            q, k, v, hooks, q_pos, k_pos, mask, scale, 0.0, bias=bias, kept_bias=kept_bias,  # type: ignore[arg-type]
        )  # fmt: skip
    attn_mask = None
    if bias is not None:
        attn_mask = bias if bias.dtype == q.dtype else bias.to(q.dtype)  # [B', h|1, n_q, n_k]
    return sdpa._kernel(q, k, v, attn_mask, 0.0, False, scale)  # the path's call


def replay_unmasked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scheme: Any,
    backend: str,
    scale: float | None,
    validate: bool = True,
    *,
    rotation: Rotation,
) -> Tensor | None:
    """The route kept for a call of ``q, k, v`` alone, run on it before the caller builds
    anything: the call :func:`posenc.attention` or a module makes with default positions
    (``arange(n_q)`` and ``arange(n_k)``), nothing masked, no dropout, no weights and no
    cache, whose checks it stands in for. ``[b, h, n_q, d_v]``; None (the caller then
    makes the call in full, and checks it) where no route is kept for it (:func:`_key`,
    with positions ``[1, n_q]`` and ``[1, n_k]``), or where the full call would check
    more than the key holds: ``q, k, v`` not 4-D tensors of one floating dtype, of one
    batch and head count (grouped heads are repeated in the full call), ``k`` of another
    head dim, ``v`` of another length, a scheme that defines none of the hooks of
    :data:`~posenc.hooks.HOOK_NAMES`, or a bias that does not fit the route
    (:func:`replay`). With ``validate`` (the checks of :func:`posenc.attention`, not a
    module's, which validates its scheme when built) the scheme's ``validate_attention``
    is called on the heads and head dim, and raises as in the full call. A route that
    calls the scheme's hooks gets, on the CPU, positions kept for the scheme per sizes
    (:func:`_default_positions`); elsewhere positions built for the call.

    A scheme that rotates replays where its ``rotate`` hook is posenc's own (defined on a
    class of posenc's: it keeps the shapes, dtypes, device and grad flags of ``q`` and
    ``k``, which the key holds) and the route is SDPA's kernel on ``q, k, v`` (one that
    reads a bias may decline it after the rotation: such a call takes the full call):
    ``q`` and ``k`` are rotated at those default positions by ``rotation``, the caller's
    (``posenc.attention``'s, which may lend the kept buffer, given back once the route has
    read it), as the full call rotates them, and the kernel runs on them; what the
    scheme's ``rotate`` raises at those positions is raised, as in the full call. A
    rotation that changed what the key holds all the same (a method patched in) takes the
    full call, which rotates again.

    Raises:
        ValueError: with ``validate``, heads or a head dim the scheme was not built for.
    """
    if not eager():  # (before the checks: a traced size compared would be recorded)
        return None
    routes = _routes(scheme)
    if not routes:
        return None
    rotates = attribute(scheme, "rotate") is not None
    if rotates and not own_hook(scheme, "rotate"):
        return None  # (a user's rotation may change what the key holds: before the key)
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return None
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return None
    b, h, n_q, d = q_shape
    n_k = k_shape[2]
    if k_shape[0] != b or k_shape[1] != h or k_shape[3] != d:
        return None
    if v_shape[0] != b or v_shape[1] != h or v_shape[2] != n_k or not q.is_floating_point():
        return None
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    key = _key(q, k, v, scheme, (1, n_q), (1, n_k), backend)
    route = None if key is None else routes.get(key)
    if route is None:
        return None
    if rotates and route:
        return None  # a bias route may decline after the rotation: the full call rotates once
    if scheme is not None:
        if not signature_defines(key[0], _MAIN_HOOKS):  # none of the hooks: the full call
            return None  # raises
        if validate:
            check = attribute(scheme, "validate_attention")
            if callable(check):
                check(heads=h, head_dim=d)
    if not (route or rotates):
        return _run(route, q, k, v, scheme, None, None, scale)
    if q.is_cpu:
        q_pos, k_pos = _default_positions(routes, n_q, n_k, q.device)
    else:
        q_pos = run_positions(0, n_q, q.device)  # [1, n_q]
        k_pos = q_pos if n_k == n_q else run_positions(0, n_k, q.device)  # [1, n_k]
    if not rotates:
        return _run(route, q, k, v, scheme, q_pos, k_pos, scale)
    q_r, k_r, lent = rotation(scheme, q, k, q_pos, k_pos, True)
    try:
        if _kept_alike(q_r, q) and _kept_alike(k_r, k):
            return _run(route, q_r, k_r, v, scheme, q_pos, k_pos, scale)
        return None
    finally:
        if lent is not None:  # the kept buffer q and k were rotated into
            lent.__exit__(None, None, None)


def _kept_alike(rotated: Tensor, x: Tensor) -> bool:
    """Whether a rotation kept what the key of ``x`` holds: its shape, dtype, device and
    grad flag."""
    return (
        isinstance(rotated, Tensor)
        and rotated.shape == x.shape
        and rotated.dtype == x.dtype
        and rotated.device == x.device
        and rotated.requires_grad == (x.requires_grad and torch.is_grad_enabled())
    )


#: the hooks a scheme passed to an attention defines one of at least
_MAIN_HOOKS = frozenset(HOOK_NAMES)


def _default_positions(
    routes: _Routes, n_q: int, n_k: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``arange(n_q)`` and ``arange(n_k)`` as ``[1, n]`` runs (:func:`run_positions`; one
    tensor when ``n_q == n_k``), kept in ``routes`` (a scheme's) between its calls of
    :func:`replay_unmasked`, at most :data:`.tuning.KEPT_ROUTES` pairs. They reach that
    scheme's hooks alone, which read positions and never write into them; a pair written
    into all the same through an in-place op (its version counter moved) is built anew.
    A write that bypasses the version counter (``.data``, a NumPy view) would reach the
    scheme's later calls, as it reaches positions the caller keeps."""
    kept = routes.positions.get((n_q, n_k, device))
    if kept is not None:
        q_pos, k_pos = kept
        if q_pos._version == q_pos._posenc_run[0] and k_pos._version == k_pos._posenc_run[0]:
            return kept
    q_pos = run_positions(0, n_q, device)  # [1, n_q] (with a version counter: not inference)
    k_pos = q_pos if n_k == n_q else run_positions(0, n_k, device)  # [1, n_k]
    if len(routes.positions) >= max(tuning.KEPT_ROUTES, 1):
        routes.positions.clear()
    kept = routes.positions[n_q, n_k, device] = q_pos, k_pos
    return kept


def clear() -> None:
    """Forget every kept route (and the default positions kept with them)."""
    _ROUTES.clear()
    _UNSCHEMED.clear()
    _UNSCHEMED.positions.clear()
