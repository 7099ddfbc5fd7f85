"""The wrapper that makes a fast path differentiable twice: a first-order backward is the
path's own, one with ``create_graph=True`` differentiates the math reference instead
(:class:`_TwiceDifferentiable`, which :func:`.dispatch._attend` puts around a path whose
own graph has no second derivative).

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..hooks import Hooks
from .learned import substituted
from .mask import Mask
from .reference import _math


def _reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *stand_ins: Tensor,
    hooks: Hooks,
    originals: list[Tensor],
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    scale: float,
) -> Tensor:
    """The math reference without dropout, its hooks reading ``stand_ins`` in place of
    ``originals``: ``[b, h, n_q, d]``."""
    if originals:
        hooks = substituted(hooks, originals, list(stand_ins))
    return _math(q, k, v, hooks, q_pos, k_pos, mask, scale, 0.0)[0]


class _TwiceDifferentiable(torch.autograd.Function):
    """A fast path whose gradient is itself differentiable.

    The forward runs ``fast`` on leaves standing in for its first ``slots`` tensors
    (``q, k, v``, then the tensors with a history that the hooks read) and keeps its graph.
    A first-order backward is that graph's (the fast path's own backward); one that does
    not keep the graph lets it go (see :func:`_keeps_graph`). A backward with
    ``create_graph=True`` (gradient penalties, Hessian-vector products, MAML) recomputes the
    output with the math reference on the saved inputs and differentiates it with a graph,
    so that the second derivative is the definition's: exact, with the reference's
    ``[b, h, n_q, n_k]`` memory. The tensors after the slots are leaves the hooks read (the
    scheme's parameters), differentiated as they are; either backward runs with the
    scheme holding the trainable parameters it held in the forward (:func:`_as_in_forward`).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        fast: Callable[..., Tensor],
        reference: Callable[..., Tensor],
        dropout_p: float,
        slots: int,
        scheme: Any,
        *tensors: Tensor,
    ) -> Tensor:
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(x.requires_grad) for x in tensors[:slots]]
            out = fast(*leaves)
        ctx.graph = (out, leaves, tensors[slots:])
        ctx.reference, ctx.dropout_p = reference, dropout_p
        ctx.scheme, ctx.owned = scheme, _trainable(scheme)
        ctx.save_for_backward(*tensors[:slots])
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if not hasattr(ctx, "graph"):  # dropped by a backward that did not keep the graph
            raise RuntimeError(
                "Trying to backward through the graph a second time (posenc's attention "
                "let its fast path's graph go after the first backward). Specify "
                "retain_graph=True if you need to backward through the graph a second time."
            )
        out, leaves, params = ctx.graph
        if not out.requires_grad:  # nothing the output depends on asks for a gradient
            return (None,) * (5 + len(leaves) + len(params))
        if torch.is_grad_enabled():  # create_graph=True: the gradient needs a graph
            if ctx.dropout_p > 0:
                raise RuntimeError(
                    "a gradient with create_graph=True through attention dropout needs the "
                    "same dropout mask twice; use backend='math' (its dropout is part of the "
                    "graph) or set dropout=0"
                )
            with _as_in_forward(ctx.scheme, ctx.owned):
                grads = _reference_gradients(ctx.reference, ctx.saved_tensors, params, grad_out)
            return None, None, None, None, None, *grads
        inputs = [*leaves, *params]
        wrt = [x for x in inputs if x.requires_grad]
        scheme, owned = ctx.scheme, ctx.owned
        if not _keeps_graph():  # the last backward through this node: let its graph go
            del ctx.graph  # when this backward returns (freeing it now could free history
            # that the graph shares with the rest of the model: a parametrised table)
        with _as_in_forward(scheme, owned):  # a path's backward may run the hooks again
            grads = iter(
                torch.autograd.grad(out, wrt, grad_out, retain_graph=True, allow_unused=True)
            )
        none = (None,) * 5
        return *none, *(next(grads) if x.requires_grad else None for x in inputs)


def _trainable(scheme: Any) -> list[tuple[str, Tensor]]:
    """The scheme's parameters that require grad, by name (none for a scheme that is not an
    ``nn.Module``)."""
    if not isinstance(scheme, nn.Module):
        return []
    return [(name, p) for name, p in scheme.named_parameters() if p.requires_grad]


@contextmanager
def _as_in_forward(scheme: Any, owned: list[tuple[str, Tensor]]) -> Iterator[None]:
    """Inside the block, the scheme holds the trainable tensors it held in the forward,
    ``owned``, where it holds others now: ``torch.func.functional_call`` swaps tensors in
    for the forward and puts the module's own back before the backward, which may run the
    hooks again (the lean engine's paths do). Nothing changes where the names differ (a
    parameter frozen or added in between)."""
    now = _trainable(scheme)
    if [name for name, _ in now] != [name for name, _ in owned]:
        return (yield)
    swaps = [(name, then) for (name, p), (_, then) in zip(now, owned, strict=True) if p is not then]
    restore = []
    for name, then in swaps:
        module_name, _, leaf = name.rpartition(".")
        module = scheme.get_submodule(module_name)
        restore.append((module, leaf, module._parameters[leaf]))
        module._parameters[leaf] = then  # as functional_call swaps it: the dict's entry
    try:
        yield
    finally:
        for module, leaf, tensor in reversed(restore):
            module._parameters[leaf] = tensor


def _keeps_graph() -> bool:
    """Whether the backward running now keeps the graph (``retain_graph=True``): then this
    node may run again and holds its fast path's graph; else it drops it as it runs, so
    that ``q, k, v`` are not held through the rest of the backward (a rotation's, for one).
    True where torch does not say."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else bool(keep_graph())


def _reference_gradients(
    reference: Callable[..., Tensor],
    saved: tuple[Tensor, ...],
    params: tuple[Tensor, ...],
    grad_out: Tensor,
) -> list[Tensor | None]:
    """The gradients of ``saved`` (``q, k, v`` and the tensors with a history that the hooks
    read) and ``params`` through the math reference, with a graph.

    Each saved tensor enters the reference as a view of its own, so that its gradient is
    the partial of that argument alone (``attention(x, x, x)`` passes one tensor three
    times, and autograd adds the three), with the history to differentiate again. A
    parameter's gradient keeps only its direct part: the part that flows through the
    history of a saved tensor (a rotation's learned frequencies, a cached parametrisation's
    table) is autograd's to add when it carries their gradients back, so it is taken out
    here rather than counted twice.
    """
    slots = [x.view_as(x) for x in saved]  # one tensor per argument, same history
    ref = reference(*slots)
    inputs = [*slots, *params]
    wrt = [x for x in inputs if x.requires_grad]
    found = torch.autograd.grad(ref, wrt, grad_out, create_graph=True, allow_unused=True)
    grads: dict[int, Tensor | None] = dict(zip(map(id, wrt), found, strict=True))
    carried = [(x, grads[id(x)]) for x in slots if x.requires_grad and grads[id(x)] is not None]
    wanted = [p for p in params if p.requires_grad]
    if carried and wanted:
        through = torch.autograd.grad(
            [x for x, _ in carried], wanted, [g for _, g in carried],
            create_graph=True, allow_unused=True,
        )  # fmt: skip
        for p, part in zip(wanted, through, strict=True):
            if part is not None:
                total = grads[id(p)]
                grads[id(p)] = -part if total is None else total - part
    return [grads.get(id(x)) if x.requires_grad else None for x in inputs]
