"""CoPE (embedding_research.py) against the paper's definition written out here in float64
loops: the gates of the scaled, masked logits, the counts from each key to the end of the
row, the table read at floor and ceil and interpolated, the term added after the scaling;
inside attention on every backend (outputs and gradients, the table's included), with a
KV cache, under gradcheck, and every fast path refusing it with its reason. The
cross-scheme tests run it through the registry (``cope``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

import posenc
import posenc.flex
from posenc import CoPE, KVCache, MultiHeadAttention, attention, explain
from posenc.embedding_research import contextual_positions, interpolated_term
from posenc.hooks import ContextualTerm

B, H, N, D = 2, 2, 7, 4


def _cope(max_position: int = N + 1, std: float = 0.5, seed: int = 0) -> CoPE:
    """A float64 CoPE whose table is away from its zero start (every column counts)."""
    torch.manual_seed(seed)
    cope = CoPE(H, D, max_position).double()
    torch.nn.init.normal_(cope.weight, std=std)
    return cope


def _inputs(seed: int = 1, n_q: int = N, n_k: int = N):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n_q, D, dtype=torch.float64, generator=gen)
    k = torch.randn(B, H, n_k, D, dtype=torch.float64, generator=gen)
    v = torch.randn(B, H, n_k, D, dtype=torch.float64, generator=gen)
    return q, k, v


def _visible(causal: bool, padding: torch.Tensor | None, n_q: int, n_k: int):
    """``visible(b, i, j)``: the keys query ``i`` sees (causal aligned at the end)."""

    def visible(b: int, i: int, j: int) -> bool:
        if causal and j > i + n_k - n_q:
            return False
        return padding is None or not bool(padding[b, j])

    return visible


def _paper_term(q, k, weight, visible, b, h, i):
    """The paper's term of one query, by the definition (section 3), float64 loops: a dict
    key ``j`` -> ``q_i . e[p_ij]`` for every key the query sees.

    ``z_ij = q_i . k_j / sqrt(d)``; ``g_ij = sigmoid(z_ij)``; ``p_ij = sum of g_it over the
    keys t >= j that the query sees`` (a masked key has gate 0), clamped to ``P - 1``;
    ``e[p] = (p - floor p) e[ceil p] + (1 - p + floor p) e[floor p]``.
    """
    n_k, d = k.shape[2], q.shape[-1]
    last = weight.shape[1] - 1
    seen = [j for j in range(n_k) if visible(b, i, j)]
    qi = [float(x) for x in q[b, h, i]]
    table = [[float(x) for x in row] for row in weight.detach()]  # [d, P]

    def dot(a, c):
        return sum(x * y for x, y in zip(a, c, strict=True))

    gate = {t: 1 / (1 + math.exp(-dot(qi, [float(x) for x in k[b, h, t]]) / math.sqrt(d)))
            for t in seen}  # fmt: skip
    terms = {}
    for j in seen:
        p = min(sum(gate[t] for t in seen if t >= j), last)
        low, high = math.floor(p), math.ceil(p)
        e = [(p - low) * table[c][high] + (1 - p + low) * table[c][low] for c in range(d)]
        terms[j] = dot(qi, e)
    return terms


def _paper_attention(q, k, v, weight, visible):
    """``softmax(z + q . e[p]) v`` over the keys each query sees, float64 loops; a query
    that sees no key gets 0."""
    b_, h_, n_q, d = q.shape
    out = torch.zeros(b_, h_, n_q, v.shape[-1], dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            for i in range(n_q):
                terms = _paper_term(q, k, weight, visible, b, h, i)
                if not terms:
                    continue
                scores = {j: float(q[b, h, i] @ k[b, h, j]) / math.sqrt(d) + t
                          for j, t in terms.items()}  # fmt: skip
                top = max(scores.values())
                total = sum(math.exp(s - top) for s in scores.values())
                for j, s in scores.items():
                    out[b, h, i] += math.exp(s - top) / total * v[b, h, j]
    return out


def _masked_logits(q, k, visible):
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [b, h, n_q, n_k]
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            for j in range(k.shape[2]):
                if not visible(b, i, j):
                    logits[b, :, i, j] = float("-inf")
    return logits


PADDING = torch.tensor([[False] * N, [False] * (N - 3) + [True] * 3])
GAPPY = torch.tensor([[False, True, False, False, True, False, False], [False] * N])
CASES = {  # name -> (causal, key padding)
    "causal": (True, None),
    "causal-padded": (True, PADDING),
    "padded": (False, PADDING),  # counts run to the last key the query sees
    "gappy": (False, GAPPY),
    "none": (False, None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("max_position", [N + 1, 3])  # 3: the far counts clamped to 2
def test_term_equals_the_papers_definition(case, max_position):
    causal, padding = CASES[case]
    cope = _cope(max_position)
    q, k, _ = _inputs()
    visible = _visible(causal, padding, N, N)
    got = cope(q, _masked_logits(q, k, visible))
    assert got.shape == (B, H, N, N) and got.dtype == torch.float64
    for b in range(B):
        for h in range(H):
            for i in range(N):
                for j, want in _paper_term(q, k, cope.weight, visible, b, h, i).items():
                    assert math.isclose(
                        float(got[b, h, i, j].detach()), want, rel_tol=1e-12, abs_tol=1e-12
                    )


def test_positions_are_the_gates_counted_to_the_end_of_the_row():
    logits = torch.tensor([[0.0, float("-inf"), 2.0, -1.0, float("-inf")]], dtype=torch.float64)
    g = torch.sigmoid(logits)
    want = torch.stack([g[0, 0] + g[0, 2] + g[0, 3], g[0, 2] + g[0, 3], g[0, 2] + g[0, 3],
                        g[0, 3], torch.zeros((), dtype=torch.float64)])[None]  # fmt: skip
    torch.testing.assert_close(contextual_positions(logits, 10), want, rtol=0, atol=1e-15)
    torch.testing.assert_close(contextual_positions(logits, 2), want.clamp(max=1.0))
    assert contextual_positions(logits.float(), 10).dtype == torch.float32
    assert contextual_positions(logits.bfloat16(), 10).dtype == torch.float32


def test_integer_positions_read_the_column_itself():
    q = torch.randn(1, 1, 2, 3, dtype=torch.float64)
    weight = torch.randn(3, 5, dtype=torch.float64)
    positions = torch.tensor([[[[0.0, 2.0, 4.0], [1.0, 3.0, 2.5]]]], dtype=torch.float64)
    got = interpolated_term(q, positions, weight)
    columns = q[0, 0] @ weight  # [2, 5]
    want = torch.stack(
        [columns[0, [0, 2, 4]], torch.stack([columns[1, 1], columns[1, 3], columns[1, 2:4].mean()])]
    )
    torch.testing.assert_close(got[0, 0], want)  # fmt: skip


@pytest.mark.parametrize("case", ["causal", "causal-padded", "padded", "gappy"])
@pytest.mark.parametrize("backend", ["math", "sdpa", "auto", "lean"])
def test_attention_equals_the_papers_attention(case, backend):
    """The term after the scaling, the gates of the masked logits, on every backend."""
    causal, padding = CASES[case]
    cope = _cope()
    q, k, v = _inputs()
    got = attention(q, k, v, position=cope, causal=causal, key_padding_mask=padding,
                    backend=backend)  # fmt: skip
    want = _paper_attention(q, k, v, cope.weight, _visible(causal, padding, N, N))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_decoding_queries_count_the_cached_keys():
    """Fewer queries than keys (a decoding step): the causal mask aligned at the end."""
    cope = _cope(max_position=5)  # and clamped
    q, k, v = _inputs(n_q=3, n_k=N)
    got = attention(q, k, v, position=cope, causal=True, key_padding_mask=PADDING)
    want = _paper_attention(q, k, v, cope.weight, _visible(True, PADDING, 3, N))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _model(backend: str, seed: int = 0) -> MultiHeadAttention:
    cope = _cope(seed=seed)
    torch.manual_seed(seed + 1)
    return MultiHeadAttention(H * D, H, position=cope, backend=backend).double()


@pytest.mark.parametrize("causal", [True, False])
def test_backends_agree_on_outputs_and_gradients_of_every_parameter(causal):
    x = torch.randn(B, N, H * D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cotangent = torch.randn(B, N, H * D, dtype=torch.float64)
    results = {}
    for backend in ("math", "sdpa", "auto", "lean"):
        model = _model(backend)
        xi = x.clone().requires_grad_()
        out = model(xi, causal=causal, key_padding_mask=PADDING)
        out.backward(cotangent)
        grads = {name: p.grad for name, p in model.named_parameters()}
        assert grads["position.weight"].abs().sum() > 0
        results[backend] = (out, xi.grad, grads)
    want_out, want_dx, want_grads = results.pop("math")
    for backend, (out, dx, grads) in results.items():
        torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12, msg=backend)
        torch.testing.assert_close(dx, want_dx, rtol=1e-10, atol=1e-12, msg=backend)
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("backend", ["math", "auto"])
def test_decoding_with_a_cache_equals_one_causal_pass(backend):
    model = _model(backend).eval()
    x = torch.randn(B, N, H * D, dtype=torch.float64)
    full = model(x, causal=True)
    cache = KVCache()
    steps = [model(x[:, :3], causal=True, cache=cache)]
    steps += [model(x[:, t : t + 1], causal=True, cache=cache) for t in range(3, N)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-12)


def test_padded_keys_have_gate_zero_and_no_influence():
    """A padded key's value changes nothing for the real queries: it neither counts in the
    positions of the keys before it nor gets a weight."""
    model = _model("auto").eval()
    x = torch.randn(B, N, H * D, dtype=torch.float64)
    changed = x.clone()
    changed[1, -3:] = 100 * torch.randn(3, H * D, dtype=torch.float64)
    real = ~PADDING
    for causal in (False, True):
        a = model(x, causal=causal, key_padding_mask=PADDING)
        c = model(changed, causal=causal, key_padding_mask=PADDING)
        torch.testing.assert_close(c[real], a[real], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto", "lean"])
def test_a_query_that_sees_no_key_gives_zeros_not_nan(backend):
    """A fully masked row (every logit -inf: every gate 0, every count 0) gives 0, as in the
    rest of posenc, with finite gradients; the other rows are the paper's attention."""
    cope = _cope()
    q, k, v = (t.clone().requires_grad_() for t in _inputs())
    allowed = torch.ones(N, N, dtype=torch.bool).tril()
    allowed[2] = False  # query 2 sees no key
    padding = torch.zeros(B, N, dtype=torch.bool)
    padding[1, :4] = True  # causal: queries 0..3 of row 1 see no key either
    got = attention(q, k, v, position=cope, attn_mask=allowed, key_padding_mask=padding,
                    backend=backend)  # fmt: skip

    def visible(b: int, i: int, j: int) -> bool:
        return bool(allowed[i, j]) and not bool(padding[b, j])

    want = _paper_attention(q.detach(), k.detach(), v.detach(), cope.weight, visible)
    assert not got[:, :, 2].any() and not got[1, :, :4].any()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got.sum().backward()
    for name, grad in (("q", q.grad), ("k", k.grad), ("v", v.grad), ("table", cope.weight.grad)):
        assert torch.isfinite(grad).all(), name
    assert not q.grad[:, :, 2].any() and not q.grad[1, :, :4].any()


