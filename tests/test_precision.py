"""Low-precision inputs and very large positions, for every scheme.

bf16 and float16
----------------
``module.to(dtype)`` with a ``dtype`` input, through every scheme of ``tests/schemes.py``
inside :class:`~posenc.MultiHeadAttention` (``backend="auto"`` and ``"math"``, causal, one
padded row), compared with the same model in float32. Errors are the largest absolute
difference divided by the largest absolute float32 value (outputs ``~1``), for the output,
the input gradient and the gradients of the positional tables.

Measured on this CPU (torch 2.13), worst over every scheme, both backends and 20 seeds
(``_errors`` below, run with seeds 0..19):

=========  ==========  =============  ============  =========================
dtype      output      input grad     table grads   no scheme (output)
=========  ==========  =============  ============  =========================
bfloat16   7.4e-3      1.2e-2         2.7e-2        6.7e-3
float16    1.1e-3      1.3e-3         3.5e-3        9.4e-4
=========  ==========  =============  ============  =========================

The last column is attention without positions: most of the error is the rounding of the
weights and the input to the dtype (bf16 keeps 8 significant bits, ``2**-8 = 3.9e-3``
relative; float16 11 bits, ``4.9e-4``), and the schemes add little to it because their
angles and biases are computed in float32 or wider. In units of the dtype's epsilon
(``7.8e-3`` bf16, ``9.8e-4`` float16) the worst errors are the same for both dtypes:
1.2 eps (output), 1.6 eps (input gradient), 3.6 eps (table gradients). The tolerances
are ``tests/tolerances.py``'s, ``SAFETY * eps`` times the largest float32 value with one
term for the output and the input gradient (4 eps: bf16 3.1e-2, float16 3.9e-3) and four
for the table gradients (8 eps), whose entries each sum many (query, key) contributions,
some of opposite sign, in the low-precision dtype.

Positions up to 1,000,000
-------------------------
The fixed schemes are compared with float64 references computed here the slow obvious
way (Python ``math`` per element). RoPE (both layouts, partial, linear / NTK / dynamic NTK
scaling) in float32: measured ``3.5e-7``, tolerance ``2.6e-6`` (two terms of size
``max|x|``); with float32 angles (the common mistake, checked too) the error there is
``7e-3`` to ``7e-2``. A bf16 input is
rotated to within half a bf16 step of the exact rotation of its values (measured 0.92 of
that bound), which float32 angles break for 17% of the entries. ALiBi's bias is within
one rounding (``4 eps`` relative), the sinusoidal encodings within two (float32) or two
bf16 roundings.

Relative schemes give the same attention output at positions shifted by 1e6 as at 0:
measured ``1.2e-7`` in float32, ``3.9e-3`` in bf16 and ``4.9e-4`` in float16 (RoPE: one
rounding of the rotated q and k; the table schemes are exact); tolerances two roundings
of the output's size (``4 * sqrt(2) eps * max|out|``).
"""

from __future__ import annotations

import math

import pytest
import torch

from posenc import (
    ALiBi,
    DynamicNTKScaling,
    LinearScaling,
    MultiHeadAttention,
    NTKScaling,
    Rotary,
    SinusoidalEncoding,
    SinusoidalEncoding2D,
    XPos,
)
from schemes import SCHEMES
from tolerances import assert_close, tolerance

HEADS, HEAD_DIM = 2, 16
DIM = HEADS * HEAD_DIM
GRID = (3, 4)
N = GRID[0] * GRID[1]
MILLION = 1_000_000

#: terms (see tests/tolerances.py) of the output, the input gradient and the table
#: gradients: one rounding of the size of the result for the first two (the inputs and
#: the result are rounded to the dtype, the sums in between accumulate in float32); a
#: table entry's gradient sums pairs of both signs in the dtype: a few roundings. 4 eps
#: and 8 eps; measured at most 1.2, 1.6 and 3.6 eps over 20 seeds
TERMS = (1, 1, 4)


# ----- bf16 / float16 against float32 -----------------------------------------------------


