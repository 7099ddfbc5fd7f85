"""posenc.engine.inputs: the check for non-finite values. (Grouped key/value heads and
non-finite tokens through the whole call are tested in tests/engine/test_dispatch.py.)"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.engine import dispatch
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
def test_finite_never_reads_a_nan_as_finite_past_the_float_range(dtype):
    big = torch.full((64,), 3e37, dtype=dtype)  # a sum of 1.9e39
    assert not finite(big, torch.tensor([float("nan")], dtype=dtype))
    assert not finite(torch.cat([big, torch.tensor([float("-inf")], dtype=dtype)]))


@pytest.mark.parametrize("causal", [False, True])
def test_the_careful_path_on_finite_inputs_equals_the_fast_one(monkeypatch, causal):
    """Where the check answers "perhaps not" for finite inputs (a sum past the float
    range), the careful path zeroes nothing: its output and gradients equal the call's with
    the check answering "finite"."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[0, -2:] = True
    results = []
    for answer in (True, False):
        monkeypatch.setattr(dispatch, "finite", lambda *xs, answer=answer: answer)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = posenc.attention(
            *leaves, position=posenc.ALiBi(2), key_padding_mask=padding, causal=causal
        )
        (out * torch.linspace(-1, 1, 4)).sum().backward()
        results.append([out, *(x.grad for x in leaves)])
    for careful, fast in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(careful, fast, rtol=0, atol=0)


def test_keys_known_finite_are_not_read_again():
    """``hideable`` leaves out the first ``finite_keys`` keys and values (a cache's, found
    finite before), with or without gradients, and with a chunk's own rule (only the last
    ``n_q`` keys without gradients) the later of the two starts; ``q`` always."""
    from posenc.engine import Mask
    from posenc.engine.inputs import hideable

    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4)
    padding = torch.zeros(1, 9, dtype=torch.bool)
    padding[0, :2] = True
    cases = (  # mask, finite_keys, grad mode: the keys read
        (Mask(3, 9, key_padding=padding), 0, False, 9),
        (Mask(3, 9, key_padding=padding), 5, False, 4),
        (Mask(3, 9, key_padding=padding), 5, True, 4),
        (Mask(3, 9, key_padding=padding), 9, False, 0),
        (Mask(3, 9, causal=True), 0, False, 3),
        (Mask(3, 9, causal=True), 8, False, 1),
        (Mask(3, 9, causal=True), 2, False, 3),
        (Mask(3, 9, causal=True), 2, True, 7),
    )
    for mask, known, grad, keys in cases:
        with torch.set_grad_enabled(grad):
            got = hideable(q, k, v, mask, finite_keys=known)
        assert got[0] is q and [t.shape[2] for t in got[1:]] == [keys, keys], (known, grad)
        assert torch.equal(got[1], k[:, :, 9 - keys :]) and torch.equal(got[2], v[:, :, 9 - keys :])