def test_gradcheck_of_the_table_queries_and_keys():
    """The math path, the table given as an input (a tensor the hook captures, not a
    parameter of the scheme: the other paths differentiate the scheme's parameters, and are
    checked with the module's own table below)."""
    cope = _cope(max_position=5)
    q, k, v = (t[:1].clone().requires_grad_() for t in _inputs())
    weight = cope.weight.detach().clone().requires_grad_()

    def f(q, k, weight):
        params = {"weight": weight}
        scheme = cope

        class Swapped(torch.nn.Module):  # the table as gradcheck's input
            def contextual_term(self, logits, q, q_pos, k_pos):
                return functional_call(scheme, params, (q, logits))

        return attention(q, k, v, position=Swapped(), causal=True, key_padding_mask=PADDING[1:],
                         backend="math")  # fmt: skip

    assert torch.autograd.gradcheck(f, (q, k, weight))


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_the_table_of_the_module_gets_the_gradient_that_gradcheck_checks(backend):
    """Through MultiHeadAttention (the table a parameter that the fast path's graph
    differentiates): functional_call swaps it in, gradcheck checks it."""
    model = _model(backend)
    x = torch.randn(1, 5, H * D, dtype=torch.float64)
    weight = model.position.weight.detach().clone().requires_grad_()

    def f(weight):
        return functional_call(model, {"position.weight": weight}, (x,), {"causal": True})

    assert torch.autograd.gradcheck(f, (weight,))


