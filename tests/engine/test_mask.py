"""posenc.engine.mask: the boolean mask of a block of rows, against the definition written
out pair by pair, and the causal or window band kept between calls."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.engine import Mask
from posenc.engine import mask as mask_module


def _definition(n_q, n_k, rows, causal, behind, ahead):
    """``[rows, n_k]`` bool, one pair at a time: query ``i`` sees key ``j`` when ``j <= i +
    n_k - n_q`` (causal), ``j > i + n_k - n_q - behind``, ``j < i + n_k - n_q + ahead``."""
    out = torch.ones(len(rows), n_k, dtype=torch.bool)
    for r, i in enumerate(rows):
        for j in range(n_k):
            at = i + n_k - n_q
            if causal and j > at:
                out[r, j] = False
            if behind is not None and j <= at - behind:
                out[r, j] = False
            if ahead is not None and j >= at + ahead:
                out[r, j] = False
    return out


@pytest.mark.parametrize(
    ("causal", "behind", "ahead"), [(True, None, None), (True, 3, None), (False, 2, 2)]
)
@pytest.mark.parametrize(("n_q", "n_k"), [(7, 7), (3, 9), (9, 4)])
@pytest.mark.parametrize("rows", [None, slice(1, 3)])
def test_keep_equals_the_definition(causal, behind, ahead, n_q, n_k, rows):
    mask = Mask(n_q, n_k, causal=causal, behind=behind, ahead=ahead)
    keep = mask.keep(rows)
    span = range(n_q) if rows is None else range(rows.start, rows.stop)
    assert keep.shape == (1, 1, len(span), n_k)
    assert torch.equal(keep[0, 0], _definition(n_q, n_k, span, causal, behind, ahead))


@pytest.mark.parametrize("read", ["keep", "shared_keep"])
def test_shared_keep_equals_keep(read):
    mask = Mask(9, 12, causal=True, behind=4)
    for rows in (None, slice(2, 7)):
        found = getattr(mask, read)(rows)
        assert torch.equal(
            found[0, 0], _definition(9, 12, range(9)[rows or slice(None)], True, 4, None)
        )


def test_a_small_band_is_shared_between_calls_and_a_large_one_is_not(monkeypatch):
    """The engine's band is the same tensor for the same band (no dozen kernel calls per
    call), to read only; past _KEPT_BAND elements a new one each call, equal; keep() hands
    out a tensor of the caller's own, which it may write into."""
    mask = Mask(16, 16, causal=True)
    assert mask.shared_keep() is Mask(16, 16, causal=True).shared_keep()
    assert mask.shared_keep(device="cpu") is mask.shared_keep(device=torch.device("cpu"))
    assert mask.shared_keep(slice(0, 8)) is not mask.shared_keep(slice(8, 16))
    mine = mask.keep()
    assert mine is not mask.shared_keep() and mine is not mask.keep()
    mine |= True  # the caller's own: the engine's band is untouched
    assert not mask.shared_keep()[0, 0, 0, 1]
    monkeypatch.setattr(mask_module, "_KEPT_BAND", 16 * 16 - 1)
    fresh = mask.shared_keep()
    assert fresh is not mask.shared_keep()
    assert torch.equal(fresh, _definition(16, 16, range(16), True, None, None)[None, None])


def test_a_band_built_under_a_function_mode_is_not_shared():
    """``shared_keep()`` without a device under a device context builds the band there,
    and keeps nothing: a later call on the CPU gets a CPU band."""
    with torch.device("meta"):
        keep = Mask(8, 8, causal=True).shared_keep()
    assert keep.device.type == "meta"
    assert Mask(8, 8, causal=True).shared_keep().device.type == "cpu"


@pytest.mark.parametrize(("n_q", "n_k"), [(5, 8), (8, 8), (8, 5)])
def test_sdpa_under_a_causal_mask_equals_math_and_zeroes_queries_with_no_key(n_q, n_k):
    """With fewer or as many queries as keys every query sees key 0 (SDPA's route skips the
    check); with more, the first see none and get 0 (float64, a bias beside the mask)."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, n_q, 4, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n_k, 4, dtype=torch.float64) for _ in range(2))
    scheme = posenc.ALiBi(2)
    out = posenc.attention(q, k, v, position=scheme, causal=True, backend="sdpa")
    expected = posenc.attention(q, k, v, position=scheme, causal=True, backend="math")
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    if n_q > n_k:
        assert bool((out[:, :, : n_q - n_k] == 0).all())
