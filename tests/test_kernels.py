"""The kernels: the lean engine against the math reference, masks, memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import posenc.kernels as kernels
from posenc.indices import run_offsets
from posenc.kernels import Mask, attend, choose_backend, hooks_of, lean_block_rows


class TableBias(nn.Module):
    """A learned relative bias per head, gathered from a table (T5/Swin-like)."""

    def __init__(self, heads, span=8):
        super().__init__()
        self.span = span
        self.table = nn.Parameter(torch.randn(heads, 2 * span + 1))

    def score_bias(self, q_pos, k_pos):
        rel = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-self.span, self.span) + self.span
        return self.table[:, rel].transpose(0, 1)  # [h, B', n_q, n_k] -> [B', h, n_q, n_k]


class QueryTerm(nn.Module):
    """q_i . r[clip(j - i)]: a content-dependent term with a learned table."""

    def __init__(self, head_dim, span=4):
        super().__init__()
        self.span = span
        self.table = nn.Parameter(torch.randn(2 * span + 1, head_dim))

    def score_term(self, q, q_pos, k_pos):
        rel = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-self.span, self.span) + self.span
        logits = q @ self.table.T  # [b, h, n_q, 2s+1]
        index = rel[:, None].expand(q.shape[0], q.shape[1], -1, -1)  # [b, h, n_q, n_k]
        return logits.gather(-1, index)


class ValueTable(nn.Module):
    """Shaw-like value term: weights summed per clipped distance, times a table."""

    def __init__(self, head_dim, span=3):
        super().__init__()
        self.span = span
        self.values = nn.Parameter(torch.randn(2 * span + 1, head_dim))

    def value_term(self, weights, q_pos, k_pos):
        rel = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-self.span, self.span) + self.span
        buckets = weights.new_zeros(*weights.shape[:-1], 2 * self.span + 1)
        buckets.scatter_add_(-1, rel[:, None].expand_as(weights), weights)
        return buckets @ self.values  # [b, h, n_q, d]


SCHEMES = {
    "none": lambda h, d: None,
    "bias": lambda h, d: TableBias(h),
    "term": lambda h, d: QueryTerm(d),
    "value": lambda h, d: ValueTable(d),
}

MASKS = {
    "none": lambda b, nq, nk: {},
    "causal": lambda b, nq, nk: {"causal": True},
    "lengths": lambda b, nq, nk: {"lengths": torch.randint(0, nk + 1, (b, nq))},
    "padding": lambda b, nq, nk: {"key_padding": torch.rand(b, nk) < 0.4},
    "documents": lambda b, nq, nk: {
        "q_doc": torch.arange(nq)[None].expand(b, nq) // 5,
        "k_doc": torch.arange(nk)[None].expand(b, nk) // 5,
    },
}


def run(backend, scheme, q, k, v, q_pos, k_pos, mask):
    out, _ = attend(q, k, v, scheme=scheme, q_pos=q_pos, k_pos=k_pos, mask=mask, backend=backend)
    return out


def spy_on(monkeypatch, engine):
    """A list that grows by one each time ``engine.apply`` runs: which path was taken."""
    calls = []
    apply = engine.apply
    monkeypatch.setattr(engine, "apply", lambda *a: calls.append(1) or apply(*a))
    return calls


def lean_and_math(scheme, q, k, v, q_pos, k_pos, mask):
    """``{backend: [out, dq, dk, dv, *parameter grads]}`` for math and lean, one weighted loss."""
    results = {}
    weights = torch.linspace(-1, 1, q.shape[-1], dtype=q.dtype)
    params = [] if scheme is None else list(scheme.parameters())
    for backend in ("math", "lean"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        for p in params:
            p.grad = None
        out = run(backend, scheme, *leaves, q_pos, k_pos, mask)
        (out * weights).sum().backward()
        results[backend] = [out, *(t.grad for t in leaves), *(p.grad for p in params)]
    return results


def assert_lean_matches_math(scheme, b: int, h: int, n: int, d: int, mask: Mask | None = None):
    """Random float64 ``q, k, v [b, h, n, d]`` (seed 0) at positions ``0 .. n-1``: lean's
    output and every gradient equal math's."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(n, n) if mask is None else mask)
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a)


@pytest.fixture(params=["threads", "single", "pairs"])
def head_groups(request, monkeypatch):
    """The fused paths' head groups: as the machine's threads give, or forced to one head
    (the accumulators' one-tensor layout) or to pairs of heads, so that both group layouts
    are tested on any machine."""
    if request.param != "threads":
        size = 1 if request.param == "single" else 2
        groups = lambda b, h: [slice(s, min(s + size, h)) for s in range(0, h, size)]  # noqa: E731
        monkeypatch.setattr(kernels, "_head_groups", groups)
    return request.param


@pytest.fixture
def small_blocks(monkeypatch):
    """Force several blocks of rows on small inputs."""
    monkeypatch.setattr(kernels, "LEAN_BLOCK_ELEMENTS", 64)


def block_rows(monkeypatch, rows: int) -> None:
    """Exactly ``rows`` query rows a block on the lean engine's paths that take
    :func:`lean_block_rows` (which never gives fewer than 16)."""
    monkeypatch.setattr(kernels, "lean_block_rows", lambda b, h, n_q, n_k: max(1, min(n_q, rows)))


def offset_rows(monkeypatch, rows: int, b: int, n_q: int, n_k: int) -> None:
    """About ``rows`` query rows a block on the per-offset bias path: its kernel calls (always
    under a causal mask; without one a call takes every query) and its written-out backward
    (one head; half with pairs)."""
    monkeypatch.setattr(kernels, "CAUSAL_ROWS", rows)
    monkeypatch.setattr(kernels, "WRITTEN_BLOCK_ELEMENTS", b * rows * n_k)


