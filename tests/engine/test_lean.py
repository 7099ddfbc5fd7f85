"""The general lean engine (engine/lean.py) against the math reference: outputs, gradients, masks, memory."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    MASKS,
    SCHEMES,
    QueryTerm,
    TableBias,
    ValueTable,
    assert_results_close,
    run,
)
from torch import nn

import posenc
from posenc.engine import Mask, common, tuning
from tolerances import logit_size


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lean_equals_math_outputs_and_gradients(small_blocks, scheme_name, mask_name, dtype):
    torch.manual_seed(0)
    b, h, n_q, n_k, d = 2, 3, 37, 37, 8
    if mask_name == "causal":
        n_q = 21  # fewer queries than keys: aligned at the end
    scheme = SCHEMES[scheme_name](h, d)
    if scheme is not None:
        scheme = scheme.to(dtype)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for n in (n_q, n_k, n_k))
    q_pos = torch.arange(n_k - n_q, n_k)[None] + 5
    k_pos = torch.arange(n_k)[None] + 5
    mask = Mask(n_q, n_k, **MASKS[mask_name](b, n_q, n_k))
    grads = {}
    for backend in ("math", "lean"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        params = [] if scheme is None else list(scheme.parameters())
        for p in params:
            p.grad = None
        out = run(backend, scheme, *leaves, q_pos, k_pos, mask)
        (out * torch.linspace(-1, 1, d, dtype=dtype)).sum().backward()
        grads[backend] = [out, *(t.grad for t in leaves), *(p.grad for p in params)]
    assert_results_close(grads, dtype, logit_size(q, k, scheme, q_pos, k_pos), n_k)


def test_lean_gradcheck_float64(small_blocks):
    torch.manual_seed(1)
    b, h, n, d = 1, 2, 6, 3
    bias, term, value = (
        TableBias(h, 2).double(),
        QueryTerm(d, 2).double(),
        ValueTable(d, 1).double(),
    )

    class Combined(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias, self.term, self.value = bias, term, value

        def score_bias(self, q_pos, k_pos):
            return self.bias.score_bias(q_pos, k_pos)

        def score_term(self, q, q_pos, k_pos):
            return self.term.score_term(q, q_pos, k_pos)

        def value_term(self, weights, q_pos, k_pos):
            return self.value.value_term(weights, q_pos, k_pos)

    scheme = Combined()
    pos = torch.arange(n)[None]
    mask = Mask(n, n, causal=True, key_padding=torch.tensor([[False] * 5 + [True]]))

    # gradcheck of q, k, v through the engine
    inputs = [torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: run("lean", scheme, q, k, v, pos, pos, mask), inputs
    )


def test_fully_masked_rows_give_zero_and_finite_grads(small_blocks):
    q, k, v = (torch.randn(2, 2, 9, 4, requires_grad=True) for _ in range(3))
    pos = torch.arange(9)[None]
    mask = Mask(9, 9, lengths=torch.tensor([[0] * 9, [3] * 9]))
    out = run("lean", TableBias(2), q, k, v, pos, pos, mask)
    assert out[0].eq(0).all() and out[1].ne(0).any()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert q.grad[0].eq(0).all()


@pytest.mark.parametrize("scheme_name", ["none", "bias"])
def test_lean_accepts_a_strided_last_dimension(small_blocks, scheme_name):
    # a rotation written as a view can leave q and k with stride(-1) != 1 (2-D RoPE does):
    # the fused CPU kernel reads the last dimension as dense, so the engine must not pass
    # such a tensor through as it is
    scheme = SCHEMES[scheme_name](2, 4)
    q, k, v = (torch.randn(2, 9, 4, 2).transpose(-1, -2).transpose(1, 2) for _ in range(3))
    assert q.shape == (2, 2, 9, 4) and q.stride(-1) != 1
    pos = torch.arange(9)[None]
    mask = Mask(9, 9)
    for x in (q, k, v):
        x.requires_grad_()
    expected = run("math", scheme, q, k, v, pos, pos, mask)
    got = run("lean", scheme, q, k, v, pos, pos, mask)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    results = {"lean": [got, *grads], "math": [expected, *expected_grads]}
    assert_results_close(results, q.dtype, logit_size(q, k, scheme, pos, pos), 9)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("scheme_name", ["none", "bias", "value"])
def test_masked_keys_have_exactly_no_influence(small_blocks, monkeypatch, fused, scheme_name):
    if not fused:
        monkeypatch.setattr(common, "_fused_cpu_available", lambda q, v, hooks: False)
    torch.manual_seed(0)
    scheme = SCHEMES[scheme_name](2, 4)
    q, k, v = (torch.randn(2, 2, 9, 4) for _ in range(3))
    pos = torch.arange(9)[None]
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[:, 6:] = True
    mask = Mask(9, 9, key_padding=padding)
    out = run("lean", scheme, q, k, v, pos, pos, mask)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 6:], v2[:, :, 6:] = -3.0, 1e30  # a masked value must not leak, not even 1e-35 of it
    torch.testing.assert_close(run("lean", scheme, q, k2, v2, pos, pos, mask), out, rtol=0, atol=0)


def test_block_rows():
    rows = common.lean_block_rows(2, 8, 4096, 4096)
    assert rows * 2 * 8 * 4096 <= tuning.LEAN_BLOCK_ELEMENTS < 2 * rows * 2 * 8 * 4096
    assert common.lean_block_rows(1, 1, 10, 10) == 10
    assert 16 <= common.lean_block_rows(64, 64, 8192, 8192) <= 512
    # per-offset bias path: one call for every query, blocks under a causal mask
    assert common._kernel_rows(4096) == 4096
    assert common._kernel_rows(4096, causal=True) == tuning.CAUSAL_ROWS
    assert common._kernel_rows(10, causal=True) == 10
    assert common._written_rows(2, 1, 4096, 4096) * 2 * 4096 == tuning.WRITTEN_BLOCK_ELEMENTS
    assert common._written_rows(2, 1, 4096, 4096, 1 << 21) == 256  # the 2-D term's budget
    assert common._written_rows(2, 1, 4096, 4096, 1 << 30) == 512  # at most 512 rows
    assert common._written_rows(1, 1, 7, 7) == 7


@pytest.mark.slow
@pytest.mark.parametrize("scheme_name", ["bias", "value"])
def test_lean_memory_stays_below_one_score_matrix(scheme_name):
    """At n = 4096 a causal fwd+bwd peaks below the size of one b*h*n*n float32 tensor, in
    bytes torch allocates during the call (the allocation events of the profiler: the same
    figure in every run, where the growth of the resident set moved with what the process
    had freed before)."""
    from posenc.cli._memory import allocation_peak_mib

    n, b, h, d = 4096, 1, 4, 32
    one_matrix_mib = b * h * n * n * 4 / 2**20

    def peak(backend):
        torch.manual_seed(0)
        scheme = {"bias": TableBias(h), "value": ValueTable(d)}[scheme_name]
        q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
        pos, grad = torch.arange(n)[None], torch.randn(b, h, n, d)

        def step():
            mask = Mask(n, n, causal=True)
            out = run(backend, scheme, q, k, v, pos, pos, mask)
            out.backward(grad)

        return allocation_peak_mib(step)

    lean = peak("lean")
    assert lean < one_matrix_mib, (lean, one_matrix_mib)
    assert peak("math") > 2 * one_matrix_mib  # the check can fail: the reference is quadratic


def test_a_term_that_reads_the_queries_only_as_an_index_has_no_query_gradient_to_add():
    """A user's score term that picks rows of a learned table by the sign of q: the lean
    backward gets no gradient for q from the term and adds none (it added None), and the
    table's and q's gradients equal math's."""
    torch.manual_seed(0)
    table = torch.randn(2, 400, dtype=torch.float64, requires_grad=True)

    class Picked:
        def score_term(self, q, q_pos, k_pos):
            rows = (q[..., 0] > 0).long()  # [b, h, n_q]
            return table[rows][..., : k_pos.shape[-1]]  # [b, h, n_q, n_k]

    q, k, v = (torch.randn(1, 2, 300, 8, dtype=torch.float64) for _ in range(3))
    grads = {}
    for backend in ("math", "lean"):
        leaf = q.clone().requires_grad_()
        out = posenc.attention(leaf, k, v, position=Picked(), backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum(), (leaf, table))
    for found, expected in zip(grads["lean"], grads["math"], strict=True):
        torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("create_graph", [False, True])
