"""``posenc._tables``: tables that a compiled attention computes once.

Eager, :func:`realized` hands its tables back untouched. While compiling it copies them
through one custom operator, which must be a copy (values equal, no alias), pass the
gradient through unchanged, batch under vmap, survive a reload of the module, and be in
the graph of every scheme that rotates or builds a sinusoidal table (captured by Dynamo
with a backend that runs the graph as it is: no Inductor compile here; tests/test_compile.py
compiles every scheme with Inductor against eager), but not in an exported program.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from posenc import MultiHeadAttention, Rotary, _tables, registry, sinusoidal
from posenc._tables import realized

HEADS, HEAD_DIM, N = 2, 8, 12
GRID = (3, 4)


def _op_targets() -> set:
    packet = getattr(torch.ops, _tables._NAMESPACE).realized
    return {packet, packet.default, _tables._copy_op}


def _graph_calls(fn, *args) -> list:
    """The ``call_function`` targets of the graphs Dynamo captures for ``fn(*args)``,
    with no graph break (fullgraph)."""
    targets: list = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()
    return targets


def test_eager_hands_the_tables_back_unchanged():
    cos, sin = torch.randn(4, 3), torch.randn(4, 3)
    got = realized(cos, sin)
    assert got[0] is cos and got[1] is sin
    (only,) = realized(cos)
    assert only is cos


def test_the_operator_is_a_copy_with_the_identity_gradient():
    table = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    copy = _tables._copy_op(table)
    assert copy.data_ptr() != table.data_ptr()
    torch.testing.assert_close(copy, table, rtol=0, atol=0)
    weights = torch.randn(5, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad((copy * weights).sum(), table)
    torch.testing.assert_close(grad, weights, rtol=0, atol=0)


def test_the_operator_batches_under_vmap():
    tables = torch.randn(4, 5, 3)
    got = torch.vmap(_tables._copy_op, in_dims=1)(tables)
    torch.testing.assert_close(got, tables.movedim(1, 0), rtol=0, atol=0)


def test_a_reload_keeps_the_operator():
    op = _tables._copy_op
    reloaded = importlib.reload(_tables)
    try:
        table = torch.randn(3)
        torch.testing.assert_close(reloaded._copy_op(table), table, rtol=0, atol=0)
    finally:
        _tables._copy_op = op


def test_compiled_tables_are_one_call_and_equal_the_eager_ones():
    angles = torch.randn(6, 4, dtype=torch.float64)

    def tables(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return realized(a.cos(), a.sin())

    calls = _graph_calls(tables, angles)
    assert sum(target in _op_targets() for target in calls) == 1, calls
    compiled = torch.compile(tables, fullgraph=True)
    for got, expected in zip(compiled(angles), tables(angles), strict=True):
        torch.testing.assert_close(got, expected)


ROTATING = [
    name
    for name in registry.names(inside=True)
    if callable(
        getattr(registry.build(name, registry.Shape(HEADS, HEAD_DIM, N, GRID)), "rotate", None)
    )
]


@pytest.mark.parametrize("name", ROTATING)
def test_every_rotation_reads_realized_tables_when_compiled(name):
    """A rotating scheme inside attention, traced: its cos and sin reach the rotation
    through the operator (without it, Inductor computes them per rotated element)."""
    assert len(ROTATING) >= 8  # rotary, its variants, 2-D, mixed, N-D, xPos
    torch.manual_seed(0)
    scheme = registry.build(name, registry.Shape(HEADS, HEAD_DIM, N, GRID))
    model = MultiHeadAttention(HEADS * HEAD_DIM, HEADS, position=scheme).eval()
    x = torch.randn(2, N, HEADS * HEAD_DIM)
    with torch.no_grad():
        calls = _graph_calls(model, x)
    assert any(target in _op_targets() for target in calls), f"{name}: {sorted(map(str, calls))}"


@pytest.mark.parametrize("name", ["rotary-2d", "rotary-mixed", "rotary-nd"])
def test_grid_rotations_read_their_tables_from_one_call_shared_by_q_and_k(name):
    """A grid rotation's tables (Rotary2D's rows and columns in one) go through one
    operator call: self-attention rotates the keys with the queries' tables."""
    scheme = registry.build(name, registry.Shape(HEADS, HEAD_DIM, N, GRID))
    model = MultiHeadAttention(HEADS * HEAD_DIM, HEADS, position=scheme).eval()
    with torch.no_grad():
        calls = _graph_calls(model, torch.randn(2, N, HEADS * HEAD_DIM))
    assert sum(target in _op_targets() for target in calls) == 1


def test_an_exported_program_holds_no_posenc_operator():
    """torch.export keeps to ATen's ops (its programs run where posenc is not imported):
    the tables pass unchanged there, and the program gives the eager output."""
    torch.manual_seed(0)
    model = MultiHeadAttention(HEADS * HEAD_DIM, HEADS, position=Rotary(HEAD_DIM)).eval()
    x = torch.randn(2, N, HEADS * HEAD_DIM)
    program = torch.export.export(model, (x,))
    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    assert not targets & _op_targets()
    assert not any(_tables._NAMESPACE in str(target) for target in targets)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x))


def test_the_sinusoidal_table_is_realized_when_compiled():
    calls = _graph_calls(lambda p: sinusoidal(p, 16), torch.arange(10))
    assert any(target in _op_targets() for target in calls)
