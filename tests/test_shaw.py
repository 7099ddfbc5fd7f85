"""Place 5 (shaw.py): Shaw, Uszkoreit and Vaswani 2018 against the paper's equations.

``paper_attention`` below is the paper written as loops (float64):
``a^K_ij = w^K[clip(j - i, -k, k) + k]``, ``a^V_ij`` likewise,
``e_ij = q_i . (k_j + a^K_ij) / sqrt(d)``, ``alpha = softmax_j(e)``,
``z_i = sum_j alpha_ij (v_j + a^V_ij)``; nothing is masked.
The literal implementation must equal it, and the lean one the literal one.
"""

from __future__ import annotations

import math

import pytest
import torch

from posenc import MultiHeadAttention
from posenc.shaw import (
    ShawRelativePosition,
    shaw_attention,
    shaw_key_term,
    shaw_key_term_literal,
    shaw_value_term,
    shaw_value_term_literal,
)
from tolerances import assert_close, logit_size

# ----- the paper, as loops -----------------------------------------------------------------


def clip_row(q_position, k_position, k):
    return min(max(k_position - q_position, -k), k) + k


def paper_attention(q, k, v, keys, values, q_pos, k_pos):
    """Equations 3-6 of Shaw et al. 2018, one (batch, head, i) at a time."""
    q, k, v = q.double(), k.double(), v.double()
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    kmax = (keys.shape[0] - 1) // 2
    q_pos, k_pos = q_pos.expand(b, -1), k_pos.expand(b, -1)
    z = torch.zeros(b, h, n_q, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(n_q):
                rows = [clip_row(int(q_pos[bi, i]), int(k_pos[bi, j]), kmax) for j in range(n_k)]
                e = torch.stack(
                    [
                        q[bi, hi, i] @ (k[bi, hi, j] + keys[rows[j]].double()) / math.sqrt(d)
                        for j in range(n_k)
                    ]
                )
                alpha = e.exp() / e.exp().sum()
                for j in range(n_k):
                    a_v = values[rows[j]].double() if values is not None else 0.0
                    z[bi, hi, i] += alpha[j] * (v[bi, hi, j] + a_v)
    return z


def paper_key_term(q, keys, q_pos, k_pos):
    b, h, n_q, _ = q.shape
    kmax = (keys.shape[0] - 1) // 2
    q_pos, k_pos = q_pos.expand(b, -1), k_pos.expand(b, -1)
    out = torch.zeros(b, h, n_q, k_pos.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for i in range(n_q):
            for j in range(k_pos.shape[-1]):
                row = clip_row(int(q_pos[bi, i]), int(k_pos[bi, j]), kmax)
                out[bi, :, i, j] = q[bi, :, i].double() @ keys[row].double()
    return out


def paper_value_term(weights, values, q_pos, k_pos):
    b, h, n_q, n_k = weights.shape
    kmax = (values.shape[0] - 1) // 2
    q_pos, k_pos = q_pos.expand(b, -1), k_pos.expand(b, -1)
    out = torch.zeros(b, h, n_q, values.shape[1], dtype=torch.float64)
    for bi in range(b):
        for i in range(n_q):
            for j in range(n_k):
                row = clip_row(int(q_pos[bi, i]), int(k_pos[bi, j]), kmax)
                out[bi, :, i] += weights[bi, :, i, j, None].double() * values[row].double()
    return out


def rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


# positions: shared arange, shifted, per batch row with far offsets, cross attention
POSITIONS = {
    "arange": (torch.arange(5)[None], torch.arange(5)[None]),
    "shifted": (torch.arange(5)[None] + 1000, torch.arange(5)[None] + 1000),
    "per-row": (
        torch.tensor([[0, 9, 3, 4, 20], [7, 6, 5, 4, 3]]),
        torch.tensor([[1, 2, 3, 30, -4], [0, 0, 9, 4, 11]]),
    ),
    "cross": (torch.tensor([[4, 5]]), torch.tensor([[0, 1, 2, 3, 4, 5, 6]])),
}


# ----- the pure functions against the paper ------------------------------------------------


@pytest.mark.parametrize("case", list(POSITIONS))
def test_key_and_value_terms_match_the_paper(case):
    torch.manual_seed(0)
    q_pos, k_pos = POSITIONS[case]
    n_q, n_k = q_pos.shape[-1], k_pos.shape[-1]
    q, keys, values = rand(2, 3, n_q, 4), rand(5, 4), rand(5, 4)  # k = 2
    weights = rand(2, 3, n_q, n_k).softmax(-1)
    expected_key = paper_key_term(q, keys, q_pos, k_pos)
    expected_value = paper_value_term(weights, values, q_pos, k_pos)
    for key_term, value_term in [
        (shaw_key_term_literal, shaw_value_term_literal),
        (shaw_key_term, shaw_value_term),
    ]:
        torch.testing.assert_close(key_term(q, keys, q_pos, k_pos), expected_key)
        torch.testing.assert_close(value_term(weights, values, q_pos, k_pos), expected_value)


@pytest.mark.parametrize("case", list(POSITIONS))
@pytest.mark.parametrize("literal", [True, False])
def test_attention_matches_the_paper(case, literal):
    torch.manual_seed(1)
    q_pos, k_pos = POSITIONS[case]
    n_q, n_k = q_pos.shape[-1], k_pos.shape[-1]
    q, k, v = rand(2, 2, n_q, 4), rand(2, 2, n_k, 4), rand(2, 2, n_k, 4)
    keys, values = rand(7, 4), rand(7, 4)  # k = 3
    expected = paper_attention(q, k, v, keys, values, q_pos, k_pos)
    got = shaw_attention(q, k, v, keys, values, q_pos, k_pos, literal=literal)
    torch.testing.assert_close(got, expected)


def test_lean_equals_literal_outputs_and_gradients_float32():
    torch.manual_seed(2)
    b, h, n, d, kmax = 2, 3, 24, 8, 4
    inputs = [rand(b, h, n, d, dtype=torch.float32) for _ in range(3)]
    tables = [rand(2 * kmax + 1, d, dtype=torch.float32) * d**-0.5 for _ in range(2)]
    q_pos = torch.stack([torch.arange(n), torch.arange(n) * 2 + 7])  # [b, n], some far offsets
    results = []
    for literal in (True, False):
        leaves = [t.clone().requires_grad_() for t in (*inputs, *tables)]
        out = shaw_attention(*leaves, q_pos, q_pos, literal=literal)
        (out * torch.linspace(-1, 1, d)).sum().backward()
        results.append((out, [leaf.grad for leaf in leaves]))
    (out_lit, grads_lit), (out_lean, grads_lean) = results
    q, k, _, keys, _ = inputs + tables  # logits: (q.k + q.keys[offset]) / sqrt(d), n keys
    close = dict(terms=n, logit=logit_size(q, k) + logit_size(q, keys))
    assert_close(out_lean, out_lit, **close)
    size = max(float(g.abs().max()) for g in grads_lit)  # gradients: at the largest's size
    for name, g_lean, g_lit in zip(
        ["q", "k", "v", "keys", "values"], grads_lean, grads_lit, strict=True
    ):
        assert_close(g_lean, g_lit, magnitude=size, **close, msg=name)


def test_gradcheck_lean_and_literal():
    torch.manual_seed(3)
    q_pos, k_pos = torch.tensor([[0, 3, 1]]), torch.tensor([[2, 0, 7, 1]])
    q = rand(1, 2, 3, 2).requires_grad_()
    weights = rand(1, 2, 3, 4).softmax(-1).requires_grad_()
    table = rand(3, 2).requires_grad_()  # k = 1: offsets beyond 1 are clipped
    for key_term, value_term in [
        (shaw_key_term_literal, shaw_value_term_literal),
        (shaw_key_term, shaw_value_term),
    ]:
        assert torch.autograd.gradcheck(lambda q, t, f=key_term: f(q, t, q_pos, k_pos), (q, table))
        assert torch.autograd.gradcheck(
            lambda w, t, f=value_term: f(w, t, q_pos, k_pos), (weights, table)
        )
    k, v = rand(1, 2, 4, 2).requires_grad_(), rand(1, 2, 4, 2).requires_grad_()
    values = rand(3, 2).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v, a, b: shaw_attention(q, k, v, a, b, q_pos, k_pos), (q, k, v, table, values)
    )


# positions of the pairs: shared by the batch (5 queries, 7 keys), or a row each (5 and 5)
PAIR_POSITIONS = {
    "shared": (torch.arange(5)[None] + 3, torch.tensor([[0, 1, 2, 3, 4, 9, -6]])),
    "per-row": POSITIONS["per-row"],
}
# (weights' b and h, positions, dtype, a graph recorded, SHAW_PAIR_VALUES or None), and
# whether the value term builds a^V [B', n_q, n_k, d] (d = 4; 140 elements when shared)
PAIR_VALUE_CASES = {
    "no larger than the weights": ((2, 3), "shared", torch.float64, False, None, True),
    "float32": ((2, 3), "shared", torch.float32, False, None, True),
    "per-row positions, as large": ((2, 4), "per-row", torch.float64, False, None, True),
    "per-row positions, larger": ((2, 3), "per-row", torch.float64, False, None, False),
    "d above b * h": ((1, 3), "shared", torch.float64, False, None, False),
    "a graph": ((2, 3), "shared", torch.float64, True, None, False),
    "at SHAW_PAIR_VALUES": ((2, 3), "shared", torch.float64, False, 140, True),
    "above SHAW_PAIR_VALUES": ((2, 3), "shared", torch.float64, False, 139, False),
}


@pytest.mark.parametrize("case", list(PAIR_VALUE_CASES))
def test_value_term_builds_pairs_only_without_a_graph_and_no_larger_than_the_weights(
    case, monkeypatch
):
    """Without a graph, a^V no larger than the weights and at most SHAW_PAIR_VALUES: one
    product per query over the pairs' vectors; otherwise the bins. The paper's value (and
    with a graph its gradient) either way."""
    import posenc.shaw as shaw_module
    from posenc.engine import tuning

    (b, h), positions, dtype, graph, limit, pairs = PAIR_VALUE_CASES[case]
    if limit is not None:
        monkeypatch.setattr(tuning, "SHAW_PAIR_VALUES", limit)
    calls = []
    real = shaw_module._weighted_pairs
    monkeypatch.setattr(shaw_module, "_weighted_pairs", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(5)
    q_pos, k_pos = PAIR_POSITIONS[positions]
    n_q, n_k = q_pos.shape[-1], k_pos.shape[-1]
    weights = torch.rand(b, h, n_q, n_k, dtype=dtype).softmax(-1).requires_grad_(graph)
    values = torch.randn(5, 4, dtype=dtype)  # k = 2
    got = shaw_value_term(weights, values, q_pos, k_pos)
    assert bool(calls) == pairs
    expected = paper_value_term(weights, values, q_pos, k_pos)
    size = float(values.abs().max())
    assert_close(got, expected, dtype=dtype, terms=n_k, magnitude=size)
    if graph:
        (grad,) = torch.autograd.grad(got.sum(), weights)
        (want,) = torch.autograd.grad(expected.sum(), weights)
        assert_close(grad, want, dtype=dtype, terms=4, magnitude=size)


def test_lean_terms_never_build_pairs_of_vectors(monkeypatch):
    """The lean path does no per-pair table lookup (no [n_q, n_k, d] tensor) where a^V
    would be larger than the weights (here d = 4 > b * h = 1)."""
    import torch.nn.functional as F

    calls = []
    real = F.embedding
    monkeypatch.setattr(F, "embedding", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, weights, table = rand(1, 1, 6, 4), rand(1, 1, 6, 6).softmax(-1), rand(5, 4)
    pos = torch.arange(6)[None]
    shaw_key_term(q, table, pos, pos)
    shaw_value_term(weights, table, pos, pos)
    assert not calls
    shaw_key_term_literal(q, table, pos, pos)
    assert calls  # the spy does see the literal path's lookup


# ----- the module and its hooks -----------------------------------------------------------


def test_module_forward_is_the_paper_and_keys_only_drops_a_v():
    torch.manual_seed(4)
    q, k, v = rand(2, 2, 6, 4), rand(2, 2, 6, 4), rand(2, 2, 6, 4)
    pos = torch.arange(6)[None]
    full = ShawRelativePosition(4, 2).double()
    torch.testing.assert_close(
        full(q, k, v), paper_attention(q, k, v, full.keys, full.values, pos, pos)
    )
    keys_only = ShawRelativePosition(4, 2, values=False).double()
    torch.testing.assert_close(
        keys_only(q, k, v, q_pos=pos + 3, k_pos=pos + 3),
        paper_attention(q, k, v, keys_only.keys, None, pos, pos),
    )


def test_values_false_defines_no_value_hook():
    full, keys_only = ShawRelativePosition(4, 2), ShawRelativePosition(4, 2, values=False)
    assert set(full.state_dict()) == {"keys", "values"}
    assert set(keys_only.state_dict()) == {"keys"}
    assert full.keys.shape == full.values.shape == (5, 4)
    for name in ("value_term", "reference_value_term"):
        assert callable(getattr(full, name))
        assert not hasattr(keys_only, name)
        assert getattr(keys_only, name, None) is None
    assert callable(keys_only.score_term) and callable(keys_only.reference_score_term)


@pytest.mark.parametrize("values", [True, False])
def test_hooks_lean_equal_reference_and_are_translation_invariant(values):
    torch.manual_seed(5)
    scheme = ShawRelativePosition(4, 2, values=values)
    q, weights = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 6).softmax(-1)
    pos = torch.arange(6)[None]
    base = scheme.score_term(q, pos, pos)  # float32 sums of d = 4 products, 6 weights
    assert_close(scheme.reference_score_term(q, pos, pos), base, terms=4)
    for shift in (5, -20, 100_000):
        assert_close(scheme.score_term(q, pos + shift, pos + shift), base, terms=4)
    if values:
        base_v = scheme.value_term(weights, pos, pos)
        assert_close(scheme.reference_value_term(weights, pos, pos), base_v, terms=6)
        assert_close(scheme.value_term(weights, pos + 9, pos + 9), base_v, terms=6)


def test_hooks_block_of_queries_and_batch_rows():
    torch.manual_seed(6)
    scheme = ShawRelativePosition(4, 2)
    q, weights = torch.randn(2, 2, 8, 4), torch.randn(2, 2, 8, 8).softmax(-1)
    pos = torch.stack([torch.arange(8), torch.tensor([3, 0, 9, 1, 5, 5, 2, 20])])  # [b, n]
    full_s, full_v = scheme.score_term(q, pos, pos), scheme.value_term(weights, pos, pos)
    for start, stop in [(0, 3), (3, 8), (7, 8)]:  # float32 sums of d = 4 and of 8 terms
        qp = pos[:, start:stop]
        assert_close(
            scheme.score_term(q[:, :, start:stop], qp, pos), full_s[:, :, start:stop], terms=4
        )
        assert_close(
            scheme.value_term(weights[:, :, start:stop], qp, pos), full_v[:, :, start:stop],
            terms=8,
        )  # fmt: skip
    for row in range(2):
        alone = scheme.score_term(q[row : row + 1], pos[row], pos[row])
        assert_close(alone, full_s[row : row + 1], terms=4)
        alone_v = scheme.value_term(weights[row : row + 1], pos[row], pos[row])
        assert_close(alone_v, full_v[row : row + 1], terms=8)


@pytest.mark.parametrize("values", [True, False])
@pytest.mark.parametrize("backend", ["math", "auto"])
def test_inside_attention_equals_the_paper(values, backend):
    """MultiHeadAttention with the scheme is the paper's attention on the projections."""
    torch.manual_seed(7)
    scheme = ShawRelativePosition(4, 2, values=values)
    attn = MultiHeadAttention(8, 2, position=scheme, backend=backend).double()
    x = rand(2, 7, 8)

    def split(t):
        return t.view(2, 7, 2, 4).transpose(1, 2)  # [b, n, dim] -> [b, h, n, d]

    q, k, v = split(attn.q_proj(x)), split(attn.k_proj(x)), split(attn.v_proj(x))
    pos = torch.arange(7)[None]
    z = paper_attention(q, k, v, scheme.keys, scheme.values if values else None, pos, pos)
    expected = attn.out_proj(z.transpose(1, 2).reshape(2, 7, 8))
    torch.testing.assert_close(attn(x), expected)


def test_meta_construction_to_empty_and_reset_parameters():
    for values in (True, False):
        with torch.device("meta"):
            scheme = ShawRelativePosition(16, 64, values=values)
        assert all(p.is_meta for p in scheme.parameters())
        scheme.to_empty(device="cpu")
        scheme.reset_parameters()
        torch.manual_seed(8)
        scheme.reset_parameters()
        torch.manual_seed(8)
        reference = ShawRelativePosition(16, 64, values=values)
        assert set(scheme.state_dict()) == ({"keys", "values"} if values else {"keys"})
        assert not list(scheme.buffers())
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(scheme.state_dict()[key], value)
            assert abs(value.std().item() - 0.25) < 0.02  # N(0, 1/head_dim), head_dim=16


# ----- errors ------------------------------------------------------------------------------


def test_errors_name_the_argument_and_the_fix():
    scheme = ShawRelativePosition(4, 2)
    q, pos = torch.randn(1, 2, 3, 4), torch.arange(3)
    with pytest.raises(ValueError, match="max_distance must be >= 1, got 0 .*clipping distance"):
        ShawRelativePosition(4, 0)
    with pytest.raises(TypeError, match="values must be a bool"):
        ShawRelativePosition(4, 2, values="yes")
    with pytest.raises(ValueError, match=r"q must have last dimension head_dim=4"):
        scheme.score_term(torch.randn(1, 2, 3, 5), pos, pos)
    with pytest.raises(TypeError, match=r"k_pos must be an integer tensor"):
        scheme.score_term(q, pos, pos.float())
    with pytest.raises(ValueError, match=r"weights must be the attention probabilities"):
        scheme.value_term(torch.rand(2, 3, 3), pos, pos)
    with pytest.raises(ValueError, match=r"k_pos must have one position per key: .*n_k=3"):
        scheme.value_term(torch.rand(1, 2, 3, 3), pos, torch.arange(4))
    with pytest.raises(ValueError, match=r"k and v must have shape \[b, h, n_k, d\]"):
        scheme(q, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"head_dim=4 but the attention has head_dim=2.*\(2, 2\)"):
        scheme.validate_attention(heads=4, head_dim=2)
    with pytest.raises(ValueError, match=r"head_dim=4 but the attention has head_dim=8"):
        MultiHeadAttention(16, 2, position=scheme)
    scheme.validate_attention(heads=7, head_dim=4)  # tables are shared: any heads


# ----- torch.compile -----------------------------------------------------------------------


@pytest.mark.compile
def test_compile_fullgraph_parity():
    torch.manual_seed(9)
    full, keys_only = ShawRelativePosition(4, 2), ShawRelativePosition(4, 2, values=False)

    def run(q, k, v, pos):
        out = full(q, k, v, q_pos=pos, k_pos=pos) + keys_only(q, k, v, q_pos=pos, k_pos=pos)
        weights = (q @ k.transpose(-2, -1)).softmax(-1)
        for scheme in (full, keys_only):  # the attention's way of finding the value hook
            value_term = getattr(scheme, "value_term", None)
            if value_term is not None:
                out = out + value_term(weights, pos, pos)
        return out

    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    pos = torch.stack([torch.arange(6), torch.arange(6) * 3])  # [b, n]
    compiled = torch.compile(run, fullgraph=True)
    logit = logit_size(q, k, full, pos, pos)  # inductor's fused kernels round otherwise
    assert_close(compiled(q, k, v, pos), run(q, k, v, pos), terms=6, logit=logit)


# ----- the family: one primitive, the rows of an offset --------------------------------------


def test_rows_of_an_offset_and_the_per_offset_forms():
    """``rows`` (``a^K``) and ``value_rows`` (``a^V``) are the clipped table rows; a run of
    positions longer than the table gives ``(table, index)``, a shorter one the rows
    themselves, and keys and values share the index (the lean engine then reads both once)."""
    from posenc import OffsetTerm
    from posenc.shaw import clipped_rows

    torch.manual_seed(0)
    scheme = ShawRelativePosition(4, 2)
    assert isinstance(scheme, OffsetTerm) and scheme.reach == 2
    offsets = torch.tensor([-9, -2, 0, 1, 30])
    assert torch.equal(scheme.rows(offsets), scheme.keys[[0, 0, 2, 3, 4]])
    assert torch.equal(scheme.value_rows(offsets), scheme.values[[0, 0, 2, 3, 4]])
    assert torch.equal(clipped_rows(scheme.keys, offsets), scheme.rows(offsets))
    long, short = torch.arange(8)[None], torch.arange(2)[None]
    table, index = scheme.offset_term(long, long)  # offsets -7 .. 7, rows of -2 .. 2
    assert torch.equal(table, scheme.keys) and index.tolist() == [0] * 6 + [1, 2, 3] + [4] * 6
    value_table, value_index = scheme.offset_value(long, long)
    assert torch.equal(value_table, scheme.values) and torch.equal(value_index, index)
    rows = scheme.offset_term(short, short)  # 3 offsets -1 .. 1: the rows themselves
    assert torch.equal(rows, scheme.keys[1:4])
    assert scheme.offset_term(torch.tensor([[0, 2]]), long) is None
    with pytest.raises(AttributeError, match="offset_value"):
        ShawRelativePosition(4, 2, values=False).offset_value