def grid_rows(monkeypatch, rows: int | None, height: int, width: int) -> None:
    """``rows`` map rows a block on the grid paths, forward and written-out backward (None:
    as the engine chooses, which for a small map is all of them); with ``rows`` given, a
    buffer holds one head's copies (several head groups forward; a backward block of two
    heads then takes fewer map rows)."""
    if rows is None:
        return
    monkeypatch.setattr(kernels, "GRID_KERNEL_ROWS", rows * width)
    monkeypatch.setattr(
        kernels, "_written_rows", lambda b, g, n_q, n_k, elements=None: rows * width
    )
    copy = kernels._GridBias.copy_size(height, width)
    monkeypatch.setattr(kernels, "GRID_BUFFER_ELEMENTS", rows * copy)


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
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a, atol=tol, rtol=tol)


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
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_strong_biases_agree_with_math(monkeypatch, fused):
    # ALiBi over 300 tokens: biases down to -150, past BIAS_SPAN and EXP_FLOOR, where the
    # engine raises far biases (fused) or floors exp's argument (plain) to avoid denormals
    from posenc import ALiBi

    if not fused:
        monkeypatch.setattr(kernels, "_fused_cpu_available", lambda q, hooks: False)
    monkeypatch.setattr(kernels, "LEAN_BLOCK_ELEMENTS", 2 * 4 * 300 * 64)  # several blocks
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 16, requires_grad=True) for _ in range(3))
    pos = torch.arange(300)[None]
    padding = torch.zeros(2, 300, dtype=torch.bool)
    padding[1, :250] = True  # row 1: the best keys of the first queries are masked
    mask = Mask(300, 300, key_padding=padding)
    scheme = ALiBi(4)
    got = run("lean", scheme, q, k, v, pos, pos, mask)
    expected = run("math", scheme, q, k, v, pos, pos, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def _offset_scheme(name, heads):
    from posenc import ALiBi, RelativePositionBias, T5RelativeBias

    torch.manual_seed(1)
    scheme = {
        "alibi": lambda: ALiBi(heads),
        "t5": lambda: T5RelativeBias(heads, num_buckets=8, max_distance=16),
        "relative": lambda: RelativePositionBias(450, heads),
    }[name]()
    for p in scheme.parameters():
        nn.init.normal_(p, std=2.0)  # learned tables far from zero
    return scheme


@pytest.mark.parametrize("name", ["alibi", "t5", "relative"])
@pytest.mark.parametrize(
    ("q_range", "k_range", "offset_path"),
    [
        ((0, 37), (0, 37), True),  # self-attention
        ((24, 37), (0, 37), True),  # decoding: the last queries against a cache
        ((0, 300), (0, 300), True),  # ALiBi spans > BIAS_SPAN: raised per offset
        ((400, 410), (0, 300), None),  # ALiBi: no row meets the best offset -> general path
        ((0, 30), (5, 17), True),  # more queries than keys
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_offset_bias_path_equals_math(
    head_groups, monkeypatch, name, q_range, k_range, offset_path, dtype, causal
):
    """Consecutive positions, no mask or a causal one: the per-offset engine, outputs and
    every gradient."""
    calls = spy_on(monkeypatch, kernels._OffsetFusedAttention)
    b, h, d = 2, 3, 8
    n_q, n_k = q_range[1] - q_range[0], k_range[1] - k_range[0]
    offset_rows(monkeypatch, 7, b, n_q, n_k)
    scheme = _offset_scheme(name, h).to(dtype)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for n in (n_q, n_k, n_k))
    q_pos, k_pos = torch.arange(*q_range)[None], torch.arange(*k_range)[None]
    mask = Mask(n_q, n_k, causal=causal)
    grads = lean_and_math(scheme, q, k, v, q_pos, k_pos, mask)
    # learned tables here span < 60; a causal mask hides the last case's offsets above
    # -110, and -110, ALiBi's best visible one, is met by every row
    expected_path = offset_path or name != "alibi" or causal
    expected_path = expected_path and not (causal and n_q > n_k)  # rows with no key: general
    assert bool(calls) == expected_path
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a, atol=tol, rtol=tol)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize(
    ("q_range", "k_range", "std", "offset_path"),
    [
        ((0, 37), (0, 37), 0.5, True),  # self-attention
        ((24, 37), (0, 37), 0.5, True),  # decoding: the last queries against a cache
        ((0, 37), (0, 37), 40.0, True),  # a term spanning > BIAS_SPAN (never clamped)
        ((0, 37), (3, 40), 0.5, True),  # keys shifted from the queries
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_offset_term_path_equals_math(
    head_groups, monkeypatch, per_head, q_range, k_range, std, offset_path, dtype, causal
):
    """Relative embedding, consecutive positions, no mask or a causal one: outputs and
    every gradient."""
    from posenc import RelativeQueryEmbedding

    calls = spy_on(monkeypatch, kernels._OffsetTermAttention)
    b, h, d = 2, 3, 8
    n_q, n_k = q_range[1] - q_range[0], k_range[1] - k_range[0]
    block_rows(monkeypatch, 7)
    torch.manual_seed(1)
    scheme = RelativeQueryEmbedding(45, d, heads=h if per_head else None).to(dtype)
    nn.init.normal_(scheme.weight, std=std)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for n in (n_q, n_k, n_k))
    q_pos, k_pos = torch.arange(*q_range)[None], torch.arange(*k_range)[None]
    mask = Mask(n_q, n_k, causal=causal)
    grads = lean_and_math(scheme, q, k, v, q_pos, k_pos, mask)
    assert bool(calls) == offset_path
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    if std > 1 and dtype == torch.float32:
        tol = 1e-4  # logits in the hundreds: float32 rounding of the scores themselves
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a, atol=tol, rtol=tol)


@pytest.mark.parametrize("causal", [False, True])
def test_shaw_strip_products_cover_the_band_alone(monkeypatch, causal):
    """With far parts, a strip block's term and its gradient are products with the band's
    ``2k - 1`` rows of each table (one per offset: nothing spread or gathered), made once
    per distinct offset range, not with the ``rows + 2k - 2`` columns of its logits."""
    from posenc import ShawRelativePosition

    made = []
    init = kernels._Rows.__init__

    def spy(self, table, index, cols):
        init(self, table, index, cols)
        made.append((cols.stop - cols.start, self.runs, self.rows.shape[-2]))

    monkeypatch.setattr(kernels._Rows, "__init__", spy)
    monkeypatch.setattr(kernels, "FAR_PAIRS", 0)
    block_rows(monkeypatch, 16)
    clip, n = 3, 80
    scheme = ShawRelativePosition(8, clip)
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for _ in range(3))
    pos = torch.arange(n)[None]
    mask = Mask(n, n, causal=causal)
    out, _ = attend(q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask, backend="lean")
    out.sum().backward()
    assert made and all(runs is None for _, runs, _ in made)
    assert all(width == rows <= 2 * clip - 1 for width, _, rows in made)
    # keys and values, forward and backward: the inner blocks share theirs
    assert len(made) <= 2 * 2 * 3


@pytest.mark.parametrize("values", [True, False])
@pytest.mark.parametrize(
    ("q_range", "k_range"),
    [
        ((0, 37), (0, 37)),  # blocks with far keys on both sides and a strip
        ((24, 37), (0, 37)),
        ((0, 30), (5, 40)),
        ((400, 410), (0, 30)),  # every key far before every query: no strip
        ((0, 10), (300, 330)),  # every key far after
        ((27, 38), (0, 30)),  # late queries meet no key in their band: rows without a strip
        ((0, 11), (8, 38)),  # early queries likewise
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("far", [True, False])
def test_shaw_offset_path_equals_math(
    head_groups, monkeypatch, values, q_range, k_range, dtype, causal, far
):
    """Shaw's keys and values, consecutive positions, no mask or a causal one: against the
    literal form, with its far pairs on the fused kernels (as from FAR_PAIRS pairs) and
    without (the strip over every key, as below)."""
    from posenc import ShawRelativePosition

    calls = spy_on(monkeypatch, kernels._OffsetTermAttention)
    monkeypatch.setattr(kernels, "FAR_PAIRS", 0 if far else 1 << 40)
    far_calls = []
    far_forward = kernels._FarPart.forward
    monkeypatch.setattr(
        kernels._FarPart, "forward", lambda self, *a: far_calls.append(1) or far_forward(self, *a)
    )
    b, h, d = 2, 3, 8
    n_q, n_k = q_range[1] - q_range[0], k_range[1] - k_range[0]
    block_rows(monkeypatch, 7)
    torch.manual_seed(1)
    scheme = ShawRelativePosition(d, 4, values=values).to(dtype)
    for table in scheme.parameters():
        nn.init.normal_(table, std=1.0)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for n in (n_q, n_k, n_k))
    q_pos, k_pos = torch.arange(*q_range)[None], torch.arange(*k_range)[None]
    grads = lean_and_math(scheme, q, k, v, q_pos, k_pos, Mask(n_q, n_k, causal=causal))
    assert calls
    assert bool(far_calls) == far
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a, atol=tol, rtol=tol)


class CyclicTerm(nn.Module):
    """``q_i . table[(j - i) mod 5]``: an offset_term given as (table, index) whose index is
    not a clipped run (the engine takes the rows themselves)."""

    def __init__(self, head_dim):
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, head_dim))

    def score_term(self, q, q_pos, k_pos):
        rel = (k_pos[:, None, :] - q_pos[:, :, None]) % 5  # [B', n_q, n_k]
        return torch.einsum("bhid,bijd->bhij", q, self.table[rel].expand(q.shape[0], -1, -1, -1))

    def offset_term(self, q_pos, k_pos):
        first = int(k_pos[0, 0] - q_pos[0, -1])
        offsets = torch.arange(first, first + q_pos.shape[-1] + k_pos.shape[-1] - 1)
        return self.table, offsets % 5