def test_auto_takes_the_math_path_and_says_why_not_the_others():
    """The path of every mask (tests/engine/test_dispatch.py checks each path's reason)."""
    cope = _cope()
    q, k, v = _inputs()
    for kwargs in ({}, {"causal": True}, {"key_padding_mask": PADDING}, {"window": 3}):
        told = explain(q, k, v, position=cope, **kwargs)
        assert told.path == "math" and "contextual term" in told.reasons["sdpa"], kwargs
        assert explain(q, k, v, position=cope, backend="lean", **kwargs).path == "math"
        assert explain(q, k, v, position=cope, backend="sdpa", **kwargs).path == "sdpa"
    with pytest.raises(ValueError, match="backend='flex' cannot add a contextual term"):
        explain(q, k, v, position=cope, backend="flex")
    with pytest.raises(ValueError, match="backend='flex' cannot add a contextual term"):
        attention(q, k, v, position=cope, backend="flex")


class WrongShape(torch.nn.Module):
    def contextual_term(self, logits, q, q_pos, k_pos):
        return logits[..., :-1]  # one key short


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto", "lean"])
def test_a_contextual_term_of_the_wrong_shape_names_the_hook(backend):
    x = torch.randn(2, 5, 8)
    model = MultiHeadAttention(8, 2, position=WrongShape(), backend=backend)
    with pytest.raises(ValueError, match=r"contextual_term hook returned shape \(2, 2, 5, 4\)"):
        model(x, causal=True)


