"""Place 2: rotary position embeddings, ``q, k -> R(pos) q, R(pos) k``.

Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding". Each pair
of channels is rotated by the angle ``p * theta_i`` with ``theta_i = base**(-2i/d)``, so
that ``(R(m) q) . (R(n) k)`` depends only on ``n - m``.

Two channel layouts, both common in checkpoints:

- ``interleaved=True``: pairs ``(2i, 2i+1)`` (GPT-J, rotary-embedding-torch; the 2x2
  blocks of :func:`~posenc.sinusoidal_shift`);
- ``interleaved=False``: pairs ``(i, i + r/2)`` (GPT-NeoX, HF Llama's ``rotate_half``).

Scaling for contexts longer than training (objects passed as ``scaling=``):
:class:`LinearScaling` (position interpolation), :class:`NTKScaling` (NTK-aware base
change), :class:`DynamicNTKScaling` (the base grows with the length), :class:`YaRNScaling`
(NTK-by-parts plus an attention temperature).

Shape legend: ``b`` batch, ``h`` heads, ``n`` sequence length, ``d`` head dim,
``r`` rotated channels (``rotary_dim``, even, ``<= d``).

Precision: angles are computed in float64 (float32 on MPS), sin/cos in float32, the
rotation in float32 (float64 for float64 inputs), and only the result is cast to the input
dtype. bf16 angles are wrong from position ~256 on; nothing here is stored as a buffer, so
``module.to(torch.bfloat16)`` cannot degrade it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import _validate as check
from .absolute import angle_dtype, inverse_frequencies

__all__ = [
    "DynamicNTKScaling",
    "LinearScaling",
    "NTKScaling",
    "Rotary",
    "Rotary2D",
    "RotaryScaling",
    "YaRNScaling",
    "apply_rotary",
    "rotary_angles",
]


# ----- pure functions ----------------------------------------------------------------------


def rotary_angles(positions: Tensor, inv_freq: Tensor) -> Tensor:
    """``positions[..., n] * inv_freq[r/2]`` in the dtype of ``inv_freq`` (float64).

    Args:
        positions: ``[..., n]`` integer (or float) positions.
        inv_freq: ``[r/2]`` frequencies, or ``[..., r/2]`` per batch row (dynamic scaling).

    Returns:
        ``[..., n, r/2]`` angles.
    """
    inv = inv_freq.unsqueeze(-2) if inv_freq.ndim > 1 else inv_freq  # [..., 1, r/2] or [r/2]
    return positions.to(inv_freq.dtype).unsqueeze(-1) * inv


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotate the first ``r = 2 * cos.shape[-1]`` channels of ``x``; pass the rest through.

    Args:
        x: ``[b, h, n, d]``.
        cos: ``[b or 1, n, r/2]`` (or ``[n, r/2]``), float32 or float64.
        sin: same shape as ``cos``.
        interleaved: pairs ``(2i, 2i+1)`` if True, else ``(i, i + r/2)``.

    Returns:
        ``[b, h, n, d]`` in ``x``'s dtype.
    """
    half = cos.shape[-1]
    rot = 2 * half
    if cos.ndim == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B', n, r/2] -> [B', 1, n, r/2]
    work = torch.promote_types(x.dtype, torch.float32)
    xr = x[..., :rot].to(work)
    cos, sin = cos.to(work), sin.to(work)
    if interleaved:
        pairs = xr.unflatten(-1, (half, 2))  # [b, h, n, r/2, 2]
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
        rotated = rotated.flatten(-2)  # [b, h, n, r/2, 2] -> [b, h, n, r]
    else:
        first, second = xr[..., :half], xr[..., half:]
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    if rot == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rot:]), dim=-1)


# ----- scaling -------------------------------------------------------------------------------


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


# ----- modules ---------------------------------------------------------------------------------


