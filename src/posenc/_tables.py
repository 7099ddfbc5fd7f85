"""Tables that a compiled attention computes once, not once per element that reads them.

The rotary schemes and the sinusoidal encodings multiply ``[b, h, n, d]`` tensors by
small tables broadcast over them: the cos and sin of ``[..., n, d/2]`` angles (times
xPos's scale). Eager, each table entry is computed once. Inductor (torch 2.13) instead
inlines such a table into every kernel that reads it, so a compiled rotation would
compute the angle, a float64 cos and sin (and a power, for xPos) for each of the
``b * h * n * d`` elements it rotates (docs/performance.md has the cost).
:func:`realized` hands the tables, while compiling, to one opaque operator (a
``torch.library`` custom op: a copy, with a fake kernel, an autograd formula and a vmap
rule), so that Inductor writes them to memory once and the kernels read them there;
eager, and under ``torch.export`` (whose programs must run where posenc is not imported:
AOTInductor, ExecuTorch), the tables pass unchanged.

Shape legend: ``S`` any shape of a table.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

#: the operator's namespace: the package's name (``posenc``), or that of a copy or a
#: vendored copy, so that two copies in one process do not define the same operator
_NAMESPACE = __name__.rpartition(".")[0].replace(".", "_")


def _copy(table: Tensor) -> Tensor:
    return table.clone()


def _copy_fake(table: Tensor) -> Tensor:
    return torch.empty_like(table)


def _setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
    pass


def _backward(ctx: Any, grad: Tensor) -> Tensor:
    return grad  # the identity's


def _vmap(info: Any, in_dims: tuple[int | None], table: Tensor) -> tuple[Tensor, int | None]:
    return _copy_op(table), in_dims[0]  # elementwise: batched along the same dim


def _define() -> Any:
    """The operator ``<namespace>::realized``: defined here, or the one an earlier import
    of this module defined (a reload)."""
    existing = getattr(getattr(torch.ops, _NAMESPACE), "realized", None)
    if existing is not None:
        return existing
    op = torch.library.custom_op(f"{_NAMESPACE}::realized", mutates_args=())(_copy)
    op.register_fake(_copy_fake)
    op.register_autograd(_backward, setup_context=_setup_context)
    op.register_vmap(_vmap)
    return op


_copy_op = _define()


def realized(*tables: Tensor) -> tuple[Tensor, ...]:
    """``tables`` themselves; while compiling (not exporting), copies made by one opaque
    operator, which Inductor runs once on the tables rather than inlining them into each
    kernel that reads them.

    Args:
        tables: ``[*S]`` tensors of one shape, dtype and device (cos and sin).

    Returns:
        The tables, in their order (while compiling, equal copies).
    """
    if not torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return tables  # an exported program keeps to ATen's ops: it runs without posenc
    if len(tables) == 1:
        return (_copy_op(tables[0]),)
    return tuple(_copy_op(torch.stack(tables)).unbind(0))  # one call: [len, *S]
