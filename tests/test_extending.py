"""docs/extending.md: a new scheme as one primitive of a family (posenc.families).

The Kerple log bias of the guide is taken from the guide itself (its code block is run
here), so the guide and the test cannot drift apart. It is checked against its formula
written as a float64 loop, hook by hook and through ``MultiHeadAttention`` on every
backend (outputs and gradients), and ``posenc.explain`` must report the per-offset bias
path. Small schemes of the three other families are defined below and checked the same
way.

Float32 tolerances follow from the size of what is compared (``eps32 * magnitude``, times
``sqrt(terms)`` for a sum), never from what passed on one CPU.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import posenc
from posenc.families import GridBias, GridTerm, OffsetTerm, offset_term_literal

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
EPS32 = torch.finfo(torch.float32).eps
SAFETY = 8.0


def guide_namespace() -> dict[str, object]:
    """The guide's ```python block that defines ``KerpleLogBias``, run."""
    blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), re.MULTILINE | re.DOTALL)
    (code,) = [block for block in blocks if "class KerpleLogBias" in block]
    namespace: dict[str, object] = {"__name__": __name__}  # importable, for torch.compile
    exec(compile(code, f"{GUIDE.name}[KerpleLogBias]", "exec"), namespace)
    return namespace


KerpleLogBias = guide_namespace()["KerpleLogBias"]


def kerple(heads: int = 4, seed: int = 0) -> nn.Module:
    """The guide's scheme with parameters that differ per head (so a head mix-up shows)."""
    scheme = KerpleLogBias(heads)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        scheme.raw_r1.copy_(torch.randn(heads, generator=generator))
        scheme.raw_r2.copy_(torch.randn(heads, generator=generator) - 1.0)
    return scheme


def kerple_reference(scheme: nn.Module, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``-r1_h * log(1 + r2_h * |k_pos_j - q_pos_i|)`` by a loop, float64: ``[B', h, n_q, n_k]``."""
    r1 = [math.log1p(math.exp(x)) for x in scheme.raw_r1.double().tolist()]  # softplus
    r2 = [math.log1p(math.exp(x)) for x in scheme.raw_r2.double().tolist()]
    rows, n_q, n_k = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    out = torch.empty(max(rows, k_pos.shape[0]), len(r1), n_q, n_k, dtype=torch.float64)
    for b in range(out.shape[0]):
        qp, kp = q_pos[min(b, rows - 1)].tolist(), k_pos[min(b, k_pos.shape[0] - 1)].tolist()
        for h in range(len(r1)):
            for i in range(n_q):
                for j in range(n_k):
                    out[b, h, i, j] = -r1[h] * math.log(1 + r2[h] * abs(kp[j] - qp[i]))
    return out


def bias_atol(reference: torch.Tensor, scheme: nn.Module) -> float:
    """The bias is ``r1 * log1p(r2 * d)`` in float32: softplus, the product ``r2 * d``
    (which moves ``log1p`` by at most its own relative error, ``x / (1 + x) < 1``),
    ``log1p`` and the product by ``r1`` each round to ``eps * |value|``: a few
    ``eps * (|B| + r1)``."""
    r1 = float(F.softplus(scheme.raw_r1.detach().double()).max())
    return SAFETY * EPS32 * (float(reference.abs().max()) + r1)


def run_of(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n)[None]  # [1, n]


POSITIONS = {
    "run": (run_of(12), run_of(12)),
    "shifted": (run_of(12, 1000), run_of(12, 1000)),
    "block-of-queries": (run_of(4, 5), run_of(12)),
    "decoding": (run_of(1, 11), run_of(12)),
    "cross": (run_of(5, 3), run_of(9, 20)),
    "per-sequence": (
        torch.stack([torch.arange(12), torch.arange(12) + 40]),
        torch.stack([torch.arange(12), torch.arange(12) + 40]),
    ),
    "shuffled": (
        torch.randperm(12, generator=torch.Generator().manual_seed(3))[None],
        torch.randperm(12, generator=torch.Generator().manual_seed(4))[None] * 3,
    ),
}


# ----- the guide --------------------------------------------------------------------------


def test_the_guides_scheme_is_about_twenty_lines():
    """The guide claims "a new scheme in about 20 lines": its class, blank lines aside."""
    (code,) = [
        block
        for block in re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), re.M | re.S)
        if "class KerpleLogBias" in block
    ]
    body = code[code.index("class KerpleLogBias") :]
    assert len([line for line in body.splitlines() if line.strip()]) <= 22
    assert issubclass(KerpleLogBias, posenc.OffsetBias)


