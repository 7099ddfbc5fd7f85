"""posenc.engine.mask: the boolean mask of a block of rows, against the definition written
out pair by pair, and the causal or window band kept between calls."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.engine import Mask, tuning
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


@pytest.mark.parametrize("behind", [None, 3])
@pytest.mark.parametrize("n_k", [1, 5])
def test_a_causal_mask_over_one_query_is_dropped(behind, n_k):
    """One query aligned at the end sees every key: without a window the causal flag reads
    False and the mask is empty; a causal window keeps it (the blocks that cut a window
    read it); keep equals the definition either way. Two queries keep it (the first sees
    one key fewer)."""
    mask = Mask(1, n_k, causal=True, behind=behind)
    assert mask.causal is (behind is not None) and mask.empty == (behind is None)
    keep = mask.keep()
    if behind is None:
        assert keep is None
    else:
        assert torch.equal(keep[0, 0], _definition(1, n_k, range(1), True, behind, None))
    two = Mask(2, n_k + 1, causal=True)
    assert two.causal and torch.equal(
        two.keep()[0, 0], _definition(2, n_k + 1, range(2), True, None, None)
    )


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


def _scores(shape, dtype, seed=0, extremes=False):
    """Finite scores with signed zeros among them (and the dtype's extremes, whose sum is
    past its range, with ``extremes``)."""
    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=torch.float64).mul_(4).to(dtype)
    flat = x.view(-1)
    flat[::7] = -0.0
    flat[3::11] = 0.0
    if extremes:
        flat[5::13] = torch.finfo(dtype).max
        flat[6::17] = torch.finfo(dtype).min
    return x


@pytest.fixture
def float_form(monkeypatch):
    """A list that grows by one each time ``Mask.filled`` takes the band's float form (an
    ``addcmul``); the form taken from one element up."""
    monkeypatch.setattr(tuning, "FILLED_ELEMENTS", 1)
    calls = []
    addcmul = torch.addcmul
    monkeypatch.setattr(
        mask_module.torch, "addcmul", lambda *a, **kw: calls.append(1) or addcmul(*a, **kw)
    )
    return calls


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
@pytest.mark.parametrize("extremes", [False, True])
def test_filled_equals_masked_fill_to_the_bit(
    band, n_q, n_k, dtype, in_place, fill, extremes, float_form
):
    """``Mask.filled`` on a kept band equals ``masked_fill(~keep, fill)`` bit for bit
    (signed zeros), in place or not: through the band's float form where the scores' sum
    is finite, through ``masked_fill`` where it is not (the dtype's extremes)."""
    mask = Mask(n_q, n_k, **band)
    keep = mask.shared_keep(device=CPU)
    fill = torch.finfo(dtype).min if fill == "min" else fill
    x = _scores((2, 3, n_q, n_k), dtype, extremes=extremes)
    expected = x.masked_fill(~keep, fill)
    x = x.clone() if in_place else x
    got = mask.filled(x, keep, fill, in_place=in_place)
    assert len(float_form) == (0 if extremes else 1)
    assert (got is x) == in_place
    assert got.shape == expected.shape and torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("where", ["hidden", "kept"])
@pytest.mark.parametrize(
    "bits",
    [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00123],
    ids=["inf", "-inf", "nan", "signalling-nan", "negative-nan-payload"],
)
@pytest.mark.parametrize("in_place", [True, False])
def test_filled_with_values_that_are_not_finite_equals_masked_fill(
    where, bits, in_place, float_form
):
    """A score that is not finite (infinities, NaNs of any sign and payload) makes the sum
    not finite: ``masked_fill``'s bits, wherever it is."""
    mask = Mask(8, 8, causal=True)
    keep = mask.shared_keep(device=CPU)
    x = _scores((2, 2, 8, 8), torch.float32)
    row, col = (1, 6) if where == "hidden" else (6, 1)
    x.view(torch.int32)[1, 0, row, col] = bits - (1 << 32 if bits >= 1 << 31 else 0)
    expected = x.masked_fill(~keep, float("-inf"))
    got = mask.filled(x.clone() if in_place else x, keep, float("-inf"), in_place=in_place)
    assert not float_form
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize(
    "case",
    ["padding", "grad", "large", "modified keep", "int", "fill -0.0", "fill 3", "other device"],
    ids=lambda c: c.replace(" ", "-"),
)
def test_filled_takes_masked_fill_where_no_float_band_applies(case, float_form):
    """Key padding (no band alone), a graph recorded for ``x``, a band past the kept float
    forms' size, a keep the caller changed, an integer ``x``, a fill other than ``-inf`` or
    the dtype's lowest (``-0.0 + x * 0`` is not ``-0.0``), or the band kept for another
    device key: ``masked_fill``, its values and its gradient."""
    n = 300 if case == "large" else 6
    padding = torch.tensor([[False] * (n - 1) + [True]])
    mask = Mask(n, n, causal=True, key_padding=padding if case == "padding" else None)
    keep = mask.shared_keep(device=None if case == "other device" else CPU)
    if case == "modified keep":
        keep = keep | torch.eye(n, dtype=torch.bool).flip(0)
    fill = {"fill -0.0": -0.0, "fill 3": 3.0}.get(case, float("-inf"))
    x = _scores((1, 2, n, n), torch.float32).requires_grad_(case == "grad")
    if case == "int":
        x, fill = torch.arange(2 * n * n).view(1, 2, n, n), -7
    got = mask.filled(x, keep, fill, in_place=False)
    assert not float_form
    expected = x.masked_fill(~keep, fill)
    assert torch.equal(
        _bits(got) if x.is_floating_point() else got,
        _bits(expected) if x.is_floating_point() else expected,
    )
    if case == "grad":
        got.sum().backward()
        assert torch.equal(x.grad, keep.expand_as(x).float())


def test_filled_takes_the_float_form_from_its_size_on(float_form, monkeypatch):
    """Below :data:`~posenc.engine.tuning.FILLED_ELEMENTS` elements ``masked_fill`` (the
    sum that checks the scores costs more there), from it on the float form."""
    mask = Mask(8, 8, causal=True)
    keep = mask.shared_keep(device=CPU)
    x = _scores((2, 2, 8, 8), torch.float32)
    expected = x.masked_fill(~keep, float("-inf"))
    for in_place in (False, True):
        float_form.clear()
        for limit, taken in ((x.numel() + 1, 0), (x.numel(), 1)):
            monkeypatch.setattr(tuning, "FILLED_ELEMENTS", limit)
            got = mask.filled(x.clone(), keep, float("-inf"), in_place=in_place)
            assert len(float_form) == taken
            assert torch.equal(_bits(got), _bits(expected))