class ClippedPerHead(nn.Module):
    """``q_i . table[h, clip(j - i, -2, 2) + 2]``: a clipped table per head (Shaw's keys are
    shared by the heads), so the far parts take a row per head."""

    def __init__(self, heads, head_dim):
        super().__init__()
        self.table = nn.Parameter(torch.randn(heads, 5, head_dim))

    def score_term(self, q, q_pos, k_pos):
        rel = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-2, 2) + 2  # [B', n_q, n_k]
        return torch.einsum("bhid,hbijd->bhij", q, self.table[:, rel])

    def offset_term(self, q_pos, k_pos):
        first = int(k_pos[0, 0] - q_pos[0, -1])
        offsets = torch.arange(first, first + q_pos.shape[-1] + k_pos.shape[-1] - 1)
        return self.table, offsets.clamp(-2, 2) + 2


@pytest.mark.parametrize("causal", [False, True])
def test_offset_term_far_parts_with_a_table_per_head(head_groups, monkeypatch, causal):
    monkeypatch.setattr(kernels, "FAR_PAIRS", 0)
    block_rows(monkeypatch, 4)
    calls = spy_on(monkeypatch, kernels._OffsetTermAttention)
    torch.manual_seed(0)
    scheme = ClippedPerHead(3, 8).double()
    assert_lean_matches_math(scheme, 2, 3, 21, 8, Mask(21, 21, causal=causal))
    assert calls


def test_shaw_far_part_whose_share_underflows(monkeypatch):
    """float32: a far part whose weight in a row is below exp(-EXP_FLOOR) gets that row's
    logsumexp at +inf in its kernel backward (exactly 0, no denormal exp over its keys);
    outputs and gradients still those of the literal form."""
    from posenc import ShawRelativePosition

    block_rows(monkeypatch, 8)
    monkeypatch.setattr(kernels, "FAR_PAIRS", 0)
    seen_lse = []
    backward = kernels._flash_cpu_backward

    def spy(*args, **kwargs):
        seen_lse.append(args[5])  # (grad_out, q, k, v, out, lse, ...)
        return backward(*args, **kwargs)

    monkeypatch.setattr(kernels, "_flash_cpu_backward", spy)
    torch.manual_seed(0)
    scheme = ShawRelativePosition(8, 2)
    with torch.no_grad():
        scheme.keys.zero_()
        scheme.keys[0, 0] = -60.0  # the lead (offsets <= -2): term about -106 for q[0] = 5
    q, k, v = (torch.randn(2, 2, 24, 8) for _ in range(3))
    q[..., 0] = 5.0
    pos = torch.arange(24)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(24, 24))
    assert any(bool(torch.isinf(lse).any()) for lse in seen_lse)
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)


def test_far_parts_only_on_long_sequences():
    """Below FAR_PAIRS query-key pairs a clipped table keeps the strip over every key."""
    for n in (64, 1024, 2048):
        index = (torch.arange(2 * n - 1) - (n - 1)).clamp(-16, 16) + 16
        parts, low, high = kernels._far_parts(torch.zeros(33, 4), None, index, n, n, False)
        assert len(parts) == (2 if n * n >= kernels.FAR_PAIRS else 0)
        assert (low is None) == (high is None) == (not parts)


def test_reused_buffers_keep_one_per_tag():
    """Blocks of one shape share a buffer; a block of another shape replaces it (under a
    causal mask every block differs: keeping one per shape kept them all)."""
    buffers = {}
    first = kernels._reused(buffers, "s", (2, 3), lambda: torch.zeros(2, 3))
    assert kernels._reused(buffers, "s", (2, 3), lambda: torch.ones(2, 3)) is first
    other = kernels._reused(buffers, "s", (2, 4), lambda: torch.zeros(2, 4))
    assert other is not first and list(buffers) == ["s"] and buffers["s"][1] is other
    kernels._reused(buffers, "p", (2, 3), lambda: torch.zeros(2, 3))
    assert sorted(buffers) == ["p", "s"]
    # _widen: the fill stays outside the columns written, whatever was written before
    wide = kernels._widen(torch.ones(2, 2), 5, 1, float("-inf"), buffers)
    assert wide[:, 0].isinf().all() and wide[:, 3:].isinf().all() and (wide[:, 1:3] == 1).all()
    narrow = kernels._widen(torch.full((2, 1), 2.0), 5, 1, float("-inf"), buffers)
    assert narrow[:, 2:].isinf().all() and (narrow[:, 1] == 2).all()  # fewer columns: no stale
    x = torch.arange(4.0).view(2, 2)
    assert kernels._widen(x, 2, 0, 0.0, buffers) is x  # every column: x itself


def test_strip_rows():
    assert kernels._strip_rows(512, None, 20) == 512  # no far parts: as given
    assert kernels._strip_rows(512, -15, 15) == 64  # Shaw, k = 16: a band of 31 offsets
    assert kernels._strip_rows(512, -127, 127) == 255
    assert kernels._strip_rows(32, -15, 15) == 32


@pytest.mark.parametrize(("n_q", "n_k"), [(9, 9), (4, 11), (11, 4), (1, 6)])
@pytest.mark.parametrize("delta", [-12, -3, 0, 1, 2, 5, 20])
def test_lead_pieces_cover_the_pairs_once(n_q, n_k, delta):
    """The kernel calls of a far part cover exactly the pairs j <= i + delta - 1, once."""
    covered = torch.zeros(n_q, n_k, dtype=torch.long)
    for rows, keys, causal in kernels._lead_pieces(n_q, n_k, delta):
        i = torch.arange(rows.start, rows.stop)[:, None]
        j = torch.arange(keys.start, keys.stop)[None, :]
        seen = (j - keys.start <= i - rows.start) if causal else torch.ones_like(i * j, dtype=bool)
        covered[rows, keys] += seen.long()  # the kernel's causal mask is top-left
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    assert torch.equal(covered, (j <= i + delta - 1).long())