def _build(name: str, seed: int, backend: str) -> MultiHeadAttention:
    torch.manual_seed(seed)
    scheme = None if name == "none" else SCHEMES[name].build(HEADS, HEAD_DIM, N, GRID)
    return MultiHeadAttention(DIM, HEADS, position=scheme, backend=backend)


def _run(model: MultiHeadAttention, x: torch.Tensor, dtype: torch.dtype):
    model = model.to(dtype)
    x = x.detach().to(dtype).clone().requires_grad_()
    padding = torch.zeros(2, N, dtype=torch.bool)
    padding[1, -3:] = True
    out = model(x, causal=True, key_padding_mask=padding)
    assert out.dtype == dtype
    (out.float() * torch.linspace(-1, 1, DIM)).sum().backward()
    tables = {k: p.grad.float() for k, p in model.named_parameters() if k.startswith("position.")}
    return out.float(), x.grad.float(), tables


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().double(), expected.detach().double()
    return float((got - expected).abs().max() / expected.abs().max())


def _errors(name: str, dtype: torch.dtype, backend: str, seed: int) -> tuple[float, float, float]:
    """(output, input gradient, worst table gradient) errors of ``dtype`` against float32."""
    x = torch.randn(2, N, DIM, generator=torch.Generator().manual_seed(1000 + seed))
    out32, grad32, tables32 = _run(_build(name, seed, backend), x, torch.float32)
    out, grad, tables = _run(_build(name, seed, backend), x, dtype)
    assert set(tables) == set(tables32)
    # the gradients of one backward at the size of the largest of them, as
    # tests/tolerances.py says: a table whose gradient cancels (FIRE's output bias adds a
    # constant to each row of scores, so its gradient is 0 up to rounding; its MLP's
    # weights nearly so at these short distances) gets float32's and the dtype's rounding
    # of much larger terms, not an error relative to its own size
    largest = max((float(t.abs().max()) for t in tables32.values()), default=1.0)
    table_error = max(
        (float((tables[k] - tables32[k]).abs().max()) / largest for k in tables), default=0.0
    )
    return _relative_error(out, out32), _relative_error(grad, grad32), table_error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["auto", "math"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_low_precision_agrees_with_float32(name, backend, dtype):
    errors = _errors(name, dtype, backend, seed=0)
    for what, error, terms in zip(
        ("output", "input gradient", "table gradient"), errors, TERMS, strict=True
    ):
        bound = tolerance(dtype, 1.0, terms=terms)  # errors are relative to max|float32|
        assert error <= bound, f"{name} {dtype} {what}: {error:.2e} > {bound:.1e}"


class SteeperALiBi(ALiBi):
    """ALiBi with slopes 10% too steep: a plausible bug, to see what the tolerances detect."""

    def score_bias(self, q_pos, k_pos):
        return 1.1 * super().score_bias(q_pos, k_pos)


def test_float16_tolerance_catches_a_wrong_bias():
    """A 10% slope error moves the output by 5.6e-3 here: caught in float16 (not in bf16,
    whose own rounding is of that size; the maths of each scheme is tested in float32 and
    float64 in its own test file)."""
    x = torch.randn(2, N, DIM, generator=torch.Generator().manual_seed(1000))
    out32 = _run(_build("alibi", 0, "auto"), x, torch.float32)[0]
    torch.manual_seed(0)
    wrong = MultiHeadAttention(DIM, HEADS, position=SteeperALiBi(HEADS))
    out = _run(wrong, x, torch.float16)[0]
    assert _relative_error(out, out32) > tolerance(torch.float16, 1.0, terms=TERMS[0])


# ----- RoPE at positions near 1e6 ---------------------------------------------------------


def _inverse_frequencies(rotary_dim: int, base: float, scaling: str, length: int) -> list[float]:
    """``theta_i`` by hand, float64, for the scalings that have a closed form."""
    factor = 4.0
    if scaling == "ntk":
        base = base * factor ** (rotary_dim / (rotary_dim - 2))
    if scaling == "dynamic":  # original_max_len 4096, length = the largest position + 1
        base = base * (factor * length / 4096 - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    thetas = [base ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)]
    if scaling == "linear":
        thetas = [t / factor for t in thetas]
    return thetas


SCALINGS = {
    "none": None,
    "linear": LinearScaling(4.0),
    "ntk": NTKScaling(4.0),
    "dynamic": DynamicNTKScaling(4.0, 4096),
}


def rope_reference(
    x: torch.Tensor, angles: list[list[float]], *, interleaved: bool
) -> torch.Tensor:
    """Rotate pair ``i`` of token ``t`` of ``x [b, h, n, d]`` by ``angles[t][i]``, one by one."""
    x = x.double()
    out = x.clone()
    for t, row in enumerate(angles):
        half = len(row)
        for i, angle in enumerate(row):
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
            c, s = math.cos(angle), math.sin(angle)
            out[..., t, a] = x[..., t, a] * c - x[..., t, b] * s
            out[..., t, b] = x[..., t, b] * c + x[..., t, a] * s
    return out


def exact_angles(positions: list[int], thetas: list[float]) -> list[list[float]]:
    return [[p * theta for theta in thetas] for p in positions]  # Python floats: float64


def float32_angles(positions: list[int], thetas: list[float]) -> list[list[float]]:
    """The common mistake: positions times frequencies in float32."""
    angles = torch.tensor(positions, dtype=torch.float32)[:, None] * torch.tensor(thetas).float()
    return angles.double().tolist()


NEAR_MILLION = [MILLION - 3, MILLION - 1, MILLION, MILLION + 17]


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize(("interleaved", "rotary_dim"), [(False, 32), (True, 32), (False, 16)])
def test_rotary_near_one_million_matches_float64(interleaved, rotary_dim, scaling):
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 4, 32), torch.randn(2, 2, 4, 32)
    rope = Rotary(32, interleaved=interleaved, rotary_dim=rotary_dim, scaling=SCALINGS[scaling])
    positions = torch.tensor(NEAR_MILLION)
    got_q, got_k = rope(q, k, positions, positions)
    thetas = _inverse_frequencies(rotary_dim, 10000.0, scaling, max(NEAR_MILLION) + 1)
    angles = exact_angles(NEAR_MILLION, thetas)
    for got, x in ((got_q, q), (got_k, k)):
        assert got.dtype == torch.float32
        expected = rope_reference(x, angles, interleaved=interleaved)
        # float64 angles: cos and sin rounded to float32, then x * c - y * s (two terms)
        assert_close(got, expected, terms=2)
    # float32 angles, the common mistake, are far outside that tolerance at 1e6
    naive = rope_reference(q, float32_angles(NEAR_MILLION, thetas), interleaved=interleaved)
    assert (naive - rope_reference(q, angles, interleaved=interleaved)).abs().max() > 1e-3