class Rotary(nn.Module):
    """Rotary position embedding (RoPE) of queries and keys.

    Args:
        head_dim: channels per head ``d`` (even).
        base: the wavelength base ``theta`` (10,000 in RoFormer; 500,000 in Llama 3).
        interleaved: rotate pairs ``(2i, 2i+1)`` (GPT-J) instead of ``(i, i + r/2)`` (NeoX).
        rotary_dim: rotate only the first ``r`` channels (GPT-NeoX's ``rotary_pct``);
            default ``head_dim``.
        scaling: a :class:`RotaryScaling` for long contexts, or None.

    Raises:
        ValueError: odd ``head_dim`` or ``rotary_dim``, ``rotary_dim > head_dim``.
        TypeError: ``scaling`` is not a :class:`RotaryScaling`.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        interleaved: bool = False,
        rotary_dim: int | None = None,
        scaling: RotaryScaling | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = check.even_int("head_dim", head_dim, why="channels are rotated in pairs")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.rotary_dim = check.even_int(
            "rotary_dim", rotary_dim, why="channels are rotated in pairs"
        )
        if rotary_dim > head_dim:
            raise ValueError(
                f"rotary_dim must be <= head_dim={head_dim}, got {rotary_dim}; rotate at most "
                f"every channel"
            )
        if scaling is not None and not isinstance(scaling, RotaryScaling):
            raise TypeError(
                f"scaling must be a RotaryScaling (LinearScaling, NTKScaling, "
                f"DynamicNTKScaling, YaRNScaling) or None, got {type(scaling).__name__}"
            )
        self.base = check.positive_float("base", base)
        self.interleaved = bool(interleaved)
        self.scaling = scaling

    @property
    def supports_cache(self) -> bool:
        """False for length-dependent scaling (see :class:`DynamicNTKScaling`)."""
        return not (self.scaling is not None and self.scaling.dynamic)

    def cos_sin(self, positions: Tensor, *, length: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin of the angles, in the angles' dtype (float64; float32 on MPS).

        Args:
            positions: ``[B', n]`` positions.
            length: ``[B', 1]`` sequence length for dynamic scaling.

        Returns:
            ``(cos, sin)``, each ``[B', n, r/2]``, times the attention factor.
        """
        device = positions.device
        if self.scaling is None:
            inv_freq = inverse_frequencies(self.rotary_dim, self.base, device=device)
            factor = 1.0
        else:
            inv_freq = self.scaling.frequencies(
                self.rotary_dim, self.base, device=device, length=length
            )
            factor = self.scaling.attention_factor
        angles = rotary_angles(positions, inv_freq)  # [B', n, r/2] float64
        return angles.cos() * factor, angles.sin() * factor  # cast by apply_rotary

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The attention hook: rotate ``q [b,h,n_q,d]`` at ``q_pos`` and ``k`` at ``k_pos``."""
        length = None
        if self.scaling is not None and self.scaling.dynamic:
            length = torch.maximum(q_pos.amax(-1, keepdim=True), k_pos.amax(-1, keepdim=True)) + 1
        cos_q, sin_q = self.cos_sin(q_pos, length=length)
        cos_k, sin_k = self.cos_sin(k_pos, length=length)
        return (
            apply_rotary(q, cos_q, sin_q, interleaved=self.interleaved),
            apply_rotary(k, cos_k, sin_k, interleaved=self.interleaved),
        )

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        *,
        offset: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """Rotate queries and keys.

        Args:
            q: ``[b, h, n_q, d]``.
            k: ``[b, h, n_k, d]``.
            q_positions: ``[n_q]`` or ``[b, n_q]``; default ``offset + arange(n_q)``.
            k_positions: ``[n_k]`` or ``[b, n_k]``; default ``offset + arange(n_k)``.
            offset: the position of the first token when positions are not given (a
                decoding step at position ``t`` passes ``offset=t``).

        Returns:
            ``(q, k)`` rotated, in their dtypes.

        Raises:
            ValueError: wrong ranks or head dim, positions of the wrong shape.
        """
        for name, x in (("q", q), ("k", k)):
            check.floating(name, x)
            if x.ndim != 4:
                raise ValueError(f"{name} must have shape [b, h, n, d], got shape {tuple(x.shape)}")
            check.last_dim(name, x, self.head_dim, what="head_dim")
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise TypeError(f"offset must be an int, got {offset!r}")
        b = q.shape[0]
        positions = []
        for given, x, name in ((q_positions, q, "q_positions"), (k_positions, k, "k_positions")):
            if given is None:
                positions.append(torch.arange(x.shape[2], device=x.device)[None] + offset)
            else:
                positions.append(
                    check.positions(given, n=x.shape[2], batch=b, name=name, device=x.device)
                )
        return self.rotate(q, k, positions[0], positions[1])

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention whose head dim differs from ``head_dim``."""
        if head_dim != self.head_dim:
            raise ValueError(
                f"Rotary was built for head_dim={self.head_dim} but the attention has "
                f"head_dim={head_dim} (dim / heads); build Rotary({head_dim})"
            )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, "
            f"interleaved={self.interleaved}, scaling={self.scaling}"
        )


