"""posenc.engine.compiled: under ``torch.compile``, a call too large for the materialised
path runs the eager lean engine as one operator, forward and backward.

The threshold is lowered (``MATERIALISED_PAIRS``) so that small calls take the operator and
each graph compiles in a second or two; every result is compared with the math path in
float64, outputs and the gradients of ``q``, ``k``, ``v`` and every parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import posenc
from posenc.engine import compiled, tuning
from schemes import SCHEMES

pytestmark = pytest.mark.compile

HEADS, HEAD_DIM, GRID = 2, 8, (3, 4)
N = GRID[0] * GRID[1]


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    """Calls of more than 64 query-key pairs per head or 256 scores are too large to write
    out."""
    monkeypatch.setattr(tuning, "MATERIALISED_PAIRS", 64)
    monkeypatch.setattr(tuning, "MATERIALISED_SCORES", 256)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _ops(fn, *args, fullgraph: bool = True) -> list[str]:
    """The operators of the graphs Dynamo traces for ``fn(*args)`` (one graph, unless
    ``fullgraph`` is False)."""
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()  # each call traced anew (one code object serves many cases)
    torch.compile(fn, backend=backend, fullgraph=fullgraph)(*args)
    return seen


def _uses_operator(ops: list[str]) -> bool:
    return any(op.endswith("lean_attention.default") for op in ops)


def _grads_of(fn, leaves, scheme, grad):
    out = fn(*leaves)
    wanted = [*leaves, *(p for p in scheme.parameters() if p.requires_grad)]
    return [out, *torch.autograd.grad(out, wanted, grad)]


@pytest.mark.parametrize(
    ("name", "causal", "backend"),
    [
        ("t5", False, "inductor"),
        ("alibi-learned", True, "inductor"),
        ("shaw", False, "inductor"),
        ("relative", True, "aot_eager"),
        ("swin-2d", False, "aot_eager"),
        ("fire", False, "aot_eager"),
        ("kerple-log", True, "aot_eager"),
    ],
)
def test_compiled_call_runs_the_lean_engine_as_one_operator(name, causal, backend):
    torch.manual_seed(0)
    scheme = SCHEMES[name].build(HEADS, HEAD_DIM, N, GRID).double()
    q, k, v = (torch.randn(2, HEADS, N, HEAD_DIM, dtype=torch.float64) for _ in range(3))

    def call(q, k, v, backend_="auto"):
        return posenc.attention(q, k, v, position=scheme, causal=causal, backend=backend_)

    assert _uses_operator(_ops(call, q, k, v))
    grad = torch.randn(2, HEADS, N, HEAD_DIM, dtype=torch.float64)
    fast = torch.compile(call, backend=backend, fullgraph=True)
    got = _grads_of(fast, [x.clone().requires_grad_() for x in (q, k, v)], scheme, grad)
    want = _grads_of(
        lambda *x: call(*x, "math"), [x.clone().requires_grad_() for x in (q, k, v)], scheme, grad
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    with torch.no_grad():  # inference: the operator's forward alone
        torch.testing.assert_close(fast(q, k, v), want[0])


def test_compiled_module_trains_with_the_operator():
    """MultiHeadAttention with T5 compiled whole: its loss and every gradient as eager."""
    torch.manual_seed(0)
    model = posenc.MultiHeadAttention(16, HEADS, position=posenc.T5RelativeBias(HEADS)).double()
    x = torch.randn(2, N, 16, dtype=torch.float64)
    assert _uses_operator(_ops(model, x))
    grads = []
    for run in (model, torch.compile(model, fullgraph=True)):
        model.zero_grad()
        loss = run(x).square().sum()
        loss.backward()
        grads.append([loss.detach(), *(p.grad.clone() for p in model.parameters())])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_calls_the_operator_does_not_take():
    """Written out below the threshold (the materialised path's size), and as before for a
    mask other than a causal one, attention dropout, a scheme that may read tensors not its
    own, no positional term, and under torch.export."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, N, HEAD_DIM) for _ in range(3))
    alibi = posenc.ALiBi(HEADS)

    def with_(**kwargs):
        return lambda q, k, v: posenc.attention(q, k, v, **kwargs)

    assert _uses_operator(_ops(with_(position=alibi), q, k, v))
    small = q[:, :, :8], k[:, :, :8], v[:, :, :8]  # 64 pairs: written out
    assert not _uses_operator(_ops(with_(position=alibi), *small))
    padding = torch.zeros(1, N, dtype=torch.bool)
    assert not _uses_operator(_ops(with_(position=alibi, key_padding_mask=padding), q, k, v))
    assert not _uses_operator(_ops(with_(position=alibi, dropout_p=0.1), q, k, v))
    assert not _uses_operator(_ops(with_(position=posenc.Rotary(HEAD_DIM)), q, k, v))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]  # a constant bias, gradients
    assert not _uses_operator(_ops(with_(position=alibi), *leaves))
    with torch.no_grad():
        assert _uses_operator(_ops(with_(position=alibi), *leaves))
    # with gradients, above the pairs per head but within the scores' budget: written out
    t5 = posenc.T5RelativeBias(HEADS)
    assert _uses_operator(_ops(with_(position=t5), *leaves))  # 288 scores
    assert not _uses_operator(_ops(with_(position=t5), *(x[:, :, :11] for x in leaves)))
    with torch.no_grad():  # 242 scores, 121 pairs: no second forward, the operator
        assert _uses_operator(_ops(with_(position=t5), *(x[:, :, :11] for x in leaves)))

    class Mine(posenc.ALiBi):  # a method outside posenc: it may read any tensor
        def note(self) -> None:
            pass

    assert not _uses_operator(_ops(with_(position=Mine(HEADS)), q, k, v))

    class Wrapper(nn.Module):
        def forward(self, q, k, v):
            return posenc.attention(q, k, v, position=alibi)

    exported = torch.export.export(Wrapper(), (q, k, v))
    targets = [str(node.target) for node in exported.graph.nodes]
    assert not any("lean_attention" in t for t in targets)
    torch.testing.assert_close(exported.module()(q, k, v), Wrapper()(q, k, v))