@pytest.mark.parametrize(("n_q", "n_k"), [(9, 9), (4, 11), (11, 4), (1, 6), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_block_pieces_cover_the_visible_pairs_once(n_q, n_k, causal):
    """The calls of a block whose queries ``rows`` see the keys ``first .. end - 1`` cover
    exactly its visible pairs, once, each call's causal mask aligned at its end."""
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    row_ranges = [(0, n_q), (0, n_q // 2), (n_q // 3, n_q), (1, max(1, n_q - 1))]
    for r0, r1 in row_ranges:
        for first in range(n_k + 1):
            for end in range(first, n_k + 1):
                covered = torch.zeros(n_q, n_k, dtype=torch.long)
                pieces = kernels._block_pieces(slice(r0, r1), first, end, n_k - n_q, causal)
                for rows, keys, sub_causal in pieces:
                    r = torch.arange(rows.stop - rows.start)[:, None]
                    c = torch.arange(keys.stop - keys.start)[None, :]
                    shift = (keys.stop - keys.start) - (rows.stop - rows.start)
                    assert not sub_causal or shift >= 0  # the fused paths' causal: n_q <= n_k
                    seen = (c <= r + shift) if sub_causal else torch.ones_like(r * c, dtype=bool)
                    covered[rows, keys] += seen.long()
                visible = (j >= first) & (j < end) & (i >= r0) & (i < r1)
                if causal:
                    visible = visible & (j <= i + n_k - n_q)
                assert torch.equal(covered, visible.long()), (r0, r1, first, end)


def test_mask_blocks_only_for_one_run_of_keys_per_document():
    q = torch.zeros(3, 1, 4, 2)
    every = slice(0, 4)
    pad = torch.tensor([[False, False, True, True], [True, False, False, False], [True] * 4])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "MASK_BLOCK_PAIRS", 1)  # any number of calls
        assert kernels._mask_blocks(Mask(4, 6, causal=True), q) is None  # nothing to split
        blocks = kernels._mask_blocks(Mask(4, 4, key_padding=pad), q)
        # the first sequence's rows cut where their own key leaves the run (see _block_pieces)
        assert blocks == [
            [(slice(0, 2), slice(0, 2), False), (slice(2, 4), slice(0, 2), False)],
            [(slice(0, 1), slice(1, 4), False), (slice(1, 4), slice(1, 4), False)],
            [],
        ]
        lengths = torch.tensor([3, 1, 0])[:, None].expand(3, 4)
        both = Mask(4, 4, key_padding=pad, lengths=lengths, causal=True)
        # (the second sequence's key 0 is padding: no key left)
        causal_run = [(slice(0, 2), slice(0, 2), True), (slice(2, 4), slice(0, 2), False)]
        assert kernels._mask_blocks(both, q) == [causal_run, [], []]
        docs = torch.tensor([[0, 0, 1, 1], [5, 6, 6, 6], [2, 2, 2, 2]])
        blocks = kernels._mask_blocks(Mask(4, 4, q_doc=docs, k_doc=docs, causal=True), q)
        first, second, rest = slice(0, 2), slice(2, 4), slice(1, 4)
        assert blocks == [
            [(first, first, True), (second, second, True)],
            [(slice(0, 1), slice(0, 1), True), (rest, rest, True)],
            [(every, every, True)],
        ]
        gaps = torch.tensor([[False, True, False, False]] * 3)
        assert kernels._mask_blocks(Mask(4, 4, key_padding=gaps), q) is None
        by_query = torch.tensor([[1, 2, 3, 4]] * 3)  # lengths that change with the query
        assert kernels._mask_blocks(Mask(4, 4, lengths=by_query), q) is None
        split_doc = torch.tensor([[0, 1, 0, 1]] * 3)  # a document's keys in two runs
        assert kernels._mask_blocks(Mask(4, 4, q_doc=split_doc, k_doc=split_doc), q) is None


@pytest.mark.parametrize("backend", ["sdpa", "lean"])
def test_masks_that_hide_every_key_keep_the_gradients(blocks_at_any_size, backend):
    """Every key hidden (found in review: the blocks had no call and returned zeros without
    a graph) or an empty batch: as math, zeros that backpropagate (to zero gradients)."""
    from posenc import ShawRelativePosition

    scheme = None if backend == "sdpa" else ShawRelativePosition(4, 2)
    pos = torch.arange(4)[None]
    for b in (2, 0):
        q, k, v = (torch.randn(b, 2, 4, 4, requires_grad=True) for _ in range(3))
        mask = Mask(4, 4, key_padding=torch.ones(b, 4, dtype=torch.bool))
        out, _ = attend(q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask, backend=backend)
        assert out.shape == (b, 2, 4, 4) and not out.any()
        out.sum().backward()
        assert q.grad is not None and not q.grad.any()
        if scheme is not None and b:
            assert all(p.grad is not None and not p.grad.any() for p in scheme.parameters())


def test_mask_blocks_leave_small_documents_to_one_masked_call():
    """More than one call per MASK_BLOCK_PAIRS pairs of the masked call costs more than it
    saves (documents of 64 tokens at n = 512: 8 calls, 32 tokens: 16)."""
    q = torch.zeros(1, 1, 512, 2)
    for length, split in ((64, True), (32, False)):
        doc = (torch.arange(512) // length)[None]
        mask = Mask(512, 512, q_doc=doc, k_doc=doc, causal=True)
        assert (kernels._mask_blocks(mask, q) is not None) == split, length


@pytest.fixture
def blocks_at_any_size(monkeypatch):
    """Masks split into blocks whatever the size of their calls (MASK_BLOCK_PAIRS)."""
    monkeypatch.setattr(kernels, "MASK_BLOCK_PAIRS", 1)


def _padded_schemes(h: int, d: int) -> dict[str, object]:
    from posenc import (
        ALiBi,
        RelativePositionBias,
        RelativeQueryEmbedding,
        ShawRelativePosition,
        T5RelativeBias,
    )

    return {
        "alibi": ALiBi(h),
        "t5": T5RelativeBias(h, num_buckets=8, max_distance=16),
        "swin-1d": RelativePositionBias(40, h),
        "relative": RelativeQueryEmbedding(40, d),
        "shaw": ShawRelativePosition(d, 3),
        "bias": TableBias(h),
        "value": ValueTable(d),
    }


PADDINGS = {  # per batch element: (visible keys first, end) of n_k keys
    "right": lambda n_k: [(0, n_k), (0, n_k - 5)],
    "left": lambda n_k: [(4, n_k), (0, n_k)],
    "one empty": lambda n_k: [(0, 0), (2, n_k - 1)],
}


@pytest.mark.parametrize("scheme_name", list(_padded_schemes(2, 4)))
@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n_q", "n_k"), [(13, 13), (3, 13)])
def test_padding_at_the_ends_takes_the_fused_paths_and_equals_math(
    blocks_at_any_size, monkeypatch, scheme_name, padding, causal, n_q, n_k
):
    """Key padding at either end (or lengths the same for a sequence's queries) runs each
    batch element over its visible keys with no mask but the causal one: the per-offset
    paths, not the general engine; outputs and every gradient equal math's, with per-batch
    positions (a cache of 10 tokens ahead for n_q = 3)."""
    calls = spy_on(monkeypatch, kernels._LeanFusedAttention)
    term_runs = spy_on(monkeypatch, kernels._OffsetTermAttention)
    bias_runs = spy_on(monkeypatch, kernels._OffsetFusedAttention)
    block_rows(monkeypatch, 4)
    torch.manual_seed(0)
    b, h, d = 2, 2, 4
    scheme = _padded_schemes(h, d)[scheme_name].double()
    for p in scheme.parameters():
        nn.init.normal_(p)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for n in (n_q, n_k, n_k))
    k_pos = torch.arange(n_k)[None] + torch.tensor([[0], [7]])  # [b, n_k]
    q_pos = k_pos[:, n_k - n_q :]
    j = torch.arange(n_k)[None, :]
    first, end = (torch.tensor(x)[:, None] for x in zip(*PADDINGS[padding](n_k), strict=True))
    mask = Mask(n_q, n_k, key_padding=(j < first) | (j >= end), causal=causal)
    grads = lean_and_math(scheme, q, k, v, q_pos, k_pos, mask)
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a)
    if scheme_name not in ("bias", "value"):  # (the test doubles have no per-offset hooks)
        assert term_runs or bias_runs
        assert not calls  # no general engine


@pytest.mark.parametrize("scheme_name", list(_padded_schemes(2, 4)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_packed_documents_take_the_fused_paths_and_equal_math(
    blocks_at_any_size, monkeypatch, scheme_name, causal, padded
):
    """Packed sequences (documents side by side, positions restarting in each, the end of
    one batch element padded): each document runs alone on the per-offset paths; outputs
    and every gradient equal math's."""
    calls = spy_on(monkeypatch, kernels._LeanFusedAttention)
    term_runs = spy_on(monkeypatch, kernels._OffsetTermAttention)
    bias_runs = spy_on(monkeypatch, kernels._OffsetFusedAttention)
    block_rows(monkeypatch, 4)
    torch.manual_seed(0)
    b, h, d, n = 2, 2, 4, 15
    scheme = _padded_schemes(h, d)[scheme_name].double()
    for p in scheme.parameters():
        nn.init.normal_(p)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    lengths = [[6, 9], [4, 4, 7]]  # documents per batch element
    doc = torch.stack([torch.cat([torch.full((m,), t) for t, m in enumerate(x)]) for x in lengths])
    pos = torch.stack([torch.cat([torch.arange(m) for m in x]) for x in lengths])
    padding = (torch.arange(n)[None, :] >= torch.tensor([[n], [n - 3]])) if padded else None
    mask = Mask(n, n, causal=causal, q_doc=doc, k_doc=doc, key_padding=padding)
    grads = lean_and_math(scheme, q, k, v, pos, pos, mask)
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a)
    if scheme_name not in ("bias", "value"):  # (the test doubles have no per-offset hooks)
        assert len(term_runs) + len(bias_runs) >= 5  # a call or more per document
        assert not calls  # no general engine


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_takes_packed_documents_and_padding_block_by_block(
    blocks_at_any_size, sdpa_masks, causal
):
    """No positional term (no scheme, or rotary, whose rotation comes before): SDPA runs
    each document of each sequence alone, with no [n_q, n_k] mask (its own causal flag on
    square blocks), and equals math; a padded query row of a document that lost its keys
    is 0."""
    masks, _ = sdpa_masks
    torch.manual_seed(0)
    n = 12
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    padding = torch.arange(n)[None, :] >= torch.tensor([[10], [9]])
    mask = Mask(n, n, causal=causal, q_doc=doc, k_doc=doc, key_padding=padding)
    q, k, v = (torch.randn(2, 3, n, 4, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    results = {}
    for backend in ("math", "sdpa"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = attend(*leaves, q_pos=pos, k_pos=pos, mask=mask, backend=backend)
        (out * torch.linspace(-1, 1, 4, dtype=out.dtype)).sum().backward()
        results[backend] = [out, *(t.grad for t in leaves)]
    for a, c in zip(results["math"], results["sdpa"], strict=True):
        torch.testing.assert_close(c, a)
    # documents [0, 5) and [5, 10) of the first sequence, [0, 9) of the second; causal, also
    # the padded rows of the last document of each, which see its whole run
    assert len(masks) == (5 if causal else 3)
    assert all(m is None or m.shape[-2:] != (n, n) for m in masks)


def test_packed_whole_maps_take_the_grid_path_per_map(blocks_at_any_size, monkeypatch):
    """Two 3 x 4 maps packed in a sequence, positions restarting in each: each map runs
    alone on the 2-D term's grid path, and equals math."""
    from posenc import RelativeQueryEmbedding2D

    grid = spy_on(monkeypatch, kernels._GridTermAttention)
    torch.manual_seed(0)
    scheme = RelativeQueryEmbedding2D((3, 4), 4).double()
    nn.init.normal_(scheme.height)
    nn.init.normal_(scheme.width)
    doc = (torch.arange(24) // 12)[None]
    pos = (torch.arange(24) % 12)[None]
    q, k, v = (torch.randn(1, 2, 24, 4, dtype=torch.float64) for _ in range(3))
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(24, 24, q_doc=doc, k_doc=doc))
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a)
    assert len(grid) == 2


def test_padding_at_the_ends_with_positions_per_sequence_equals_math(blocks_at_any_size):
    """Each batch element's calls take its own positions (here one sequence's are spread
    out, which a relative scheme sees)."""
    from posenc import T5RelativeBias

    torch.manual_seed(0)
    scheme = T5RelativeBias(2, num_buckets=8, max_distance=16).double()
    q, k, v = (torch.randn(2, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    pos = torch.stack([torch.arange(9), 3 * torch.arange(9)])  # [b, n]
    padding = torch.arange(9)[None, :] >= torch.tensor([[9], [6]])
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(9, 9, key_padding=padding))
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a)


def test_padding_queries_alone_leave_the_per_offset_path(blocks_at_any_size):
    """ALiBi over 200 tokens spans more than BIAS_SPAN, so rows that do not meet offset 0
    cannot take the per-offset path: with the end of a sequence padded, only the padding's
    own queries (the rows past its last key) take the general engine."""
    from posenc import ALiBi

    general = []
    apply = kernels._LeanFusedAttention.apply
    kernels_apply = lambda q, *a: general.append(q.shape[2]) or apply(q, *a)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels._LeanFusedAttention, "apply", kernels_apply)
        offset = spy_on(mp, kernels._OffsetFusedAttention)
        padding = torch.arange(200)[None, :] >= torch.tensor([[200], [150]])
        assert_lean_matches_math(ALiBi(8), 2, 8, 200, 4, Mask(200, 200, key_padding=padding))
    assert len(offset) == 2 and general == [50]  # each sequence's own rows; 50 padded rows


def test_lengths_equal_across_queries_equal_math(blocks_at_any_size):
    from posenc import T5RelativeBias

    torch.manual_seed(0)
    scheme = T5RelativeBias(2, num_buckets=8, max_distance=16).double()
    lengths = torch.tensor([9, 4])[:, None].expand(2, 11)
    assert_lean_matches_math(scheme, 2, 2, 11, 4, Mask(11, 11, lengths=lengths, causal=True))


@pytest.mark.parametrize(("n_q", "n_k"), [(30, 30), (10, 30), (30, 12)])
@pytest.mark.parametrize("causal", [False, True])
def test_far_parts_and_strips_split_the_pairs(monkeypatch, n_q, n_k, causal):
    """Shaw, k = 4: every visible pair is in exactly one of the lead part (first row), the
    tail part (last row) and its block's strip, whose hidden logit columns are the pairs
    of the other parts or hidden by the causal mask."""
    monkeypatch.setattr(kernels, "FAR_PAIRS", 0)
    table = torch.zeros(9, 2)
    width = n_q + n_k - 1
    offsets = torch.arange(width) - (n_q - 1)
    index = offsets.clamp(-4, 4) + 4
    parts, low, high = kernels._far_parts(table, None, index, n_q, n_k, causal)
    assert len(parts) == (1 if causal else 2)
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    visible = (j <= i + n_k - n_q) if causal else torch.ones(n_q, n_k, dtype=torch.bool)
    count = torch.zeros(n_q, n_k, dtype=torch.long)
    for part in parts:
        seq_i, seq_j = (n_q - 1 - i, n_k - 1 - j) if part.flip else (i, j)
        mine = seq_j <= seq_i + part.delta - 1
        assert (index[j - i + n_q - 1][mine] == part.row).all()  # one table row
        count += mine.long()
    for blk in (slice(s, min(s + 7, n_q)) for s in range(0, n_q, 7)):
        keys, cols, left, right = kernels._strip(blk, n_q, n_k, low, high)
        rows = blk.stop - blk.start
        for r in range(rows):
            for c in range(keys.start, keys.stop):
                col = c - keys.start - r + rows - 1  # the logit column of (r, c) in the skew
                assert index[cols][col] == index[c - (blk.start + r) + n_q - 1]
                shown = col >= left and (right is None or col < right)
                count[blk.start + r, c] += int(shown)
    assert torch.equal(count, visible.long())


def test_offset_term_with_any_index_equals_math(monkeypatch):
    block_rows(monkeypatch, 5)
    torch.manual_seed(0)
    scheme = CyclicTerm(8).double()
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for n in (13, 19, 19))
    q_pos, k_pos = torch.arange(6, 19)[None], torch.arange(19)[None]
    results = {}
    for backend in ("math", "lean"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        scheme.table.grad = None
        out = run(backend, scheme, *leaves, q_pos, k_pos, Mask(13, 19))
        out.square().sum().backward()
        results[backend] = [out, *(t.grad for t in leaves), scheme.table.grad]
    for got, expected in zip(results["lean"], results["math"], strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("std", [0.5, 40.0])  # 40: a term spanning > BIAS_SPAN (never clamped)
def test_offset_term_future_keys_have_exactly_no_influence(monkeypatch, std):
    from posenc import RelativeQueryEmbedding

    block_rows(monkeypatch, 4)
    torch.manual_seed(0)
    scheme = RelativeQueryEmbedding(12, 4)
    nn.init.normal_(scheme.weight, std=std)
    q, k, v = (torch.randn(1, 2, 12, 4) for _ in range(3))
    pos = torch.arange(12)[None]
    mask = Mask(12, 12, causal=True)
    out = run("lean", scheme, q, k, v, pos, pos, mask)
    v2 = v.clone()
    v2[:, :, 11] = 1e30  # only the last query may see the last key
    torch.testing.assert_close(
        run("lean", scheme, q, k, v2, pos, pos, mask)[:, :, :11], out[:, :, :11], rtol=0, atol=0
    )


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("kind", ["cyclic", "direction"])
def test_offset_term_any_index_any_size(monkeypatch, n, kind):
    """An index that is no clipped run, decreasing ones included, at several sizes."""
    block_rows(monkeypatch, 3)
    torch.manual_seed(0)
    scheme = CyclicTerm(8).double()
    if kind == "direction":  # row 1 for offsets <= 0, row 0 after: [1, .., 1, 0, .., 0]
        scheme.score_term = lambda q, q_pos, k_pos: torch.einsum(
            "bhid,bijd->bhij",
            q,
            scheme.table[(k_pos[:, None, :] <= q_pos[:, :, None]).long()].expand(
                q.shape[0], -1, -1, -1
            ),
        )
        first = lambda q_pos, k_pos: int(k_pos[0, 0] - q_pos[0, -1])  # noqa: E731
        scheme.offset_term = lambda q_pos, k_pos: (
            scheme.table,
            (torch.arange(q_pos.shape[-1] + k_pos.shape[-1] - 1) + first(q_pos, k_pos) <= 0).long(),
        )
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    results = {}
    for backend in ("math", "lean"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        scheme.table.grad = None
        out = run(backend, scheme, *leaves, pos, pos, Mask(n, n))
        out.square().sum().backward()
        results[backend] = [out, *(t.grad for t in leaves), scheme.table.grad]
    for got, expected in zip(results["lean"], results["math"], strict=True):
        torch.testing.assert_close(got, expected)


def test_a_subclass_overriding_a_hook_drops_the_parents_fast_forms():
    """A steeper ALiBi (score_bias overridden) must not run on ALiBi's offset_bias."""
    from posenc import ALiBi, RelativeQueryEmbedding

    class SteeperALiBi(ALiBi):
        def score_bias(self, q_pos, k_pos):
            return 1.1 * super().score_bias(q_pos, k_pos)

    class SteeperSlopes(ALiBi):  # the natural way: no hook overridden, fast forms kept
        def slopes(self, device=None):
            return 1.1 * super().slopes(device)

    class Both(ALiBi):  # a hook and its fast form redefined in one class: kept
        def score_bias(self, q_pos, k_pos):
            return super().score_bias(q_pos, k_pos)

        def offset_bias(self, q_pos, k_pos):
            return super().offset_bias(q_pos, k_pos)

    class Doubled(RelativeQueryEmbedding):
        def score_term(self, q, q_pos, k_pos):
            return 2 * super().score_term(q, q_pos, k_pos)

    assert hooks_of(SteeperALiBi(4)).offset_bias is None
    assert hooks_of(SteeperALiBi(4)).flex_score_mod is None
    assert hooks_of(SteeperSlopes(4)).offset_bias is not None
    assert hooks_of(Both(4)).offset_bias is not None
    assert hooks_of(ALiBi(4)).offset_bias is not None
    assert hooks_of(Doubled(16, 8)).offset_term is None
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(16)[None]
    for scheme in (SteeperALiBi(4), SteeperSlopes(4), Doubled(16, 8).double()):
        expected = run("math", scheme, q, k, v, pos, pos, Mask(16, 16))
        torch.testing.assert_close(run("auto", scheme, q, k, v, pos, pos, Mask(16, 16)), expected)


class SharedOffsetBias(nn.Module):
    """A learned bias per offset shared by the heads: ``offset_bias`` in its ``[1, W]`` form."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.values = nn.Parameter(torch.randn(2 * n - 1))

    def score_bias(self, q_pos, k_pos):
        offsets = k_pos[:, None, :] - q_pos[:, :, None]  # [B', n_q, n_k]
        return self.values[offsets + self.n - 1].unsqueeze(1)  # [B', 1, n_q, n_k]

    def offset_bias(self, q_pos, k_pos):
        offsets = run_offsets(q_pos, k_pos)
        return None if offsets is None else self.values[offsets + self.n - 1][None]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("learn", [True, False])
def test_offset_bias_path_with_a_bias_shared_by_the_heads(head_groups, monkeypatch, causal, learn):
    """``[1, W]`` values, learned (``dS`` summed over heads too, every block) or frozen (the
    fused backward reads one row for every head)."""
    calls = spy_on(monkeypatch, kernels._OffsetFusedAttention)
    offset_rows(monkeypatch, 5, 2, 20, 20)
    torch.manual_seed(0)
    scheme = SharedOffsetBias(20).double().requires_grad_(learn)
    assert_lean_matches_math(scheme, 2, 3, 20, 8, Mask(20, 20, causal=causal))
    assert calls


def test_offset_bias_kernel_calls_stop_at_the_last_key_seen(monkeypatch):
    """Without a mask one kernel call takes every query and head; under a causal mask a block
    of queries takes only the keys its last query sees (reversed: the last ones)."""
    from posenc import ALiBi

    shapes = []
    forward = kernels._flash_cpu
    monkeypatch.setattr(
        kernels,
        "_flash_cpu",
        lambda q, k, *a, **kw: (
            shapes.append((q.shape[1], q.shape[2], k.shape[2])) or forward(q, k, *a, **kw)
        ),
    )
    monkeypatch.setattr(kernels, "CAUSAL_ROWS", 5)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8) for _ in range(3))
    pos = torch.arange(20)[None]
    run("lean", ALiBi(3), q, k, v, pos, pos, Mask(20, 20))
    assert shapes == [(3, 20, 20)]
    shapes.clear()
    run("lean", ALiBi(3), q, k, v, pos, pos, Mask(20, 20, causal=True))
    assert shapes == [(3, 5, 5), (3, 5, 10), (3, 5, 15), (3, 5, 20)]


@pytest.mark.parametrize("name", ["t5", "relative"])
def test_offset_bias_path_with_frozen_tables(monkeypatch, name):
    """No table gradient wanted: the fused backward, q/k/v gradients still exact."""
    calls = spy_on(monkeypatch, kernels._OffsetFusedAttention)
    fused_backward = []
    backward = kernels._flash_cpu_backward
    monkeypatch.setattr(
        kernels,
        "_flash_cpu_backward",
        lambda *a, **kw: fused_backward.append(1) or backward(*a, **kw),
    )
    offset_rows(monkeypatch, 5, 2, 20, 20)
    scheme = _offset_scheme(name, 3).double().requires_grad_(False)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(20)[None]
    results = {}
    for backend in ("math", "lean"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(backend, scheme, *leaves, pos, pos, Mask(20, 20))
        out.square().sum().backward()
        results[backend] = [out, *(t.grad for t in leaves)]
    assert calls and fused_backward
    for got, expected in zip(results["lean"], results["math"], strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("scheme_name", ["relative", "relative-2d"])
def test_a_content_term_is_never_clamped(monkeypatch, scheme_name):
    """q.r spans 400 but q.k cancels it for one key: that key counts (no BIAS_SPAN clamp)."""
    from posenc import RelativeQueryEmbedding, RelativeQueryEmbedding2D

    if scheme_name == "relative":
        scheme = RelativeQueryEmbedding(8, 4).double()
        table, row = scheme.weight, 7 + 7  # offset +7
    else:
        scheme = RelativeQueryEmbedding2D((2, 4), 4).double()
        table, row = scheme.width, 3 + 3  # column offset +3: key 7 from query 0
    with torch.no_grad():
        for p in scheme.parameters():
            p.zero_()
        table[row, 0] = -100.0
    q = torch.zeros(1, 1, 8, 4, dtype=torch.float64)
    q[..., 0] = 8.0  # scaled term of (0, 7): -400
    k = torch.zeros(1, 1, 8, 4, dtype=torch.float64)
    k[0, 0, 7, 0] = 100.0  # scaled q.k of (0, 7): +400, so key 7 ties with the others
    v = torch.arange(8.0, dtype=torch.float64).view(1, 1, 8, 1).expand(1, 1, 8, 4)
    pos = torch.arange(8)[None]
    monkeypatch.setattr(kernels, "LEAN_BLOCK_ELEMENTS", 8)  # the fast paths even at this size
    with torch.no_grad():
        got = run("auto", scheme, q, k, v, pos, pos, Mask(8, 8))
        expected = run("math", scheme, q, k, v, pos, pos, Mask(8, 8))
    torch.testing.assert_close(got, expected)
    if scheme_name == "relative":
        assert float(expected[0, 0, 0, 0]) == pytest.approx(3.5)  # the mean of keys 0..7


def test_offset_term_rejects_offsets_beyond_the_table():
    from posenc import RelativeQueryEmbedding

    with pytest.raises(
        ValueError, match=r"offsets k_pos - q_pos range from -9 to 9.*max_len >= 10"
    ):
        RelativeQueryEmbedding(6, 4).offset_term(torch.arange(10)[None], torch.arange(10)[None])
    assert (
        RelativeQueryEmbedding(6, 4).offset_term(torch.tensor([[0, 2]]), torch.arange(3)[None])
        is None
    )


@pytest.mark.parametrize(
    ("window", "table", "grid_path"),
    [
        ((4, 6), "learned", True),
        ((5, 3), "learned", True),
        ((4, 6), "peaked", True),  # spans > BIAS_SPAN, best at offset (0, 0): raised
        ((4, 6), "off-centre", False),  # spans > BIAS_SPAN, best elsewhere: general path
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("map_rows", [1, 2, None])
def test_grid_bias_path_equals_math(
    head_groups, monkeypatch, window, table, grid_path, dtype, map_rows
):
    """A 2-D table over a whole map, no mask: the map-row engine, outputs and gradients;
    one map row a block, two (a short last block on the 5-row map), all."""
    from posenc import RelativePositionBias

    calls = spy_on(monkeypatch, kernels._GridFusedAttention)
    monkeypatch.setattr(kernels, "LEAN_BLOCK_ELEMENTS", 64)
    monkeypatch.setattr(kernels, "GRID_BIAS_PAIRS", 0)
    grid_rows(monkeypatch, map_rows, *window)
    b, h, d = 2, 3, 8
    n = window[0] * window[1]
    torch.manual_seed(1)
    scheme = RelativePositionBias(window, h).to(dtype)
    with torch.no_grad():
        nn.init.normal_(scheme.table, std=2.0)
        if table != "learned":
            # -10 per unit of distance from the best offset: far keys 70 and more below it
            rows, cols = torch.meshgrid(
                torch.arange(2 * window[0] - 1), torch.arange(2 * window[1] - 1), indexing="ij"
            )
            best = (window[0] - 1, window[1] - 1) if table == "peaked" else (0, 0)
            far = (rows - best[0]).abs() + (cols - best[1]).abs()
            scheme.table.sub_(10.0 * far.flatten()[:, None].to(dtype))
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for _ in range(3))
    pos = torch.arange(n)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(n, n))
    assert bool(calls) == grid_path
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a, atol=tol, rtol=tol)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize(("size", "std"), [((4, 6), 0.5), ((5, 3), 0.5), ((4, 6), 40.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("map_rows", [1, 2, None])
def test_grid_term_path_equals_math(head_groups, monkeypatch, per_head, size, std, dtype, map_rows):
    """2-D relative embedding over a whole map, no mask: outputs and every gradient; one map
    row a block, two (a short last block on the 5-row map), all."""
    from posenc import RelativeQueryEmbedding2D

    calls = spy_on(monkeypatch, kernels._GridTermAttention)
    monkeypatch.setattr(kernels, "LEAN_BLOCK_ELEMENTS", 64)
    grid_rows(monkeypatch, map_rows, *size)
    b, h, d = 2, 3, 8
    n = size[0] * size[1]
    torch.manual_seed(1)
    scheme = RelativeQueryEmbedding2D(size, d, heads=h if per_head else None).to(dtype)
    for table in (scheme.height, scheme.width):
        nn.init.normal_(table, std=std)  # 40: the term spans > BIAS_SPAN (never clamped)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for _ in range(3))
    pos = torch.arange(n)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(n, n))
    assert calls
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    if std > 1 and dtype == torch.float32:
        tol = 1e-4  # logits in the hundreds: float32 rounding of the scores themselves
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a, atol=tol, rtol=tol)
    assert scheme.grid_term(pos[:, 1:], pos) is None  # not the whole map: general path


@pytest.mark.parametrize("map_rows", [1, 2, None])
def test_grid_bias_path_with_a_frozen_table(monkeypatch, map_rows):
    """A frozen 2-D table: the fused kernel's backward over blocks of whole map rows (no
    ``dS`` written out), outputs and input gradients as math's."""
    from posenc import RelativePositionBias

    calls = spy_on(monkeypatch, kernels._GridFusedAttention)
    fused_backward = []
    backward = kernels._flash_cpu_backward
    monkeypatch.setattr(
        kernels,
        "_flash_cpu_backward",
        lambda *a, **kw: fused_backward.append(a[1].shape[2]) or backward(*a, **kw),
    )
    monkeypatch.setattr(kernels, "LEAN_BLOCK_ELEMENTS", 64)
    monkeypatch.setattr(kernels, "GRID_BIAS_PAIRS", 0)
    monkeypatch.setattr(kernels, "_head_groups", lambda b, h: [slice(i, i + 1) for i in range(h)])
    b, h, d, window = 2, 3, 8, (5, 3)
    grid_rows(monkeypatch, map_rows, *window)
    torch.manual_seed(1)
    scheme = RelativePositionBias(window, h).double().requires_grad_(False)
    with torch.no_grad():
        nn.init.normal_(scheme.table, std=2.0)
    assert_lean_matches_math(scheme, b, h, 15, d)
    assert calls
    # queries per kernel backward call: whole map rows, the last block short
    expected = {1: {3}, 2: {6, 3}, None: {15}}[map_rows]
    assert set(fused_backward) == expected


def test_grid_paths_by_size(monkeypatch):
    """A 2-D bias takes its grid path from GRID_BIAS_PAIRS query-key pairs per head (below,
    the general engine's one block is faster); a 2-D term at any size."""
    from posenc import RelativePositionBias, RelativeQueryEmbedding2D

    bias_calls = spy_on(monkeypatch, kernels._GridFusedAttention)
    term_calls = spy_on(monkeypatch, kernels._GridTermAttention)
    q, k, v = (torch.randn(2, 3, 24, 8) for _ in range(3))
    pos = torch.arange(24)[None]
    bias, term = RelativePositionBias((4, 6), 3), RelativeQueryEmbedding2D((4, 6), 8)
    for pairs, taken in ((24 * 24 + 1, 0), (24 * 24, 1)):
        monkeypatch.setattr(kernels, "GRID_BIAS_PAIRS", pairs)
        bias_calls.clear()
        with torch.no_grad():
            run("auto", bias, q, k, v, pos, pos, Mask(24, 24))
        assert len(bias_calls) == taken
    with torch.no_grad():
        run("auto", term, q, k, v, pos, pos, Mask(24, 24))
    assert term_calls


@pytest.mark.parametrize("learn", [True, False])
def test_grid_bias_buffers_stay_within_their_budget(monkeypatch, learn):
    """Every :class:`_GridBias` buffer, forward and backward (learned or frozen table, with
    head groups of two), holds at most ``GRID_BUFFER_ELEMENTS`` values."""
    from posenc import RelativePositionBias

    sizes = []
    init = kernels._GridBias.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sizes.append(self.buffer.numel())

    monkeypatch.setattr(kernels._GridBias, "__init__", spy)
    monkeypatch.setattr(kernels, "LEAN_BLOCK_ELEMENTS", 64)
    monkeypatch.setattr(kernels, "GRID_BIAS_PAIRS", 0)
    monkeypatch.setattr(kernels, "_head_groups", lambda b, h: [slice(0, 2), slice(2, 3)])
    budget = 3 * kernels._GridBias.copy_size(5, 3)  # three map rows of one head
    monkeypatch.setattr(kernels, "GRID_BUFFER_ELEMENTS", budget)
    torch.manual_seed(0)
    scheme = RelativePositionBias((5, 3), 3).double().requires_grad_(learn)
    assert_lean_matches_math(scheme, 2, 3, 15, 8)
    assert sizes and max(sizes) <= budget


@pytest.mark.parametrize("name", ["t5", "relative", "shaw", "swin-2d", "relative-2d"])
def test_fast_paths_take_inputs_in_projection_layout(monkeypatch, name):
    """q, k, v as a projection gives them, ``[b, n, h, d]`` viewed as ``[b, h, n, d]`` (not
    contiguous): every fast path with a written-out backward, outputs and gradients."""
    from posenc import (
        RelativePositionBias,
        RelativeQueryEmbedding,
        RelativeQueryEmbedding2D,
        ShawRelativePosition,
        T5RelativeBias,
    )

    b, h, d, n = 2, 3, 8, 24
    engine, scheme = {
        "t5": (
            kernels._OffsetFusedAttention,
            lambda: T5RelativeBias(h, num_buckets=8, max_distance=16),
        ),
        "relative": (kernels._OffsetTermAttention, lambda: RelativeQueryEmbedding(n, d)),
        "shaw": (kernels._OffsetTermAttention, lambda: ShawRelativePosition(d, 3)),
        "swin-2d": (kernels._GridFusedAttention, lambda: RelativePositionBias((4, 6), h)),
        "relative-2d": (kernels._GridTermAttention, lambda: RelativeQueryEmbedding2D((4, 6), d)),
    }[name]
    calls = spy_on(monkeypatch, engine)
    monkeypatch.setattr(kernels, "FAR_PAIRS", 0)  # Shaw's far parts too
    monkeypatch.setattr(kernels, "GRID_BIAS_PAIRS", 0)  # the 2-D bias's gate
    block_rows(monkeypatch, 5)
    offset_rows(monkeypatch, 5, b, n, n)
    torch.manual_seed(1)
    scheme = scheme().double()
    for p in scheme.parameters():
        nn.init.normal_(p, std=1.0)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float64).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    pos = torch.arange(n)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(n, n))
    assert calls
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a)


def test_grid_bias_is_the_score_bias_by_offsets():
    from posenc import RelativePositionBias

    scheme = RelativePositionBias((3, 4), 2)
    pos = torch.arange(12)[None]
    grid = scheme.grid_bias(pos, pos)  # [h, 5, 7]
    bias = scheme.score_bias(pos, pos)[0]  # [h, 12, 12]
    for i in range(12):
        for j in range(12):
            dr, dc = j // 4 - i // 4, j % 4 - i % 4
            torch.testing.assert_close(grid[:, dr + 2, dc + 3], bias[:, i, j], rtol=0, atol=0)
    assert scheme.grid_bias(pos[:, :6], pos) is None  # not the whole map
    assert scheme.grid_bias(pos.flip(-1), pos) is None  # not in order
    assert RelativePositionBias(12, 2).grid_bias(pos, pos) is None  # 1-D


def test_skewed_bias_blocks_are_the_toeplitz_rows():
    from posenc.indices import toeplitz

    values = torch.randn(3, 11 + 6 - 1)
    full = toeplitz(values, 11, 6)  # [h, n_q, n_k]
    groups = [slice(0, 2), slice(2, 3)]
    for shared in (False, True):
        vals = values[:1] if shared else values
        seen = []
        for heads, skewed in kernels._SkewedBias.per_group(vals, groups, 11, 6, rows=4):
            seen.append(heads)
            for start in (0, 4, 8):
                count = min(4, 11 - start)
                block = skewed.block(start, count)  # [1, g|1, count, n_k]
                want = full[:1] if shared else full[heads]
                torch.testing.assert_close(block[0], want[:, start : start + count], rtol=0, atol=0)
                first = skewed.block(start, count, keys=3)  # the first 3 keys
                torch.testing.assert_close(first, block[..., :3], rtol=0, atol=0)
        assert seen == groups


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("scheme_name", ["none", "bias", "value"])
def test_masked_keys_have_exactly_no_influence(small_blocks, monkeypatch, fused, scheme_name):
    if not fused:
        monkeypatch.setattr(kernels, "_fused_cpu_available", lambda q, hooks: False)
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
    rows = lean_block_rows(2, 8, 4096, 4096)
    assert rows * 2 * 8 * 4096 <= kernels.LEAN_BLOCK_ELEMENTS < 2 * rows * 2 * 8 * 4096
    assert lean_block_rows(1, 1, 10, 10) == 10
    assert 16 <= lean_block_rows(64, 64, 8192, 8192) <= 512
    # per-offset bias path: one call for every query, blocks under a causal mask
    assert kernels._kernel_rows(4096) == 4096
    assert kernels._kernel_rows(4096, causal=True) == kernels.CAUSAL_ROWS
    assert kernels._kernel_rows(10, causal=True) == 10
    assert kernels._written_rows(2, 1, 4096, 4096) * 2 * 4096 == kernels.WRITTEN_BLOCK_ELEMENTS
    assert kernels._written_rows(2, 1, 4096, 4096, 1 << 21) == 256  # the 2-D term's budget
    assert kernels._written_rows(2, 1, 4096, 4096, 1 << 30) == 512  # at most 512 rows
    assert kernels._written_rows(1, 1, 7, 7) == 7


def test_auto_choice():
    pos = torch.arange(4)[None]
    q = torch.zeros(1, 1, 4, 2)
    assert choose_backend(hooks_of(None), q) == "sdpa"
    assert choose_backend(hooks_of(TableBias(1)), q) == "lean"
    assert choose_backend(hooks_of(ValueTable(2)), q) == "lean"
    assert choose_backend(hooks_of(TableBias(1)), q, dropout_p=0.1) == "sdpa"
    assert choose_backend(hooks_of(ValueTable(2)), q, dropout_p=0.1) == "math"
    with pytest.raises(ValueError, match="backend='lean' has no attention dropout"):
        attend(
            q,
            q,
            q,
            scheme=None,
            q_pos=pos,
            k_pos=pos,
            mask=Mask(4, 4),
            backend="lean",
            dropout_p=0.5,
        )


MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, torch
    sys.path.insert(0, {tests!r})
    from test_kernels import TableBias, ValueTable
    from posenc.kernels import Mask, attend
    torch.manual_seed(0)
    backend, scheme_name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    b, h, d = 1, 4, 32
    scheme = {{"bias": TableBias(h), "value": ValueTable(d)}}[scheme_name]
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    pos = torch.arange(n)[None]
    grad = torch.randn(b, h, n, d)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out, _ = attend(q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=Mask(n, n, causal=True),
                    backend=backend)
    out.backward(grad)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({{"peak_kib": after - before}}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("scheme_name", ["bias", "value"])
def test_lean_memory_stays_below_one_score_matrix(tmp_path, scheme_name):
    """At n = 4096 a fwd+bwd peaks below the size of one b*h*n*n float32 tensor."""
    script = tmp_path / "memory.py"
    script.write_text(MEMORY_SCRIPT.format(tests=str(__import__("pathlib").Path(__file__).parent)))
    n, b, h = 4096, 1, 4
    one_matrix_kib = b * h * n * n * 4 / 1024

    def peak(backend):
        result = subprocess.run(
            [sys.executable, str(script), backend, scheme_name, str(n)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return json.loads(result.stdout.strip().splitlines()[-1])["peak_kib"]

    lean = peak("lean")
    assert lean < one_matrix_kib, (lean, one_matrix_kib)
    assert peak("math") > 2 * one_matrix_kib  # the check can fail: the reference is quadratic
