"""Per-offset values and per-pair layouts: the Toeplitz spread, its adjoint, the skew.

A relative scheme over consecutive positions has one value per offset ``j - i``; these
functions move between that ``[..., n_q + n_k - 1]`` form and the ``[..., n_q, n_k]``
pairs by strided views and broadcast copies, never an ``[n_q, n_k]`` index (Huang et al.
2018's skew). :mod:`posenc.indices` re-exports them.

Shape legend: ``n_q`` queries, ``n_k`` keys, ``W = n_q + n_k - 1`` offsets, ``L`` the
length of a square relative matrix.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _validate as check
from ._memo import _plain

__all__ = ["diagonal_sums", "relative_to_absolute", "skew_rows", "toeplitz"]


def toeplitz(values: Tensor, n_q: int, n_k: int) -> Tensor:
    """A per-offset value spread over the pairs: ``out[..., i, j] = values[..., j - i + n_q - 1]``.

    The bias of a relative scheme for consecutive positions (see :func:`offset_run`), from
    its ``n_q + n_k - 1`` values per offset, with no ``[n_q, n_k]`` index: the rows of a
    Hankel view of ``values`` copied in reverse order. The gradient sums along the
    diagonals.

    Args:
        values: ``[..., n_q + n_k - 1]``, offsets in increasing order; differentiable.
        n_q: number of query rows.
        n_k: number of key columns.

    Returns:
        ``[..., n_q, n_k]``, a new tensor.

    Raises:
        ValueError: the last dimension of ``values`` is not ``n_q + n_k - 1``.
    """
    if values.shape[-1] != n_q + n_k - 1:
        raise ValueError(
            f"values must have n_q + n_k - 1 = {n_q + n_k - 1} entries in its last dimension "
            f"(one per offset), got shape {tuple(values.shape)}"
        )
    if torch.is_grad_enabled() and values.requires_grad:
        return _Toeplitz.apply(values, n_q, n_k)
    return _toeplitz(values, n_q, n_k)  # no graph to record: the forward alone


def _diagonals(x: Tensor, n_q: int, count: int) -> Tensor:
    """``view[..., i, t] = x[..., i, i + t]`` for ``t < count``: the diagonals ``0 .. count - 1``
    of a contiguous ``x [..., n_q, n_k]`` (``count <= n_k - n_q + 1``), as a strided view."""
    n_k = x.shape[-1]
    sizes = (*x.shape[:-2], n_q, count)
    return x.as_strided(sizes, (*x.stride()[:-2], n_k + 1, 1))  # at x's storage offset


def _diagonal_sums(grad: Tensor, n_q: int) -> Tensor:
    """``out[..., m] = sum_i grad[..., i, m - (n_q - 1) + i]`` for a small ``grad``: shift
    row i right by ``n_q - 1 - i`` in a zero buffer and sum the rows (skew_rows reversed)."""
    n_k = grad.shape[-1]
    width = n_q + n_k - 1
    buffer = grad.new_zeros(*grad.shape[:-2], n_q * (width + 1))  # [..., n_q * (width + 1)]
    written = buffer[..., n_q - 1 : n_q - 1 + n_q * width].unflatten(-1, (n_q, width))
    written[..., :n_k].copy_(grad)  # [..., n_q, n_k] at column n_q - 1 of rows width long
    shifted = buffer.unflatten(-1, (n_q, width + 1))  # row i starts at n_q - 1 - i
    return shifted.sum(dim=-2)[..., :width]  # [..., n_q + n_k - 1]


def _toeplitz(values: Tensor, n_q: int, n_k: int) -> Tensor:
    """:func:`toeplitz`'s forward (see :class:`_Toeplitz`): ``[..., n_q, n_k]``, contiguous.

    ``H[..., r, j] = values[..., r + j]`` is a Hankel matrix, a view of ``values`` with
    strides ``(1, 1)``; its rows in reverse order are the Toeplitz matrix
    (``out[i] = H[n_q - 1 - i]``): one copy and no ``[n_q, n_k]`` index. With fewer rows
    than columns ``flip`` would keep the view's column-major order, so the rows are
    picked in reverse by ``index_select`` instead: in eager code on the CPU, from
    :data:`_MATRIX_ROWS` rows and :data:`_MATRIX_PAIRS` pairs, one matrix at a time (a
    2-D view's rows are copied in one piece each, where over more dimensions the kernel
    reads them element by element)."""
    values = values.contiguous()  # [..., n_q + n_k - 1]
    sizes, strides = (*values.shape[:-1], n_q, n_k), (*values.stride()[:-1], 1, 1)
    hankel = values.as_strided(sizes, strides)  # [..., n_q, n_k], at values' storage offset
    if n_q >= n_k:
        return hankel.flip(-2)  # [..., n_q, n_k], row i = hankel row n_q - 1 - i
    rows = torch.arange(n_q - 1, -1, -1, device=values.device)  # [n_q]
    if (
        n_q < _MATRIX_ROWS
        or n_q * n_k < _MATRIX_PAIRS
        or values.dim() == 1
        or not values.is_cpu
        or not _plain()
    ):
        return hankel.index_select(-2, rows)  # [..., n_q, n_k]
    count = math.prod(values.shape[:-1])  # the matrices
    # a matrix at a time: the CPU's index_select of whole rows of a 2-D view copies each
    # row in one piece, where over more dimensions it reads element by element
    out = torch.empty(sizes, dtype=values.dtype, device=values.device)  # [..., n_q, n_k]
    sources, targets = hankel.reshape(count, n_q, n_k), out.view(count, n_q, n_k)  # (views)
    for source, target in zip(sources, targets, strict=True):
        torch.index_select(source, 0, rows, out=target)  # [n_q, n_k]
    return out


#: query-key pairs per matrix, and rows, from which :func:`_toeplitz` spreads one matrix
#: at a time (measured: docs/performance.md, "Thirty-third pass")
_MATRIX_PAIRS = 1 << 15
_MATRIX_ROWS = 16


class _Toeplitz(torch.autograd.Function):
    """:func:`toeplitz`: one pass over ``[n_q, n_k]`` each way, no index.

    Forward: the flipped Hankel view of :func:`_toeplitz`. Backward: :func:`diagonal_sums`
    (autograd's own gradient of the overlapping view would go through an ``as_strided``
    scatter).
    """

    @staticmethod
    def forward(ctx: Any, values: Tensor, n_q: int, n_k: int) -> Tensor:  # type: ignore[override]
        return _toeplitz(values, n_q, n_k)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return diagonal_sums(grad), None, None


def diagonal_sums(x: Tensor) -> Tensor:
    """The adjoint of :func:`toeplitz`: ``out[..., m] = sum_i x[..., i, m - (n_q - 1) + i]``.

    Sums ``x [..., n_q, n_k]`` along each diagonal ``j - i = m - (n_q - 1)``: the gradient of
    a per-offset value from the gradient of its pairs. One pass over ``x``: the offsets every
    row meets are a strided view of ``x`` summed over its rows; the two corners take a
    padded skew.

    Args:
        x: ``[..., n_q, n_k]``.

    Returns:
        ``[..., n_q + n_k - 1]``, offsets in increasing order.
    """
    n_q, n_k = x.shape[-2], x.shape[-1]
    count = n_k - n_q + 1
    if count < n_q:
        return _diagonal_sums(x, n_q)
    x = x.contiguous()  # [..., n_q, n_k]
    out = x.new_empty(*x.shape[:-2], n_q + n_k - 1)  # [..., n_q + n_k - 1]
    out[..., n_q - 1 : n_k] = _diagonals(x, n_q, count).sum(dim=-2)
    corner = n_q - 1
    if corner:
        # offsets below 0 lie in the first n_q - 1 columns, above n_k - n_q in the last
        out[..., :corner] = _diagonal_sums(x[..., :corner], n_q)[..., :corner]
        out[..., n_k:] = _diagonal_sums(x[..., n_k - corner :], n_q)[..., corner:]
    return out


def padded_count(count: int, multiple: int) -> int:
    """``count`` rounded up to a multiple of ``multiple`` where that adds at most an eighth
    to it, else ``count``: the rows of a table that :func:`pad_rows` gives (a GEMM with an
    odd count of output columns runs slow edge kernels on CPU; a few columns more cost less
    than those, many more do not: 33 rows padded to 40 gained nothing, 63, 97 or 127 to a
    multiple of 8, 0.44-0.77 of the time)."""
    extra = -count % multiple
    return count + extra if 8 * extra <= count else count


def pad_rows(table: Tensor, multiple: int) -> Tensor:
    """``table`` with zero rows appended up to :func:`padded_count` rows (itself when that
    is its own): ``q @ pad_rows(table)^T`` holds ``q @ table^T`` in its first columns (up to
    rounding: the GEMM's kernel for the wider product may sum in another order), at a width
    the GEMM runs faster at (:func:`skew_rows` and a gather read only those).

    Args:
        table: ``[..., R, d]``; differentiable.
        multiple: at least 1.

    Returns:
        ``[..., R', d]``, ``R' = padded_count(R, multiple)``.
    """
    extra = padded_count(table.shape[-2], multiple) - table.shape[-2]
    return F.pad(table, (0, 0, 0, extra)) if extra else table  # [..., R', d]


def skew_rows(x: Tensor, n_k: int) -> Tensor:
    """The skew for a block of queries: ``out[..., i, j] = x[..., i, j - i + n_q - 1]``.

    Row ``i`` of ``x`` holds one logit per offset (column ``m`` is offset
    ``first + m``, see :func:`offset_run`); the pair ``(i, j)`` needs column
    ``j - i + n_q - 1``. Reading the flat buffer from element ``n_q - 1`` in rows one
    shorter than ``x``'s shifts row ``i`` left by ``i``: a view, no copy and no index
    (Huang et al. 2018's skew, for a rectangle of queries and keys). Columns past the
    ``n_q + n_k - 1`` offsets are not read (a product padded to a width its GEMM runs
    faster at).

    Args:
        x: ``[..., n_q, W]``, ``W >= n_q + n_k - 1``; differentiable.
        n_k: number of keys.

    Returns:
        ``[..., n_q, n_k]`` (a view of ``x`` when ``x`` is contiguous; outside
        ``torch.compile`` one ``as_strided`` view, whose backward writes the gradient into
        one buffer of ``x``'s size).

    Raises:
        ValueError: ``x`` has fewer than ``n_q + n_k - 1`` columns.
    """
    n_q = x.shape[-2]
    width = x.shape[-1]
    if width < n_q + n_k - 1:
        raise ValueError(
            f"x must have at least n_q + n_k - 1 = {n_q + n_k - 1} columns (one per offset), "
            f"got shape {tuple(x.shape)}"
        )
    if n_q == 1:
        return x[..., :n_k]
    x = x.contiguous()
    if torch.compiler.is_compiling():  # (Dynamo does not trace storage_offset)
        flat = x.flatten(-2)  # [..., n_q * W]
        rows = flat[..., n_q - 1 : n_q - 1 + n_q * (width - 1)]  # [..., n_q * (W - 1)]
        return rows.unflatten(-1, (n_q, width - 1))[..., :n_k]  # [..., n_q, n_k]
    # the same view in one step: its backward writes the gradient into one buffer of x's
    # size, where the slices' wrote two (each slice's own, alive at once)
    size, strides = (*x.shape[:-2], n_q, n_k), (*x.stride()[:-2], width - 1, 1)
    return x.as_strided(size, strides, x.storage_offset() + n_q - 1)  # [..., n_q, n_k]


def relative_to_absolute(x: Tensor) -> Tensor:
    """The skew: relative logits ``[..., L, 2L-1]`` to absolute ``[..., L, L]``.

    ``out[..., i, j] = x[..., i, j - i + L - 1]``: column ``m`` of ``x`` holds relative
    offset ``m - (L - 1)``, from ``-(L-1)`` to ``L-1``. Done by padding and reshaping
    (Huang et al. 2018, Music Transformer; Bello et al. 2019), with no ``[L, L]`` index:
    after one column of padding each row is ``2L`` long, so reading the flat buffer with
    rows of ``2L - 1`` shifts row ``i`` left by ``i``.

    Args:
        x: ``[..., L, 2L-1]``, any dtype; differentiable.

    Returns:
        ``[..., L, L]``.

    Raises:
        ValueError: the last dimension is not ``2L - 1``.
    """
    check.tensor("x", x)
    if x.ndim < 2 or x.shape[-1] != 2 * x.shape[-2] - 1:
        raise ValueError(
            f"x must have shape [..., L, 2L-1] (one column per relative offset -(L-1)..L-1), "
            f"got shape {tuple(x.shape)}"
        )
    length = x.shape[-2]
    lead = x.shape[:-2]
    x = F.pad(x, (0, 1))  # [..., L, 2L]
    x = x.reshape(*lead, 2 * length * length)  # [..., 2L*L]
    x = F.pad(x, (0, length - 1))  # [..., (L+1) * (2L-1)]
    x = x.reshape(*lead, length + 1, 2 * length - 1)  # [..., L+1, 2L-1]
    return x[..., :length, length - 1 :]  # [..., L, L]
