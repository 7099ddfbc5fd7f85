"""Place 2, length-extrapolation research rotations: ``q, k -> R(pos) q, R(pos) k`` with a decay.

- :class:`XPos`: RoPE whose pairs also decay exponentially with the distance (Sun et al.
  2022, "A Length-Extrapolatable Transformer", arXiv 2212.10554; the "Extrapolatable
  Position Embedding" of its Length-Extrapolatable Transformer).

A scheme of place 2 rotates queries and keys before attention (the ``rotate`` hook, as
:class:`~posenc.Rotary`); the rotation, the channel layouts and the frequencies are those
of :mod:`posenc.rotary` (:func:`~posenc.rotary.apply_rotary`,
:func:`~posenc.rotary.rotary_angles`, :func:`~posenc.absolute.inverse_frequencies`).

Shape legend: ``b`` batch, ``h`` heads, ``n`` sequence length, ``d`` head dim (even),
``B'`` 1 or ``b`` (positions shared by the batch or per row).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import _validate as check
from ._tables import realized
from .absolute import angle_dtype, inverse_frequencies
from .rotary import apply_rotary, rotary_angles

__all__ = ["XPos", "xpos_decay", "xpos_scale"]

#: the layouts of ``q, k`` that :meth:`XPos.forward` accepts, and their shapes
_LAYOUTS = {"bhnd": "[b, h, n, d]", "bnhd": "[b, n, h, d]"}


# ----- pure functions ----------------------------------------------------------------------


def xpos_decay(
    head_dim: int, *, gamma: float = 0.4, device: torch.device | str | None = None
) -> Tensor:
    """xPos's decay per channel pair, ``zeta_k = (k / (d/2) + gamma) / (1 + gamma)``.

    ``k = 0 .. d/2 - 1``, so ``gamma / (1 + gamma) <= zeta_k < 1``: the lowest pair (the
    fastest rotation) decays fastest. The official code (microsoft/torchscale,
    ``torchscale/component/xpos_relative_position.py``) writes it
    ``(arange(0, d, 2) + gamma * d) / ((1 + gamma) * d)``, ``gamma = 0.4``.

    Args:
        head_dim: ``d``, even.
        gamma: ``gamma > 0`` (0.4 in the paper).
        device: where to build the result.

    Returns:
        ``[d/2]`` in float64 (float32 on MPS, which has no float64).

    Raises:
        ValueError: odd or non-positive ``head_dim``, ``gamma`` not a finite number > 0.
        TypeError: a non-int ``head_dim``, a non-number ``gamma``.
    """
    check.even_int("head_dim", head_dim, why="channels are rotated in pairs")
    gamma = check.positive_float("gamma", gamma)
    twice_k = torch.arange(0, head_dim, 2, dtype=angle_dtype(device), device=device)  # [d/2]
    return (twice_k / head_dim + gamma) / (1.0 + gamma)


def xpos_scale(
    positions: Tensor, decay: Tensor, scale_base: float, *, inverse: bool = False
) -> Tensor:
    """``decay ** (p / s)`` per position ``p`` and pair, computed as ``exp(p * log(decay) / s)``.

    Args:
        positions: ``[..., n]`` integer (or float) positions.
        decay: ``[d/2]`` the ``zeta_k`` of :func:`xpos_decay` (float64).
        scale_base: ``s > 0``.
        inverse: ``decay ** (-p / s)`` (the keys' factor) instead.

    Returns:
        ``[..., n, d/2]`` in the dtype of ``decay``.
    """
    rate = decay.log() / (-scale_base if inverse else scale_base)  # [d/2]
    return torch.exp(rotary_angles(positions, rate))  # [..., n, d/2]


# ----- module ----------------------------------------------------------------------------------


class XPos(nn.Module):
    """xPos: RoPE with a per-pair exponential decay of the distance (Sun et al. 2022).

    Sun, Dong, Patra, Ma, Huang, Benhaim, Chaudhary, Song, Wei 2022, "A Length-Extrapolatable
    Transformer" (arXiv 2212.10554, ACL 2023). Each channel pair ``k`` of a query at
    position ``m`` is rotated by ``m * theta_k`` and scaled by ``zeta_k ** (m / s)``; each
    pair of a key at position ``n`` is rotated by ``n * theta_k`` and scaled by the inverse,
    ``zeta_k ** (-n / s)``. Written with each pair as a complex number ``q~_k``, ``k~_k``,
    the score of the rotated vectors is

        ``(R q)_m . (R k)_n = Re[sum_k q~_k conj(k~_k) zeta_k^((m - n)/s) e^(i (m - n) theta_k)]``

    with ``theta_k = base ** (-2k/d)`` (RoPE's), ``zeta_k = (k / (d/2) + gamma) / (1 +
    gamma)`` (:func:`xpos_decay`), ``gamma = 0.4`` and the scale base ``s = 512``: a function
    of ``m - n`` alone, like RoPE's, that decays with the distance of a key behind its
    query (``m > n``), fastest on the fastest-rotating pairs. The official code
    (microsoft/torchscale) pairs channels ``(2k, 2k+1)`` ("rotate_every_two"), the default
    here; ``interleaved=False`` pairs ``(k, k + d/2)`` instead (a permutation of the
    channels: the same scores on permuted projections).

    The factors are absolute: ``zeta_k ** (+-p / s)`` of the position ``p`` alone, computed
    in float64 and cast last. The official code centres the positions of each call instead
    (it shifts them by half the length), which its scores do not see (the shift cancels in
    ``m - n``) but keys rotated at one call and read at a later one would:
    :class:`~posenc.KVCache` stores keys rotated, so the factors here must not depend on the
    call. Being relative, the scheme gives the same scores when every position moves by
    the same amount: explicit ``positions`` may be centred to double the range below.

    Range: the factor of a position ``p`` is as large as ``(1/zeta_0) ** (|p|/s)`` (keys at
    ``p > 0``, queries at ``p < 0``; ``1/zeta_0 = (1 + gamma)/gamma = 3.5``) and the other
    side as small as its inverse. Both stay normal numbers of the dtype of ``q`` and ``k``
    for ``|p| <= s * ln(1/tiny) / ln(1/zeta_0)`` (:meth:`max_position`), with ``s = 512``:
    35,694 for float32 and bfloat16, 3,966 for float16, 289,519 for float64. Within it the
    scores are exact up to the rounding of their largest terms (near the bound, elements
    below 1 on the shrunk side become subnormal numbers, whose rounding is that of
    ``tiny``; in float16 the grown side reaches ``1/tiny = 2**14``, so values up to
    ``65504 / 2**14 = 4`` stay finite). Past it the shrunk side loses its digits, then
    vanishes, and the grown side soon overflows to ``inf`` (NaN scores); a larger
    ``scale_base`` (a slower decay) lengthens the range in proportion. :meth:`rotate` and :meth:`forward` raise for positions past it
    where the positions can be read (not on the meta device, nor inside ``torch.compile``).

    Causal models: the paper trains causal language models. Without a causal mask, a key
    ``n > m`` after the query is amplified by ``zeta_k ** ((m - n)/s) > 1`` (by 3.5 on the
    lowest pair at ``n - m = s``, exponentially more further on): allowed, but outside what
    the paper evaluates. The paper's blockwise causal attention at inference is a matter of
    the mask, not of this module.

    Args:
        head_dim: channels per head ``d`` (even).
        scale_base: ``s``, the distance over which a pair decays by a factor ``zeta_k``
            (512 in the paper and its code).
        gamma: ``gamma > 0`` of ``zeta_k`` (0.4 in the paper and its code).
        base: the wavelength base of the rotation (10,000, RoPE's).
        interleaved: pairs ``(2k, 2k+1)`` (the official code) if True, else ``(k, k + d/2)``.

    Raises:
        ValueError: an odd or non-positive ``head_dim``; ``scale_base``, ``gamma`` or
            ``base`` not a finite number > 0.
        TypeError: a non-int ``head_dim``, a non-number ``scale_base``, ``gamma`` or ``base``.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        scale_base: float = 512.0,
        gamma: float = 0.4,
        base: float = 10000.0,
        interleaved: bool = True,
    ) -> None:
        super().__init__()
        self.head_dim = check.even_int("head_dim", head_dim, why="channels are rotated in pairs")
        self.scale_base = check.positive_float("scale_base", scale_base)
        self.gamma = check.positive_float("gamma", gamma)
        self.base = check.positive_float("base", base)
        self.interleaved = bool(interleaved)

    @property
    def supports_cache(self) -> bool:
        """True: the factors of a position do not depend on the call (see the class)."""
        return True

    def max_position(self, dtype: torch.dtype = torch.float32) -> int:
        """The largest ``|position|`` whose factors are normal numbers of ``dtype``.

        ``floor(s * ln(1/tiny) / ln((1 + gamma)/gamma))`` with ``tiny`` the smallest normal
        number of ``dtype``: 35,694 for float32 and bfloat16, 3,966 for float16 at the
        defaults.

        Args:
            dtype: the floating dtype of the queries and keys.

        Returns:
            The bound, an int.

        Raises:
            TypeError: ``dtype`` is not a floating-point dtype.
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(
                f"dtype must be a floating-point torch.dtype (the dtype of q and k), got {dtype!r}"
            )
        reach = math.log(1.0 / torch.finfo(dtype).tiny) / math.log((1.0 + self.gamma) / self.gamma)
        return math.floor(self.scale_base * reach)

    def _check_range(self, what: str, positions: Tensor, dtype: torch.dtype) -> None:
        """Raise when a position's factors leave the normal range of ``dtype``."""
        if not check._can_inspect(positions):
            return
        limit = self.max_position(dtype)
        low, high = (int(v) for v in torch.aminmax(positions))
        worst = max(-low, high)
        if worst <= limit:
            return
        bad = low if -low > high else high
        needed = math.ceil(self.scale_base * worst / limit)
        raise ValueError(
            f"{what} holds position {bad}, but XPos(scale_base={self.scale_base:g}, gamma="
            f"{self.gamma:g}) scales a {dtype} position p by zeta ** (+-p / scale_base), which "
            f"stays within {dtype}'s normal numbers for |p| <= {limit} (max_position); pass "
            f"positions within that (the scores are relative: moving every position by the "
            f"same amount leaves them unchanged, so positions may be centred), build XPos "
            f"with scale_base >= {needed}, or compute in float32 or float64"
        )

    def cos_sin(self, positions: Tensor, *, keys: bool = False) -> tuple[Tensor, Tensor]:
        """cos and sin of the rotation, times the decay factor, in float64 (float32 on MPS).

        Args:
            positions: ``[B', n]`` positions.
            keys: the keys' factor ``zeta ** (-p / s)`` if True, else the queries'
                ``zeta ** (p / s)``.

        Returns:
            ``(cos * factor, sin * factor)``, each ``[B', n, d/2]``.
        """
        device = positions.device
        inv_freq = inverse_frequencies(self.head_dim, self.base, device=device)  # [d/2]
        angles = rotary_angles(positions, inv_freq)  # [B', n, d/2]
        decay = xpos_decay(self.head_dim, gamma=self.gamma, device=device)  # [d/2]
        factor = xpos_scale(positions, decay, self.scale_base, inverse=keys)  # [B', n, d/2]
        return realized(angles.cos() * factor, angles.sin() * factor)  # [B', n, d/2], cast later

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The attention hook: rotate and scale ``q [b,h,n_q,d]`` at ``q_pos`` and ``k`` at
        ``k_pos``.

        Args:
            q: ``[b, h, n_q, d]``.
            k: ``[b, h_kv, n_k, d]``.
            q_pos: ``[B', n_q]`` integer positions.
            k_pos: ``[B', n_k]`` likewise.

        Returns:
            ``(q, k)`` rotated and scaled, in their dtypes.

        Raises:
            ValueError: a position past :meth:`max_position` for the dtype of ``q`` or
                ``k`` (checked where values can be read).
        """
        return self._rotate(q, k, q_pos, k_pos, layout="bhnd", names=("q_pos", "k_pos"))

    def _rotate(
        self,
        q: Tensor,
        k: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        *,
        layout: str,
        names: tuple[str, str],
    ) -> tuple[Tensor, Tensor]:
        """The rotation of :meth:`rotate` and :meth:`forward`, for either ``layout``."""
        self._check_range(names[0], q_pos, q.dtype)
        if k_pos is not q_pos or k.dtype != q.dtype:
            self._check_range(names[1], k_pos, k.dtype)
        cos_q, sin_q = self.cos_sin(q_pos)  # [B', n_q, d/2]
        cos_k, sin_k = self.cos_sin(k_pos, keys=True)  # [B', n_k, d/2]
        if layout == "bnhd":  # [B', n, d/2] -> [B', n, 1, d/2], the heads after the sequence
            cos_q, sin_q, cos_k, sin_k = (t.unsqueeze(2) for t in (cos_q, sin_q, cos_k, sin_k))
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
        layout: str = "bhnd",
    ) -> tuple[Tensor, Tensor]:
        """Rotate and scale queries and keys, as :meth:`posenc.Rotary.forward` rotates them.

        Args:
            q: ``[b, h, n_q, d]`` (or ``[b, n_q, h, d]`` with ``layout="bnhd"``).
            k: ``[b, h, n_k, d]`` (or ``[b, n_k, h, d]`` with ``layout="bnhd"``).
            q_positions: ``[n_q]`` or ``[b, n_q]``; default ``offset + arange(n_q)``.
            k_positions: ``[n_k]`` or ``[b, n_k]``; default ``offset + arange(n_k)``.
            offset: the position of the first token when positions are not given.
            layout: ``"bhnd"`` (heads before the sequence: SDPA, HF) or ``"bnhd"`` (the
                sequence before the heads: flash-attn, torchtune).

        Returns:
            ``(q, k)`` rotated and scaled, in their shapes, layout and dtypes.

        Raises:
            ValueError: an unknown ``layout``, wrong ranks or head dim, positions that do
                not match the sequence axis, a position past :meth:`max_position`.
            TypeError: non-float ``q`` or ``k``, a non-int ``offset``, float positions.
        """
        if not isinstance(layout, str) or layout not in _LAYOUTS:
            raise ValueError(
                f"layout must be 'bhnd' (q and k as [b, h, n, d], the default) or 'bnhd' "
                f"([b, n, h, d], as flash-attn and torchtune), got {layout!r}"
            )
        for name, x in (("q", q), ("k", k)):
            check.floating(name, x)
            if x.ndim != 4:
                raise ValueError(
                    f"{name} must have shape {_LAYOUTS[layout]} (layout={layout!r}), got shape "
                    f"{tuple(x.shape)}"
                )
            check.last_dim(name, x, self.head_dim, what="head_dim")
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise TypeError(f"offset must be an int, got {offset!r}")
        axis = 2 if layout == "bhnd" else 1
        positions = []
        for given, x, name in ((q_positions, q, "q"), (k_positions, k, "k")):
            n = x.shape[axis]
            if given is None:
                positions.append(torch.arange(n, device=x.device)[None] + offset)  # [1, n]
                continue
            positions.append(
                check.positions(
                    given, n=n, batch=q.shape[0], name=f"{name}_positions", device=x.device
                )
            )
        names = ("q_positions", "k_positions")
        if q_positions is None and k_positions is None:
            names = (f"positions offset={offset} + arange(n)",) * 2
        return self._rotate(q, k, positions[0], positions[1], layout=layout, names=names)

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention whose head dim differs from ``head_dim``."""
        if head_dim != self.head_dim:
            raise ValueError(
                f"XPos was built for head_dim={self.head_dim} but the attention has "
                f"head_dim={head_dim} (dim / heads); build XPos({head_dim})"
            )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, scale_base={self.scale_base}, gamma={self.gamma}, "
            f"base={self.base}, interleaved={self.interleaved}"
        )