# ----- the bias against its formula ------------------------------------------------------


@pytest.mark.parametrize("case", POSITIONS)
def test_score_bias_equals_the_formula(case):
    scheme = kerple()
    q_pos, k_pos = POSITIONS[case]
    expected = kerple_reference(scheme, q_pos, k_pos)
    got = scheme.score_bias(q_pos, k_pos)
    assert got.dtype == torch.float32 and got.shape[1:] == expected.shape[1:]
    atol = bias_atol(expected, scheme)
    torch.testing.assert_close(
        got.detach().double().expand_as(expected), expected, atol=atol, rtol=0
    )


@pytest.mark.parametrize("case", ["run", "per-sequence", "shuffled"])
def test_bias_gradients_equal_the_formulas(case):
    """d(sum g * B) / d raw_r: a float32 sum over the pairs of ``g * dB/draw``, each term
    of a known sign per head; the float64 closed form ``dB/draw1 = -log1p(r2 d) s(raw1)``,
    ``dB/draw2 = -r1 d / (1 + r2 d) s(raw2)`` (``s`` the sigmoid)."""
    scheme = kerple()
    q_pos, k_pos = POSITIONS[case]
    bias = scheme.score_bias(q_pos, k_pos)  # [B', h, n_q, n_k]
    g = torch.randn(bias.shape, generator=torch.Generator().manual_seed(5))
    got = torch.autograd.grad(bias, [scheme.raw_r1, scheme.raw_r2], g)
    raw1, raw2 = scheme.raw_r1.detach().double(), scheme.raw_r2.detach().double()
    r1, r2 = F.softplus(raw1)[:, None, None], F.softplus(raw2)[:, None, None]  # [h, 1, 1]
    distance = (k_pos[:, None, :] - q_pos[:, :, None]).abs().double()[:, None]  # [B', 1, ..]
    d_raw1 = -torch.log1p(r2 * distance) * torch.sigmoid(raw1)[:, None, None]
    d_raw2 = -r1 * distance / (1 + r2 * distance) * torch.sigmoid(raw2)[:, None, None]
    terms = distance[0, 0].numel() * bias.shape[0]
    for grad, derivative in zip(got, (d_raw1, d_raw2), strict=True):
        products = g.double() * derivative  # [B', h, n_q, n_k]
        expected = products.sum(dim=(0, 2, 3))  # [h]
        atol = SAFETY * EPS32 * float(products.abs().max()) * math.sqrt(terms)
        torch.testing.assert_close(grad.double(), expected, atol=atol, rtol=0)


def test_every_derived_hook_is_the_same_bias():
    """offset_bias, flex_score_mod and forward read the bias that score_bias gives."""
    scheme = kerple()
    q_pos, k_pos = run_of(5, 7), run_of(9)
    dense = scheme.score_bias(q_pos, k_pos)[0]  # [h, 5, 9]
    values = scheme.offset_bias(q_pos, k_pos)  # [h, 5 + 9 - 1]: offset k_pos[0] - q_pos[-1] + m
    assert values.shape == (4, 13)
    for i in range(5):
        for j in range(9):
            torch.testing.assert_close(values[:, j - i + 4], dense[:, i, j], atol=0, rtol=0)
    torch.testing.assert_close(scheme(5, 9, offset=7), dense, atol=0, rtol=0)
    assert scheme.offset_bias(torch.tensor([[0, 2]]), k_pos) is None  # not a run
    # the score_mod, called with broadcast indices as FlexAttention's reference does
    b, h = 2, 4
    score = torch.randn(b, h, 5, 9)
    index = [torch.arange(s).view([-1 if a == n else 1 for a in range(4)]) for n, s in
             enumerate((b, h, 5, 9))]  # fmt: skip
    for positions in ((q_pos, k_pos), (q_pos.expand(b, -1), k_pos.expand(b, -1))):
        got = scheme.flex_score_mod(*positions)(score, *index)
        expected = score + dense
        atol = 2 * EPS32 * float(expected.detach().abs().max())  # one addition each
        torch.testing.assert_close(got.detach(), expected.detach(), atol=atol, rtol=0)


def test_state_meta_and_head_check():
    with torch.device("meta"):
        scheme = KerpleLogBias(4)
    assert scheme.raw_r1.is_meta
    scheme = KerpleLogBias(4)
    assert list(scheme.state_dict()) == ["raw_r1", "raw_r2"]
    with pytest.raises(ValueError, match="KerpleLogBias was built for heads=4 but the attention"):
        posenc.MultiHeadAttention(64, 8, position=scheme)


# ----- through attention: the fast path, every backend, and the float64 reference ---------


