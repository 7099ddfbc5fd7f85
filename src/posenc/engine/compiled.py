"""The lean engine inside ``torch.compile``: one opaque operator per call.

Dynamo cannot trace the lean paths: they read the positions, the masks and the bias on the
host and choose their blocks by those values. Traced as it is, a call compiles to what the
math or SDPA path computes, the ``[b, h, n_q, n_k]`` bias or term written out, as the
code without posenc does. Where the scores are more than the materialised path writes out
(:func:`~.plans.materialised_size`), :func:`lean_plan` runs the call instead through the
operator ``<namespace>::lean_attention`` (a ``torch.library`` custom op): its kernel is the
eager dispatcher, which takes the lean paths as an eager call does, and Inductor calls it
as one opaque kernel. Its backward, the operator ``<namespace>::lean_attention_backward``,
runs the call again with autograd and returns the gradients of ``q``, ``k``, ``v`` and of
the scheme's parameters (a recomputation: an operator keeps nothing from its forward but
its inputs); an operator's kernel runs below autograd, so it does so in a thread of its
own, where autograd records as in eager code.

The operator takes the scheme by a handle (:func:`_handle`, evaluated once when Dynamo
traces the call, which then guards on the scheme's identity: one graph per scheme object),
and only a scheme whose hooks read its parameters and buffers alone
(:func:`~.learned._reads_own_only`). Those the graph passes to the operator, which swaps
them into the scheme for its kernels (:class:`_Bound`): the scheme's own tensors, or those
a caller swapped in while tracing (``torch.func.functional_call``), whose gradients the
backward returns. Not under ``torch.export``
(whose programs must run where posenc is not imported), not for attention dropout, masks
other than a causal one, a contextual term, a key shift folded into the keys, devices
other than the CPU or dtypes other than float32 and float64: those compile as before.

A call with gradients takes the operator only above the memory budget
(:data:`~.tuning.MATERIALISED_SCORES` scores; not for the pairs per head alone): its
backward computes the forward a second time. A constant bias (no parameter that requires
grad: ALiBi, a frozen table) with gradients compiles as before at any size: SDPA's fused
route with the bias as its float mask keeps no ``[b, h, n_q, n_k]`` weights, and its
backward needs no second forward.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim,
``d_v`` value head dim; positions ``[B', n]`` with ``B'`` 1 or ``b``.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .._tables import _NAMESPACE
from . import tuning
from .learned import _reads_own_only
from .mask import Mask

# kept across a reload of this module (whose operators are defined once per process: see
# :func:`_define`): the schemes by handle, and the dispatcher the operators run
_handles: weakref.WeakKeyDictionary[Any, int] = globals().get(
    "_handles", weakref.WeakKeyDictionary()
)
_schemes: dict[int, weakref.ref[Any]] = globals().get("_schemes", {})
_counter: itertools.count[int] = globals().get("_counter", itertools.count())
#: the eager dispatcher, :func:`.dispatch.attend`, which hands itself to this module when
#: it is imported (:func:`use_dispatcher`: the dispatcher imports this module)
_dispatcher: list[Callable[..., tuple[Tensor, Tensor | None]]] = globals().get("_dispatcher", [])


def use_dispatcher(attend: Callable[..., tuple[Tensor, Tensor | None]]) -> None:
    """Make ``attend`` the dispatcher the operators run."""
    _dispatcher[:] = [attend]


@torch.compiler.assume_constant_result
def _handle(scheme: Any) -> int:
    """The scheme's handle for the operator, or -1 where the operator may not take it (its
    hooks may read a tensor that is not its own parameter or buffer). Run once, on the
    scheme itself, when Dynamo traces the call; the compiled graph holds the integer (and
    Dynamo guards on the scheme's identity)."""
    if scheme is None or not _reads_own_only(scheme):
        return -1
    handle = _handles.get(scheme)
    if handle is None:
        handle = _handles[scheme] = next(_counter)
        _schemes[handle] = weakref.ref(scheme, lambda _, h=handle: _schemes.pop(h, None))
    return handle


def _scheme(handle: int) -> Any:
    """The scheme of ``handle``.

    Raises:
        RuntimeError: the scheme is gone (a compiled graph outlived it).
    """
    ref = _schemes.get(handle)
    scheme = None if ref is None else ref()
    if scheme is None:
        raise RuntimeError(
            f"posenc's compiled attention holds the handle {handle} of a scheme that no longer "
            "exists; call torch.compiler.reset() after replacing a compiled model's scheme"
        )
    return scheme


class _Bound(nn.Module):
    """The scheme as a submodule, so that :func:`torch.func.functional_call` runs the
    dispatcher with the tensors the graph passed in place of the scheme's own (they are
    the same tensors unless the caller swapped them in: ``functional_call``, FSDP), the
    backward included: the lean engine's backward may run the hooks again."""

    def __init__(self, scheme: nn.Module) -> None:
        super().__init__()
        self.scheme = scheme

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, causal: bool,
        scale: float, grad: Tensor | None, wrt: list[Tensor],
    ) -> Tensor | tuple[Tensor | None, ...]:  # fmt: skip
        """The output ``[b, h, n_q, d_v]``; with ``grad``, the gradients of ``wrt`` instead."""
        mask = Mask(q.shape[2], k.shape[2], causal=causal)
        attend = _dispatcher[0]
        out = attend(q, k, v, scheme=self.scheme, q_pos=q_pos, k_pos=k_pos, mask=mask, scale=scale)[
            0
        ]
        if grad is None:
            return out
        return torch.autograd.grad(out, wrt, grad, allow_unused=True)


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    tensors: list[Tensor],
    names: str,
    handle: int,
    causal: bool,
    scale: float,
    grad: Tensor | None = None,
    wrt: list[Tensor] | None = None,
) -> Any:
    """The eager dispatcher on the call, the scheme reading ``tensors`` (its parameters and
    buffers ``names``, one a line): ``[b, h, n_q, d_v]``, or with ``grad`` the gradients of
    ``wrt`` (None for one the output does not reach)."""
    bound = _Bound(_scheme(handle))
    swapped = dict(zip(_names(names, len(tensors)), tensors, strict=True))
    args = (q, k, v, q_pos, k_pos, causal, scale, grad, wrt or [])
    return torch.func.functional_call(bound, swapped, args)


