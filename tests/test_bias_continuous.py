"""Swin V2's continuous position bias against the paper's equation written out here in
float64 loops, against HF transformers' ``Swinv2SelfAttention`` with the same weights, its
gradients (``torch.autograd.gradcheck``), the grid fast path against the math backend,
and its errors. The cross-scheme tests run it inside attention through the registry
(``swin-v2-cpb``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

import posenc
from posenc import ContinuousPositionBias, MultiHeadAttention
from tolerances import assert_close, forward


def _random(module: ContinuousPositionBias, seed: int = 0, std: float = 0.7):
    """``module`` with every parameter drawn from ``N(0, std**2)`` (no ReLU kink at 0, a
    bias that is not saturated), rounded to float32."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            value = torch.randn(p.shape, generator=generator, dtype=torch.float64) * std
            p.copy_(value.float())  # float32 values: the same in a float32 and a float64 module
    return module


def _loop_bias(module, window, pretrained, tokens_q=None, tokens_k=None):
    """``(bias [h, n_q, n_k], logit [h, n_q, n_k])`` float64, one pair at a time.

    Liu et al. 2022 (arXiv 2111.09883) and the official code: the offset query minus key
    ``(r_i - r_j, c_i - c_j)``, normalised by ``pretrained - 1`` per axis and times 8, then
    ``sign(x) log2(1 + |x|) / log2(8)``; a two-layer MLP with a ReLU, no bias in its second
    layer; ``16 sigmoid`` of its output."""
    w1, b1, w2 = (p.detach().double().tolist() for p in module.parameters())
    height, width = window
    cells = height * width
    tokens_q = list(range(cells)) if tokens_q is None else tokens_q
    tokens_k = list(range(cells)) if tokens_k is None else tokens_k
    heads, hidden = len(w2), len(b1)
    bias = torch.zeros(heads, len(tokens_q), len(tokens_k), dtype=torch.float64)
    logit = torch.zeros_like(bias)
    for a, i in enumerate(tokens_q):
        for c, j in enumerate(tokens_k):
            delta = (i // width - j // width, i % width - j % width)
            coords = []
            for d, p in zip(delta, pretrained, strict=True):
                x = d / max(p - 1, 1) * 8
                coords.append(math.copysign(math.log2(abs(x) + 1), x) / 3 if x else 0.0)
            units = [
                max(0.0, w1[u][0] * coords[0] + w1[u][1] * coords[1] + b1[u]) for u in range(hidden)
            ]
            for h in range(heads):
                z = sum(w2[h][u] * units[u] for u in range(hidden))
                logit[h, a, c] = z
                bias[h, a, c] = 16 / (1 + math.exp(-z))
    return bias, logit


#: (window built, pretrained_window, window called at): plain, another window, a
#: pretrained window, and a transfer to a larger window normalised by the built one
CASES = [
    ((3, 4), None, None),
    ((2, 5), None, None),
    ((3, 4), (5, 3), None),
    ((3, 4), None, (5, 6)),
]


@pytest.mark.parametrize(("window", "pretrained", "called"), CASES)
def test_bias_equals_the_papers_equation(window, pretrained, called):
    module = _random(ContinuousPositionBias(window, 3, hidden=16, pretrained_window=pretrained))
    size = called or window
    expected, logit = _loop_bias(module, size, pretrained or window)
    double = _random(
        ContinuousPositionBias(window, 3, hidden=16, pretrained_window=pretrained).double()
    )
    got = double(window=called)  # [h, N, N]
    assert got.dtype == torch.float64 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    # the same through .size and the family's hooks
    double.size = size
    tokens = torch.arange(size[0] * size[1])[None]
    torch.testing.assert_close(double.score_bias(tokens, tokens)[0], expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(double(), expected, atol=1e-12, rtol=0)
    grid = double.grid_bias(tokens, tokens)  # [h, 2H-1, 2W-1], entry [dr + H-1, dc + W-1]
    assert grid.shape == (3, 2 * size[0] - 1, 2 * size[1] - 1)
    # float32: the MLP's output z is a sum of `hidden` terms; 16 sigmoid'(z) <= 4
    single = module(window=called)
    assert single.dtype == torch.float32
    assert_close(single, expected, magnitude=4 * float(logit.abs().max()), terms=16)


def test_scattered_and_per_sequence_positions():
    module = _random(ContinuousPositionBias((3, 4), 2, hidden=8).double(), seed=1)
    q_pos = torch.tensor([[11, 0, 5, 5], [3, 7, 1, 8]])  # per sequence, any order, repeats
    k_pos = torch.tensor([[2, 9, 0], [10, 4, 6]])
    got = module.score_bias(q_pos, k_pos)  # [2, h, 4, 3]
    for b in range(2):
        expected, _ = _loop_bias(module, (3, 4), (3, 4), q_pos[b].tolist(), k_pos[b].tolist())
        torch.testing.assert_close(got[b], expected, atol=1e-12, rtol=0)


def _hf_attention(window, pretrained, heads, mlp_state):
    from transformers import Swinv2Config
    from transformers.models.swinv2.modeling_swinv2 import Swinv2SelfAttention

    config = Swinv2Config(attention_probs_dropout_prob=0.0, qkv_bias=True)
    pretrained_size = [0, 0] if pretrained is None else list(pretrained)
    hf = Swinv2SelfAttention(config, 4 * heads, heads, list(window), pretrained_size).eval()
    hf.continuous_position_bias_mlp.load_state_dict(mlp_state)  # the same weights
    return hf


@pytest.mark.parametrize(
    ("window", "pretrained"), [((3, 5), None), ((4, 6), (3, 5)), ((6, 6), None)]
)
def test_equals_hf_transformers_swinv2(window, pretrained):
    pytest.importorskip("transformers")
    heads, cells = 3, window[0] * window[1]
    module = _random(ContinuousPositionBias(window, heads, pretrained_window=pretrained), std=0.3)
    hf = _hf_attention(window, pretrained, heads, module.cpb_mlp.state_dict())
    # HF's bias, as its forward reads it: the MLP on its coordinates table, at its index
    with torch.no_grad():
        table = hf.continuous_position_bias_mlp(hf.relative_coords_table).view(-1, heads)
        index = hf.relative_position_index.view(-1)
        expected = 16 * torch.sigmoid(table[index].view(cells, cells, heads).permute(2, 0, 1))
        got = module()
    assert_close(got, expected)  # the same float32 operations: rounding apart, equal
    # and HF's whole forward: with q = k = 0 its cosine scores vanish, its weights are
    # softmax(bias)
    with torch.no_grad():
        for layer in (hf.query, hf.key):
            layer.weight.zero_()
            if layer.bias is not None:
                layer.bias.zero_()
        _, weights = hf(torch.randn(1, cells, 4 * heads), output_attentions=True)
    assert_close(weights[0], got.softmax(-1), terms=cells, logit=16)
    if pretrained is not None:  # built at the pretrained window, moved to the new one
        moved = ContinuousPositionBias(pretrained, heads)
        moved.load_state_dict(module.state_dict())
        moved.size = window
        assert_close(moved(), expected)


class _Bias(torch.nn.Module):
    """A hook of the bias as a module call, for ``functional_call``."""

    def __init__(self, module: ContinuousPositionBias, hook: str) -> None:
        super().__init__()
        self.module, self.hook = module, hook

    def forward(self, *args: object) -> torch.Tensor:
        return getattr(self.module, self.hook)(*args)


@pytest.mark.parametrize("hook", ["forward", "score_bias", "grid_bias"])
def test_gradients_against_gradcheck(hook):
    module = _random(ContinuousPositionBias((2, 3), 2, hidden=4, pretrained_window=(3, 2)))
    module = module.double()
    module.size = (3, 3)  # a transfer: offsets beyond the pretrained window
    names = [name for name, _ in module.named_parameters()]
    values = tuple(p.detach().clone().requires_grad_() for p in module.parameters())
    tokens = torch.arange(9)[None]
    args = {
        "forward": (),
        "score_bias": (torch.tensor([[8, 0, 4, 4]]), torch.tensor([[1, 7, 3]])),
        "grid_bias": (tokens, tokens),
    }[hook]
    wrapper = _Bias(module, hook)

    def f(*params):
        return functional_call(
            wrapper, {f"module.{n}": p for n, p in zip(names, params, strict=True)}, args
        )

    assert torch.autograd.gradcheck(f, values)


def test_math_and_auto_agree_on_a_whole_map_through_the_grid_path(monkeypatch):
    monkeypatch.setattr(posenc.engine.tuning, "MATERIALISED_SCORES", 0)  # a long sequence's
    size, heads, dim = (16, 32), 2, 16  # 512 tokens: the grid bias path
    x = torch.randn(1, size[0] * size[1], dim, generator=torch.Generator().manual_seed(2))
    results = {}
    for backend in ("math", "auto"):
        torch.manual_seed(5)
        scheme = _random(ContinuousPositionBias((8, 16), heads, hidden=32), seed=3, std=0.5)
        scheme.size = size  # built on a smaller window, run on the map
        m = MultiHeadAttention(dim, heads, position=scheme, backend=backend)
        out, logit = forward(m, x)
        out.pow(2).sum().backward()
        results[backend] = (out, [p.grad for p in m.parameters()])
    q, k, v = (torch.randn(1, heads, size[0] * size[1], dim // heads) for _ in range(3))
    assert posenc.explain(q, k, v, position=scheme).path == "grid-bias"
    (o1, p1), (o2, p2) = results["math"], results["auto"]
    close = dict(terms=dim, logit=logit)
    assert_close(o2, o1, **close)
    size_grad = max(float(g.abs().max()) for g in p1)
    names = [name for name, _ in m.named_parameters()]
    assert any(name.startswith("position.cpb_mlp") for name in names)
    for name, a, b in zip(names, p1, p2, strict=True):
        assert_close(b, a, magnitude=size_grad, msg=name, **close)


def test_state_init_precision_and_meta_device():
    module = ContinuousPositionBias((3, 4), 2)
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {
        "cpb_mlp.0.weight": (512, 2),  # Swin V2's names and shapes: its checkpoints load
        "cpb_mlp.0.bias": (512,),
        "cpb_mlp.2.weight": (2, 512),
    }
    assert not list(module.buffers())
    # Swin V2's initialisation: small weights, zero first bias, so the bias starts near 8
    assert torch.all(module.cpb_mlp[0].bias == 0)
    assert float(module.cpb_mlp[0].weight.detach().std()) == pytest.approx(0.02, rel=0.15)
    bias = module()
    assert bias.shape == (2, 12, 12) and ((bias - 8).abs() < 0.5).all()
    # the bias lies in [0, 16] however large the weights (16 sigmoid, rounded at the ends)
    large = _random(module, std=5.0)().detach()
    assert (large >= 0).all() and (large <= 16).all() and large.min() < 1 and large.max() > 15
    # computed in float32 from bfloat16 parameters
    half = ContinuousPositionBias((3, 4), 2).to(torch.bfloat16)
    half.load_state_dict(module.state_dict())
    reference = ContinuousPositionBias((3, 4), 2)
    reference.load_state_dict(half.state_dict())  # the rounded weights, in float32
    assert half().dtype == torch.float32
    torch.testing.assert_close(half(), reference(), atol=0, rtol=0)
    # built on the meta device, then materialised and initialised, or loaded
    with torch.device("meta"):
        meta = ContinuousPositionBias((3, 4), 2)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    assert ((meta() - 8).abs() < 0.5).all()
    meta.load_state_dict(module.state_dict())
    assert torch.equal(meta(), module())


def test_errors():
    with pytest.raises(ValueError, match=r"window must be a pair \(H, W\), got 7"):
        ContinuousPositionBias(7, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"window\[1\] must be >= 1, got 0"):
        ContinuousPositionBias((3, 0), 2)
    with pytest.raises(TypeError, match=r"window\[0\] must be an int, got 2.5"):
        ContinuousPositionBias((2.5, 3), 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="heads must be >= 1, got 0"):
        ContinuousPositionBias((3, 3), 0)
    with pytest.raises(TypeError, match="hidden must be an int, got 8.0"):
        ContinuousPositionBias((3, 3), 2, hidden=8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pretrained_window must be a pair \(H, W\), got \(8,\)"):
        ContinuousPositionBias((3, 3), 2, pretrained_window=(8,))  # type: ignore[arg-type]
    module = ContinuousPositionBias((3, 4), 2, hidden=8)
    with pytest.raises(ValueError, match=r"size\[0\] must be >= 1, got -2"):
        module.size = (-2, 4)
    assert module.size == (3, 4)  # a refused size leaves the module as it was
    with pytest.raises(ValueError, match=r"window must be a pair \(H, W\), got \[5\]"):
        module(window=[5])  # type: ignore[arg-type]
    tokens = torch.arange(13)[None]
    with pytest.raises(ValueError, match=r"k_pos must be in \[0, 12\) .* 3x4 map"):
        module.score_bias(tokens[:, :12], tokens)
    with pytest.raises(ValueError, match="built for heads=2 but the attention has heads=4"):
        MultiHeadAttention(16, 4, position=module)