class Rotary2D(nn.Module):
    """Axial 2-D RoPE for images: half the channels rotate with the row, half with the column.

    Heo et al. 2024, "Rotary Position Embedding for Vision Transformer" (RoPE-Axial). The
    first ``d/2`` channels are a RoPE of the row index, the last ``d/2`` a RoPE of the
    column index, each with ``inverse_frequencies(d/2, base)`` (the frequency function that
    :class:`~posenc.SinusoidalEncoding2D` uses) and pairs ``(i, i + d/4)`` within its half.
    ``(R q_i) . (R k_j)`` then depends only on ``(row_j - row_i, col_j - col_i)``.

    Tokens are in row-major order: flat index ``p = row * W + col``. The grid ``size``
    given to the constructor (or to :meth:`forward`, or set on ``.size``) tells the width.

    Args:
        head_dim: channels per head, a multiple of 4.
        base: the wavelength base.
        size: ``(H, W)`` of the token grid; needed for the attention hook.

    Raises:
        ValueError: ``head_dim % 4 != 0`` or a bad ``size``.
    """

    def __init__(
        self, head_dim: int, *, base: float = 10000.0, size: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        check.positive_int("head_dim", head_dim)
        if head_dim % 4:
            raise ValueError(
                f"head_dim must be a multiple of 4 for 2-D RoPE (half the channels per axis, "
                f"rotated in pairs), got {head_dim}"
            )
        self.head_dim = head_dim
        self.base = check.positive_float("base", base)
        self.size = None if size is None else _grid(size)

    def _rotate_flat(self, x: Tensor, pos: Tensor, width: int) -> Tensor:
        inv_freq = inverse_frequencies(self.head_dim // 2, self.base, device=pos.device)  # [d/4]
        rows, cols = pos // width, pos % width  # [B', n]
        half = self.head_dim // 2
        out = []
        for part, axis in ((x[..., :half], rows), (x[..., half:], cols)):
            angles = rotary_angles(axis, inv_freq)  # [B', n, d/4]
            out.append(apply_rotary(part, angles.cos(), angles.sin()))
        return torch.cat(out, dim=-1)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The attention hook: positions are flat row-major token indices."""
        if self.size is None:
            raise ValueError(
                "Rotary2D needs the grid size to turn token indices into (row, column): build "
                "it with size=(H, W) or set rotary.size"
            )
        width = self.size[1]
        return self._rotate_flat(q, q_pos, width), self._rotate_flat(k, k_pos, width)

    def forward(
        self, q: Tensor, k: Tensor, size: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Rotate ``q, k [b, h, H*W, d]`` of tokens on an ``(H, W)`` grid (row-major).

        Raises:
            ValueError: no size, or a size whose cells do not match the token count.
        """
        size = self.size if size is None else _grid(size)
        if size is None:
            raise ValueError("pass size=(H, W) (or build Rotary2D with size=)")
        for name, x in (("q", q), ("k", k)):
            check.floating(name, x)
            if x.ndim != 4:
                raise ValueError(
                    f"{name} must have shape [b, h, H*W, d], got shape {tuple(x.shape)}"
                )
            check.last_dim(name, x, self.head_dim, what="head_dim")
            if x.shape[2] != size[0] * size[1]:
                raise ValueError(
                    f"size={size} has {size[0] * size[1]} cells but {name} has {x.shape[2]} "
                    f"tokens; pass the grid the tokens come from"
                )
        pos = torch.arange(size[0] * size[1], device=q.device)[None]
        return self._rotate_flat(q, pos, size[1]), self._rotate_flat(k, pos, size[1])

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention whose head dim differs from ``head_dim``."""
        if head_dim != self.head_dim:
            raise ValueError(
                f"Rotary2D was built for head_dim={self.head_dim} but the attention has "
                f"head_dim={head_dim}; build Rotary2D({head_dim})"
            )

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}, size={self.size}"


def _grid(size: object) -> tuple[int, int]:
    if not isinstance(size, (tuple, list)) or len(size) != 2:
        raise ValueError(f"size must be a pair (H, W), got {size!r}")
    return check.positive_int("size[0]", size[0]), check.positive_int("size[1]", size[1])
