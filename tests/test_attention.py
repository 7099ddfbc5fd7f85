"""MultiHeadAttention against a row-by-row float64 reference written here.

Scheme-specific parity (every scheme, every backend) lives in tests/test_schemes.py.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from torch import nn

from posenc.attention import MultiHeadAttention
from tolerances import assert_close, forward

BACKENDS = ["math", "sdpa", "lean", "auto"]
EPS32 = torch.finfo(torch.float32).eps


class DecayBias(nn.Module):
    """The docstring's example scheme: a learned per-head decay with distance."""

    def __init__(self, heads):
        super().__init__()
        self.rate = nn.Parameter(torch.linspace(0.1, 0.5, heads))

    def score_bias(self, q_pos, k_pos):
        distance = (k_pos[:, None, :] - q_pos[:, :, None]).abs()  # [B', n_q, n_k]
        return -self.rate[:, None, None] * distance[:, None]  # [B', h, n_q, n_k]


class QueryTerm(nn.Module):
    """A content-dependent term: q_i . r[j - i] with a small learned table."""

    def __init__(self, head_dim, span=16):
        super().__init__()
        self.span = span
        self.table = nn.Parameter(torch.randn(2 * span + 1, head_dim))

    def score_term(self, q, q_pos, k_pos):
        rel = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-self.span, self.span) + self.span
        r = self.table[rel]  # [B', n_q, n_k, d]
        return torch.einsum("bhid,bijd->bhij", q, r.expand(q.shape[0], -1, -1, -1))