def test_it_starts_at_zero_is_the_protocol_and_builds_on_meta():
    cope = CoPE(4, 16, 33)
    assert isinstance(cope, ContextualTerm)
    assert dict(cope.state_dict()).keys() == {"weight"} and cope.weight.shape == (16, 33)
    assert not cope.weight.any()  # the paper's code: zeros
    with torch.device("meta"):
        meta = CoPE(4, 16, 33)
    assert meta.weight.is_meta
    assert "heads=4, head_dim=16, max_position=33" in repr(cope)


def test_errors_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match="heads must be >= 1, got 0"):
        CoPE(0, 8, 4)
    with pytest.raises(TypeError, match=r"head_dim must be an int, got 8.0"):
        CoPE(2, 8.0, 4)
    with pytest.raises(ValueError, match="max_position must be >= 1, got 0"):
        CoPE(2, 8, 0)
    with pytest.raises(ValueError, match=r"CoPE was built for heads=2 but the attention has "
                       r"heads=4; build it with heads=4"):  # fmt: skip
        MultiHeadAttention(16, 4, position=CoPE(2, 4, 8))
    with pytest.raises(ValueError, match=r"built for head_dim=4 but the attention has head_dim=8"):
        MultiHeadAttention(16, 2, position=CoPE(2, 4, 8))
    cope = CoPE(2, 4, 8)
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"q must have shape \[batch, heads, n_q, head_dim=4\]"):
        cope(torch.randn(1, 2, 3, 5), torch.randn(1, 2, 3, 3))
    with pytest.raises(ValueError, match=r"logits must have shape \[batch, heads, n_q, n_k\]"):
        cope(q, torch.randn(1, 2, 4, 3))
    with pytest.raises(TypeError, match=r"content-dependent hook\(s\) \['contextual_term'\]"):
        posenc.as_attn_mask(cope, 4)
    with pytest.raises(TypeError, match="adds a contextual term .CoPE."):
        posenc.flex.score_mod(cope, q=q)


@pytest.mark.parametrize("backend", ["math", "auto"])
def test_a_nan_key_gives_nan_not_an_index_error(backend):
    """A NaN logit makes its gate, and so the positions of the keys before it, NaN: the
    term reads column 0 there and is NaN (an index made of NaN was out of range), and
    every query that sees the key gets NaN."""
    torch.manual_seed(0)
    scheme = CoPE(2, 8, 6)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    k[0, :, 2, 0] = float("nan")
    positions = torch.tensor([[0.5, float("nan"), 2.0]])
    term = interpolated_term(torch.randn(1, 1, 1, 8), positions[None, None], torch.randn(8, 6))
    assert term[..., 1].isnan().all() and not term[..., [0, 2]].isnan().any()
    for causal in (False, True):
        out = attention(q, k, v, position=scheme, causal=causal, backend=backend)
        seeing = slice(2, 5) if causal else slice(0, 5)
        assert out[:, :, seeing].isnan().all()
        if causal:
            assert not out[:, :, :2].isnan().any()
