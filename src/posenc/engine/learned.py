"""Which tensors that ask for a gradient a scheme's hooks read.

The fast paths take the gradients of a scheme's tables through autograd Functions that
recompute the hooks block by block in their backward, or through the wrapper that makes a
fast path differentiable twice: each returns gradients for the tensors it is handed, and
only for those. They are handed the scheme's parameters and, where the scheme may read
others (a user's scheme that is not an ``nn.Module``, a method overridden to read a learned
tensor held elsewhere, a hypernetwork's output kept as an attribute), the tensors
requiring grad that a probe of its hooks reads. Without them such a tensor would get no
gradient from the fast paths, silently.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim;
positions ``[B', n]``.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ..hooks import Hooks, _defined_by
from . import common

#: posenc's package, as it is imported (``posenc``, or where a copy of it lives: a vendored
#: ``project._vendor.posenc``, a second version loaded beside it)
PACKAGE = __name__.rpartition(".engine.")[0]


def own_module(name: str) -> bool:
    """Whether the module ``name`` is posenc's own (of :data:`PACKAGE`)."""
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def own_hook(scheme: Any, name: str) -> bool:
    """Whether the scheme's hook ``name`` is posenc's own: defined on a class of one of
    posenc's modules (not set on the instance, not a user's class)."""
    owner = _defined_by(scheme, name)  # None: set on the instance
    return owner is not None and own_module(owner.__module__)


def scheme_parameters(scheme: Any) -> list[Tensor]:
    """The parameters of ``scheme`` (an ``nn.Module``) that require grad; none otherwise."""
    if isinstance(scheme, nn.Module):
        return [p for p in scheme.parameters() if p.requires_grad]
    return []


