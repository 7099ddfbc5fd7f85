"""diagonals.py: the Toeplitz spread, its adjoint and the skew against their definitions
written out pair by pair, with gradients (gradcheck)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize(
    ("n_q", "n_k"), [(1, 1), (1, 5), (3, 5), (3, 6), (2, 9), (7, 2), (4, 4), (5, 12)]
)
def test_toeplitz_and_skew_rows_match_the_definition(n_q, n_k):
    from posenc.diagonals import skew_rows, toeplitz

    # two leading dimensions, offsets not innermost in memory (as T5's table.t() gives)
    values = torch.randn(n_q + n_k - 1, 2, 3, dtype=torch.float64).permute(1, 2, 0)
    values.requires_grad_(True)
    expected = torch.empty(2, 3, n_q, n_k, dtype=torch.float64)
    for i in range(n_q):
        for j in range(n_k):
            expected[..., i, j] = values[..., j - i + n_q - 1]
    torch.testing.assert_close(toeplitz(values, n_q, n_k), expected)
    assert toeplitz(values, n_q, n_k).is_contiguous()  # row-major whatever n_q and n_k
    with torch.no_grad():  # no graph to record: the forward without its autograd Function
        torch.testing.assert_close(toeplitz(values, n_q, n_k), expected)
    assert torch.autograd.gradcheck(lambda v: toeplitz(v, n_q, n_k), (values,))
    # a contiguous slice that starts inside its storage; the result is a tensor of its own
    wide = torch.randn(2, 3, n_q + n_k + 4, dtype=torch.float64)
    inner = wide.view(-1)[5 : 5 + 6 * (n_q + n_k - 1)].view(2, 3, n_q + n_k - 1)
    spread = toeplitz(inner, n_q, n_k)
    for i in range(n_q):
        for j in range(n_k):
            torch.testing.assert_close(spread[..., i, j], inner[..., j - i + n_q - 1])
    spread.fill_(7.0)
    assert not (inner == 7.0).any()
    x = torch.randn(3, n_q, n_q + n_k - 1, dtype=torch.float64, requires_grad=True)
    skewed = torch.empty(3, n_q, n_k, dtype=torch.float64)
    for i in range(n_q):
        for j in range(n_k):
            skewed[:, i, j] = x[:, i, j - i + n_q - 1]
    torch.testing.assert_close(skew_rows(x, n_k), skewed)
    assert torch.autograd.gradcheck(lambda t: skew_rows(t, n_k), (x,))


def test_toeplitz_spreads_many_rows_a_matrix_at_a_time(monkeypatch):
    """Past ``_MATRIX_PAIRS`` pairs and ``_MATRIX_ROWS`` rows the spread runs one matrix at
    a time: the definition's values (an index of offsets, float64), for values laid out
    any way, under autograd and without, and a new tensor."""
    import posenc.diagonals as diagonals

    def definition(values, n_q, n_k):
        offsets = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None] + n_q - 1  # [n_q, n_k]
        return values[..., offsets]  # [..., n_q, n_k]

    torch.manual_seed(0)
    n_q, n_k = 16, 2100  # 33,600 pairs: past the defaults
    assert n_q >= diagonals._MATRIX_ROWS and n_q * n_k >= diagonals._MATRIX_PAIRS
    values = torch.randn(n_q + n_k - 1, 2, 3, dtype=torch.float64).permute(1, 2, 0)
    spread = diagonals.toeplitz(values, n_q, n_k)
    assert spread.is_contiguous() and torch.equal(spread, definition(values, n_q, n_k))
    monkeypatch.setattr(diagonals, "_MATRIX_PAIRS", 1)
    monkeypatch.setattr(diagonals, "_MATRIX_ROWS", 1)
    for n_q, n_k in ((2, 9), (3, 5), (5, 12)):
        values = torch.randn(2, 3, n_q + n_k - 1, dtype=torch.float64, requires_grad=True)
        assert torch.equal(diagonals.toeplitz(values, n_q, n_k), definition(values, n_q, n_k))
        assert torch.autograd.gradcheck(lambda v: diagonals.toeplitz(v, n_q, n_k), (values,))  # noqa: B023
        wide = torch.randn(2, 3, n_q + n_k + 4, dtype=torch.float64)
        inner = wide.view(-1)[5 : 5 + 6 * (n_q + n_k - 1)].view(2, 3, n_q + n_k - 1)
        out = diagonals.toeplitz(inner, n_q, n_k)
        assert torch.equal(out, definition(inner, n_q, n_k))
        out.fill_(7.0)
        assert not (inner == 7.0).any()


@pytest.mark.parametrize(("n_q", "n_k"), [(1, 4), (3, 3), (3, 8), (6, 2), (5, 12)])
def test_diagonal_sums_is_the_adjoint_of_toeplitz(n_q, n_k):
    from posenc.diagonals import diagonal_sums

    x = torch.randn(2, n_q, n_k, dtype=torch.float64)
    expected = torch.zeros(2, n_q + n_k - 1, dtype=torch.float64)
    for i in range(n_q):
        for j in range(n_k):
            expected[:, j - i + n_q - 1] += x[:, i, j]
    torch.testing.assert_close(diagonal_sums(x), expected)
    torch.testing.assert_close(diagonal_sums(x.transpose(-1, -2).contiguous().mT), expected)


def test_toeplitz_and_skew_rows_reject_wrong_widths():
    from posenc.diagonals import skew_rows, toeplitz

    with pytest.raises(ValueError, match="n_q \\+ n_k - 1 = 6 entries"):
        toeplitz(torch.zeros(5), 2, 5)
    with pytest.raises(ValueError, match="at least n_q \\+ n_k - 1 = 6 columns"):
        skew_rows(torch.zeros(2, 5), 5)


@pytest.mark.parametrize(("n_q", "n_k", "extra"), [(1, 4, 3), (3, 5, 1), (4, 4, 5), (5, 2, 9)])
def test_skew_rows_reads_only_the_offsets_of_a_wider_product(n_q, n_k, extra):
    """Columns past the n_q + n_k - 1 offsets (a product padded for the GEMM) are never
    read: NaN there changes nothing, and gets no gradient."""
    from posenc.diagonals import skew_rows

    x = torch.randn(2, n_q, n_q + n_k - 1 + extra, dtype=torch.float64)
    x[..., n_q + n_k - 1 :] = float("nan")
    x.requires_grad_(True)
    got = skew_rows(x, n_k)
    expected = torch.empty(2, n_q, n_k, dtype=torch.float64)
    for i in range(n_q):
        for j in range(n_k):
            expected[:, i, j] = x[:, i, j - i + n_q - 1]
    torch.testing.assert_close(got, expected)
    (grad,) = torch.autograd.grad(got.sum(), x)
    assert not grad[..., n_q + n_k - 1 :].any()
    assert float(grad.sum()) == 2 * n_q * n_k


def test_pad_rows_appends_zero_rows_to_a_multiple_where_they_add_an_eighth_at_most():
    from posenc.diagonals import pad_rows, padded_count

    assert [padded_count(n, 8) for n in (8, 13, 33, 56, 57, 61, 127)] == [
        8,
        13,
        33,
        56,
        64,
        64,
        128,
    ]
    assert padded_count(5, 1) == 5
    table = torch.randn(3, 61, 4, dtype=torch.float64, requires_grad=True)
    padded = pad_rows(table, 8)
    assert padded.shape == (3, 64, 4)
    assert torch.equal(padded[:, :61], table) and not padded[:, 61:].any()
    (grad,) = torch.autograd.grad((padded * 2).sum(), table)
    assert torch.equal(grad, torch.full_like(table, 2.0))
    assert pad_rows(table, 61) is table and pad_rows(table, 1) is table
    assert pad_rows(table[:, :33], 8).shape == (3, 33, 4)  # 7 rows more: not padded


@pytest.mark.compile
def test_toeplitz_compiles_in_one_graph():
    """torch.compile(fullgraph=True) of the spread and its backward (the corners and the
    middle of a wide block) gives the eager values and gradient."""
    from posenc.diagonals import toeplitz

    values = torch.randn(2, 3 + 6 - 1)
    weights = torch.randn(2, 3, 6)

    def loss(v):
        return (toeplitz(v, 3, 6) * weights).sum()

    compiled = torch.compile(loss, fullgraph=True)
    results = {}
    for name, fn in (("eager", loss), ("compiled", compiled)):
        leaf = values.clone().requires_grad_()
        out = fn(leaf)
        out.backward()
        results[name] = (out, leaf.grad)
    for a, c in zip(results["eager"], results["compiled"], strict=True):
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-6)


def test_skew_rows_backward_writes_one_buffer_and_follows_the_transforms():
    """The skew's gradient is written into one buffer the size of ``x`` (two slices wrote
    one each, alive at once: the relative embedding's fwd+bwd at Swin's windows peaked
    above its peer's); its values and gradient equal the definition's, from a view of a
    larger buffer too, and under ``torch.func.vmap``, ``jvp`` and second derivatives."""
    from torch.func import jvp, vmap

    from posenc.cli._memory import allocation_peak_mib
    from posenc.diagonals import skew_rows

    n_q, n_k, width = 5, 7, 13

    def definition(x):
        out = torch.empty(*x.shape[:-2], n_q, n_k, dtype=x.dtype)
        for i in range(n_q):
            for j in range(n_k):
                out[..., i, j] = x[..., i, j - i + n_q - 1]
        return out

    big = torch.randn(4, 3, n_q, width, dtype=torch.float64, requires_grad=True)
    x = big[1:]  # a view at an offset of its storage
    grad = torch.randn(3, 3, n_q, n_k, dtype=torch.float64)
    got, want = skew_rows(x, n_k), definition(x)
    assert torch.equal(got, want)
    assert torch.equal(*(torch.autograd.grad(y, big, grad)[0] for y in (got, want)))
    assert torch.equal(vmap(lambda t: skew_rows(t, n_k))(x.detach()), want.detach())
    tangent = torch.randn_like(x)
    assert torch.equal(
        jvp(lambda t: skew_rows(t, n_k), (x.detach(),), (tangent,))[1], definition(tangent)
    )
    leaf = x.detach().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: skew_rows(t, n_k), (leaf,))

    large = torch.randn(64, 4, 49, 104, requires_grad=True)  # 4.9 MiB
    out_grad = torch.randn(64, 4, 49, 49)

    def backward():
        torch.autograd.grad(skew_rows(large, 49), large, out_grad)

    backward()
    assert allocation_peak_mib(backward) <= 1.01 * large.numel() * 4 / 2**20