def test_rotary_bf16_input_is_rotated_with_wide_angles():
    """A bf16 q at 1e6 is the exact rotation of its values, rounded once to bf16."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 4, 32).bfloat16()
    rope = Rotary(32).to(torch.bfloat16)
    got, _ = rope(q, q, torch.tensor(NEAR_MILLION), torch.tensor(NEAR_MILLION))
    assert got.dtype == torch.bfloat16
    thetas = _inverse_frequencies(32, 10000.0, "none", 0)
    expected = rope_reference(q, exact_angles(NEAR_MILLION, thetas), interleaved=False)
    # rounding to bf16 moves a value by at most 2**-8 of itself (half a step of 8 bits)
    bound = 2**-8 * expected.abs() + 1e-6
    assert ((got.double() - expected).abs() <= bound).all()
    # float32 angles (let alone bf16 ones) would break that bound for many entries
    naive = rope_reference(q, float32_angles(NEAR_MILLION, thetas), interleaved=False)
    assert ((naive - expected).abs() > bound).float().mean() > 0.1


# ----- ALiBi and the sinusoidal encodings near 1e6 ----------------------------------------


@pytest.mark.parametrize("heads", [8, 6])
def test_alibi_near_one_million_matches_float64(heads):
    # the paper's slopes by hand: 2**(-8/n) geometric, the odd ones of 2n added for n != 2**k
    if heads == 8:
        slopes = [2.0 ** -(i + 1) for i in range(8)]
    else:
        slopes = [2.0 ** (-2 * (i + 1)) for i in range(4)] + [2.0**-1, 2.0**-3]
    q_pos = torch.tensor([[MILLION - 2, MILLION, MILLION + 5]])
    k_pos = torch.tensor([[0, 3, MILLION - 40, MILLION, MILLION + 1, 2 * MILLION]])
    alibi = ALiBi(heads).to(torch.bfloat16)  # nothing to round: slopes are recomputed
    got = alibi.score_bias(q_pos, k_pos)[0]  # [h, n_q, n_k]
    assert got.dtype == torch.float32
    expected = torch.tensor(
        [
            [[-s * abs(kp - qp) for kp in k_pos[0].tolist()] for qp in q_pos[0].tolist()]
            for s in slopes
        ],
        dtype=torch.float64,
    )
    one_rounding = tolerance(torch.float32, 1.0)  # per value: slope * distance, rounded
    torch.testing.assert_close(got.double(), expected, atol=0, rtol=one_rounding)
    # the dense forward with the queries at offset 1e6
    dense = ALiBi(heads)(2, 3, offset=MILLION)  # queries 1e6, 1e6 + 1 against keys 0, 1, 2
    for h, s in enumerate(slopes):
        for i in range(2):
            for j in range(3):
                assert math.isclose(dense[h, i, j], -s * (MILLION + i - j), rel_tol=one_rounding)


def _sinusoid(p: float, dim: int) -> list[float]:
    row = []
    for j in range(dim // 2):
        angle = p / 10000.0 ** (2 * j / dim)
        row += [math.sin(angle), math.cos(angle)]
    return row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinusoidal_encodings_near_one_million_match_float64(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 64).to(dtype)
    positions = torch.tensor(NEAR_MILLION)
    got = SinusoidalEncoding(64).to(dtype)(x, positions)
    assert got.dtype == dtype
    table = torch.tensor([_sinusoid(p, 64) for p in NEAR_MILLION], dtype=torch.float64)
    expected = x.double() + table
    if dtype == torch.float32:
        assert_close(got, expected, terms=2)  # the table rounded to float32, then the sum
    else:  # the table rounded to bf16 (|P| <= 1), then the sum rounded: 2**-8 each
        assert ((got.double() - expected).abs() <= 2**-8 * (expected.abs() + 1) + 1e-6).all()
    # 2-D: rows and columns near 1e6
    grid = torch.stack(
        torch.meshgrid(
            torch.tensor([MILLION, MILLION + 1]), torch.tensor([7, MILLION]), indexing="ij"
        ),
        -1,
    )  # [2, 2, 2]
    got2d = SinusoidalEncoding2D(64)(torch.zeros(1, 2, 2, 64), grid)[0]  # [b, H, W, dim]
    for r in range(2):
        for c in range(2):
            row, col = grid[r, c].tolist()
            expected2d = torch.tensor(_sinusoid(row, 32) + _sinusoid(col, 32), dtype=torch.float64)
            assert_close(got2d[r, c], expected2d)  # |P| <= 1, rounded once


# ----- relative schemes: shifted by 1e6 equals unshifted ----------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("name", [n for n, e in SCHEMES.items() if e.relative])
def test_relative_schemes_unchanged_by_a_shift_of_one_million(name, dtype):
    torch.manual_seed(0)
    model = _build(name, 0, "auto").eval().to(dtype)
    x = torch.randn(2, N, DIM).to(dtype)
    at_zero = model(x, causal=True)
    if isinstance(model.position, XPos):  # its factors leave the dtype's range: it raises
        with pytest.raises(ValueError, match="max_position"):
            model(x, causal=True, positions=torch.arange(N) + MILLION)
        return
    for shift in (MILLION - 7, MILLION):
        shifted = model(x, causal=True, positions=torch.arange(N) + shift)
        # RoPE: q and k rotated by other angles, each rounded once; tables: exact
        assert_close(shifted, at_zero, terms=2, msg=f"shift {shift}")
