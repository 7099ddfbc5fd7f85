"""Every scheme inside MultiHeadAttention: backends agree, gradients reach every table,
relative schemes are translation-invariant, decoding with a cache equals the full pass.

Each scheme's own maths is tested against its definition in its module's test file.
"""

from __future__ import annotations

import pytest
import torch

from posenc import KVCache, MultiHeadAttention
from posenc.engine import tuning
from schemes import SCHEMES
from tolerances import assert_close, recorded_logits

HEADS, HEAD_DIM, DIM = 2, 8, 16
GRID = (3, 4)
N = GRID[0] * GRID[1]


def build(name, backend, seed=0):
    torch.manual_seed(seed)
    scheme = SCHEMES[name].build(HEADS, HEAD_DIM, N, GRID)
    torch.manual_seed(seed + 1)
    return MultiHeadAttention(DIM, HEADS, position=scheme, backend=backend)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(tuning, "LEAN_BLOCK_ELEMENTS", 64)  # several blocks of rows


def run_with_grads(model, x, **kwargs):
    x = x.clone().requires_grad_()
    out = model(x, **kwargs)
    (out * torch.linspace(-1, 1, DIM)).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return out, x.grad, grads


@pytest.mark.parametrize("name", list(SCHEMES))
def test_backends_agree_outputs_and_gradients(name):
    torch.manual_seed(5)
    x = torch.randn(2, N, DIM)
    padding = torch.zeros(2, N, dtype=torch.bool)
    padding[1, -3:] = True
    results = {}
    for backend in ("math", "sdpa", "lean", "auto"):
        model = build(name, backend)
        if backend == "sdpa" and getattr(model.position, "value_term", None) is not None:
            continue  # sdpa cannot add a value term (tested in test_attention)
        with recorded_logits() as logits:
            results[backend] = run_with_grads(model, x, key_padding_mask=padding, causal=True)
    reference = results.pop("math")
    close = dict(terms=N, logit=max(logits))  # tests/tolerances.py: N keys, these logits
    # the gradients at the size of the largest: they sum the same score gradients, which
    # cancel in some (k_proj.bias: exactly, as a row's softmax ignores a constant)
    size = max(float(g.abs().max()) for g in (reference[1], *reference[2].values()))
    for backend, (out, x_grad, grads) in results.items():
        assert_close(out, reference[0], **close, msg=f"{backend} output")
        assert_close(x_grad, reference[1], magnitude=size, **close, msg=f"{backend} dx")
        for key, grad in reference[2].items():
            assert_close(grads[key], grad, magnitude=size, **close, msg=f"{backend} {key}")


@pytest.mark.parametrize("name", [n for n, e in SCHEMES.items() if e.learned])
@pytest.mark.parametrize("backend", ["math", "lean", "sdpa"])
def test_gradients_reach_every_table(name, backend):
    model = build(name, backend)
    if backend == "sdpa" and getattr(model.position, "value_term", None) is not None:
        pytest.skip("sdpa has no value term")
    _, _, grads = run_with_grads(model, torch.randn(2, N, DIM))
    tables = {k: g for k, g in grads.items() if k.startswith("position.")}
    assert tables, "the scheme has no learned table"
    for key, grad in tables.items():
        assert grad is not None and grad.abs().sum() > 0, key


@pytest.mark.parametrize("name", [n for n, e in SCHEMES.items() if e.relative])
@pytest.mark.parametrize("backend", ["math", "auto"])
def test_relative_schemes_are_translation_invariant(name, backend):
    model = build(name, backend).eval()
    x = torch.randn(2, 8, DIM)
    with recorded_logits() as logits:
        base = model(x, causal=True)
    for shift in (3, 1000):
        moved = model(x, causal=True, positions=torch.arange(8) + shift)
        assert_close(moved, base, terms=8, logit=max(logits), msg=f"shift {shift}")


@pytest.mark.parametrize("name", [n for n, e in SCHEMES.items() if not e.two_d and e.cache])
@pytest.mark.parametrize("backend", ["math", "auto", "lean"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_decoding_with_cache_equals_full_pass(name, backend, grad):
    """In grad mode the cache concatenates; without, it writes into its buffer (a view of
    it holds the keys, buffer made on the first step and grown on the way: capacity 6)."""
    model = build(name, backend).eval()
    x = torch.randn(2, N, DIM)
    with recorded_logits() as logits:
        full = model(x, causal=True)
    cache = KVCache(capacity=6)
    with torch.set_grad_enabled(grad):
        steps = [model(x[:, :4], causal=True, cache=cache)]
        steps += [model(x[:, t : t + 1], causal=True, cache=cache) for t in range(4, N)]
    assert (cache._buffer is None) == grad
    assert_close(torch.cat(steps, 1), full, terms=N, logit=max(logits))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_positions_per_batch_row(name):
    """[b, n] positions equal running each row with its own [n] positions."""
    model = build(name, "auto").eval()
    x = torch.randn(2, 6, DIM)
    positions = torch.stack([torch.arange(6), torch.arange(6) + 4])
    with recorded_logits() as logits:
        out = model(x, positions=positions)
    for row in range(2):
        alone = model(x[row : row + 1], positions=positions[row])
        assert_close(out[row : row + 1], alone, terms=6, logit=max(logits), msg=f"row {row}")


@pytest.mark.parametrize("name", list(SCHEMES))
def test_meta_construction_and_state_dict(name):
    with torch.device("meta"):
        model = build(name, "auto")
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    reference = build(name, "auto")
    assert set(model.state_dict()) == set(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert value.dtype.is_floating_point, f"{key}: only learned tables are saved"
    # derived buffers are rebuilt: after loading the same weights, the outputs agree
    model.load_state_dict(reference.state_dict())
    x = torch.randn(1, N, DIM)
    with recorded_logits() as logits:
        expected = reference.eval()(x)
    assert_close(model.eval()(x), expected, terms=N, logit=max(logits))


@pytest.mark.compile  # FlexAttention is compiled by inductor (which needs AVX2 on a CPU)
@pytest.mark.parametrize("name", [n for n, e in SCHEMES.items() if e.flex])
def test_flex_backend_forward_parity(name):
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = build(name, "flex").eval()
    reference = build(name, "math").eval()
    x = torch.randn(2, N, DIM)  # within every table
    padding = torch.zeros(2, x.shape[1], dtype=torch.bool)
    padding[0, -5:] = True
    with torch.no_grad(), recorded_logits() as logits:
        got = model(x, key_padding_mask=padding, causal=True)
        expected = reference(x, key_padding_mask=padding, causal=True)
    assert_close(got, expected, terms=x.shape[1], logit=max(logits))
