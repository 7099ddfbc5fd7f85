"""What the fused paths share (engine/common.py): far biases raised only as far as changes nothing, reused buffers."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    EPS32,
    assert_results_close,
    run,
)

from posenc.engine import Mask, attend, common, tuning
from tolerances import logit_size


@pytest.mark.parametrize("fused", [True, False])
def test_strong_biases_agree_with_math(monkeypatch, fused):
    # ALiBi over 300 tokens: biases down to -150, past BIAS_SPAN and EXP_FLOOR, where the
    # engine raises far biases (fused) or floors exp's argument (plain) to avoid denormals
    from posenc import ALiBi

    if not fused:
        monkeypatch.setattr(common, "_fused_cpu_available", lambda q, v, hooks: False)
    monkeypatch.setattr(tuning, "LEAN_BLOCK_ELEMENTS", 2 * 4 * 300 * 64)  # several blocks
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 16, requires_grad=True) for _ in range(3))
    pos = torch.arange(300)[None]
    padding = torch.zeros(2, 300, dtype=torch.bool)
    padding[1, :250] = True  # row 1: the best keys of the first queries are masked
    mask = Mask(300, 300, key_padding=padding)
    scheme = ALiBi(4)
    got = run("lean", scheme, q, k, v, pos, pos, mask)
    expected = run("math", scheme, q, k, v, pos, pos, mask)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    results = {"lean": [got, *grads], "math": [expected, *expected_grads]}
    assert_results_close(results, q.dtype, logit_size(q, k, scheme, pos, pos), 300)


def test_reused_buffers_keep_one_per_tag():
    """Blocks of one shape share a buffer; a block of another shape replaces it (under a
    causal mask every block differs: keeping one per shape kept them all)."""
    buffers = {}
    first = common._reused(buffers, "s", (2, 3), lambda: torch.zeros(2, 3))
    assert common._reused(buffers, "s", (2, 3), lambda: torch.ones(2, 3)) is first
    other = common._reused(buffers, "s", (2, 4), lambda: torch.zeros(2, 4))
    assert other is not first and list(buffers) == ["s"] and buffers["s"][1] is other
    common._reused(buffers, "p", (2, 3), lambda: torch.zeros(2, 3))
    assert sorted(buffers) == ["p", "s"]
    # _widen: the fill stays outside the columns written, whatever was written before
    wide = common._widen(torch.ones(2, 2), 5, 1, float("-inf"), buffers)
    assert wide[:, 0].isinf().all() and wide[:, 3:].isinf().all() and (wide[:, 1:3] == 1).all()
    narrow = common._widen(torch.full((2, 1), 2.0), 5, 1, float("-inf"), buffers)
    assert narrow[:, 2:].isinf().all() and (narrow[:, 1] == 2).all()  # fewer columns: no stale
    x = torch.arange(4.0).view(2, 2)
    assert common._widen(x, 2, 0, 0.0, buffers) is x  # every column: x itself


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
    monkeypatch.setattr(tuning, "LEAN_BLOCK_ELEMENTS", 8)  # the fast paths even at this size
    with torch.no_grad():
        got = run("auto", scheme, q, k, v, pos, pos, Mask(8, 8))
        expected = run("math", scheme, q, k, v, pos, pos, Mask(8, 8))
    torch.testing.assert_close(got, expected)
    if scheme_name == "relative":
        assert float(expected[0, 0, 0, 0]) == pytest.approx(3.5)  # the mean of keys 0..7


@pytest.mark.parametrize("backend", ["auto", "lean"])
def test_far_biases_are_raised_only_where_content_cannot_make_up_for_them(backend):
    """ALiBi(1) with a query [10, 0, 0, 0] at 0 and keys [0, 0, 0, 0], [20, 1, 0, 0],
    [20, 0, 1, 0] at 0, 16000, 20000: the far keys' biases (-62.5, -78.1) were raised to
    60 below the best, and 'auto' gave [20, .5, .5, 0] where the definition gives
    [20, 1, 0, 0] (the content scores, 100, make up for the bias)."""
    from posenc import ALiBi

    q = torch.tensor([10.0, 0, 0, 0]).view(1, 1, 1, 4)
    k = torch.tensor([[0.0, 0, 0, 0], [20, 1, 0, 0], [20, 0, 1, 0]]).view(1, 1, 3, 4)
    q_pos, k_pos = torch.tensor([[0]]), torch.tensor([[0, 16000, 20000]])
    args = dict(scheme=ALiBi(1), q_pos=q_pos, k_pos=k_pos, mask=Mask(1, 3))
    want, _ = attend(q.double(), k.double(), k.double(), backend="math", **args)
    got, _ = attend(q, k, k, backend=backend, **args)
    assert torch.allclose(
        want[0, 0, 0], torch.tensor([20.0, 1, 0, 0], dtype=torch.float64), atol=1e-6
    )
    torch.testing.assert_close(got.double(), want, rtol=0, atol=20 * 4 * EPS32)


@pytest.mark.parametrize("path", ["offset", "general", "grid"])
def test_raised_biases_equal_the_definition_with_large_content_scores(path):
    """Every path that raises far biases (per offset, row by row, 2-D grid), with content
    scores large enough to overturn a 60-unit bias: outputs and gradients equal math."""
    from posenc import ALiBi, RelativePositionBias

    torch.manual_seed(0)
    if path == "grid":
        scheme = RelativePositionBias((16, 32), 2)  # 512 tokens: the grid path's size
        with torch.no_grad():
            scheme.table.copy_(-0.4 * torch.arange(scheme.table.shape[0]).float()[:, None])
            scheme.table[scheme.table.shape[0] // 2] = 0.0  # best at offset (0, 0)
        n = 512
    else:
        scheme, n = ALiBi(2), 300
    b, h, d = 1, 2, 4
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    # the last query meets the first key with a content score of 100 (10 * 20 / sqrt(4)):
    # ALiBi's bias there (positions 40 apart: -747 in the first head) leaves it out of the
    # softmax, raised to 60 below the best it would dominate; the 2-D table's corner likewise
    q[:, :, -1] = torch.tensor([10.0, 0, 0, 0])
    k[:, :, 0] = torch.tensor([20.0, 0, 0, 0])
    pos = torch.arange(n)[None] * (1 if path == "grid" else 40)
    padding = torch.zeros(b, n, dtype=torch.bool)
    if path == "general":  # a gap in the keys keeps it off the per-offset and block paths
        padding[:, n // 3 : n // 3 + 5] = True
    mask = Mask(n, n, key_padding=padding if path == "general" else None)
    results = {}
    for backend in ("math", "lean"):
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        out, _ = attend(*leaves, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask, backend=backend)
        out.backward(torch.ones_like(out))
        results[backend] = [out, *(t.grad for t in leaves)]
    for got, want in zip(results["lean"], results["math"], strict=True):
        # float32, a softmax over n keys of values ~1 and logits up to ~100: rounding scale
        atol = 64 * EPS32 * float(want.detach().abs().max()) * n**0.5
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
