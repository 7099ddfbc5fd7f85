"""posenc.engine.inputs: the check for non-finite values. (Grouped key/value heads and
non-finite tokens through the whole call are tested in tests/engine/test_dispatch.py.)"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.engine.inputs import finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finite_finds_one_non_finite_element_anywhere(dtype, bad):
    x, y = torch.randn(2, 3, 37, 8, dtype=dtype), torch.randn(5, dtype=dtype)
    assert finite(x, y) and finite(x, torch.empty(0, dtype=dtype)) and finite()
    for which, at in ((0, 0), (0, x.numel() // 2 + 3), (0, x.numel() - 1), (1, 4)):
        xs = [x.clone(), y.clone()]
        xs[which].view(-1)[at] = bad
        assert not finite(*xs)
        assert not finite(xs[0].transpose(-1, -2), xs[1])  # not contiguous


def test_finite_sums_half_precision_in_float32():
    """float16 values whose sum passes float16's largest (65504) but not float32's: finite."""
    assert finite(torch.full((64,), 6e4, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_reads_an_overflowing_sum_as_not_finite_and_attention_stays_exact(dtype):
    """Finite values whose sum passes float32's largest: the check answers "perhaps not"
    (never "finite" for a tensor with a NaN), and the careful path that follows finds
    nothing to zero: the output equals the math reference's, finite."""
    big = torch.full((64,), 3e37, dtype=dtype)  # sum 1.9e39
    assert not finite(big)
    assert not finite(big, torch.tensor([float("nan")], dtype=dtype))
    torch.manual_seed(0)
    q = torch.randn(1, 2, 8, 4, dtype=dtype) * 1e-3
    k = torch.full((1, 2, 8, 4), 3e37, dtype=dtype)  # q . k about 1e35: finite scores
    assert not finite(q, k, q)
    padding = torch.zeros(1, 8, dtype=torch.bool)
    padding[0, -2:] = True
    out = posenc.attention(q, k, q, key_padding_mask=padding)
    expected = posenc.attention(q, k, q, key_padding_mask=padding, backend="math")
    torch.testing.assert_close(out, expected)
    assert torch.isfinite(out).all()