def learned_inputs(
    scheme: Any,
    hooks: Hooks,
    q: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    params: list[Tensor] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """The tensors requiring grad that the hooks of ``scheme`` read, as ``(leaves,
    histories)``: its parameters and the other leaves, then the tensors with a history of
    their own (a network's output, a cached parametrisation), which a fast path must not
    differentiate through (it would count their history's share twice: once itself, once
    through the tensor's gradient) and so reads through leaves that stand in for them
    (:func:`substituted`).

    The others are found by a probe of the hooks (:func:`_probe`), only for a scheme that
    may read them (:func:`_reads_own_only` false), and only in grad mode outside
    ``torch.compile`` and ``torch.func`` transforms (where the probe's function mode would
    not run as eager code does).

    Args:
        scheme: the object whose hooks are ``hooks``.
        hooks: its hooks.
        q: ``[b, h, n_q, d]`` queries (rotated).
        q_pos: ``[B', n_q]`` query positions.
        k_pos: ``[B', n_k]`` key positions.
        params: :func:`scheme_parameters` of ``scheme`` when the caller has them.

    Returns:
        ``(leaves, histories)``, each tensor once: the parameters first, then the others in
        the order the probe met them.
    """
    params = scheme_parameters(scheme) if params is None else params
    if (
        not torch.is_grad_enabled()
        or _reads_own_only(scheme)
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or q.shape[2] == 0
        or k_pos.shape[-1] == 0
    ):
        return params, []
    known = {id(p) for p in params}
    others = [x for x in _probe(hooks, q, q_pos, k_pos) if id(x) not in known]
    return params + [x for x in others if x.grad_fn is None], [
        x for x in others if x.grad_fn is not None
    ]


def _reads_own_only(scheme: Any) -> bool:
    """Whether ``scheme`` can read no tensor requiring grad but its parameters: None, or an
    ``nn.Module`` none of whose submodules is parametrised (``torch.nn.utils.parametrize``:
    a cached parametrisation is a tensor with a history) or of a class that defines
    methods outside posenc and torch (:func:`_own_class`: a subclass that only sets up
    posenc's class in ``__init__`` counts as posenc's), and that has no function or tensor
    requiring grad set on the instance (a hook or method replaced there, a learned tensor
    kept as a plain attribute). Called once per call in grad mode: a few microseconds."""
    return own_learning(scheme) is not None


def own_learning(scheme: Any) -> tuple[bool, ...] | None:
    """Where :func:`_reads_own_only` holds, which of the scheme's parameters and buffers
    require grad, in the order of one walk over its modules (``()`` for no scheme); None
    where it does not hold: what a call with gradients reads to key its route
    (:func:`~.kept._grad_flags`: whether a bias or term asks for a gradient follows from
    them, and a thawed table's call must not replay the route kept while it was frozen,
    nor the reverse)."""
    if scheme is None:
        return ()
    if not isinstance(scheme, nn.Module):
        return None
    learning: list[bool] = []
    stack, seen = [scheme], {id(scheme)}
    while stack:
        module = stack.pop()
        modules = module._modules
        if not _own_class(type(module)) or "parametrizations" in modules:
            return None
        for p in module._parameters.values():
            if p is not None:
                learning.append(p.requires_grad)
        for buffer in module._buffers.values():  # (a buffer may ask for a gradient too)
            if buffer is not None:
                learning.append(buffer.requires_grad)
        state = module.__dict__
        for name in state.keys() - _MODULE_STATE:  # what was set on the instance
            value = state[name]
            if callable(value) or (isinstance(value, Tensor) and value.requires_grad):
                return None
        for m in modules.values():  # each once: a module shared, or a cycle of modules
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                stack.append(m)
    return tuple(learning)


#: the attributes every ``nn.Module`` instance has
_MODULE_STATE = frozenset(vars(nn.Module()))

#: what a class outside posenc and torch may define and still read only what posenc's
#: methods read: its constructor and the attributes Python gives every class
_SETUP_ONLY = frozenset(
    ("__init__", "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__",
     "__annotations__", "__firstlineno__", "__static_attributes__")
)  # fmt: skip


@functools.cache
def _own_class(cls: type) -> bool:
    """Whether every method of ``cls`` comes from posenc or torch: each class of its MRO is
    theirs, or defines no attribute that is a function or descriptor but its
    ``__init__``."""
    for c in cls.__mro__:
        if c is object or own_module(c.__module__) or c.__module__.partition(".")[0] == "torch":
            continue
        for name, attr in vars(c).items():
            if name not in _SETUP_ONLY and (callable(attr) or hasattr(attr, "__get__")):
                return False
    return True


class _Reads(TorchFunctionMode):
    """Records each tensor requiring grad that a torch function is given and that no
    function under the mode made (a tensor the code read from outside)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, Tensor] = {}  # kept alive, so that no id is reused meanwhile
        self.read: dict[int, Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for x in _tensors((args, kwargs)):
            if x.requires_grad and id(x) not in self.made:
                self.read.setdefault(id(x), x)
        out = func(*args, **kwargs)
        for y in _tensors(out):
            self.made[id(y)] = y
        return out


def _tensors(x: Any) -> list[Tensor]:
    """The tensors in ``x``: a tensor, or tuples, lists and dicts of them (one pass)."""
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def _probe(hooks: Hooks, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> list[Tensor]:
    """The tensors requiring grad that the hooks read, in the order met: every hook on
    every query (in blocks of rows, as the lean engine takes them: a hook may read a tensor
    for some rows only), the per-offset and grid forms on all positions (their tables are
    small). ``q`` enters detached: its own gradient is the paths' business.

    A hook that raises on a block is left to the call, which runs it and raises there. A
    tensor that the hooks make on their first call and keep (a cached parametrisation
    computed on first use) is read by every later call: when a tensor the probe made
    outlives it, the first block is probed once more, and finds it read.
    """
    q = q.detach()  # outside the probe's mode: slicing q there would read q itself
    b, h, n_q, _ = q.shape
    n_k = k_pos.shape[-1]
    rows = common.lean_block_rows(b, h, n_q, n_k)

    def calls(start: int) -> list[tuple[Any, tuple[Any, ...]]]:
        blk = slice(start, min(start + rows, n_q))
        q_blk, qp = q[:, :, blk], q_pos[:, blk]  # [b, h, rows, d], [B', rows]
        weights = q.new_zeros(b, h, q_blk.shape[2], n_k)  # [b, h, rows, n_k]
        return [
            (hooks.score_bias, (qp, k_pos)),
            (hooks.score_term, (q_blk, qp, k_pos)),
            (hooks.value_term, (weights, qp, k_pos)),
            (hooks.key_shift, (q_blk, qp, k_pos)),
        ]

    whole = [
        (hooks.offset_bias, (q_pos, k_pos)),
        (hooks.offset_term, (q_pos, k_pos)),
        (hooks.offset_value, (q_pos, k_pos)),
        (hooks.grid_bias, (q_pos, k_pos)),
        (hooks.grid_term, (q_pos, k_pos)),
    ]

    def once(blocks: range) -> tuple[list[Tensor], list[weakref.ref[Tensor]]]:
        reads, made = _Reads(), []
        groups = (*(functools.partial(calls, start) for start in blocks), lambda: whole)
        with reads, torch.enable_grad():
            for group in groups:
                for hook, args in group():
                    _call(hook, args)
                # what a block made is let go before the next (one block's memory at a
                # time); one still alive then is kept outside, and is read from then on
                made += [weakref.ref(x) for x in reads.made.values() if x.requires_grad]
                reads.made.clear()
        return list(reads.read.values()), made

    read, made = once(range(0, n_q, rows))
    if any(ref() is not None for ref in made):  # kept by something outside the hooks' calls
        known = {id(x) for x in read}
        read += [x for x in once(range(1))[0] if id(x) not in known]
    return read


def _call(hook: Any, args: tuple[Any, ...]) -> None:
    """``hook(*args)`` without its shape check (which the call runs), its result dropped;
    nothing if it raises (the call runs it on its own rows, and raises there)."""
    if hook is None:
        return
    try:
        getattr(hook, "__wrapped__", hook)(*args)
    except Exception:
        return


class _Substitute(TorchFunctionMode):
    """Gives each torch function, in place of a tensor of ``pairs``, its stand-in."""

    def __init__(self, pairs: dict[int, Tensor]) -> None:
        super().__init__()
        self.pairs = pairs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def swap(x: Any) -> Any:
            return self.pairs.get(id(x), x) if isinstance(x, Tensor) else x

        return func(*tree_map(swap, args), **tree_map(swap, kwargs or {}))


#: the hooks a substituted :class:`Hooks` keeps: FlexAttention's mods return functions
#: that read their tensors later, outside any mode, so they are dropped (the flex path
#: then declines the call)
_FLEX_HOOKS = ("flex_score_mod", "flex_term_mod")


def substituted(hooks: Hooks, originals: list[Tensor], stand_ins: list[Tensor]) -> Hooks:
    """``hooks`` reading ``stand_ins[i]`` wherever they read ``originals[i]``.

    Args:
        hooks: the scheme's hooks.
        originals: tensors the hooks read.
        stand_ins: one tensor of the same shape per original (a leaf, or a view).

    Returns:
        The hooks, each run under a function mode that swaps the tensors; FlexAttention's
        mods dropped.
    """
    pairs = {id(x): s for x, s in zip(originals, stand_ins, strict=True)}

    def wrap(hook: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with _Substitute(pairs):
                return hook(*args, **kwargs)

        return run

    fields = {
        name: None if name in _FLEX_HOOKS or hook is None else wrap(hook)
        for name, hook in vars(hooks).items()
    }
    return replace(hooks, **fields)
