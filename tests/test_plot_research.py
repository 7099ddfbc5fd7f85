"""The data of ``posenc plot``'s research kinds against the schemes' formulas, by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from posenc import alibi_slopes
from posenc.cli.plot_research import DISTANCE_SCHEMES, distance_data


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
    from posenc import registry

    if name not in registry.SCHEMES:
        pytest.skip(f"{name} is not in the registry")
    data = distance_data(name, 2, 8)
    assert data.shape == (2, 9) and np.isfinite(data).all()