def _names(names: str, count: int) -> list[str]:
    """The names of ``names`` (one a line) as the bound scheme's: ``scheme.<name>``.

    Raises:
        RuntimeError: not ``count`` of them.
    """
    found = [f"scheme.{name}" for name in names.split("\n")] if names else []
    if len(found) != count:
        raise RuntimeError(f"{count} tensors for {len(found)} names: {names!r}")
    return found


def _lean_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, learned: list[Tensor],
    fixed: list[Tensor], names: str, handle: int, causal: bool, scale: float,
) -> Tensor:  # fmt: skip
    with torch.no_grad():
        out = _attend(q, k, v, q_pos, k_pos, [*learned, *fixed], names, handle, causal, scale)
    return out.contiguous()


def _lean_attention_fake(q: Tensor, k: Tensor, v: Tensor, *rest: Any) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))  # [b, h, n_q, d_v]


def _lean_attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor,
    learned: list[Tensor], fixed: list[Tensor], names: str, handle: int, causal: bool,
    scale: float,
) -> list[Tensor]:  # fmt: skip
    threads = torch.get_num_threads()
    result: list[Any] = []

    def recompute() -> None:
        try:
            torch.set_num_threads(threads)  # a thread's own setting, as the caller's
            with torch.enable_grad():
                leaves = [x.detach().requires_grad_() for x in (q, k, v, *learned)]
                tensors = [*leaves[3:], *fixed]
                result.extend(
                    _attend(
                        *leaves[:3], q_pos, k_pos, tensors, names, handle, causal, scale,
                        grad, leaves,
                    )
                )  # fmt: skip
        except BaseException as error:  # raised again by the caller's thread
            result[:] = [error]

    worker = threading.Thread(target=recompute, name="posenc-compiled-backward")
    worker.start()
    worker.join()
    if len(result) == 1 and isinstance(result[0], BaseException):
        raise result[0]
    wrt = [q, k, v, *learned]
    return [
        torch.zeros(x.shape, dtype=x.dtype, device=x.device) if g is None else g.contiguous()
        for g, x in zip(result, wrt, strict=True)
    ]


