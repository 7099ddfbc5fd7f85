"""RoPE scaling: how a context extension changes rotary frequencies (and the attention
temperature), for :class:`~posenc.Rotary`'s ``scaling=``.

Linear position interpolation (Chen et al. 2023), NTK-aware scaling (bloc97 2023), its
dynamic form (as in HF transformers), and YaRN (Peng et al. 2023).

Shape legend: ``r`` the rotated channels, ``r/2`` their frequencies.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _validate as check
from .absolute import angle_dtype, inverse_frequencies

__all__ = ["DynamicNTKScaling", "LinearScaling", "NTKScaling", "RotaryScaling", "YaRNScaling"]


class RotaryScaling:
    """How a scaling changes RoPE's frequencies (and the attention temperature).

    Subclasses override :meth:`frequencies`; ``attention_factor`` multiplies sin and cos
    (so the logits by its square), 1 unless the method prescribes one.
    """

    attention_factor: float = 1.0
    #: True when the frequencies depend on the sequence length (breaks cached keys)
    dynamic: bool = False

    def frequencies(
        self, dim: int, base: float, *, device: torch.device | None, length: Tensor | None
    ) -> Tensor:
        """The scaled inverse frequencies ``[dim/2]`` (float64)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _factor(factor: object) -> float:
    factor = check.positive_float("factor", factor)
    if factor < 1:
        raise ValueError(f"factor must be >= 1 (the context is extended by it), got {factor}")
    return factor


class LinearScaling(RotaryScaling):
    """Position interpolation: positions are divided by ``factor``.

    Chen et al. 2023, "Extending Context Window of Large Language Models via Positional
    Interpolation": ``theta_i' = theta_i / factor``, so a model trained on ``L`` tokens
    sees the positions of ``factor * L`` tokens squeezed into its trained range.

    Args:
        factor: the context extension, >= 1.
    """

    def __init__(self, factor: float) -> None:
        self.factor = _factor(factor)

    def frequencies(self, dim, base, *, device, length):
        return inverse_frequencies(dim, base, device=device) / self.factor


class NTKScaling(RotaryScaling):
    """NTK-aware scaling: a larger base, ``base' = base * factor**(d / (d - 2))``.

    bloc97 2023 ("NTK-Aware Scaled RoPE"); high frequencies (local order) are kept and low
    ones are interpolated. The length-independent form: the frequencies are fixed, so keys
    in a KV cache stay valid.

    Args:
        factor: the context extension, >= 1.
    """

    def __init__(self, factor: float) -> None:
        self.factor = _factor(factor)

    def frequencies(self, dim, base, *, device, length):
        return inverse_frequencies(dim, base * self.factor ** (dim / (dim - 2)), device=device)


class DynamicNTKScaling(RotaryScaling):
    """Dynamic NTK: the base grows with the sequence length ``L`` past ``original_max_len``.

    ``base' = base * (factor * L / original_max_len - (factor - 1)) ** (d / (d - 2))`` for
    ``L > original_max_len`` (unchanged below), as HF transformers' dynamic NTK rope. ``L`` is
    the largest position in the call plus one.

    With a KV cache this is inconsistent by nature: keys cached at an earlier, shorter
    length were rotated with a smaller base, and re-rotating them at every step would
    change what the cache holds. posenc therefore refuses to decode a dynamic-NTK
    :class:`Rotary` with a cache (``supports_cache`` is False, the attention raises a
    clear error): run the full sequence each step, or use :class:`NTKScaling` with the
    factor of your target length, whose frequencies do not move.

    Args:
        factor: the scaling factor.
        original_max_len: the training context length.
    """

    dynamic = True

    def __init__(self, factor: float, original_max_len: int) -> None:
        self.factor = _factor(factor)
        self.original_max_len = check.positive_int("original_max_len", original_max_len)

    def frequencies(self, dim, base, *, device, length):
        exponents = torch.arange(0, dim, 2, dtype=angle_dtype(device), device=device) / dim
        if length is None:
            return base**-exponents
        length = length.to(exponents.dtype).clamp(min=self.original_max_len)  # [B', 1]
        grow = (self.factor * length / self.original_max_len - (self.factor - 1)) ** (
            dim / (dim - 2)
        )
        return (base * grow) ** -exponents  # [B', dim/2]


class YaRNScaling(RotaryScaling):
    """YaRN: NTK-by-parts interpolation plus an attention temperature.

    Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models".
    Frequency ``i`` is interpolated (divided by ``factor``) when its wavelength is long
    compared with ``original_max_len``, kept when it is short, and blended linearly between
    the dimensions where it completes ``beta_fast`` and ``beta_slow`` rotations over the
    original context. sin and cos are multiplied by ``0.1 * ln(factor) + 1``. Matches HF
    transformers' ``_compute_yarn_parameters``.

    Args:
        factor: the context extension, >= 1.
        original_max_len: the training context length.
        beta_fast: rotations that mark the start of the blend (extrapolated side).
        beta_slow: rotations that mark its end (interpolated side).
        attention_factor: override the temperature (default ``0.1 ln(factor) + 1``).
        truncate: round the blend bounds to whole dimensions (as the reference does).
    """

    def __init__(
        self,
        factor: float,
        original_max_len: int,
        *,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        attention_factor: float | None = None,
        truncate: bool = True,
    ) -> None:
        self.factor = _factor(factor)
        self.original_max_len = check.positive_int("original_max_len", original_max_len)
        self.beta_fast = check.positive_float("beta_fast", beta_fast)
        self.beta_slow = check.positive_float("beta_slow", beta_slow)
        if attention_factor is None:
            attention_factor = 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0
        self.attention_factor = check.positive_float("attention_factor", attention_factor)
        self.truncate = bool(truncate)

    def _correction_dim(self, rotations: float, dim: int, base: float) -> float:
        # the dimension whose wavelength fits `rotations` times in the original context
        return (
            dim * math.log(self.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    def frequencies(self, dim, base, *, device, length):
        low = self._correction_dim(self.beta_fast, dim, base)
        high = self._correction_dim(self.beta_slow, dim, base)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        extrapolated = inverse_frequencies(dim, base, device=device)  # [dim/2]
        index = torch.arange(dim // 2, dtype=extrapolated.dtype, device=device)
        ramp = ((index - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: interpolate
        return extrapolated / self.factor * ramp + extrapolated * (1 - ramp)
