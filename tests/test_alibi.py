"""ALiBi (:mod:`posenc.alibi`): the paper's slopes, the bias, decoding offsets, casts and
errors. Its kept runs beside T5's, and the subclasses that opt out of them, are tested in
tests/test_bias.py."""

from __future__ import annotations

import math

import pytest
import torch

from posenc import ALiBi, alibi_slopes
from tolerances import tolerance


def reference_slopes(n):
    """The paper's rule, float64."""

    def power_of_two(m):
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + reference_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("heads", [1, 2, 4, 8, 16, 6, 12, 20, 3])
def test_alibi_slopes_follow_the_paper(heads):
    torch.testing.assert_close(
        alibi_slopes(heads).double(),
        torch.tensor(reference_slopes(heads), dtype=torch.float64),
        rtol=tolerance(torch.float32, 1.0),
        atol=0,
    )


def test_alibi_published_slopes_for_8_heads():
    assert alibi_slopes(8).tolist() == [1 / 2**i for i in range(1, 9)]


def test_alibi_bias_and_offset_decoding():
    alibi = ALiBi(4)
    dense = alibi(6, 6)
    slopes = alibi_slopes(4)
    for h in range(4):
        for i in range(6):
            for j in range(6):
                assert dense[h, i, j] == pytest.approx(-float(slopes[h]) * abs(j - i))
    for t in range(6):
        torch.testing.assert_close(alibi(1, t + 1, offset=t)[:, 0], dense[:, t, : t + 1])
    pos = torch.arange(6)[None]
    torch.testing.assert_close(alibi.score_bias(pos + 77, pos + 77)[0], dense)
    assert not list(alibi.state_dict())


def test_alibi_survives_bf16_cast():
    alibi = ALiBi(8).to(torch.bfloat16)
    bias = alibi(1, 1001, offset=1000)
    assert bias.dtype == torch.float32
    assert bias[0, 0, 0] == pytest.approx(-0.5 * 1000) and bias[0, 0, 1] == pytest.approx(
        -0.5 * 999
    )


def test_alibi_errors():
    with pytest.raises(ValueError, match="heads must be >= 1, got 0"):
        ALiBi(0)
    with pytest.raises(
        ValueError, match="ALiBi was built for heads=4 but the attention has heads=8"
    ):
        ALiBi(4).validate_attention(heads=8, head_dim=8)
