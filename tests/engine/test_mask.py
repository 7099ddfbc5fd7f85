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


CPU = torch.device("cpu")


def _bits(x):
    """``x``'s bits, so that ``-0.0`` and ``0.0`` (and NaN payloads) differ."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _scores(shape, dtype, seed=0):
    """Scores with signed zeros and extremes among them, finite."""
    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=torch.float64).mul_(4).to(dtype)
    flat = x.view(-1)
    flat[::7] = -0.0
    flat[3::11] = 0.0
    flat[5::13] = torch.finfo(dtype).max
    flat[6::17] = torch.finfo(dtype).min
    return x


BANDS = [
    dict(causal=True),
    dict(behind=3),
    dict(behind=2, ahead=3),
    dict(causal=True, behind=4),
]


@pytest.mark.parametrize("band", BANDS, ids=lambda b: ",".join(f"{k}={v}" for k, v in b.items()))
@pytest.mark.parametrize(("n_q", "n_k"), [(9, 9), (5, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("fill", [float("-inf"), "min"])
def test_filled_equals_masked_fill_to_the_bit(band, n_q, n_k, dtype, in_place, fill):
    """``Mask.filled`` on a kept band equals ``masked_fill(~keep, fill)`` bit for bit
    (signed zeros, the dtype's extremes), in place or not, through the band's float form."""
    mask = Mask(n_q, n_k, **band)
    keep = mask.shared_keep(device=CPU)
    fill = torch.finfo(dtype).min if fill == "min" else fill
    x = _scores((2, 3, n_q, n_k), dtype)
    expected = x.masked_fill(~keep, fill)
    hits = mask_module._kept_band_floats.cache_info()
    got = mask.filled(x.clone() if in_place else x, keep, fill, in_place=in_place)
    after = mask_module._kept_band_floats.cache_info()
    assert after.hits + after.misses == hits.hits + hits.misses + 1  # the float form read
    assert got.shape == expected.shape and torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("where", ["hidden", "kept"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("in_place", [True, False])
def test_filled_with_values_that_are_not_finite_equals_masked_fill(where, value, in_place):
    """A non-finite score where the band hides makes NaN in the float form, found by the
    sum and filled by ``masked_fill_``; where it keeps, it stays: ``masked_fill``'s values
    either way."""
    mask = Mask(8, 8, causal=True)
    keep = mask.shared_keep(device=CPU)
    x = _scores((2, 2, 8, 8), torch.float32)
    row, col = (1, 6) if where == "hidden" else (6, 1)
    x[1, 0, row, col] = value
    expected = x.masked_fill(~keep, float("-inf"))
    if in_place:
        got = x.clone()
        assert mask.filled(got, keep, float("-inf"), in_place=True) is got
    else:
        got = mask.filled(x, keep, float("-inf"), in_place=False)
        assert got is not x and not torch.equal(_bits(got), _bits(x))
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize(
    "case", ["padding", "grad", "large", "modified keep", "int"], ids=lambda c: c.replace(" ", "-")
)
def test_filled_takes_masked_fill_where_no_float_band_applies(case):
    """Key padding (no band alone), a graph recorded for ``x``, a band past the kept float
    forms' size, a keep the caller changed or an integer ``x``: ``masked_fill``, its values and
    its gradient."""
    n = 300 if case == "large" else 6
    padding = torch.tensor([[False] * (n - 1) + [True]])
    mask = Mask(n, n, causal=True, key_padding=padding if case == "padding" else None)
    keep = mask.shared_keep(device=CPU)
    if case == "modified keep":
        keep = keep | torch.eye(n, dtype=torch.bool).flip(0)
    x = _scores((1, 2, n, n), torch.float32).requires_grad_(case == "grad")
    if case == "int":
        x = torch.arange(2 * n * n).view(1, 2, n, n)
    before = mask_module._kept_band_floats.cache_info()
    got = mask.filled(x, keep, -7, in_place=False)
    after = mask_module._kept_band_floats.cache_info()
    assert after.hits + after.misses == before.hits + before.misses
    assert torch.equal(got, x.masked_fill(~keep, -7))
    if case == "grad":
        got.sum().backward()
        assert torch.equal(x.grad, keep.expand_as(x).float())