def test_lean_paths_differentiate_the_tensors_functional_call_swaps_in(monkeypatch, create_graph):
    """``torch.func.functional_call`` puts the module's own tensors back before the backward,
    which on the lean paths runs the hooks again: the backward reads the tensors swapped in
    for the forward (the table's gradient, and q's, k's and v's from that table), as the
    math path's graph does; with ``create_graph=True`` (the reference's gradients) too."""
    from torch.func import functional_call

    from schemes import SCHEMES

    monkeypatch.setattr(tuning, "MATERIALISED_PAIRS", 64)  # 12 tokens: the lean-fused path
    torch.manual_seed(0)
    scheme = SCHEMES["swin-2d"].build(2, 8, 12, (3, 4)).double()

    class Bound(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scheme = scheme

        def forward(self, q, k, v, backend):
            return posenc.attention(q, k, v, position=self.scheme, backend=backend)

    bound = Bound()
    q, k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    assert posenc.explain(q, k, v, position=scheme).path == "lean-fused"
    swapped = {n: p.detach() * 3 + 1 for n, p in bound.named_parameters()}
    results = {}
    for backend in ("auto", "math"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        tables = {n: p.clone().requires_grad_() for n, p in swapped.items()}
        out = functional_call(bound, tables, (*leaves, backend))
        wrt = [*leaves, *tables.values()]
        grads = torch.autograd.grad(out.square().sum(), wrt, create_graph=create_graph)
        if create_graph:  # a second derivative through the first
            grads = torch.autograd.grad(sum(g.square().sum() for g in grads), wrt)
        results[backend] = grads
    for got, want in zip(results["auto"], results["math"], strict=True):
        torch.testing.assert_close(got, want)
