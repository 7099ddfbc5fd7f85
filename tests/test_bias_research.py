"""The length-generalisation research biases (KERPLE, ALiBi with learned slopes, Sandwich, FIRE)
against their papers' formulas written out here in float64 loops, their constraints, their
gradients (``torch.autograd.gradcheck``) and their errors. The cross-scheme tests run them
inside attention through the registry."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from posenc import (
    ALiBi,
    FIREBias,
    KerpleBias,
    KVCache,
    MultiHeadAttention,
    SandwichBias,
    alibi_slopes,
)
from posenc.bias_research import fire_inputs, sandwich_bias
from tolerances import assert_close, recorded_logits


def _loop(formula, heads: int, q_pos: list[int], k_pos: list[int]) -> torch.Tensor:
    """``[heads, n_q, n_k]`` float64: ``formula(h, j - i)`` for every head and pair."""
    return torch.tensor(
        [[[formula(h, k - q) for k in k_pos] for q in q_pos] for h in range(heads)],
        dtype=torch.float64,
    )


def _kerple(kind: str, r1: list[float], r2: list[float]):
    if kind == "log":
        return lambda h, d: -r1[h] * math.log(1 + r2[h] * abs(d))
    return lambda h, d: -r1[h] * abs(d) ** r2[h]


def _kerple_module(kind: str, r1: list[float], r2: list[float]) -> KerpleBias:
    module = KerpleBias(len(r1), kind=kind).double()
    with torch.no_grad():
        module.r1.copy_(torch.tensor(r1))
        module.r2.copy_(torch.tensor(r2))
    return module


#: positions of three kinds: a consecutive run (per-offset path), shifted, scattered
POSITIONS = [(list(range(3, 9)), list(range(0, 9))), ([5, 9, 2, 40], [0, 1, 7, 33, 40, 41])]


@pytest.mark.parametrize("kind", ["log", "power"])
@pytest.mark.parametrize(("q_pos", "k_pos"), POSITIONS)
def test_kerple_equals_the_papers_kernel(kind, q_pos, k_pos):
    r1, r2 = [0.7, 1.9, 0.05], [0.3, 1.5, 2.0]
    module = _kerple_module(kind, r1, r2)
    got = module.score_bias(torch.tensor([q_pos]), torch.tensor([k_pos]))[0]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _loop(_kerple(kind, r1, r2), 3, q_pos, k_pos))
    float32 = _kerple_module(kind, r1, r2).float()
    assert float32(6, 9, 3).dtype == torch.float32
    torch.testing.assert_close(float32(6, 9, 3).double(), module(6, 9, 3), rtol=1e-5, atol=1e-5)


def test_learned_alibi_starts_at_the_papers_slopes_and_trains():
    fixed, learned = ALiBi(6), ALiBi(6, learned=True)
    assert fixed.state_dict() == {} and not list(fixed.parameters())  # unchanged
    assert list(learned.state_dict()) == ["log_slopes"]
    torch.testing.assert_close(learned.slopes(), alibi_slopes(6))
    torch.testing.assert_close(learned(5, 7), fixed(5, 7))
    model = MultiHeadAttention(12, 6, position=learned)
    before = learned.slopes().detach().clone()
    model(torch.randn(2, 9, 12)).square().sum().backward()
    assert learned.log_slopes.grad is not None and learned.log_slopes.grad.abs().sum() > 0
    torch.optim.SGD(learned.parameters(), lr=0.5).step()
    assert not torch.equal(learned.slopes(), before)


@pytest.mark.parametrize(("q_pos", "k_pos"), POSITIONS)
def test_learned_alibi_equals_the_papers_bias(q_pos, k_pos):
    module = ALiBi(3, learned=True).double()
    with torch.no_grad():
        module.log_slopes.copy_(torch.tensor([0.5, -1.0, -6.0]))
    slopes = [math.exp(0.5), math.exp(-1.0), math.exp(-6.0)]
    got = module.score_bias(torch.tensor([q_pos]), torch.tensor([k_pos]))[0]
    torch.testing.assert_close(got, _loop(lambda h, d: -slopes[h] * abs(d), 3, q_pos, k_pos))


def _schemes():
    return {
        "kerple-log": _kerple_module("log", [0.7, 1.2], [0.3, 1.1]),
        "kerple-power": _kerple_module("power", [0.7, 1.2], [0.3, 1.9]),
        "alibi-learned": ALiBi(2, learned=True),
        "sandwich": SandwichBias(3, 16),
    }


@pytest.mark.parametrize("name", list(_schemes()))
def test_translation_invariance(name):
    module = _schemes()[name]
    q_pos, k_pos = torch.tensor([[3, 8, 1, 20]]), torch.tensor([[0, 2, 9, 21, 30]])
    base = module.score_bias(q_pos, k_pos)
    for shift in (1, 17, 1000):
        torch.testing.assert_close(module.score_bias(q_pos + shift, k_pos + shift), base)


class _ScoreBias(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return self.module.score_bias(q_pos, k_pos)


@pytest.mark.parametrize(
    ("name", "parameter"),
    [
        ("kerple-log", "r1"),
        ("kerple-log", "r2"),
        ("kerple-power", "r1"),
        ("kerple-power", "r2"),
        ("alibi-learned", "log_slopes"),
    ],
)
@pytest.mark.parametrize("scattered", [False, True])
def test_gradients_against_gradcheck(name, parameter, scattered):
    module = _schemes()[name].double()
    value = getattr(module, parameter).detach().clone().requires_grad_()
    wrapper = _ScoreBias(module)
    args = ((torch.tensor([[4, 0, 9]]), torch.tensor([[1, 9, 3, 12]])),) if scattered else ()

    def f(x):
        if scattered:  # the dense bias of scattered positions (a table of the offsets)
            return functional_call(wrapper, {f"module.{parameter}": x}, args[0])
        return functional_call(module, {parameter: x}, (5, 7, 2))  # the per-offset path

    assert torch.autograd.gradcheck(f, (value,))


def test_kerple_keeps_its_parameters_in_range():
    module = _kerple_module("power", [-1.0, 0.5], [5.0, -3.0])
    r1, r2 = module.parameters_used()
    torch.testing.assert_close(r1, torch.tensor([0.01, 0.5], dtype=torch.float64))
    torch.testing.assert_close(r2, torch.tensor([2.0, 0.01], dtype=torch.float64))
    want = _loop(_kerple("power", [0.01, 0.5], [2.0, 0.01]), 2, list(range(4)), list(range(6)))
    torch.testing.assert_close(module(4, 6), want)
    module(4, 6).sum().backward()  # the clamp passes the gradient: a clamped value can return
    assert (module.r1.grad != 0).all() and (module.r2.grad != 0).all()
    module.project_()
    assert module.r1.tolist() == [0.01, 0.5] and module.r2.tolist() == [2.0, 0.01]
    log = _kerple_module("log", [-2.0, 3.0], [-1.0, 50.0]).project_()
    assert log.r1.tolist() == [0.01, 3.0] and log.r2.tolist() == [0.01, 50.0]  # no upper bound
    for kind in ("log", "power"):
        fresh = KerpleBias(16, kind=kind)
        assert (fresh.r1 >= 0.01).all() and (fresh.r2 >= 0.01).all()
        assert kind == "log" or (fresh.r2 <= 2).all()


def test_learned_slopes_stay_positive():
    module = ALiBi(2, learned=True)
    with torch.no_grad():
        module.log_slopes.copy_(torch.tensor([-80.0, 40.0]))
    assert (module.slopes() > 0).all() and (module(3, 5) <= 0).all()


def test_errors():
    with pytest.raises(ValueError, match="kind must be one of 'log', 'power', got 'cubic'"):
        KerpleBias(2, kind="cubic")
    with pytest.raises(ValueError, match="heads must be >= 1, got 0"):
        KerpleBias(0)
    with pytest.raises(ValueError, match="eps must be a finite number > 0, got 0.0"):
        KerpleBias(2, eps=0.0)
    with pytest.raises(ValueError, match=r"eps must be <= 2.0 \(r2's upper bound\), got 3"):
        KerpleBias(2, kind="power", eps=3)
    with pytest.raises(TypeError, match="heads must be an int"):
        ALiBi(2.0, learned=True)  # type: ignore[arg-type]
    for module in (KerpleBias(2), ALiBi(2, learned=True)):
        with pytest.raises(ValueError, match="heads=2"):
            MultiHeadAttention(12, 3, position=module)


# ----- Sandwich (Chi et al. 2023) ------------------------------------------------------------


def _sandwich(heads: int, dim: int, base: float = 10000.0):
    """The bias of the paper's formula, one pair at a time in float64: the inner product of
    two sinusoidal embeddings ``[sin(m w_f), cos(m w_f)]``, ``w_f = base ** (-2f / dim)`` for
    ``f = 1 .. dim / 2``, minus ``dim / 2``, divided by ``8 h / H`` for head ``h = 1 .. H``."""

    def embedding(m: int) -> list[float]:
        w = [base ** (-2 * f / dim) for f in range(1, dim // 2 + 1)]
        return [g(m * x) for x in w for g in (math.sin, math.cos)]

    def bias(h: int, d: int) -> float:
        inner = sum(a * b for a, b in zip(embedding(0), embedding(d), strict=True))
        return (inner - dim / 2) / (8 * (h + 1) / heads)

    return bias


#: positions as POSITIONS, and keys 10^4 and 3 * 10^4 away (float32 angles would be off)
SANDWICH_POSITIONS = [*POSITIONS, ([0, 7], [0, 10_000, 30_001])]


@pytest.mark.parametrize(("heads", "dim", "base"), [(4, 16, 10000.0), (3, 6, 50.0)])
@pytest.mark.parametrize(("q_pos", "k_pos"), SANDWICH_POSITIONS)
def test_sandwich_equals_the_papers_bias(heads, dim, base, q_pos, k_pos):
    module = SandwichBias(heads, dim, base=base)
    got = module.score_bias(torch.tensor([q_pos]), torch.tensor([k_pos]))[0]
    assert got.dtype == torch.float32
    expected = _loop(_sandwich(heads, dim, base), heads, q_pos, k_pos)
    # a float32 rounding of values of at most dim in size (the sum of dim / 2 cosines)
    torch.testing.assert_close(got.double(), expected, rtol=2**-23, atol=dim * 2**-24)


def test_sandwich_is_zero_at_distance_zero_negative_elsewhere_and_compressed_per_head():
    bias = SandwichBias(4, 32)(1, 4000)[:, 0]  # [h, 4000]: distances 0 .. 3999
    assert torch.all(bias[:, 0] == 0) and torch.all(bias[:, 1:] < 0)
    for h in range(4):  # head h (from 0) is head 0's bias divided by h + 1
        torch.testing.assert_close(bias[h] * (h + 1), bias[0])
    assert not list(SandwichBias(4, 32).parameters()) and SandwichBias(4, 32).state_dict() == {}


def test_sandwich_errors():
    with pytest.raises(ValueError, match=r"dim must be even \(a sinusoid pairs a sine with"):
        SandwichBias(2, 7)
    with pytest.raises(TypeError, match="dim must be an int, got 8.0"):
        SandwichBias(2, 8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="base must be a finite number > 0, got -1.0"):
        SandwichBias(2, 8, base=-1.0)
    with pytest.raises(ValueError, match="SandwichBias was built for heads=2"):
        MultiHeadAttention(12, 3, position=SandwichBias(2, 4))
    with pytest.raises(ValueError, match="dim must be even"):
        sandwich_bias(torch.arange(3), 2, 5)
    with pytest.raises(TypeError, match="offsets must be an integer tensor, got torch.float32"):
        sandwich_bias(torch.arange(3.0), 2, 4)


# ----- FIRE (Li et al. 2023) ----------------------------------------------------------------


def _fire_module(init_L: float = 4.37, seed: int = 0) -> FIREBias:
    """A float64 FIRE with a small ``L`` (so that queries past it occur at test sizes), ``c``
    and ``L_multiplier`` away from their initial values, negative ones included (both enter
    through an absolute value)."""
    torch.manual_seed(seed)
    module = FIREBias(3, hidden=5, init_L=init_L).double()
    with torch.no_grad():
        module.c.fill_(-0.37)
        module.L_multiplier.fill_(-1.2)
        for p in module.mlp.parameters():
            p.normal_()
    return module


def _fire_loop(module: FIREBias, q_pos: list[int], k_pos: list[int]) -> torch.Tensor:
    """``[heads, n_q, n_k]`` float64: the paper's bias written out, one pair at a time:
    ``f(psi(i - j) / psi(max(L, i)))``, ``psi(x) = log(|c x| + 1)``, ``L = |mult * init_L|``,
    ``eps`` added to the denominator, ``f = W2 relu(w1 x + b1) + b2``."""
    c, mult = module.c.item(), module.L_multiplier.item()
    w1, b1 = module.mlp[0].weight[:, 0].tolist(), module.mlp[0].bias.tolist()
    w2, b2 = module.mlp[2].weight.tolist(), module.mlp[2].bias.tolist()
    threshold = abs(mult * module.init_L)

    def bias(h: int, i: int, j: int) -> float:
        x = math.log(abs(c * (i - j)) + 1) / (math.log(abs(c * max(threshold, i)) + 1) + module.eps)
        hidden = [max(0.0, w * x + b) for w, b in zip(w1, b1, strict=True)]
        return sum(w * u for w, u in zip(w2[h], hidden, strict=True)) + b2[h]

    return torch.tensor(
        [[[bias(h, i, j) for j in k_pos] for i in q_pos] for h in range(module.heads)],
        dtype=torch.float64,
    )


#: consecutive (queries before and past L = 5.244), shifted far past L, scattered
FIRE_POSITIONS = [
    (list(range(0, 9)), list(range(0, 9))),
    (list(range(3, 9)), list(range(0, 12))),
    (list(range(600, 605)), list(range(590, 610))),
    ([5, 9, 2, 40, 0], [0, 1, 7, 33, 40, 41]),
]


@pytest.mark.parametrize(("q_pos", "k_pos"), FIRE_POSITIONS)
def test_fire_equals_the_papers_bias(q_pos, k_pos):
    module = _fire_module()
    got = module.score_bias(torch.tensor([q_pos]), torch.tensor([k_pos]))[0]
    assert got.dtype == torch.float64 and got.shape == (3, len(q_pos), len(k_pos))
    torch.testing.assert_close(got, _fire_loop(module, q_pos, k_pos), rtol=1e-12, atol=1e-12)
    # per-sequence positions: each row its own
    rows = torch.tensor([q_pos, [p + 7 for p in q_pos]]), torch.tensor([k_pos, k_pos])
    both = module.score_bias(*rows)
    torch.testing.assert_close(both[1], _fire_loop(module, [p + 7 for p in q_pos], k_pos))
    # the standalone bias: queries at offset + arange(q_len), keys at arange(k_len)
    torch.testing.assert_close(module(3, 5, 600), _fire_loop(module, [600, 601, 602], range(5)))
    float32 = _fire_module().float()
    dense = float32(6, 9, 3)
    assert dense.dtype == torch.float32
    assert_close(dense, module(6, 9, 3), terms=5)  # a 5-term hidden layer


def test_fire_initial_values_and_state():
    module = FIREBias(4)
    assert module.c.item() == pytest.approx(0.1) and module.L_multiplier.item() == 1.0
    assert module.init_L == 512.0 and module.eps == 1e-6
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    assert shapes == {
        "mlp.0.weight": (32, 1),
        "mlp.0.bias": (32,),
        "mlp.2.weight": (4, 32),
        "mlp.2.bias": (4,),
        "c": (),
        "L_multiplier": (),
    }
    with torch.device("meta"):
        meta = FIREBias(4)
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    assert meta.c.item() == pytest.approx(0.1) and meta.L_multiplier.item() == 1.0


def test_fire_interpolates_into_the_unit_interval_and_is_symmetric():
    module = _fire_module(init_L=512.0)
    # a key at or before its query: psi(i - j) <= psi(max(L, i)), so the input is in [0, 1]
    c, threshold = module.c, (module.L_multiplier * module.init_L).abs()
    i = torch.arange(2000.0, dtype=torch.float64)[:, None]
    j = torch.arange(0, 2000, 37, dtype=torch.float64)[None]
    with torch.no_grad():
        x = fire_inputs(i - j, i, c, threshold, module.eps)[(j <= i).expand(2000, -1)]
    assert float(x.min()) == 0.0 and float(x.max()) <= 1.0
    # |c (i - j)|: a key m after its query gets the bias of a key m before it
    forward, backward = module.score_bias(torch.tensor([[9]]), torch.tensor([[4, 14]]))[0, :, 0].T
    torch.testing.assert_close(forward, backward)


def test_fire_is_translation_invariant_only_before_L():
    module = FIREBias(2)  # L = 512
    q_pos, k_pos = torch.tensor([[3, 8, 1, 20]]), torch.tensor([[0, 2, 9, 21, 30]])
    base = module.score_bias(q_pos, k_pos)
    for shift in (1, 17, 400):  # every query still before L: the normaliser is psi(L)
        torch.testing.assert_close(module.score_bias(q_pos + shift, k_pos + shift), base)
    past = module.score_bias(q_pos + 5000, k_pos + 5000)  # psi(i) now: distances squeezed
    assert not torch.allclose(past, base)


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize(
    "parameter", ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias", "c", "L_multiplier"]
)
def test_fire_gradients_against_gradcheck(parameter, scattered):
    module = _fire_module()  # L = 5.244: queries before L (L's gradient) and past it (c's)
    value = dict(module.named_parameters())[parameter].detach().clone().requires_grad_()
    wrapper = _ScoreBias(module)
    q_pos, k_pos = (
        (torch.tensor([[9, 0, 3, 14]]), torch.tensor([[1, 9, 3, 12, 0]]))
        if scattered
        else (torch.arange(2, 10)[None], torch.arange(10)[None])
    )

    def f(x):
        return functional_call(wrapper, {f"module.{parameter}": x}, (q_pos, k_pos))

    assert torch.autograd.gradcheck(f, (value,))


@pytest.mark.parametrize("shared", [True, False])
def test_fire_score_mod_equals_the_dense_bias(shared):
    module = _fire_module().float()
    b, h, n = 2, 3, 9
    positions = (
        torch.arange(n) + 2 if shared else torch.stack([torch.arange(n), torch.arange(n) * 3])
    )
    q_pos = positions if positions.ndim == 2 else positions[None]
    score = torch.randn(b, h, n, n)
    mod = module.flex_score_mod(positions, positions)
    bi = torch.arange(b)[:, None, None, None]
    hi = torch.arange(h)[None, :, None, None]
    qi = torch.arange(n)[None, None, :, None]
    ki = torch.arange(n)[None, None, None, :]
    got = mod(score, bi, hi, qi, ki)
    # a 5-term hidden layer summed in another order, then added to the score
    assert_close(got, score + module.score_bias(q_pos, q_pos), terms=5)
    # one pair at a time, as FlexAttention traces it (0-d indices)
    one = mod(score[1, 2, 4, 7], *(torch.tensor(v) for v in (1, 2, 4, 7)))
    assert_close(one, got[1, 2, 4, 7], terms=5)


def _fire_attention(backend: str) -> MultiHeadAttention:
    torch.manual_seed(3)
    scheme = FIREBias(2, hidden=8, init_L=5.0)  # queries past L at these lengths
    return MultiHeadAttention(8, 2, position=scheme, backend=backend)


def _run(model, x, **kwargs):
    x = x.clone().requires_grad_()
    out = model(x, **kwargs)
    (out * torch.linspace(-1, 1, 8)).sum().backward()
    return out, x.grad, {k: p.grad for k, p in model.named_parameters()}


def test_fire_backends_agree_outputs_and_parameter_gradients():
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(0))
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, -3:] = True
    positions = torch.stack([torch.arange(12), torch.arange(12) + 40])  # per sequence
    results = {}
    for backend in ("math", "auto", "lean", "sdpa"):
        with recorded_logits() as logits:
            results[backend] = _run(
                _fire_attention(backend),
                x,
                causal=True,
                key_padding_mask=padding,
                positions=positions,
            )
    reference = results.pop("math")
    size = max(float(g.abs().max()) for g in (reference[1], *reference[2].values()))
    close = dict(terms=12, logit=max(logits))
    for backend, (out, x_grad, grads) in results.items():
        assert_close(out, reference[0], **close, msg=f"{backend} output")
        assert_close(x_grad, reference[1], magnitude=size, **close, msg=f"{backend} dx")
        for key, grad in reference[2].items():
            assert_close(grads[key], grad, magnitude=size, **close, msg=f"{backend} {key}")
    for key in ("c", "L_multiplier", "mlp.0.weight", "mlp.2.bias"):
        assert reference[2][f"position.{key}"].abs().sum() > 0, key


@pytest.mark.parametrize("backend", ["math", "auto"])
def test_fire_decoding_with_a_cache_equals_one_causal_pass(backend):
    model = _fire_attention(backend).eval()
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), recorded_logits() as logits:
        full = model(x, causal=True)
        cache = KVCache()
        steps = [model(x[:, :4], causal=True, cache=cache)]
        steps += [model(x[:, t : t + 1], causal=True, cache=cache) for t in range(4, 12)]
    assert_close(torch.cat(steps, 1), full, terms=12, logit=max(logits))


def test_fire_errors():
    with pytest.raises(ValueError, match="heads must be >= 1, got 0"):
        FIREBias(0)
    with pytest.raises(TypeError, match="heads must be an int"):
        FIREBias(2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hidden must be >= 1, got 0"):
        FIREBias(2, hidden=0)
    with pytest.raises(ValueError, match="init_c must be a finite number > 0, got 0.0"):
        FIREBias(2, init_c=0.0)
    with pytest.raises(ValueError, match="init_L must be a finite number > 0, got -1.0"):
        FIREBias(2, init_L=-1.0)
    with pytest.raises(ValueError, match="eps must be a finite number > 0, got inf"):
        FIREBias(2, eps=float("inf"))
    with pytest.raises(
        ValueError, match="FIREBias was built for heads=2 but the attention has heads=3"
    ):
        MultiHeadAttention(12, 3, position=FIREBias(2))
    with pytest.raises(ValueError, match="q_len must be >= 0, got -1"):
        FIREBias(2)(-1, 3)
    with pytest.raises(TypeError, match=r"q_pos must be an integer tensor .* q_pos.long\(\)"):
        FIREBias(2).flex_score_mod(torch.arange(4.0), torch.arange(4))