def test_auto_takes_the_per_offset_bias_path(monkeypatch):
    monkeypatch.setattr(posenc.engine.tuning, "MATERIALISED_SCORES", 0)  # a long sequence's
    scheme = kerple()
    q, k, v = (torch.randn(2, 4, 64, 16) for _ in range(3))
    assert posenc.explain(q, k, v, position=scheme).path == "offset-bias"
    assert posenc.explain(q, k, v, position=scheme, causal=True).path == "offset-bias"
    shifted = run_of(64, 500)
    assert posenc.explain(q, k, v, position=scheme, positions=shifted).path == "offset-bias"
    # per-sequence positions are not one run: the general engine, and explain says why
    rows = torch.stack([torch.arange(64), torch.arange(64) + 3])
    why = posenc.explain(q, k, v, position=scheme, positions=rows)
    assert why.path != "offset-bias" and "offset-bias" in why.reasons


def dense_attention_float64(module, x, bias):
    """``MultiHeadAttention``'s forward written out, float64: projections, ``softmax(q k^T /
    sqrt(d) + B) v``, output projection."""
    b, n, dim = x.shape
    h, d = module.heads, module.head_dim
    x = x.double()

    def project(linear):
        y = x @ linear.weight.double().t() + linear.bias.double()  # [b, n, dim]
        return y.view(b, n, h, d).transpose(1, 2)  # [b, n, dim] -> [b, h, n, d]

    q, k, v = project(module.q_proj), project(module.k_proj), project(module.v_proj)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d) + bias  # [b, h, n, n]
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, dim)  # [b, h, n, d] -> [b, n, dim]
    out_proj = module.out_proj
    return out @ out_proj.weight.double().t() + out_proj.bias.double(), scores, v


@pytest.mark.parametrize("causal", [False, True])
def test_attention_auto_and_math_equal_the_float64_reference(causal):
    """Float32 outputs and gradients of ``auto`` (the per-offset bias path) and ``math``
    against the attention written out in float64, with the bias of the loop."""
    torch.manual_seed(0)
    n, dim, heads = 24, 32, 4
    scheme = kerple(heads)
    x = torch.randn(2, n, dim)
    pos = run_of(n)
    bias = kerple_reference(scheme, pos, pos)  # [1, h, n, n]
    if causal:
        bias = bias.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    module = posenc.MultiHeadAttention(dim, heads, position=scheme)
    expected, scores, v = dense_attention_float64(module, x, bias)
    # float32: a logit of size L is off by ~eps * L (q.k a sum of d terms, the bias a few
    # roundings), which moves a softmax-weighted mean of values by ~eps * L * max|v|; the
    # mean over n keys and the output projection (dim terms) add eps * sqrt(terms) each
    logit = float(scores.masked_fill(scores.isinf(), 0).abs().max())
    per_value = float(v.abs().max()) * (logit + math.sqrt(n))
    weight = float(module.out_proj.weight.abs().sum(-1).max())  # |row|_1 of the projection
    atol = SAFETY * EPS32 * (weight * per_value + float(expected.abs().max()) * math.sqrt(dim))
    results = {}
    for backend in ("auto", "math"):
        module.backend = backend
        module.zero_grad()
        leaf = x.clone().requires_grad_()
        out = module(leaf, causal=causal)
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0, msg=backend)
        (out * torch.linspace(-1, 1, dim)).sum().backward()
        results[backend] = [leaf.grad, *(p.grad for p in module.parameters())]
    # gradients: sums over the batch and positions of products of the same size; some
    # cancel to 0 exactly (the key bias's: softmax ignores a constant per query), so each
    # is compared at the size of the largest, that of the terms that cancel
    size = max(float(g.abs().max()) for g in results["math"])
    terms = 2 * n * dim
    atol = SAFETY * EPS32 * size * (math.sqrt(terms) + logit)
    for got, want in zip(results["auto"], results["math"], strict=True):
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
    assert results["auto"][-1].abs().sum() > 0  # the bias's parameters learn (raw_r2)


