"""Constant tensors kept between calls: small tensors that are pure functions of ints.

A relative scheme recomputes, in every call, tensors that depend on integers alone (ALiBi's
slopes from the number of heads, T5's buckets from a run of offsets): a dozen small kernel
calls that cost more than the attention itself at a few dozen tokens. :func:`memo` keeps
them per argument tuple and device. Never a tensor that depends on a parameter's value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec

import torch
from torch import Tensor
from torch.autograd import forward_ad

P = ParamSpec("P")


def _plain() -> bool:
    """Whether tensors built now are plain eager tensors: not traced by ``torch.compile``,
    not fake nor meta under a dispatch mode, not redirected by a function mode (a default
    device), not wrapped by a ``torch.func`` transform (grad, vmap, functionalize)."""
    return not (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
    )


def plain_autograd() -> bool:
    """Whether autograd records as in eager code: not inside ``torch.compile`` or
    ``torch.jit.trace``, no ``torch.func`` transform, no forward-mode AD level (where
    posenc's own autograd Functions, with neither a vmap rule nor a forward derivative,
    may stand in for plain ops)."""
    return not (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch._C._are_functorch_transforms_active()
        or forward_ad._current_level >= 0
    )


def eager() -> bool:
    """:func:`_plain` and :func:`plain_autograd` both: plain eager tensors, and autograd
    recording as in eager code (their checks, each once)."""
    return not (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
        or torch.jit.is_tracing()
        or forward_ad._current_level >= 0
    )


def memo(maxsize: int) -> Callable[[Callable[P, Tensor]], Callable[P, Tensor]]:
    """Keep the results of a function of hashable arguments (ints, bools, a
    ``torch.device``) that returns a constant tensor, the ``maxsize`` most recently used.

    The kept tensor is built outside inference mode and autograd (usable in any later
    call) and is shared: the functions of posenc that use it read it, and hand it to a
    caller only as a kept tensor by name (``kept_score_bias``; others return a copy), but
    an autograd node may save it for its backward, where ``grad_fn``'s saved tensors reach
    it: writing into it there changes every later call. Under ``torch.compile``, a dispatch mode,
    a function mode or a ``torch.func`` transform the function runs as it is, and nothing
    is kept.
    """

    def wrap(fn: Callable[P, Tensor]) -> Callable[P, Tensor]:
        @functools.lru_cache(maxsize=maxsize)
        def kept(*args: P.args, **kwargs: P.kwargs) -> Tensor:
            with torch.inference_mode(False), torch.no_grad():
                return fn(*args, **kwargs)

        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> Tensor:
            if _plain():
                return kept(*args, **kwargs)
            return fn(*args, **kwargs)

        call.cache_clear = kept.cache_clear  # type: ignore[attr-defined]
        call.cache_info = kept.cache_info  # type: ignore[attr-defined]
        return call

    return wrap