def _lean_attention_backward_fake(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor,
    learned: list[Tensor], *rest: Any,
) -> list[Tensor]:  # fmt: skip
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, *learned)]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    q, k, v, q_pos, k_pos, learned, fixed, names, handle, causal, scale = inputs
    ctx.save_for_backward(q, k, v, q_pos, k_pos, *learned, *fixed)
    ctx.call = (len(learned), names, handle, causal, scale)


def _backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    q, k, v, q_pos, k_pos, *tensors = ctx.saved_tensors
    count, names, handle, causal, scale = ctx.call
    learned, fixed = tensors[:count], tensors[count:]
    grads = _backward_op(grad, q, k, v, q_pos, k_pos, learned, fixed, names, handle, causal, scale)
    fixed_grads = [None] * len(fixed)  # the buffers and frozen parameters: none
    return (*grads[:3], None, None, list(grads[3:]), fixed_grads, None, None, None, None)


def _define() -> tuple[Any, Any]:
    """The two operators: defined here, or those an earlier import of this module defined
    (a reload)."""
    ops = getattr(torch.ops, _NAMESPACE)
    forward = getattr(ops, "lean_attention", None)
    backward = getattr(ops, "lean_attention_backward", None)
    if forward is not None and backward is not None:
        return forward, backward
    name = f"{_NAMESPACE}::lean_attention"
    backward = torch.library.custom_op(f"{name}_backward", mutates_args=())(
        _lean_attention_backward
    )
    backward.register_fake(_lean_attention_backward_fake)
    forward = torch.library.custom_op(name, mutates_args=())(_lean_attention)
    forward.register_fake(_lean_attention_fake)
    forward.register_autograd(_backward, setup_context=_setup_context)
    return forward, backward


_forward_op, _backward_op = _define()


def lean_plan(call: Any, too_large: str | None) -> Callable[[], Tensor] | None:
    """While compiling, the operator for a call the lean engine runs better than the
    compiled math: ``too_large`` the reason the materialised path gives by the call's size
    (None: it would write the call out, and so does the compiled graph), and nothing the
    operator does not take (see the module docstring). None otherwise."""
    if too_large is None or not torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return None
    q, k, v, hooks = call.q, call.k, call.v, call.hooks
    if hooks.contextual_term is not None or call.dropout_p > 0 or call.read_by is not None:
        return None
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
        return None
    if not (k.dtype == v.dtype == q.dtype) or not call.mask.causal_at_most:
        return None
    scheme = call.scheme
    if not isinstance(scheme, nn.Module):
        return None
    learned = [(n, p) for n, p in scheme.named_parameters() if p.requires_grad]
    fixed = [(n, p) for n, p in scheme.named_parameters() if not p.requires_grad]
    fixed += list(scheme.named_buffers())
    grad = torch.is_grad_enabled() and any(
        x.requires_grad for x in (q, k, v, *(p for _, p in learned))
    )
    if grad and not learned and hooks.score_term is None and hooks.value_term is None:
        # a constant bias with gradients: SDPA's fused route with the bias as its mask
        # keeps no weights, where the operator would compute the forward twice
        return None
    if grad and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= tuning.MATERIALISED_SCORES:
        # with gradients the operator computes the forward twice: it pays from the memory
        # budget on, not from the pairs per head
        return None
    handle = _handle(scheme)  # last: Dynamo guards the graph on the scheme's identity
    if handle < 0:
        return None
    names = "\n".join(n for n, _ in learned + fixed)
    tensors = [p for _, p in learned], [t for _, t in fixed]
    return lambda: _forward_op(
        q, k, v, call.q_pos, call.k_pos, *tensors, names, handle, call.mask.causal, call.scale
    )