@pytest.mark.compile
@pytest.mark.parametrize("per_pair", [False, True], ids=["table", "per-pair"])
def test_compiled_flex_attention(monkeypatch, per_pair):
    """FlexAttention compiles the score_mod: from a table of the offsets met (CPU), or
    with the primitive itself per pair (where the offsets are not read: GPU), which
    checks that it compiles inside FlexAttention's kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    import posenc.families.biases as biases

    if per_pair:
        monkeypatch.setattr(biases, "offset_span", lambda *args: None)
    torch.manual_seed(0)
    b, h, n, d = 2, 4, 16, 8
    scheme = kerple(h)
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    pos = run_of(n)
    compiled = torch.compile(flex_attention, dynamic=False)
    with torch.no_grad():
        got = compiled(q, k, v, score_mod=scheme.flex_score_mod(pos, pos))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + scheme.score_bias(pos, pos)
        expected = scores.softmax(-1) @ v
    logit = float(scores.abs().max()) + d * float(q.abs().max() * k.abs().max()) / math.sqrt(d)
    atol = SAFETY * EPS32 * float(v.abs().max()) * (logit + math.sqrt(n))
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


# ----- the other families: a scheme each, against its formula -----------------------------


class GaussianGridBias(GridBias):
    """A 2-D bias ``-w_h * (dr^2 + dc^2)`` on an ``H x W`` map (a test scheme)."""

    def __init__(self, size: tuple[int, int], heads: int) -> None:
        super().__init__()
        self.size, self.heads = size, heads
        self.weight = nn.Parameter(torch.linspace(0.05, 0.4, heads))

    def bias(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        squared = (rows.square() + cols.square()).float().unsqueeze(-1)  # [*S, 1]
        return -self.weight * squared  # [*S, h]


class SinusoidalTerm(OffsetTerm):
    """``r(j - i) = sinusoidal(j - i)`` per head, scaled: no reach (a test scheme)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, heads))

    def rows(self, offsets: torch.Tensor) -> torch.Tensor:
        table = posenc.sinusoidal(offsets, self.head_dim)  # [*S, d]
        return self.scale.view(-1, *[1] * table.ndim) * table  # [h, *S, d]


class AxisTerm(GridTerm):
    """``r = height[dr] + width[dc]`` from two learned tables (a test scheme)."""

    def __init__(self, size: tuple[int, int], head_dim: int) -> None:
        super().__init__()
        self.size, self.head_dim = size, head_dim
        self.height = nn.Parameter(torch.randn(2 * size[0] - 1, head_dim))
        self.width = nn.Parameter(torch.randn(2 * size[1] - 1, head_dim))

    def axis_rows(self, axis: int, offsets: torch.Tensor) -> torch.Tensor:
        table, length = (self.width, self.size[1]) if axis else (self.height, self.size[0])
        return table[offsets + length - 1]  # [*S, d]


def test_grid_bias_family_equals_its_formula_and_takes_the_grid_path(monkeypatch):
    size, heads = (16, 32), 2  # 512 tokens: large enough for the grid bias path
    scheme = GaussianGridBias(size, heads).double()
    tokens = torch.arange(size[0] * size[1])[None]
    picked = tokens[:, ::37]  # a few tokens against a few others, any order
    got = scheme.score_bias(picked, picked.flip(-1))[0]  # [h, m, m]
    for h in range(heads):
        for a, i in enumerate(picked[0].tolist()):
            for c, j in enumerate(picked.flip(-1)[0].tolist()):
                dr, dc = j // 32 - i // 32, j % 32 - i % 32
                want = -float(scheme.weight[h]) * (dr * dr + dc * dc)
                assert abs(float(got[h, a, c]) - want) <= SAFETY * EPS32 * abs(want)
    grid = scheme.grid_bias(tokens, tokens)  # [h, 31, 63]
    assert grid.shape == (heads, 31, 63)
    assert float(grid[1, 15 + 2, 31 - 3]) == pytest.approx(-float(scheme.weight[1]) * 13)
    q, k, v = (torch.randn(1, heads, 512, 8) for _ in range(3))
    monkeypatch.setattr(posenc.engine.tuning, "MATERIALISED_SCORES", 0)  # a long sequence's
    assert posenc.explain(q, k, v, position=GaussianGridBias(size, heads)).path == "grid-bias"


def test_offset_term_family_without_reach_equals_its_formula(monkeypatch):
    torch.manual_seed(0)
    scheme = SinusoidalTerm(3, 8).double()
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    for q_pos, k_pos in (
        (run_of(5, 7), run_of(12)),  # a run: the skew
        (torch.stack([torch.arange(5) * 3, torch.arange(5)]), torch.stack([run_of(12)[0]] * 2)),
    ):
        got = scheme.score_term(q, q_pos, k_pos)  # [b, h, n_q, n_k]
        offsets = (k_pos[:, None, :] - q_pos[:, :, None]).expand(2, -1, -1)  # [b, n_q, n_k]
        table = posenc.sinusoidal(offsets, 8).double()  # [b, n_q, n_k, d]
        expected = torch.einsum("bhid,bijd->bhij", q, table) * scheme.scale.view(1, 3, 1, 1)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
        literal = offset_term_literal(q, scheme.rows, q_pos, k_pos)
        torch.testing.assert_close(literal, expected, atol=1e-12, rtol=0)
    rows = scheme.offset_term(run_of(5, 7), run_of(12))  # [h, 16, d]: offsets -11 .. 4
    expected = scheme.scale[1] * posenc.sinusoidal(torch.tensor(-11), 8).double()
    torch.testing.assert_close(rows[1, 0], expected, atol=1e-12, rtol=0)
    qf, k, v = (torch.randn(2, 3, 64, 8) for _ in range(3))
    monkeypatch.setattr(posenc.engine.tuning, "MATERIALISED_SCORES", 0)  # a long sequence's
    assert posenc.explain(qf, k, v, position=SinusoidalTerm(3, 8)).path == "offset-term"