def test_another_scheme_object_gets_its_own_graph():
    """The handle is the scheme's: a second T5 of other values is not run as the first."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, N, HEAD_DIM) for _ in range(3))
    call = torch.compile(
        lambda q, k, v, s: posenc.attention(q, k, v, position=s), backend="aot_eager"
    )
    for _ in range(2):
        scheme = posenc.T5RelativeBias(HEADS)
        with torch.no_grad():
            got = call(q, k, v, scheme)
            want = posenc.attention(q, k, v, position=scheme, backend="math")
        torch.testing.assert_close(got, want)


def test_operator_reads_the_tensors_the_graph_passes():
    """``torch.func.functional_call`` swaps parameters in while compiling: the operator's
    forward and backward read those, not the module's own (the gradients of the table
    passed, of the projections and of the input all equal eager's); with the module frozen
    and its tensors passed trainable too. (Dynamo breaks the graph where posenc reads the
    scheme's class after the swap: not ``fullgraph``.)"""
    from torch.func import functional_call

    torch.manual_seed(0)
    model = posenc.MultiHeadAttention(16, HEADS, position=posenc.T5RelativeBias(HEADS)).double()
    x = torch.randn(2, N, 16, dtype=torch.float64)
    for frozen in (False, True):
        model.requires_grad_(not frozen)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        params["position.embedding.weight"] = params["position.embedding.weight"] * 5 + 1
        results = []
        for run in (lambda p, x: functional_call(model, p, (x,)),):
            for fn in (run, torch.compile(run, backend="aot_eager")):
                leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
                inputs = x.clone().requires_grad_()
                out = fn(leaves, inputs)
                wrt = [inputs, *leaves.values()]
                results.append([out, *torch.autograd.grad(out.square().sum(), wrt)])
        call = lambda p, x: functional_call(model, p, (x,))  # noqa: E731
        assert _uses_operator(_ops(call, params, x, fullgraph=False))
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b)


def test_graphs_do_not_specialise_on_lengths_or_scheme_objects():
    """Dynamo's graphs: one for every length with dynamic shapes (the size reason names no
    size), and one for several ALiBi modules compiled apart where the operator is not used
    (a constant bias with gradients: the handle, which ties a graph to its scheme object,
    is not asked for)."""
    from torch._dynamo.utils import counters

    alibi = posenc.ALiBi(HEADS)
    call = torch.compile(
        lambda q, k, v: posenc.attention(q, k, v, position=alibi), backend="eager", dynamic=True
    )
    counters.clear()
    for n in (20, 21, 23, 26):
        q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM) for _ in range(3))
        with torch.no_grad():
            torch.testing.assert_close(call(q, k, v), posenc.attention(q, k, v, position=alibi))
    assert counters["stats"]["unique_graphs"] == 1

    torch._dynamo.reset()
    counters.clear()
    layers = [posenc.MultiHeadAttention(16, HEADS, position=posenc.ALiBi(HEADS)) for _ in range(3)]
    for layer in layers:
        layer.compile(backend="eager")
    y = torch.randn(1, N, 16, requires_grad=True)
    for layer in layers:
        y = layer(y)
    y.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1


def test_operator_errors(monkeypatch):
    """A handle whose scheme is gone, names that do not match the tensors, and an error
    inside the backward's recomputation (raised in the caller's thread)."""
    import gc

    scheme = posenc.T5RelativeBias(HEADS)
    handle = compiled._handle(scheme)
    del scheme
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists; call torch.compiler.reset"):
        compiled._scheme(handle)
    assert compiled._handle(None) == -1

    scheme = posenc.T5RelativeBias(HEADS)
    handle = compiled._handle(scheme)
    q, k, v = (torch.randn(1, HEADS, N, HEAD_DIM) for _ in range(3))
    pos = torch.arange(N)[None]
    weight = scheme.embedding.weight.detach()
    with pytest.raises(RuntimeError, match="1 tensors for 0 names"):
        compiled._forward_op(q, k, v, pos, pos, [weight], [], "", handle, False, 0.5)

    def broken(*args):
        raise ValueError("inside the recomputation")

    monkeypatch.setattr(compiled, "_attend", broken)
    with pytest.raises(ValueError, match="inside the recomputation"):
        compiled._backward_op(
            q, q, k, v, pos, pos, [weight], [], "embedding.weight", handle, False, 0.5
        )
