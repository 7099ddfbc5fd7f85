"""The hook protocol: how a positional scheme enters attention.

A scheme is any object (usually an ``nn.Module``, so that its tables are trained and saved
with the model) that defines only the hooks it needs; the engine (:mod:`posenc.engine`)
sees the hooks, never the scheme's class. Each hook is described by a ``Protocol`` below,
with its shapes.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim;
positions ``q_pos [B', n_q]`` and ``k_pos [B', n_k]`` have ``B'`` 1 (shared by the batch)
or ``b``; ``W = n_q + n_k - 1`` offsets; ``R`` the rows of a clipped table.

=========================================  =====  =============================================
hook                                       place  what it does
=========================================  =====  =============================================
``rotate(q, k, q_pos, k_pos) -> (q, k)``   2      rotate queries and keys (RoPE)
``score_term(q, q_pos, k_pos)``            4, 5   ``[b, h, n_q, n_k]`` added to ``q k^T``,
                                                  scaled with it by ``1/sqrt(d)``
``score_bias(q_pos, k_pos)``               3      ``[B', h or 1, n_q, n_k]`` added after
                                                  the scaling (Swin, T5, ALiBi)
``value_term(weights, q_pos, k_pos)``      5      ``[b, h, n_q, d]`` added to
                                                  ``weights @ v`` (Shaw's ``a^V``)
``contextual_term(z, q, q_pos, k_pos)``    4      ``[b, h, n_q, n_k]`` added to the scaled
                                                  logits ``z``, read from them (CoPE)
=========================================  =====  =============================================

so that attention computes ``softmax(z + contextual_term(z)) v + value_term`` with the
logits ``z = (q k^T + score_term) / sqrt(d) + score_bias`` (masked keys at ``-inf``).
Optional extras, each another form of one of the hooks above (the engine's fast paths use
them):

- ``reference_score_term`` / ``reference_value_term``: a literal form that
  ``backend="math"`` prefers;
- ``flex_score_mod(q_pos, k_pos)``: the bias as a FlexAttention ``score_mod``;
- ``flex_term_mod(q, q_pos, k_pos, scale)``: a query term of bounded reach as one (the
  logits of ``q`` against its rows, read per pair), or None where it has no bound;
- ``offset_bias(q_pos, k_pos)``: a relative bias as one value per offset, ``[h|1, W]``,
  when the positions are one consecutive run (None otherwise);
- ``kept_score_bias(q_pos, k_pos)``: ``score_bias`` as a tensor the scheme keeps between
  calls, which the engine reads and never writes (no allocation per call), and which
  the scheme never writes either (new values come as a new tensor: the engine may keep
  what it derives from it, such as its causal-masked form, while it lives), or None
  where it keeps none;
- ``offset_term(q_pos, k_pos)`` / ``offset_value``: the same for a query term
  ``q_i . r_(j-i)`` and Shaw's ``a^V``, as rows ``r [(h,) W, d]`` or ``(table, index)``;
- ``grid_bias(q_pos, k_pos)`` / ``grid_term(q_pos, k_pos)``: the 2-D counterparts, for
  queries and keys that are a whole ``H x W`` map in order;
- ``key_shift(q, q_pos, k_pos)``: a score term of the key alone, ``q_i . e_j``, as the
  vector ``e [B', 1, n_k, d]`` added to the keys;
- ``validate_attention(heads, head_dim)``: called when a module is built and by each
  call of :func:`posenc.attention`, to reject a scheme built for another shape.

An extra counts only where the hook it stands for is defined in the same class or after it
in the method resolution order (:data:`DERIVED_HOOKS`): a subclass that overrides
``score_bias`` alone, or a mixin listed before the scheme that does, runs on its
``score_bias``, not on the parent's ``offset_bias``. Hooks must accept any positions (a
block of queries against all keys, shifted, per-batch), never assume ``n_q == n_k``, and
read positions, never write into them (the default positions of one call may be handed
to the next). Masks are the attention's job, never a hook's.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn


@runtime_checkable
class Rotate(Protocol):
    """Place 2: ``rotate(q [b, h, n_q, d], k [b, h_kv, n_k, d], q_pos [B', n_q], k_pos [B', n_k])
    -> (q, k)`` of the same shapes (RoPE); ``h_kv`` divides ``h`` (grouped-query attention:
    the key heads are repeated for their query heads after the rotation)."""

    def rotate(
        self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor
    ) -> tuple[Tensor, Tensor]: ...


@runtime_checkable
class ScoreBias(Protocol):
    """Place 3: ``score_bias(q_pos [B', n_q], k_pos [B', n_k]) -> [B', h|1, n_q, n_k]``, added
    to the scores after the scaling (Swin, T5, ALiBi)."""

    def score_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor: ...


@runtime_checkable
class ScoreTerm(Protocol):
    """Places 4-5: ``score_term(q [b, h, n_q, d], q_pos, k_pos) -> [b|1, h|1, n_q, n_k]``, added
    to ``q k^T`` and scaled with it (relative embeddings, Shaw's ``a^K``)."""

    def score_term(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor: ...


@runtime_checkable
class ValueTerm(Protocol):
    """Place 5: ``value_term(weights [b, h, n_q, n_k], q_pos, k_pos) -> [b, h, n_q, d_v]``,
    added to ``weights @ v`` (Shaw's ``a^V``). ``weights`` is valid during the call only (a
    forward without gradients reuses its memory): return what is computed from it, do not
    keep it."""

    def value_term(self, weights: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor: ...


@runtime_checkable
class ContextualTerm(Protocol):
    """Place 4, positions that the content sets (CoPE): ``contextual_term(logits [b, h, n_q,
    n_k], q [b, h, n_q, d], q_pos [B', n_q], k_pos [B', n_k]) -> [b|1, h|1, n_q, n_k]``, added
    to the logits after the scaling.

    ``logits`` are the scheme's scaled scores, ``(q k^T + score_term) * scale + score_bias``,
    with every masked key at ``-inf`` (so ``sigmoid(logits)`` is 0 there); the values of a
    float ``attn_mask`` are added beside the term, not read by it (its ``-inf`` entries mask
    keys, and the attention moves each of its rows by a constant, which a softmax ignores
    and a gate would not). Row ``i`` of the result may read row ``i`` of the logits, never
    another row; its values at masked keys are ignored. The logits are written out for it
    (``[b, h, n_q, n_k]``): the per-offset, grid, lean and FlexAttention paths do not run it
    (``backend="auto"`` and ``"lean"`` take the math path, ``"sdpa"`` computes the logits
    once more and takes the term as its float mask)."""

    def contextual_term(
        self, logits: Tensor, q: Tensor, q_pos: Tensor, k_pos: Tensor
    ) -> Tensor: ...


@runtime_checkable
class OffsetBias(Protocol):
    """The per-offset form of :class:`ScoreBias`: ``offset_bias(q_pos, k_pos) -> [h|1, W]``,
    the bias of offsets ``-(n_q - 1) .. n_k - 1``, or None when the positions are not one
    consecutive run."""

    def offset_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None: ...


@runtime_checkable
class KeptScoreBias(Protocol):
    """:class:`ScoreBias` as a tensor kept between calls: ``kept_score_bias(q_pos, k_pos) ->
    [B', h|1, n_q, n_k]``, the values of ``score_bias``, shared (the engine reads it and
    never writes into it, it requires no grad, and the scheme never writes it either: new
    values come as a new tensor), or None where the scheme keeps none."""

    def kept_score_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None: ...


@runtime_checkable
class OffsetTerm(Protocol):
    """The per-offset form of :class:`ScoreTerm`: ``offset_term(q_pos, k_pos)`` the rows
    ``r [(h,) W, d]`` with ``term_ij = q_i . r[j - i + n_q - 1]``, or ``(table [(h,) R, d],
    index [W])`` with ``r = table[index]``, or None."""

    def offset_term(
        self, q_pos: Tensor, k_pos: Tensor
    ) -> Tensor | tuple[Tensor, Tensor] | None: ...


@runtime_checkable
class GridBias(Protocol):
    """The 2-D per-offset form of :class:`ScoreBias` over one whole ``H x W`` map in order:
    ``grid_bias(q_pos, k_pos) -> [h, 2H-1, 2W-1]`` (offset ``(dy, dx)`` at ``(dy + H - 1,
    dx + W - 1)``), or None."""

    def grid_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None: ...


@runtime_checkable
class GridTerm(Protocol):
    """The 2-D per-offset form of :class:`ScoreTerm` over one whole map: ``grid_term(q_pos,
    k_pos) -> (height [(h,) 2H-1, d], width [(h,) 2W-1, d])``, or None."""

    def grid_term(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor] | None: ...


@runtime_checkable
class FlexScoreMod(Protocol):
    """:class:`ScoreBias` as a FlexAttention ``score_mod``: ``flex_score_mod(q_pos [B', n_q],
    k_pos [B', n_k]) -> score_mod(score, b, h, q_idx, kv_idx)``, for shared (``B' = 1``) or
    per-sequence positions."""

    def flex_score_mod(self, q_pos: Tensor, k_pos: Tensor) -> Callable[..., Tensor]: ...


@runtime_checkable
class FlexTermMod(Protocol):
    """:class:`ScoreTerm` with a bounded reach as a FlexAttention ``score_mod``:
    ``flex_term_mod(q [b, h, n_q, d], q_pos [B', n_q], k_pos [B', n_k], scale) ->
    score_mod(score, b, h, q_idx, kv_idx)`` adding ``scale * score_term``, read from the
    ``[b, h, n_q, R]`` logits of the queries against the term's ``R`` rows."""

    def flex_term_mod(
        self, q: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float
    ) -> Callable[..., Tensor] | None: ...


@dataclass(frozen=True)
class Hooks:
    """The hooks a scheme defines (None where it defines none)."""

    rotate: Callable[..., tuple[Tensor, Tensor]] | None = None
    score_bias: Callable[..., Tensor] | None = None
    score_term: Callable[..., Tensor] | None = None
    value_term: Callable[..., Tensor] | None = None
    contextual_term: Callable[..., Tensor] | None = None
    offset_bias: Callable[..., Tensor | None] | None = None
    key_shift: Callable[..., Tensor] | None = None
    offset_term: Callable[..., Tensor | None] | None = None
    grid_bias: Callable[..., Tensor | None] | None = None
    grid_term: Callable[..., tuple[Tensor, Tensor] | None] | None = None
    offset_value: Callable[..., Tensor | None] | None = None
    reference_score_term: Callable[..., Tensor] | None = None
    reference_value_term: Callable[..., Tensor] | None = None
    flex_score_mod: Callable[..., Callable[..., Tensor]] | None = None
    flex_term_mod: Callable[..., Callable[..., Tensor] | None] | None = None
    kept_score_bias: Callable[..., Tensor | None] | None = None


HOOK_NAMES = ("rotate", "score_bias", "score_term", "value_term", "contextual_term")


#: each optional extra and the hook it is another form of: an extra inherited from a class
#: above the one that (re)defines its hook would compute the parent's term, so it is dropped
DERIVED_HOOKS = {
    "offset_bias": "score_bias",
    "kept_score_bias": "score_bias",
    "grid_bias": "score_bias",
    "flex_score_mod": "score_bias",
    "flex_term_mod": "score_term",
    "offset_term": "score_term",
    "grid_term": "score_term",
    "key_shift": "score_term",
    "reference_score_term": "score_term",
    "offset_value": "value_term",
    "reference_value_term": "value_term",
}


#: ``nn.Module``'s own ``__getattr__`` (parameters, buffers, submodules)
_MODULE_GETATTR = nn.Module.__getattr__


def attribute(scheme: Any, name: str) -> Any:
    """``getattr(scheme, name, None)``; None for no scheme (None). For an ``nn.Module``
    whose class keeps Python's and ``nn.Module``'s attribute lookup, a name that no class
    of its MRO, nor the instance, nor its parameters, buffers or submodules hold is
    answered None at once:
    ``getattr`` would reach ``nn.Module.__getattr__``, which formats and raises an
    ``AttributeError`` for ``getattr`` to catch (a scheme's missing hooks, in every
    call). Any other case, and any call traced by ``torch.compile``, is ``getattr``'s own."""
    if scheme is None:
        return None
    cls = type(scheme)
    if (
        torch.compiler.is_compiling()
        or getattr(cls, "__getattr__", None) is not _MODULE_GETATTR
        or cls.__getattribute__ is not object.__getattribute__
    ):
        return getattr(scheme, name, None)
    own = scheme.__dict__
    if name in own:
        return getattr(scheme, name, None)
    for c in cls.__mro__:
        if name in c.__dict__:  # as object.__getattribute__ finds it (a descriptor too)
            return getattr(scheme, name, None)
    for store in ("_parameters", "_buffers", "_modules"):  # as nn.Module.__getattr__
        held = own.get(store)
        if held is not None and name in held:
            return held[name]
    return None


def _defined_by(scheme: Any, name: str) -> type | None:
    """The class in ``scheme``'s MRO that defines ``name`` (None: the instance itself; a
    value that a class's ``functools.cached_property`` wrote into the instance is that
    class's)."""
    cls = next((c for c in type(scheme).__mro__ if name in c.__dict__), None)
    return _owner(cls, name, getattr(scheme, "__dict__", {}))


def _owner(cls: type | None, name: str, own: dict[str, Any]) -> type | None:
    """Whose ``name`` is, from ``cls``, the first class of the MRO whose dict holds it (or
    None), and the instance's dict ``own``: the instance's where it holds the name, but
    for the value of ``cls``'s ``functools.cached_property`` (cached there on first
    lookup: still ``cls``'s method)."""
    if name in own and not (
        cls is not None and isinstance(cls.__dict__[name], functools.cached_property)
    ):
        return None
    return cls


#: every hook name, in the order of :class:`Hooks`'s fields
_HOOK_NAMES = tuple(Hooks.__dataclass_fields__)
_HOOK_SET = frozenset(_HOOK_NAMES)
_NO_HOOKS = dict.fromkeys(_HOOK_NAMES)


def _hook_owners(scheme: Any) -> dict[str, type | None] | None:
    """Each hook name ``getattr`` may find on ``scheme``, with the first class of its MRO
    whose dict holds it (None: none does; the name is set on the instance or is a
    submodule's), in one pass over the class dicts as they are now (a descriptor is not
    run without an instance; no cache to go stale). None for a class with its own
    attribute lookup (``__getattr__`` other than ``nn.Module``'s, or ``__getattribute__``),
    which may answer any name. A name missing from an instance costs
    ``nn.Module.__getattr__`` an exception; these lookups are cheaper. Traced by
    ``torch.compile`` too: Dynamo then guards on the keys of these dicts, which cost its
    guard check far less than guards on every name ``nn.Module.__getattr__`` misses."""
    cls = type(scheme)
    if getattr(cls, "__getattr__", nn.Module.__getattr__) is not nn.Module.__getattr__:
        return None
    if cls.__getattribute__ is not object.__getattribute__:
        return None
    owners: dict[str, type | None] = {}
    for c in cls.__mro__:
        if c is object:  # immutable, and defines no hook
            continue
        for name in _HOOK_SET & vars(c).keys():  # a set against a dict's keys: in C
            owners.setdefault(name, c)
    own = getattr(scheme, "__dict__", {})
    for name in _HOOK_SET & own.keys():
        owners.setdefault(name, None)
    modules = own.get("_modules")
    if modules:
        for name in _HOOK_SET & modules.keys():
            owners.setdefault(name, None)
    return owners


def hooks_of(scheme: Any) -> Hooks:
    """Collect the hooks that ``scheme`` defines (``getattr`` that is not None).

    An optional extra (see :data:`DERIVED_HOOKS`) is kept only when the hook it stands for
    is defined in the same class or above: a subclass that overrides ``score_bias`` (say a
    steeper ALiBi) is not silently computed with its parent's ``offset_bias``.
    """
    if scheme is None:
        return Hooks()
    owners = _hook_owners(scheme)
    names = _HOOK_NAMES if owners is None else tuple(owners)
    hooks = {}
    for name in names:
        fn = getattr(scheme, name, None)
        if callable(fn):
            hooks[name] = fn
    # whose each hook is, as :func:`_defined_by` says after the lookups (a lookup may write
    # into the instance: a ``functools.cached_property``)
    own = getattr(scheme, "__dict__", {})
    mro = type(scheme).__mro__
    for extra, base in DERIVED_HOOKS.items():
        if extra in hooks and base in hooks:
            if owners is None:
                extra_cls, base_cls = _defined_by(scheme, extra), _defined_by(scheme, base)
            else:  # (no closure over the instance's dict: Dynamo would guard its every key)
                extra_cls = _owner(owners[extra], extra, own)
                base_cls = _owner(owners[base], base, own)
            if extra_cls is None:  # set on the instance with its hook: trust the pair
                continue
            # the hook set on the instance, or found before the extra's class in the method
            # resolution order (a subclass of it, or a mixin listed before it)
            if base_cls is None or mro.index(base_cls) < mro.index(extra_cls):
                del hooks[extra]
    return _new_hooks(Hooks, hooks)


def hooks_signature(scheme: Any) -> tuple[Any, ...] | None:
    """What :func:`hooks_of` reads of ``scheme``, as a hashable key: its class, and for each
    hook name the class of the MRO whose dict holds it and what that dict holds. Two calls
    with equal keys collect the same hooks. A hook held as a ``property`` (a hook present
    only for some instances, as Shaw's value hooks) is keyed by its getter's answer for
    this instance (:func:`_answered`: the function of the bound method it gives, or
    absent where it raises ``AttributeError``). None where no such key says it: a class
    with its own attribute lookup; a hook name whose class entry is neither a plain
    function nor such a property (a staticmethod or another descriptor, which may answer
    otherwise for another instance or call; a property that answers anything else; a
    class attribute set to None); a hook set on the instance or named by a submodule. No
    descriptor but a property's getter is run."""
    cls = type(scheme)  # (as _hook_owners, in one pass that keeps each owner's entry)
    if (
        getattr(cls, "__getattr__", _MODULE_GETATTR) is not _MODULE_GETATTR
        or cls.__getattribute__ is not object.__getattribute__
    ):
        return None
    own = getattr(scheme, "__dict__", _NO_HOOKS_HERE)
    if not _HOOK_SET.isdisjoint(own) or not _HOOK_SET.isdisjoint(
        own.get("_modules") or _NO_HOOKS_HERE
    ):
        return None  # set on the instance: hooks_of reads it there
    owners: dict[str, type] = {}
    entries = []
    for c in cls.__mro__:
        if c is object:  # immutable, and defines no hook
            continue
        held = c.__dict__
        for name in _HOOK_SET & held.keys():  # a set against a dict's keys: in C
            if name not in owners:
                owners[name] = c
                entries.append(held[name])
    if entries and set(map(type, entries)) != _FUNCTIONS:
        answered = _answered(scheme, entries)
        if answered is None:
            return None
        entries = answered
    return (cls, tuple(owners.items()), tuple(entries))


def _answered(scheme: Any, entries: list[Any]) -> list[Any] | None:
    """``entries`` (the class entries of a scheme's hooks) with each ``property`` replaced
    by its getter's answer for ``scheme``, as :func:`hooks_of`'s ``getattr`` gets it: the
    pair of the property and the plain function of the bound method of ``scheme`` it
    gives (a function the class holds: :func:`_on_class`), or of the property and None
    where it raises ``AttributeError`` (no hook); None for another descriptor, or another
    answer (a closure, a callable object, another instance's method, a function made for
    this instance: nothing says the next call's is the same)."""
    answered = []
    for entry in entries:
        kind = type(entry)
        if kind is _FUNCTION:
            answered.append(entry)
            continue
        if kind is not property:
            return None
        try:
            answer = entry.__get__(scheme, type(scheme))
        except AttributeError:
            answered.append((entry, None))
            continue
        except Exception:  # hooks_of's getattr raises it: no key
            return None
        if not (
            type(answer) is _METHOD
            and answer.__self__ is scheme
            and _on_class(type(scheme), answer.__func__)
        ):
            return None
        answered.append((entry, answer.__func__))
    return answered


def signature_defines(signature: tuple[Any, ...], names: frozenset[str]) -> bool:
    """Whether a :func:`hooks_signature` (not None) says the scheme defines one of ``names``
    (a property that answered ``AttributeError`` defines none)."""
    _, owners, entries = signature
    return any(
        name in names and not (type(entry) is tuple and entry[1] is None)
        for (name, _), entry in zip(owners, entries, strict=True)
    )


def _on_class(cls: type, fn: Any) -> bool:
    """Whether ``fn`` is a plain function that ``cls`` holds under its name (found in its
    MRO's dicts, as a method is): a function made for one instance (a closure over it) is
    not, and a key holding it would keep the instance alive in its routes."""
    if type(fn) is not _FUNCTION:
        return False
    name = fn.__name__
    for c in cls.__mro__:
        held = c.__dict__
        if name in held:
            return held[name] is fn
    return False


#: an empty mapping, for a scheme without an instance dict or submodules
_NO_HOOKS_HERE: dict[str, Any] = {}


#: the type of a plain function, and of a bound method
_FUNCTION, _METHOD = types.FunctionType, types.MethodType
#: the type of a plain function, alone
_FUNCTIONS = {_FUNCTION}


def bias_fits(bias: Tensor, b: int, h: int, q_pos: Tensor, k_pos: Tensor) -> bool:
    """Whether ``bias`` has a shape :func:`checked_hooks` lets a ``score_bias`` return for
    an attention of ``b`` sequences and ``h`` heads at these positions: ``[B', h or 1,
    n_q, n_k]``."""
    shape = bias.shape  # as _fits against _EXPECTED["score_bias"], without building the tuple
    return (
        len(shape) == 4
        and shape[0] in (1, q_pos.shape[0], b)
        and shape[1] in (1, h)
        and shape[2] == q_pos.shape[-1]
        and shape[3] == k_pos.shape[-1]
    )


def _new_hooks(cls: type[Hooks], found: dict[str, Any]) -> Hooks:
    """``cls(**found)`` without the dataclass's ``__init__`` (once per attention call: the
    hooks are written into the instance's dict at once)."""
    hooks = object.__new__(cls)
    fields = hooks.__dict__
    fields.update(_NO_HOOKS)
    fields.update(found)
    return hooks


def _batch(pos: Tensor, b: int) -> tuple[int, int, int]:
    return (1, pos.shape[0], b)


#: for each hook whose result :func:`checked_hooks` checks, the shape it expects from the
#: heads allowed, the batch, the value head dim and the hook's arguments: per dimension an
#: int, a tuple of allowed ints, or None (any)
_EXPECTED: dict[str, Callable[..., tuple[Any, ...]]] = {
    "score_bias": lambda heads, b, d_v, qp, kp: (_batch(qp, b), heads, qp.shape[-1], kp.shape[-1]),
    "kept_score_bias": lambda heads, b, d_v, qp, kp: (
        _batch(qp, b),
        heads,
        qp.shape[-1],
        kp.shape[-1],
    ),
    "score_term": lambda heads, b, d_v, q, qp, kp: (
        (1, q.shape[0]),
        heads,
        q.shape[2],
        kp.shape[-1],
    ),
    "reference_score_term": lambda heads, b, d_v, q, qp, kp: (
        (1, q.shape[0]),
        heads,
        q.shape[2],
        kp.shape[-1],
    ),
    "value_term": lambda heads, b, d_v, w, qp, kp: ((1, w.shape[0]), heads, w.shape[2], d_v),
    "reference_value_term": lambda heads, b, d_v, w, qp, kp: (
        (1, w.shape[0]),
        heads,
        w.shape[2],
        d_v,
    ),
    "contextual_term": lambda heads, b, d_v, z, q, qp, kp: (
        (1, q.shape[0]),
        heads,
        q.shape[2],
        z.shape[-1],
    ),
    "offset_bias": lambda heads, b, d_v, qp, kp: (heads, qp.shape[-1] + kp.shape[-1] - 1),
}


def _said(a: Any) -> str:
    """An expected dimension as a message says it."""
    if a is None:
        return "any"
    return " or ".join(map(str, sorted(set(a)))) if isinstance(a, tuple) else str(a)


def _fits(shape: torch.Size, allowed: tuple[Any, ...]) -> bool:
    """Whether ``shape`` has the dimensions ``allowed`` (see :data:`_EXPECTED`)."""
    if len(shape) != len(allowed):
        return False
    for size, a in zip(shape, allowed, strict=True):
        if a is None:
            continue
        if size not in a if type(a) is tuple else size != a:
            return False
    return True


def _shape_check(scheme: Any, name: str, fn: Callable[..., Any], b: int, h: int, d_v: int):
    """``fn`` with its result's shape checked against :data:`_EXPECTED` ``[name]`` for an
    attention of ``b`` sequences, ``h`` heads and value head dim ``d_v``. ``None`` results
    (an extra declining) pass."""
    expect = _EXPECTED[name]
    heads = (1, h)

    def checked(*args: Any) -> Any:
        out = fn(*args)
        if out is None or not isinstance(out, Tensor):
            return out
        allowed = expect(heads, b, d_v, *args)
        if not _fits(out.shape, allowed):
            raise ValueError(
                f"position={type(scheme).__name__}: its {name} hook returned shape "
                f"{tuple(out.shape)}, expected [{', '.join(map(_said, allowed))}] for the "
                f"positions it was given (heads: 1, shared, or this attention's {h}); build "
                f"the scheme for heads={h}"
            )
        return out

    checked.__wrapped__ = fn  # type: ignore[attr-defined]
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
    own = vars(hooks)
    found = None
    for name in _EXPECTED:
        fn = own[name]
        if fn is not None:
            if found is None:
                found = dict(own)
            found[name] = _shape_check(scheme, name, fn, b, h, d_v)
    return hooks if found is None else _new_hooks(type(hooks), found)