def reference(m, query, key=None, *, visible=None, bias=None, term=None):
    """Multi-head attention one query row at a time, float64.

    visible(b, i, j) -> bool; bias(h, i, j) -> float (after scaling);
    term(b, h, i, j, q_vec) -> float (before scaling).
    """
    key = query if key is None else key
    wq, wk, wv, wo = (
        p.weight.detach().double() for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj)
    )
    bq, bk, bv, bo = (p.bias.detach().double() for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj))
    q_all = query.double() @ wq.T + bq
    k_all = key.double() @ wk.T + bk
    v_all = key.double() @ wv.T + bv
    b, n_q, dim = query.shape
    n_k, h, d = key.shape[1], m.heads, m.head_dim
    heads_out = torch.zeros(b, n_q, dim, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            cols = slice(hi * d, (hi + 1) * d)
            for i in range(n_q):
                qv = q_all[bi, i, cols]
                js = [j for j in range(n_k) if visible is None or visible(bi, i, j)]
                if not js:
                    continue  # no key: zero attention output
                scores = []
                for j in js:
                    s = float(qv @ k_all[bi, j, cols])
                    if term is not None:
                        s += term(bi, hi, i, j, qv)
                    s /= math.sqrt(d)
                    if bias is not None:
                        s += bias(hi, i, j)
                    scores.append(s)
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for w, j in zip(weights, js, strict=True):
                    heads_out[bi, i, cols] += (w / total) * v_all[bi, j, cols]
    return heads_out @ wo.T + bo


def make(backend="auto", position=None, dim=16, heads=4, **kw):
    torch.manual_seed(0)
    return MultiHeadAttention(dim, heads, position=position, backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_self_attention(backend):
    m = make(backend)
    x = torch.randn(2, 6, 16)
    got, logit = forward(m, x)  # float32 against float64: 6 keys, tests/tolerances.py
    assert_close(got, reference(m, x), terms=6, logit=logit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_valid_lens_both_shapes(backend):
    m = make(backend)
    x = torch.randn(2, 5, 16)
    lens = torch.tensor([3, 1])
    expected = reference(m, x, visible=lambda b, i, j: j < int(lens[b]))
    got, logit = forward(m, x, valid_lens=lens)
    assert_close(got, expected, terms=5, logit=logit)
    per_query = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 0, 2, 1]])
    expected = reference(m, x, visible=lambda b, i, j: j < int(per_query[b, i]))
    got, logit = forward(m, x, valid_lens=per_query)
    assert_close(got, expected, terms=5, logit=logit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_padding_mask_equals_valid_lens(backend):
    m = make(backend)
    x = torch.randn(3, 7, 16)
    lens = torch.tensor([7, 4, 2])
    padding = torch.arange(7)[None, :] >= lens[:, None]  # True = padding
    expected, logit = forward(m, x, valid_lens=lens)
    assert_close(m(x, key_padding_mask=padding), expected, terms=7, logit=logit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_and_cross_attention_aligned_at_the_end(backend):
    m = make(backend)
    x = torch.randn(2, 6, 16)
    expected = reference(m, x, visible=lambda b, i, j: j <= i)
    got, logit = forward(m, x, causal=True)
    assert_close(got, expected, terms=6, logit=logit)
    memory = torch.randn(2, 9, 16)
    queries = torch.randn(2, 4, 16)
    expected = reference(m, queries, memory)
    got, logit = forward(m, queries, memory)
    assert_close(got, expected, terms=9, logit=logit)
    # causal with fewer queries than keys: query i is position i + 5 of 9
    expected = reference(m, queries, memory, visible=lambda b, i, j: j <= i + 5)
    got, logit = forward(m, queries, memory, causal=True)
    assert_close(got, expected, terms=9, logit=logit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_zero_never_nan(backend):
    m = make(backend, bias=False)
    x = torch.randn(2, 4, 16, requires_grad=True)
    padding = torch.tensor([[True] * 4, [False, True, True, True]])
    out = m(x, key_padding_mask=padding, causal=True)
    assert out[0].eq(0).all()  # batch 0 has no key at all: exactly zero
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    lens = torch.tensor([[0, 2, 0, 1], [4, 4, 4, 4]])
    out = m(x, valid_lens=lens)
    assert out[0, 0].eq(0).all() and out[0, 2].eq(0).all() and out[0, 1].ne(0).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_scheme_added_after_scaling(backend):
    scheme = DecayBias(4)
    m = make(backend, position=scheme)
    x = torch.randn(2, 5, 16)
    rate = scheme.rate.detach().double()
    expected = reference(
        m, x, visible=lambda b, i, j: j <= i, bias=lambda h, i, j: -float(rate[h]) * abs(j - i)
    )
    got, logit = forward(m, x, causal=True)
    assert_close(got, expected, terms=5, logit=logit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_score_term_scaled_with_qk(backend):
    torch.manual_seed(1)
    scheme = QueryTerm(4)
    m = make(backend, position=scheme)
    x = torch.randn(2, 5, 16)
    table = scheme.table.detach().double()

    def term(b, h, i, j, qv):
        return float(qv @ table[max(-16, min(16, j - i)) + 16])

    got, logit = forward(m, x)
    assert_close(got, reference(m, x, term=term), terms=5, logit=logit)


@pytest.mark.parametrize("scheme_cls", [DecayBias, QueryTerm])
def test_backends_agree_on_outputs_and_gradients(scheme_cls):
    x = torch.randn(2, 7, 16)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 5:] = True
    results = {}
    for backend in ["math", "sdpa"]:
        torch.manual_seed(3)
        scheme = scheme_cls(4)
        m = MultiHeadAttention(16, 4, position=scheme, backend=backend)
        xi = x.clone().requires_grad_()
        out, logit = forward(m, xi, key_padding_mask=padding, causal=True)
        out.pow(2).sum().backward()
        results[backend] = (out, xi.grad, [p.grad for p in m.parameters()])
    (o1, g1, p1), (o2, g2, p2) = results["math"], results["sdpa"]
    close = dict(terms=7, logit=logit)
    assert_close(o2, o1, **close)
    # the gradients at the size of the largest: they sum the same score gradients, which
    # cancel in some (k_proj.bias: exactly, as a row's softmax ignores a constant)
    size = max(float(g.abs().max()) for g in (g1, *p1))
    assert_close(g2, g1, magnitude=size, **close)
    for a, b in zip(p1, p2, strict=True):
        assert_close(b, a, magnitude=size, **close)


@pytest.mark.parametrize("backend", BACKENDS)
def test_permutation_equivariant_without_positions(backend):
    m = make(backend)
    x = torch.randn(2, 8, 16)
    perm = torch.randperm(8)
    expected, logit = forward(m, x)
    assert_close(m(x[:, perm]), expected[:, perm], terms=8, logit=logit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_relative_scheme_is_translation_invariant(backend):
    m = make(backend, position=DecayBias(4))
    x = torch.randn(2, 6, 16)
    shifted = torch.arange(6) + 1000
    expected, logit = forward(m, x)
    assert_close(m(x, positions=shifted), expected, terms=6, logit=logit)
    per_batch = torch.stack([torch.arange(6) + 3, torch.arange(6) + 77])
    assert_close(m(x, positions=per_batch), expected, terms=6, logit=logit)
    # but a scheme is not blind to order: reversing positions changes the output
    assert not torch.allclose(m(x, positions=torch.arange(6).flip(0) * 3), m(x), atol=1e-4)


def test_need_weights_rows_sum_to_one_or_zero():
    m = make("sdpa", position=DecayBias(4))
    x = torch.randn(2, 5, 16)
    lens = torch.tensor([[5, 5, 0, 5, 5], [2, 2, 2, 2, 2]])
    out, weights = m(x, valid_lens=lens, need_weights=True)
    assert weights.shape == (2, 4, 5, 5)
    sums = weights.sum(-1)  # sums of 5 weights in [0, 1]
    assert_close(sums[0, :, 2], torch.zeros(4), magnitude=1.0, terms=5)
    sums[0, :, 2] = 1
    assert_close(sums, torch.ones_like(sums), terms=5)
    assert weights[1, :, :, 2:].eq(0).all()
    expected, logit = forward(m, x, valid_lens=lens)
    assert_close(out, expected, terms=5, logit=logit)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_dropout_only_in_training(backend):
    m = make(backend, dropout=0.5)
    x = torch.randn(2, 6, 16)
    m.eval()
    torch.testing.assert_close(m(x), m(x))
    reference_out = reference(m, x)
    got, logit = forward(m, x)
    assert_close(got, reference_out, terms=6, logit=logit)
    m.train()
    torch.manual_seed(0)
    assert not torch.allclose(m(x).double(), reference_out, atol=1e-3)


def test_docstring_example_scheme_runs():
    module = importlib.import_module("posenc.attention")  # the module, not the function

    namespace = {"nn": nn, "torch": torch, "MultiHeadAttention": MultiHeadAttention}
    example = module.__doc__.split("::\n")[1].split("\nPlace 1")[0]
    exec(compile(__import__("textwrap").dedent(example), "<docstring>", "exec"), namespace)
    attn = namespace["attn"]
    assert attn(torch.randn(1, 3, 64)).shape == (1, 3, 64)


def test_errors_name_the_argument_and_fix():
    with pytest.raises(ValueError, match=r"dim must be divisible by heads, got dim=10, heads=4"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match=r"backend must be one of .*got 'fast'"):
        MultiHeadAttention(8, 2, backend="fast")
    from posenc import SinusoidalEncoding

    with pytest.raises(TypeError, match=r"SinusoidalEncoding defines none of the attention hooks"):
        MultiHeadAttention(8, 2, position=SinusoidalEncoding(8))
    m = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"query must have shape \[batch, seq, dim=8\]"):
        m(torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"query must have last dimension dim=8, got shape"):
        m(torch.randn(1, 5, 6))
    with pytest.raises(TypeError, match="query must be a floating-point tensor"):
        m(torch.ones(1, 5, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="key has batch size 3 but query has 2"):
        m(torch.randn(2, 5, 8), torch.randn(3, 4, 8))
    with pytest.raises(ValueError, match="key and value must have the same length, got 4 and 3"):
        m(torch.randn(2, 5, 8), torch.randn(2, 4, 8), torch.randn(2, 3, 8))
    with pytest.raises(TypeError, match=r"key_padding_mask must be a bool tensor.*\.bool\(\)"):
        m(torch.randn(2, 5, 8), key_padding_mask=torch.zeros(2, 5))
    with pytest.raises(
        ValueError, match=r"key_padding_mask must have shape \[batch, n_k\] = \[2, 5\]"
    ):
        m(torch.randn(2, 5, 8), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"valid_lens must have shape \[batch\] = \[2\]"):
        m(torch.randn(2, 5, 8), valid_lens=torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="valid_lens must be an integer tensor"):
        m(torch.randn(2, 5, 8), valid_lens=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        m(torch.randn(2, 5, 8), positions=torch.arange(5.0))
    with pytest.raises(
        ValueError, match=r"positions must cover the sequence: expected last dimension n=5"
    ):
        m(torch.randn(2, 5, 8), positions=torch.arange(4))
    with pytest.raises(ValueError, match="key_positions is for cross-attention"):
        m(torch.randn(2, 5, 8), key_positions=torch.arange(5))
    with pytest.raises(ValueError, match="value was given without key"):
        m(torch.randn(2, 5, 8), value=torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="backend='sdpa' cannot add a value term"):

        class ValueOnly(nn.Module):
            def value_term(self, weights, q_pos, k_pos):
                return 0

        MultiHeadAttention(8, 2, position=ValueOnly(), backend="sdpa")(torch.randn(1, 3, 8))


def test_flex_backend_rejects_content_terms():
    m = make("flex", position=QueryTerm(4))
    with (
        torch.no_grad(),
        pytest.raises(
            ValueError, match="backend=.flex. takes a query term only with a bounded reach"
        ),
    ):
        m(torch.randn(1, 4, 16))


@pytest.mark.compile
def test_compile_fullgraph_parity():
    m = make("auto", position=DecayBias(4))
    x = torch.randn(2, 9, 16)
    lens = torch.tensor([9, 4])
    compiled = torch.compile(m, fullgraph=True)
    got = compiled(x, valid_lens=lens, causal=True)
    expected, logit = forward(m, x, valid_lens=lens, causal=True)
    assert_close(got, expected, terms=9, logit=logit)  # inductor reorders the float32 sums


# ----- defects: inputs that were misread, crashes, padding that leaked ------------------------


def build_scheme(name, heads=2, head_dim=4, n=4):
    from schemes import SCHEMES

    torch.manual_seed(0)
    scheme = SCHEMES[name].build(heads, head_dim, n, (2, n // 2))
    if isinstance(scheme, nn.Module):
        for p in scheme.parameters():  # tables away from zero: every term counts
            nn.init.normal_(p, std=0.5) if p.is_floating_point() else None
    return scheme


def scheme_names():
    from schemes import SCHEMES

    return sorted(SCHEMES)


def has_value_term(scheme):
    from posenc.hooks import hooks_of

    return hooks_of(scheme).value_term is not None


@pytest.mark.parametrize("backend", ["auto", "lean", "sdpa"])
@pytest.mark.parametrize("name", scheme_names())
def test_second_order_gradients_equal_math(name, backend):
    """A gradient penalty (create_graph=True, then backward) through every fast path equals
    the math path's, for the input and every parameter, scheme tables included; and
    gradgradcheck passes. Before the fix the lean paths' backwards were constants to
    autograd: T5, Swin-1d, the relative embeddings and Shaw gave wrong second derivatives."""
    scheme = build_scheme(name)
    if backend == "sdpa" and has_value_term(scheme):
        pytest.skip("sdpa has no value term")
    torch.manual_seed(1)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    results = {}
    for be in ("math", backend):
        torch.manual_seed(0)
        m = MultiHeadAttention(8, 2, position=scheme, backend=be).double()
        xi = x.clone().requires_grad_()
        out = m(xi, causal=True)
        (g,) = torch.autograd.grad((out * out.detach().sin()).sum(), xi, create_graph=True)
        penalty = (g**2).sum()
        params = [xi, *m.parameters()]
        results[be] = torch.autograd.grad(penalty, params, allow_unused=True)
    for got, want in zip(results[backend], results["math"], strict=True):
        if want is None:
            assert got is None or not got.any()
            continue
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    m = MultiHeadAttention(8, 2, position=scheme, backend=backend).double()
    xi = x[:1].clone().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: m(t, causal=True), (xi,), fast_mode=True)


def test_second_order_gradients_with_dropout_name_the_fix():
    m = make("sdpa", position=DecayBias(4), dropout=0.5).train()
    x = torch.randn(1, 5, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True through attention dropout.*'math'"):
        torch.autograd.grad(m(x).sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(m(x).sum(), x)  # first order: the fast path, with dropout
    assert g.isfinite().all()


class WideDecay(DecayBias):
    """DecayBias built for another number of heads than the attention's."""


class BadTerm(nn.Module):
    def score_term(self, q, q_pos, k_pos):
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[2], k_pos.shape[-1] + 1)


class BadValue(nn.Module):
    def value_term(self, weights, q_pos, k_pos):
        return weights.new_zeros(*weights.shape[:3], 3)


@pytest.mark.parametrize("backend", ["auto", "math", "sdpa", "lean"])
def test_hook_outputs_of_the_wrong_shape_name_the_hook(backend):
    """DecayBias(8) in a 4-head attention used the first 4 rates on the lean path and
    failed with a broadcast error on math; DecayBias(2) gave an aminmax() error."""
    x = torch.randn(2, 5, 16)
    for heads in (8, 2):
        m = make(backend, position=WideDecay(heads))
        want = rf"WideDecay: its score_bias hook returned shape \(1, {heads}, 5, 5\), expected "
        with pytest.raises(ValueError, match=want + r"\[1 or 2, 1 or 4, 5, 5\].*heads=4"):
            m(x)
    with pytest.raises(ValueError, match=r"score_term hook returned shape \(2, 4, 5, 6\)"):
        make(backend, position=BadTerm())(x)
    if backend != "sdpa":
        with pytest.raises(ValueError, match=r"value_term hook returned shape \(2, 4, 5, 3\)"):
            make(backend, position=BadValue())(x)


def test_flex_checks_the_bias_heads_too():
    class FlexDecay(WideDecay):
        def flex_score_mod(self, q_pos, k_pos):
            return lambda score, b, h, i, j: score

    with torch.no_grad(), pytest.raises(ValueError, match=r"score_bias hook returned shape"):
        make("flex", position=FlexDecay(8))(torch.randn(1, 5, 16))


def test_misread_arguments_are_rejected():
    m = make()
    x = torch.randn(2, 5, 16)
    with pytest.raises(TypeError, match=r"causal must be True or False, got 'yes' \(str\)"):
        m(x, causal="yes")
    with pytest.raises(ValueError, match="valid_lens must be >= 0.*minimum of -1"):
        m(x, valid_lens=torch.tensor([-1, 3]))
    with pytest.raises(ValueError, match="valid_lens must be >= 0.*minimum of -2"):
        m(x, valid_lens=torch.tensor([[1, 2, 3, 4, -2], [0, 0, 0, 0, 0]]))
    assert m(x, valid_lens=torch.tensor([0, 9])).shape == x.shape  # 0 and past n_k are fine


def test_dtypes_that_do_not_match_name_the_fix():
    m = make()
    x = torch.randn(2, 5, 16)
    for bad in (torch.float64, torch.bfloat16):
        with pytest.raises(TypeError, match=rf"query has dtype {bad} but this module's param"):
            m(x.to(bad))
    with pytest.raises(TypeError, match=r"key has dtype torch.float64 but query has torch.float32"):
        m(x, x.double())
    with pytest.raises(TypeError, match=r"value has dtype torch.bfloat16 but query has"):
        m(x, x, x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts inside the module
        assert m(x.bfloat16()).dtype == torch.bfloat16
    assert m.double()(x.double()).dtype == torch.float64


def test_a_scheme_class_instead_of_an_instance_says_so():
    from posenc import Rotary

    with pytest.raises(TypeError, match=r"position=Rotary is a class, not a scheme object"):
        MultiHeadAttention(16, 4, position=Rotary)


@pytest.mark.parametrize("backend", ["auto", "lean", "sdpa"])
@pytest.mark.parametrize("name", scheme_names())
def test_empty_batches_and_sequences_run_forward_and_backward(name, backend):
    """An empty batch raised ZeroDivisionError in the backward of every lean scheme; and,
    twice, without gradients (the second call replays a kept route where one is kept)."""
    scheme = build_scheme(name, head_dim=8, n=8)
    if backend == "sdpa" and has_value_term(scheme):
        pytest.skip("sdpa has no value term")
    m = MultiHeadAttention(16, 2, position=scheme, backend=backend)
    for shape in ((0, 8, 16), (2, 0, 16)):
        for causal in (False, True):
            x = torch.randn(*shape, requires_grad=True)
            out = m(x, causal=causal)
            out.sum().backward()
            assert out.shape == shape and x.grad.shape == shape
            with torch.no_grad():
                for _ in range(2):
                    assert m(x, causal=causal).shape == shape


@pytest.mark.parametrize("backend", ["auto", "math", "sdpa", "lean"])
@pytest.mark.parametrize(
    "name", ["none", "rotary", "alibi", "t5", "swin-1d", "relative", "shaw", "absolute-query"]
)
def test_masked_keys_and_values_never_reach_a_query(name, backend):
    """NaN or inf in a masked key or value (key padding, valid_lens, a causal future,
    another packed document) reached real queries as 0 x NaN on every backend. The
    outputs of the queries that cannot see them, and the gradients of q, k, v there, are
    those of the same input with the hidden tokens finite; a query that sees one gets NaN."""
    from posenc.engine import Mask, attend

    scheme = None if name == "none" else build_scheme(name, head_dim=8, n=12)
    if backend == "sdpa" and has_value_term(scheme):
        pytest.skip("sdpa has no value term")
    torch.manual_seed(0)
    b, h, n, d = 2, 2, 12, 8
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    padding = torch.zeros(b, n, dtype=torch.bool)
    padding[1, 9:] = True
    docs = torch.tensor([[0] * 6 + [1] * 6] * b)
    lengths = torch.tensor([[n] * n, [9] * n])
    cases = [  # (mask, (sequence, tokens made non-finite), query rows that cannot see them,
        # rows that see them or None)
        (Mask(n, n, key_padding=padding), (1, slice(9, n)), slice(0, n), None),
        (Mask(n, n, lengths=lengths), (1, slice(9, n)), slice(0, n), None),
        (Mask(n, n, causal=True), (1, slice(9, n)), slice(0, 9), slice(9, n)),
        (Mask(n, n, q_doc=docs, k_doc=docs), (0, slice(0, 6)), slice(6, n), slice(0, 6)),
    ]
    for mask, (bi, hidden), clean, seeing in cases:
        results = []
        for fill in (None, float("nan"), float("inf")):
            leaves = [t.clone() for t in (q, k, v)]
            if fill is not None:
                leaves[1][bi, :, hidden, 0] = fill  # a hidden key
                leaves[2][bi, :, hidden, 1] = -fill  # and value
            leaves = [t.requires_grad_() for t in leaves]
            out, _ = attend(
                *leaves, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask, backend=backend
            )
            out[bi, :, clean].sum().backward()
            results.append((out[bi, :, clean], *(t.grad[bi, :, clean] for t in leaves)))
            if fill is not None and seeing is not None:  # NaN where it is seen
                assert out[bi, :, seeing].isnan().all()
        for got in results[1:]:
            for a, want in zip(got, results[0], strict=True):
                torch.testing.assert_close(a, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["auto", "math", "sdpa", "lean"])
@pytest.mark.parametrize("name", ["none", "alibi", "t5", "relative", "shaw"])
def test_without_gradients_a_causal_chunk_checks_only_the_keys_it_hides(name, backend):
    """Without gradients, under the causal mask alone over a chunk of queries at the end of
    the keys (a decoder's chunk over its cache), only q and the last n_q keys and values
    are checked for non-finite values: one in a key or value some query does not see still
    reaches none that cannot see it; a NaN in a key every query sees (not checked) makes
    every query NaN; a non-finite query its own row alone; and keys of query 0 that all
    score -inf leave the keys it does not see weighing nothing."""
    from posenc.engine import Mask, attend
    from posenc.engine.inputs import hideable

    scheme = None if name == "none" else build_scheme(name, head_dim=8, n=20)
    if backend == "sdpa" and has_value_term(scheme):
        pytest.skip("sdpa has no value term")
    torch.manual_seed(0)
    b, h, n_q, n_k, d = 2, 2, 4, 20, 8
    q = torch.randn(b, h, n_q, d, dtype=torch.float64)
    k, v = (torch.randn(b, h, n_k, d, dtype=torch.float64) for _ in range(2))
    mask = Mask(n_q, n_k, causal=True)

    def run(q, k, v):
        n_q, n_k = q.shape[2], k.shape[2]
        q_pos, k_pos = torch.arange(n_k - n_q, n_k)[None], torch.arange(n_k)[None]
        with torch.no_grad():
            return attend(
                q, k, v, scheme=scheme, q_pos=q_pos, k_pos=k_pos,
                mask=Mask(n_q, n_k, causal=True), backend=backend,
            )[0]  # fmt: skip

    clean = run(q, k, v)
    with torch.no_grad():
        checked = hideable(q, k, v, mask)
    assert [t.shape[2] for t in checked] == [n_q] * 3  # q; keys 16 .. 19
    for fill in (float("nan"), float("inf")):
        k2, v2 = k.clone(), v.clone()
        k2[1, :, 17, 0], v2[1, :, 17, 1] = fill, -fill  # hidden from query 0 alone
        out = run(q, k2, v2)
        torch.testing.assert_close(out[0], clean[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(out[1, :, :1], clean[1, :, :1], rtol=0, atol=1e-12)
        assert out[1, :, 1:].isnan().all()
    k2 = k.clone()
    k2[1, :, 3, 0] = float("nan")  # seen by every query
    out = run(q, k2, v)
    assert out[1].isnan().all()
    torch.testing.assert_close(out[0], clean[0], rtol=0, atol=1e-12)
    for fill in (float("nan"), float("inf"), float("-inf")):  # a query's own: its row NaN
        q2 = q.clone()
        q2[0, :, 1, 2] = fill
        out = run(q2, k, v)
        assert out[0, :, 1].isnan().all()
        rows = [0, 2, 3]
        torch.testing.assert_close(out[0, :, rows], clean[0, :, rows], rtol=0, atol=1e-12)
        torch.testing.assert_close(out[1], clean[1], rtol=0, atol=1e-12)
    # query 0 of 3 over 5 keys sees keys 0 .. 2, which score -inf for it but for key 2,
    # which is checked: the values of keys 3 and 4, which it does not see, weigh nothing
    q3 = torch.randn(1, h, 3, d, dtype=torch.float64)
    q3[..., 0] = 1.0
    k3 = torch.randn(1, h, 5, d, dtype=torch.float64)
    k3[0, :, :2, 0] = float("-inf")
    outs = []
    for hidden in (0.0, 100.0):
        v3 = torch.zeros(1, h, 5, d, dtype=torch.float64)
        v3[0, :, 3:] = hidden
        outs.append(run(q3, k3, v3)[:, :, 0])
    assert torch.equal(outs[0], outs[1])
    for n in (3, 5):  # as many queries as keys: all checked, each query NaN that sees one
        k3 = torch.randn(1, h, n, d, dtype=torch.float64)
        k3[0, :, 0, 0] = float("nan")
        assert run(torch.randn(1, h, n, d, dtype=torch.float64), k3, k3).isnan().all()


def test_the_keys_checked_for_non_finite_values():
    """q and the last n_q keys without gradients under the causal mask alone over fewer
    queries than keys; all of q, k, v with gradients, another mask, as many queries as
    keys, or a contextual term."""
    from posenc.engine import Mask
    from posenc.engine.inputs import hideable

    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4)
    with torch.no_grad():
        assert [t.shape[2] for t in hideable(q, k, v, Mask(3, 9, causal=True))] == [3, 3, 3]
        padding = torch.zeros(1, 9, dtype=torch.bool)
        assert len(hideable(q, k, v, Mask(3, 9, causal=True, key_padding=padding))) == 3
        assert hideable(k, k, v, Mask(9, 9, causal=True))[1] is k
        assert hideable(q, k, v, Mask(3, 9, causal=True, behind=4))[1] is k
        assert hideable(q, k, v, Mask(3, 9, causal=True), contextual=True)[1] is k
    assert hideable(q, k, v, Mask(3, 9, causal=True))[1] is k  # grad mode


def test_a_contextual_term_in_a_causal_chunk_gives_nan_for_a_nan_key():
    """CoPE's gates index its table with the logits: a NaN key every query sees is
    checked, and the queries that see it get NaN (not an index error)."""
    from posenc.engine import Mask, attend

    scheme = build_scheme("cope", heads=2, head_dim=8, n=20)
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8)
    k, v = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    k[0, :, 2, 0] = float("nan")
    with torch.no_grad():
        out = attend(
            q, k, v, scheme=scheme, q_pos=torch.arange(16, 20)[None],
            k_pos=torch.arange(20)[None], mask=Mask(4, 20, causal=True),
        )[0]  # fmt: skip
    assert out.isnan().all()


# ----- the functional form and explain ------------------------------------------------------


def test_functional_attention_equals_sdpa_without_a_scheme():
    import torch.nn.functional as F

    from posenc import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8) for n in (5, 7, 7))
    padding = torch.rand(2, 7) < 0.3
    padding[:, 0] = False
    keep = ~padding[:, None, None, :]  # [b, 1, 1, n_k]
    for kwargs, sdpa_kwargs in (
        ({}, {}),
        ({"causal": True}, {"attn_mask": torch.ones(5, 7, dtype=torch.bool).tril(2)}),
        ({"key_padding_mask": padding}, {"attn_mask": keep}),
        ({"scale": 0.3}, {"scale": 0.3}),
    ):
        want = F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
        for backend in ("auto", "math", "sdpa", "lean"):
            got = attention(q, k, v, backend=backend, **kwargs)
            torch.testing.assert_close(got, want, rtol=0, atol=16 * EPS32 * float(v.abs().max()))


@pytest.mark.parametrize("name", scheme_names())
def test_multi_head_attention_is_projections_around_the_functional_form(name):
    """MultiHeadAttention's output is out_proj of posenc.attention on its projections, with
    the same scheme, positions and masks (float64, the same path)."""
    from posenc import attention

    scheme = build_scheme(name, heads=2, head_dim=8, n=8)
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 2, position=scheme).double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    lens = torch.tensor([8, 5])
    causal = True
    want = m(x, valid_lens=lens, causal=causal)
    q, k, v = (p(x).view(2, 8, 2, 8).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    out = attention(q, k, v, position=scheme, valid_lens=lens, causal=causal)
    got = m.out_proj(out.transpose(1, 2).reshape(2, 8, 16))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_explain_names_the_path_and_why_not_the_others(monkeypatch):
    from posenc import ALiBi, ShawRelativePosition, explain
    from posenc.engine import tuning

    q = k = v = torch.randn(1, 2, 16, 8)
    plain = explain(q, k, v)
    assert plain.path == "sdpa" and plain.reasons == {}
    assert explain(q, k, v, position=ALiBi(2)).path == "materialised"  # 512 scores: SDPA's
    monkeypatch.setattr(tuning, "MATERIALISED_SCORES", 0)  # as for a long sequence
    monkeypatch.setattr(tuning, "KEPT_BIAS_PAIRS", 0)
    alibi = explain(q, k, v, position=ALiBi(2))
    assert alibi.path == "offset-bias"
    assert alibi.reasons["sdpa"].startswith("the scheme adds a bias")
    assert "no offset_term" in alibi.reasons["offset-term"]
    assert "path: offset-bias" in str(alibi) and "not sdpa:" in str(alibi)
    assert "scores would be 0.0 MiB, above the budget" in alibi.reasons["materialised"]
    gappy = torch.zeros(1, 16, dtype=torch.bool)
    gappy[0, 3] = True  # a gap in the keys: neither the blocks nor the per-offset path
    general = explain(q, k, v, position=ALiBi(2), key_padding_mask=gappy)
    assert general.path == "lean-fused"
    assert general.reasons["offset-bias"] == "a mask other than causal"
    shaw = explain(q, k, v, position=ShawRelativePosition(8, 2), dropout_p=0.1)
    assert shaw.path == "math" and "value term" in shaw.reasons["sdpa"]
    assert explain(q, k, v, position=ALiBi(2), backend="math").path == "math"
    with pytest.raises(ValueError, match="backend='sdpa' cannot add a value term"):
        explain(q, k, v, position=ShawRelativePosition(8, 2), backend="sdpa")


def test_explain_agrees_with_the_path_taken(monkeypatch):
    """The path explain names is the one attention then runs, with and without gradients."""
    from posenc.engine import dispatch, tuning

    taken = []
    walk, fast = dispatch._walk, dispatch._fast

    def spy_walk(paths, call, backend="lean"):  # the walk's own plan, run as it is
        name, run, reasons = walk(paths, call, backend)
        return name, (lambda: taken.append(name) or run()), reasons

    def spy_fast(*args, name, **kwargs):  # the path planned again (under autograd's wrapper)
        taken.append(name)
        return fast(*args, name=name, **kwargs)

    monkeypatch.setattr(dispatch, "_walk", spy_walk)
    monkeypatch.setattr(dispatch, "_fast", spy_fast)
    told = set()
    budget = tuning.MATERIALISED_SCORES
    for q in (torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8, requires_grad=True)):
        _explain_each_call(monkeypatch, q, budget, taken, told)
    assert {"sdpa", "materialised", "offset-bias", "offset-term", "lean-fused"} <= told


def _explain_each_call(monkeypatch, q, budget, taken, told):
    from posenc import ALiBi, RelativeQueryEmbedding, T5RelativeBias, attention, explain
    from posenc.engine import tuning

    k = v = q
    for scores in (budget, 0):  # SDPA's few scores; a long sequence's
        monkeypatch.setattr(tuning, "MATERIALISED_SCORES", scores)
        for scheme in (None, ALiBi(2), T5RelativeBias(2), RelativeQueryEmbedding(12, 8)):
            for kwargs in ({}, {"causal": True}, {"valid_lens": torch.tensor([12, 7])}):
                path = explain(q, k, v, position=scheme, **kwargs).path
                taken.clear()
                attention(q, k, v, position=scheme, **kwargs)
                assert taken[0] == path, (scheme, kwargs)
                told.add(path)


def test_functional_attention_errors_name_the_fix():
    from posenc import ALiBi, Rotary, attention

    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"q must have shape \[batch, heads, seq, head_dim\]"):
        attention(q[0], q[0], q[0])
    with pytest.raises(TypeError, match=r"k has dtype torch.float64 but q has torch.float32"):
        attention(q, q.double(), q)
    with pytest.raises(
        ValueError, match=r"q, k and v must share the batch, and k and v their heads"
    ):
        attention(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8))
    with pytest.raises(ValueError, match=r"k and v must have the same length, got 5 and 4"):
        attention(q, q, q[:, :, :4])
    with pytest.raises(ValueError, match=r"positions covers the 5 queries but there are 6 keys"):
        attention(q, torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), positions=torch.arange(5))
    with pytest.raises(TypeError, match=r"position=Rotary is a class"):
        attention(q, q, q, position=Rotary)
    with pytest.raises(ValueError, match=r"ALiBi was built for heads=4"):
        attention(q, q, q, position=ALiBi(4))
    with pytest.raises(ValueError, match=r"backend must be one of"):
        attention(q, q, q, backend="fast")
    with pytest.raises(ValueError, match=r"scale must be a finite number > 0"):
        attention(q, q, q, scale=0.0)


def test_a_rotations_parameters_get_the_same_gradient_with_create_graph():
    """A rotation's parameters (RoPE-Mixed's learned frequencies) reach q and k before the
    attention call: their first-order gradient with create_graph=True equals the one
    without, on the wrapped fast path as on the math path (they must not count twice)."""
    from posenc import RotaryMixed, attention, explain

    torch.manual_seed(0)
    scheme = RotaryMixed(8, 4, size=(2, 3)).double()
    q, k, v = (torch.randn(1, 4, 6, 8, dtype=torch.float64) for _ in range(3))
    assert explain(q, k, v, position=scheme).path == "sdpa"
    grads = {}
    for backend in ("math", "auto"):
        for create_graph in (False, True):
            out = attention(q, k, v, position=scheme, backend=backend)
            (grads[backend, create_graph],) = torch.autograd.grad(
                out.sum(), list(scheme.parameters()), create_graph=create_graph
            )
    for key, grad in grads.items():
        torch.testing.assert_close(grad, grads["math", False], rtol=1e-10, atol=1e-12, msg=str(key))
