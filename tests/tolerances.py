"""Tolerances derived from the size of what is compared, not tuned to one CPU.

Two computations of one value in floating point (a fused kernel and the math reference,
float32 and a float64 reference, AVX-512 and AVX2 kernels) round differently, and how
far apart they land depends on the magnitudes involved, not on a constant:

* a sum of ``n`` terms of size about ``m``, each product and addition rounded to a
  relative ``eps`` (``torch.finfo(dtype).eps``: 1.2e-7 float32, 7.8e-3 bfloat16, 9.8e-4
  float16, 2.2e-16 float64), is off by about ``eps * m * sqrt(n)`` when the roundings
  are independent (a random walk), ``eps * m * n`` at worst. Blocked and vectorised
  kernels sum in short chains (each SIMD lane, each block), so they sit near the
  typical case; ``sqrt(n)`` is what :func:`tolerance` takes;
* a softmax turns an absolute error ``delta`` of a logit into a relative error ``delta``
  of its weight, and a logit whose terms are of size ``L`` is off by about ``eps * L``:
  a weighted mean of values (an attention output, and each of its gradients) is off by
  about ``eps * L`` times its own size. Softmax weights sum to 1, so an output is bounded
  by ``max|v|`` whatever ``n``. :func:`tolerance`'s ``logit`` adds that term;
* hence ``atol = SAFETY * eps * magnitude * (sqrt(terms) + logit)``, ``magnitude`` the
  largest ``|x|`` of the compared values unless given, and no ``rtol``: the tolerance
  is already relative to the values' size, and an element near 0 (a cancellation) has
  the rounding error of the terms that cancelled, not a smaller one.

``SAFETY = 4``: the largest of thousands of compared elements lies 3 to 4 standard
deviations out, both sides of a comparison round (another ``sqrt(2)``), and exp or a
reciprocal may be off by a few ulps. Measured with ``POSENC_TOLERANCE_LOG`` under the
AVX-512, AVX2 and plain kernels (``ATEN_CPU_CAPABILITY``), the float32 comparisons reach
at most 0.16 of their tolerance (tests/test_kernels.py) and 0.22 (tests/test_properties.py,
200 examples); bf16/float16 against float32, 0.3 (tests/test_precision.py). A real bug
moves results by far more: against the math reference, keys one position off, a table
read with its offsets reversed or a missing term exceed the float32 tolerance 10^3 to
10^5 times, a single table entry moved by 1% of the table's largest 240 to 350 times,
ALiBi slopes 1% too steep 90 times (n = 300). float64 comparisons may keep their tight
constants (1e-10 is still 10^5 ulps).

A gradient can be far smaller than its terms (the score gradients ``P * (dP - rowsum)``
cancel: a row's softmax ignores a constant, so a key bias or a table row shared by a
whole row gets 0 up to rounding): compare a backward's gradients at the size of the
largest of them (``magnitude=``), not each at its own.

Set ``POSENC_TOLERANCE_LOG=<file>`` to append ``ratio test`` lines (error over
tolerance, every call of :func:`assert_close`), to see how close the suite runs.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os

import torch

SAFETY = 4.0


def eps(dtype: torch.dtype) -> float:
    """The machine epsilon of ``dtype`` (the spacing of floats just above 1)."""
    return torch.finfo(dtype).eps


def tolerance(dtype: torch.dtype, magnitude: float, *, terms: int = 1, logit: float = 0.0) -> float:
    """Absolute tolerance for values of size ``magnitude`` computed in ``dtype``: each a sum
    of ``terms`` rounded terms, after a softmax over logits whose terms are of size
    ``logit`` (0: no softmax). ``SAFETY * eps * magnitude * (sqrt(terms) + logit)``."""
    return SAFETY * eps(dtype) * float(magnitude) * (math.sqrt(terms) + float(logit))


def _coarsest(*tensors: torch.Tensor) -> torch.dtype:
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    return max(floats, key=eps) if floats else torch.float64


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    magnitude: float | None = None,
    terms: int = 1,
    logit: float = 0.0,
    dtype: torch.dtype | None = None,
    msg: str = "",
) -> float:
    """``|actual - expected| <= tolerance(...)`` elementwise, with ``dtype`` the coarser of
    the two (or the one given: pass the dtype a result was computed in when it was upcast
    before the comparison) and ``magnitude`` ``max|expected|`` unless given (floored at
    the smallest normal float, so all-zero tensors compare exactly). Shapes, NaNs and
    infinities as ``torch.testing.assert_close``. Returns error / tolerance; the failure
    message says it too."""
    dtype = dtype or _coarsest(actual, expected)
    if magnitude is None:
        finite = expected.detach()[expected.detach().isfinite()]
        magnitude = float(finite.abs().max()) if finite.numel() else 0.0
    atol = max(tolerance(dtype, magnitude, terms=terms, logit=logit), torch.finfo(dtype).tiny)
    wide = torch.promote_types(actual.dtype, expected.dtype)
    diff = (actual.detach().to(wide) - expected.detach().to(wide)).abs()
    diff = diff[diff.isfinite()]
    error = float(diff.max()) if diff.numel() else 0.0
    ratio = error / atol
    how = (
        f"error {error:.3g} / tolerance {atol:.3g} = {ratio:.2f} "
        f"({SAFETY:g} * eps({dtype}) * magnitude {magnitude:.3g} * (sqrt({terms}) + logit "
        f"{logit:.3g}))"
    )
    log = os.environ.get("POSENC_TOLERANCE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{ratio:.4f}\t{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{msg}\n")
    torch.testing.assert_close(
        actual,
        expected,
        atol=atol,
        rtol=0,
        check_dtype=False,
        msg=lambda text: f"{text}\n{msg + ': ' if msg else ''}{how}",
    )
    return ratio


def logit_size(q, k, scheme=None, q_pos=None, k_pos=None) -> float:
    """The size of the terms of attention's largest logit, as posenc computes them:
    ``(max|q.k| + max|score_term|) / sqrt(d) + max|score_bias|`` (terms that cancel still
    count: each rounds at its own size)."""
    term, bias = (getattr(scheme, hook, None) for hook in ("score_term", "score_bias"))
    with torch.no_grad():
        size = float((q @ k.transpose(-2, -1)).abs().max()) if q.numel() and k.numel() else 0.0
        if callable(term) and size:
            size += float(term(q, q_pos, k_pos).abs().max())
        size *= q.shape[-1] ** -0.5
        if callable(bias) and q.numel() and k.numel():
            size += float(bias(q_pos, k_pos).abs().max())
    return size


@contextlib.contextmanager
def recorded_logits():
    """Within the block, every attention call of :class:`posenc.MultiHeadAttention` appends
    its :func:`logit_size` (rotated q and k, the scheme's terms) to the list it yields:
    ``max(sizes)`` is the ``logit`` of a comparison of module outputs."""
    attention = importlib.import_module("posenc.attention")
    sizes: list[float] = []
    original = attention.attend

    def spy(q, k, v, *, scheme=None, q_pos, k_pos, **kwargs):
        sizes.append(logit_size(q, k, scheme, q_pos, k_pos))
        return original(q, k, v, scheme=scheme, q_pos=q_pos, k_pos=k_pos, **kwargs)

    attention.attend = spy
    try:
        yield sizes
    finally:
        attention.attend = original


def forward(module, *args, **kwargs):
    """``(module(*args, **kwargs), logit)``: the call's result and the largest
    :func:`logit_size` of its attention calls (0 when it made none)."""
    with recorded_logits() as sizes:
        out = module(*args, **kwargs)
    return out, max(sizes, default=0.0)