@pytest.mark.parametrize("columns", [1, 8, 64])
def test_offset_term_family_padded_product_equals_its_formula(monkeypatch, columns):
    """The product with the rows padded to a multiple of GEMM_COLUMNS where that adds at
    most an eighth (1: none; 8: 62 and 70 rows to 64 and 72; 64: 62 to 64, 70 not) reads
    only the offsets' columns: the formula, for a run (the skew) and for other positions
    (the gather), its gradients too."""
    from posenc.diagonals import padded_count
    from posenc.families import terms

    monkeypatch.setattr(posenc.engine.tuning, "GEMM_COLUMNS", columns)
    widths = []
    real = terms.table_logits
    monkeypatch.setattr(
        terms, "table_logits", lambda q, t: widths.append(t.shape[-2]) or real(q, t)
    )
    torch.manual_seed(0)
    scheme = SinusoidalTerm(3, 8).double()
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    for q_pos, k_pos, rows in (
        (run_of(5, 7), run_of(58), 62),  # a run: the skew of 62 offsets
        (torch.stack([torch.arange(5) * 3, torch.arange(5)]), torch.stack([run_of(58)[0]] * 2), 70),
    ):
        widths.clear()
        got = scheme.score_term(q, q_pos, k_pos)  # [b, h, n_q, n_k]
        assert widths == [padded_count(rows, columns)]  # the product's width
        offsets = (k_pos[:, None, :] - q_pos[:, :, None]).expand(2, -1, -1)  # [b, n_q, n_k]
        table = posenc.sinusoidal(offsets, 8).double()  # [b, n_q, n_k, d]
        expected = torch.einsum("bhid,bijd->bhij", q, table) * scheme.scale.view(1, 3, 1, 1)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
        weights = torch.randn_like(expected)
        (grad,) = torch.autograd.grad((got * weights).sum(), q)
        (want,) = torch.autograd.grad((expected * weights).sum(), q)
        torch.testing.assert_close(grad, want, atol=1e-12, rtol=0)


def test_grid_term_family_equals_its_formula_and_takes_the_grid_path(monkeypatch):
    torch.manual_seed(0)
    size = (3, 4)
    scheme = AxisTerm(size, 8).double()
    q = torch.randn(1, 2, 12, 8, dtype=torch.float64)
    tokens = torch.arange(12)[None]
    got = scheme.score_term(q, tokens, tokens.flip(-1))
    for i in range(12):
        for c, j in enumerate(tokens.flip(-1)[0].tolist()):
            r = scheme.height[j // 4 - i // 4 + 2] + scheme.width[j % 4 - i % 4 + 3]
            torch.testing.assert_close(got[0, :, i, c], q[0, :, i] @ r, atol=1e-12, rtol=0)
    height, width = scheme.grid_term(tokens, tokens)
    assert torch.equal(height, scheme.height) and torch.equal(width, scheme.width)
    assert scheme.grid_term(tokens[:, 1:], tokens) is None
    with pytest.raises(ValueError, match=r"k_pos must be in \[0, 12\)"):
        scheme.score_term(q, tokens, tokens + 1)
    qf, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    monkeypatch.setattr(posenc.engine.tuning, "MATERIALISED_SCORES", 0)  # a long sequence's
    assert posenc.explain(qf, k, v, position=AxisTerm(size, 8)).path == "grid-term"
    with pytest.raises(ValueError, match="AxisTerm was built for head_dim=8"):
        posenc.MultiHeadAttention(32, 2, position=AxisTerm(size, 8))


def test_a_primitive_left_out_names_itself():
    class Empty(posenc.OffsetBias):
        pass

    with pytest.raises(NotImplementedError, match=r"Empty must define bias\(offsets\)"):
        Empty().score_bias(run_of(3), run_of(3))
