"""The data of ``posenc plot``'s research kinds against the schemes' formulas, by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from posenc import alibi_slopes
from posenc.cli.plot_research import COPE_TEXT, DISTANCE_SCHEMES, cope_data, cpb_data, distance_data


def test_distance_of_alibi_is_minus_slope_times_distance():
    slopes = alibi_slopes(4).double().numpy()
    expected = -slopes[:, None] * np.arange(21)[None, :]  # [h, L + 1]
    np.testing.assert_allclose(distance_data("alibi", 4, 20), expected, rtol=1e-6)


def test_distance_of_kerple_log_follows_its_kernel():
    import torch

    from posenc import registry

    torch.manual_seed(0)
    kerple = registry.build("kerple-log", registry.Shape(3, 64, 11, causal=True))
    r1, r2 = (t.detach().double().numpy() for t in kerple.parameters_used())
    expected = [[-r1[h] * math.log1p(r2[h] * t) for t in range(11)] for h in range(3)]
    np.testing.assert_allclose(distance_data("kerple-log", 3, 10), expected, rtol=1e-6)


@pytest.mark.parametrize("name", DISTANCE_SCHEMES)
def test_distance_gives_a_curve_per_head(name):
    data = distance_data(name, 2, 8)
    assert data.shape == (2, 9) and np.isfinite(data).all()


def test_cope_counts_the_full_stops_between_key_and_query():
    gates, positions, distance = cope_data(sharpness=12.0)
    n = len(COPE_TEXT)
    gate = [1 / (1 + math.exp(-12.0 if c == "." else 12.0)) for c in COPE_TEXT]
    expected = [sum(gate[j:]) for j in range(n)]  # the query is the last character
    np.testing.assert_allclose(positions, expected, rtol=1e-12)
    np.testing.assert_allclose(gates, gate, rtol=1e-12)
    np.testing.assert_array_equal(distance, np.arange(n - 1, -1, -1))
    stops_after = [COPE_TEXT[j:].count(".") for j in range(n)]
    np.testing.assert_allclose(positions, stops_after, atol=1e-3 * n)  # about a count


def test_cpb_on_a_larger_window_extends_the_built_one():
    built, doubled = cpb_data((3, 4), heads=2)
    assert built.shape == (5, 7) and doubled.shape == (11, 15)
    # the same network and normalisation: the offsets both windows have agree exactly
    np.testing.assert_array_equal(doubled[3:8, 4:11], built)
    assert ((built > 0) & (built < 16)).all()
