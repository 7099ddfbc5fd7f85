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
(NTK-by-parts plus an attention temperature), :class:`Llama3Scaling` (Llama 3.1's frequency
bands), :class:`LongRoPEScaling` (per-frequency factors, Phi-3).

Tensor layouts: inside :class:`~posenc.MultiHeadAttention` (the ``rotate`` hook) queries and
keys are always ``[b, h, n, d]``. The standalone ``forward`` of :class:`Rotary` and
:class:`Rotary2D` takes ``layout="bhnd"`` (the default, PyTorch's SDPA and HF) or
``layout="bnhd"`` (``[b, n, h, d]``, flash-attn and torchtune); nothing in the shape tells
the two apart, so name the layout rather than transposing by hand.

Shape legend: ``b`` batch, ``h`` heads, ``n`` sequence length, ``d`` head dim,
``r`` rotated channels (``rotary_dim``, even, ``<= d``), ``B'`` 1 or ``b`` (positions
shared by the batch or per row), ``H, W`` the token grid of :class:`Rotary2D`, ``P`` its
prefix tokens (``n = P + H*W``).

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
from ._rotary_runs import rotate_runs
from ._tables import realized
from .absolute import inverse_frequencies
from .rotary_scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    NTKScaling,
    RotaryScaling,
    YaRNScaling,
)

__all__ = [
    "DynamicNTKScaling",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPEScaling",
    "NTKScaling",
    "Rotary",
    "Rotary2D",
    "RotaryScaling",
    "YaRNScaling",
    "apply_rotary",
    "check_grid_positions",
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
        x: ``[b, h, n, d]`` (or ``[b, n, h, d]`` with a 4-D ``cos``).
        cos: ``[b or 1, n, r/2]`` or ``[n, r/2]`` for ``x [b, h, n, d]``;
            ``[b or 1, n, 1, r/2]`` for ``x [b, n, h, d]``. float32 or float64.
        sin: same shape as ``cos``.
        interleaved: pairs ``(2i, 2i+1)`` if True, else ``(i, i + r/2)``.

    Returns:
        ``x``'s shape and dtype.
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
                f"scaling must be a RotaryScaling (LinearScaling, NTKScaling, DynamicNTKScaling, "
                f"YaRNScaling, Llama3Scaling, LongRoPEScaling) or None, got "
                f"{type(scaling).__name__}"
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
        return realized(angles.cos() * factor, angles.sin() * factor)  # cast by apply_rotary

    def hf_cos_sin(
        self,
        positions: Tensor,
        *,
        dtype: torch.dtype = torch.float32,
        layout: str | None = None,
    ) -> tuple[Tensor, Tensor]:
        """cos and sin in HF transformers' layouts, for a model's ``apply_rotary_pos_emb``.

        Args:
            positions: ``[n]`` or ``[B', n]`` integer positions (HF's ``position_ids``).
            dtype: the dtype of the result (HF casts to the dtype of ``q``).
            layout: how the ``r/2`` angles fill the ``r`` channels:

                - ``"half"``: ``cat(angles, angles)``, as Llama's ``rotate_half`` pairs
                  channels ``(i, i + r/2)``;
                - ``"interleaved"``: each angle twice in place,
                  ``repeat_interleave(angles, 2)``, as the rotary embeddings of HF's models
                  that pair channels ``(2i, 2i+1)`` (Cohere) give them;
                - None (default): ``"interleaved"`` for ``interleaved=True``, else
                  ``"half"``.

                Some HF models that pair ``(2i, 2i+1)`` (GLM, Helium, Ernie 4.5) take
                ``"half"`` and interleave it in their ``apply_rotary_pos_emb``.

        Returns:
            ``(cos, sin)``, each ``[B', n, r]``, times the attention factor. HF's
            partial-rotary models (Phi-3, GPT-NeoX) rotate ``cos.shape[-1]`` channels;
            Llama's ``apply_rotary_pos_emb`` needs ``r = d``.

        Raises:
            ValueError: an unknown ``layout``, positions of the wrong rank.
            TypeError: non-tensor or float positions.
        """
        if layout is None:
            layout = "interleaved" if self.interleaved else "half"
        if layout not in ("half", "interleaved"):
            raise ValueError(
                f"layout must be 'half' (cat(angles, angles)), 'interleaved' (each angle twice "
                f"in place) or None (the Rotary's own: interleaved={self.interleaved}), got "
                f"{layout!r}"
            )
        check.tensor("positions", positions)
        n = positions.shape[-1] if positions.ndim else 0
        positions = check.positions(positions, n=n, name="positions")  # [B', n]
        length = None
        if self.scaling is not None and self.scaling.dynamic and positions.shape[-1]:
            length = positions.amax(-1, keepdim=True) + 1  # [B', 1], as in _rotate
        cos, sin = self.cos_sin(positions, length=length)  # [B', n, r/2]
        if layout == "interleaved":
            cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        else:
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        return cos.to(dtype), sin.to(dtype)  # [B', n, r]

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The attention hook: rotate ``q [b,h,n_q,d]`` at ``q_pos`` and ``k`` at ``k_pos``."""
        return self._rotate(q, k, q_pos, k_pos, layout="bhnd")

    def _rotate(
        self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, *, layout: str
    ) -> tuple[Tensor, Tensor]:
        """The rotation of :meth:`rotate` and :meth:`forward`, for either ``layout``."""
        length = None
        if self.scaling is not None and self.scaling.dynamic:
            # the longest position seen (an empty side, n = 0, has none)
            ends = [p.amax(-1, keepdim=True) for p in (q_pos, k_pos) if p.shape[-1]]
            if ends:
                length = (torch.maximum(*ends) if len(ends) == 2 else ends[0]) + 1  # [B', 1]
        # runs of positions: tables kept between calls (not with a scaling, nor a cos_sin
        # of a subclass's or the instance's, which the call's tables follow)
        plain = type(self).cos_sin is Rotary.cos_sin and "cos_sin" not in vars(self)
        if self.scaling is None and plain:
            rotated = rotate_runs(
                q, k, q_pos, k_pos, self.rotary_dim, self.base, self.interleaved,
                heads_after=layout == "bnhd",
            )  # fmt: skip
            if rotated is not None:
                return rotated
        work = torch.promote_types(q.dtype, torch.float32)  # what apply_rotary computes in
        cos_q, sin_q = (t.to(work) for t in self.cos_sin(q_pos, length=length))  # [B', n_q, r/2]
        if k_pos is q_pos:  # self-attention at the same positions: the same angles
            cos_k, sin_k = cos_q, sin_q
        else:
            cos_k, sin_k = (
                t.to(work) for t in self.cos_sin(k_pos, length=length)
            )  # [B', n_k, r/2]
        if layout == "bnhd":  # [B', n, r/2] -> [B', n, 1, r/2], the heads after the sequence
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
        """Rotate queries and keys.

        Args:
            q: ``[b, h, n_q, d]`` (or ``[b, n_q, h, d]`` with ``layout="bnhd"``).
            k: ``[b, h, n_k, d]`` (or ``[b, n_k, h, d]`` with ``layout="bnhd"``).
            q_positions: ``[n_q]`` or ``[b, n_q]``; default ``offset + arange(n_q)``.
            k_positions: ``[n_k]`` or ``[b, n_k]``; default ``offset + arange(n_k)``.
            offset: the position of the first token when positions are not given (a
                decoding step at position ``t`` passes ``offset=t``).
            layout: ``"bhnd"`` (heads before the sequence: SDPA, HF) or ``"bnhd"`` (the
                sequence before the heads: flash-attn, torchtune). The positions run along
                the sequence axis of this layout.

        Returns:
            ``(q, k)`` rotated, in their shapes, layout and dtypes.

        Raises:
            ValueError: an unknown ``layout``, wrong ranks or head dim, positions that do
                not match the sequence axis of ``layout``.
            TypeError: non-float ``q`` or ``k``, a non-int ``offset``, float positions.
        """
        layout = _layout(layout)
        for name, x in (("q", q), ("k", k)):
            _check_qk(name, x, self.head_dim, layout)
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise TypeError(f"offset must be an int, got {offset!r}")
        b, axis = q.shape[0], _seq_axis(layout)
        positions = []
        for given, x, name in ((q_positions, q, "q"), (k_positions, k, "k")):
            n = x.shape[axis]
            if given is None:
                positions.append(torch.arange(n, device=x.device)[None] + offset)  # [1, n]
                continue
            check.tensor(f"{name}_positions", given)
            if given.ndim in (1, 2) and given.shape[-1] != n:
                hint = _layout_hint(name, x, layout, given.shape[-1])
                if hint:
                    raise ValueError(
                        f"{name}_positions has {given.shape[-1]} positions but {name} of shape "
                        f"{tuple(x.shape)} has n={n} tokens on the sequence axis of "
                        f"layout={layout!r} {_LAYOUTS[layout]}{hint}"
                    )
            positions.append(
                check.positions(given, n=n, batch=b, name=f"{name}_positions", device=x.device)
            )
        return self._rotate(q, k, positions[0], positions[1], layout=layout)

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


def check_grid_positions(
    owner: str, what: str, pos: Tensor, size: tuple[int, ...], prefix_tokens: int
) -> None:
    """Raise when a flat position falls outside ``prefix_tokens`` and a row-major grid.

    The grid rotaries (:class:`Rotary2D`, :class:`~posenc.RotaryMixed`,
    :class:`~posenc.RotaryND`) read position ``t >= P`` as the cell ``t - P`` of ``size``;
    a position past the grid would wrap into rows it does not have. Checked where the
    values can be read (not under ``torch.compile``).

    Args:
        owner: the scheme's class name, for the message.
        what: ``"query"`` or ``"key"``.
        pos: integer positions, any shape.
        size: the grid.
        prefix_tokens: ``P``, the tokens in front of the grid.

    Raises:
        ValueError: a position below 0 or at least ``P + prod(size)``, with the fix.
    """
    if not check._can_inspect(pos):
        return
    total = prefix_tokens + math.prod(size)
    low, high = (int(v) for v in torch.aminmax(pos))
    if low >= 0 and high < total:
        return
    cells = "*".join(map(str, size))
    shape = "(H, W)" if len(size) == 2 else f"(one size per axis: {len(size)})"
    raise ValueError(
        f"{what} positions reach {low if low < 0 else high} but {owner}(size={size}, "
        f"prefix_tokens={prefix_tokens}) has positions 0..{total - 1} ({prefix_tokens} prefix "
        f"tokens, then {cells} grid cells in row-major order), so the rows would wrap past the "
        f"grid; set size={shape} to the grid the tokens come from, prefix_tokens= to the "
        f"number of CLS/register tokens in front of it, or pass positions within 0..{total - 1}"
    )


class Rotary2D(nn.Module):
    """Axial 2-D RoPE for images: half the channels rotate with the row, half with the column.

    Heo et al. 2024, "Rotary Position Embedding for Vision Transformer" (RoPE-Axial). The
    first ``d/2`` channels are a RoPE of the row index, the last ``d/2`` a RoPE of the
    column index, each with ``inverse_frequencies(d/2, base)`` (the frequency function that
    :class:`~posenc.SinusoidalEncoding2D` uses) and pairs ``(i, i + d/4)`` within its half.
    ``(R q_i) . (R k_j)`` then depends only on ``(row_j - row_i, col_j - col_i)``.

    Tokens are in row-major order after ``P = prefix_tokens`` tokens that are not rotated
    (a CLS token and register tokens in front of the patches, as EVA-02 and DINOv2-style
    ViTs keep them): token ``t >= P`` is the cell ``row = (t - P) // W``,
    ``col = (t - P) % W``, and ``n = P + H*W``. The grid ``size`` given to the constructor
    is the default; :meth:`forward` takes another one per call (another image resolution),
    and the attention hook reads ``.size``, which may be set.

    Inside :class:`~posenc.MultiHeadAttention` the positions index this flattened sequence:
    a KV cache decodes a grid in raster order (positions ``t, t+1, ...``), and explicit
    positions (per-row, packed images) give the cells directly. A position outside
    ``[0, P + H*W)`` raises instead of wrapping into the next row. The hook cannot tell a
    first part of the grid (a decoding prefix) from a grid of another size: fewer tokens
    than ``P + H*W`` at positions ``0, 1, ...`` are read as the first cells in row-major
    order. :meth:`forward`, which sees whole grids, requires ``n == P + H*W`` exactly.

    Args:
        head_dim: channels per head, a multiple of 4.
        base: the wavelength base.
        size: ``(H, W)`` of the token grid; needed for the attention hook.
        prefix_tokens: ``P``, the number of tokens in front of the grid that are not
            rotated (1 for a CLS token, ``1 + registers`` with register tokens).

    Raises:
        ValueError: ``head_dim % 4 != 0``, a bad ``size``, ``prefix_tokens < 0``.
        TypeError: a non-int ``prefix_tokens``.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        size: tuple[int, int] | None = None,
        prefix_tokens: int = 0,
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
        self.prefix_tokens = _prefix(prefix_tokens)

    def _flat_tables(
        self, pos: Tensor, width: int, layout: str = "bhnd"
    ) -> tuple[tuple[Tensor, ...], Tensor | None]:
        """The rotation at flat positions ``pos [B', n]``, for :meth:`_rotate_flat`:
        ``((cos_rows, sin_rows, cos_cols, sin_cols), prefix)``, the tables ``[B', n, d/4]``
        (``[B', n, 1, d/4]`` for ``layout="bnhd"``) and the prefix tokens' mask ``[B', 1,
        n, 1]`` (``[B', n, 1, 1]``), None without prefix tokens."""
        inv_freq = inverse_frequencies(self.head_dim // 2, self.base, device=pos.device)  # [d/4]
        cell = pos - self.prefix_tokens  # [B', n] row-major cell index, < 0 for prefix tokens
        grid = cell.clamp(min=0) if self.prefix_tokens else cell
        tables = []
        for axis in (grid // width, grid % width):  # rows, columns: [B', n]
            angles = rotary_angles(axis, inv_freq)  # [B', n, d/4]
            if layout == "bnhd":
                angles = angles.unsqueeze(2)  # [B', n, d/4] -> [B', n, 1, d/4]
            tables += [angles.cos(), angles.sin()]
        if not self.prefix_tokens:
            return realized(*tables), None
        prefix = (cell < 0)[:, :, None, None]  # [B', n] -> [B', n, 1, 1]
        if layout == "bhnd":
            prefix = prefix.transpose(1, 2)  # [B', n, 1, 1] -> [B', 1, n, 1]
        return realized(*tables), prefix

    def _rotate_flat(self, x: Tensor, tables: tuple[tuple[Tensor, ...], Tensor | None]) -> Tensor:
        """Rotate ``x [b, h, n, d]`` (or ``[b, n, h, d]``) by the :meth:`_flat_tables` of its
        positions; prefix tokens pass unchanged."""
        (cos_rows, sin_rows, cos_cols, sin_cols), prefix = tables
        half = self.head_dim // 2
        rows = apply_rotary(x[..., :half], cos_rows, sin_rows)  # [..., d/2]
        rotated = torch.cat((rows, apply_rotary(x[..., half:], cos_cols, sin_cols)), dim=-1)
        if prefix is None:
            return rotated
        return torch.where(prefix, x, rotated)  # prefix tokens exactly unchanged

    def _check_positions(self, what: str, pos: Tensor, size: tuple[int, int]) -> None:
        """Raise when a position falls outside the prefix tokens and the grid."""
        check_grid_positions("Rotary2D", what, pos, size, self.prefix_tokens)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The attention hook: positions are flat indices of the prefix tokens and the grid.

        Args:
            q: ``[b, h, n_q, d]``.
            k: ``[b, h, n_k, d]``.
            q_pos: ``[B', n_q]`` integer positions in ``[0, P + H*W)``.
            k_pos: ``[B', n_k]`` likewise.

        Returns:
            ``(q, k)`` rotated, in their dtypes.

        Raises:
            ValueError: no ``size``, or a position outside ``[0, P + H*W)`` (checked where
                values can be read: not on the meta device nor while compiling).
        """
        if self.size is None:
            raise ValueError(
                "Rotary2D needs the grid size to turn token indices into (row, column): build "
                "it with size=(H, W) or set rotary.size"
            )
        size = _grid(self.size)
        self._check_positions("query", q_pos, size)
        if k_pos is not q_pos:
            self._check_positions("key", k_pos, size)
        tables = self._flat_tables(q_pos, size[1])
        # self-attention at the same positions: the same tables
        k_tables = tables if k_pos is q_pos else self._flat_tables(k_pos, size[1])
        return self._rotate_flat(q, tables), self._rotate_flat(k, k_tables)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        size: tuple[int, int] | None = None,
        *,
        layout: str = "bhnd",
    ) -> tuple[Tensor, Tensor]:
        """Rotate the queries and keys of one whole grid (after the prefix tokens).

        Args:
            q: ``[b, h, P + H*W, d]`` (or ``[b, P + H*W, h, d]`` with ``layout="bnhd"``).
            k: same layout and token count as ``q``.
            size: ``(H, W)`` for this call (another image resolution); default the
                constructor's ``size``, which is left as it is.
            layout: ``"bhnd"`` (the default) or ``"bnhd"``, as for :meth:`Rotary.forward`.

        Returns:
            ``(q, k)`` rotated, in their shapes, layout and dtypes.

        Raises:
            ValueError: no size, an unknown ``layout``, wrong ranks or head dim, a token
                count other than ``prefix_tokens + H*W``.
            TypeError: non-float ``q`` or ``k``.
        """
        layout = _layout(layout)
        size = self.size if size is None else _grid(size)
        if size is None:
            raise ValueError(
                "Rotary2D.forward needs the grid size to turn token indices into (row, column): "
                "pass size=(H, W) or build Rotary2D(head_dim, size=(H, W))"
            )
        total = self.prefix_tokens + size[0] * size[1]
        axis = _seq_axis(layout)
        for name, x in (("q", q), ("k", k)):
            _check_qk(name, x, self.head_dim, layout)
            if x.shape[axis] != total:
                raise ValueError(
                    f"{name} has {x.shape[axis]} tokens on the sequence axis of layout="
                    f"{layout!r} {_LAYOUTS[layout]} (shape {tuple(x.shape)}) but size={size} "
                    f"with prefix_tokens={self.prefix_tokens} needs {total} = "
                    f"{self.prefix_tokens} + {size[0]}*{size[1]}; pass the size=(H, W) of the "
                    f"grid the tokens come from, and prefix_tokens= for CLS/register tokens in "
                    f"front of it{_layout_hint(name, x, layout, total)}"
                )
        pos = torch.arange(total, device=q.device)[None]  # [1, P + H*W]
        width = size[1]
        tables = self._flat_tables(pos, width, layout)  # q and k: the same positions
        return self._rotate_flat(q, tables), self._rotate_flat(k, tables)

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention whose head dim differs from ``head_dim``."""
        if head_dim != self.head_dim:
            raise ValueError(
                f"Rotary2D was built for head_dim={self.head_dim} but the attention has "
                f"head_dim={head_dim}; build Rotary2D({head_dim})"
            )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, base={self.base}, size={self.size}, "
            f"prefix_tokens={self.prefix_tokens}"
        )


def _grid(size: object) -> tuple[int, int]:
    if not isinstance(size, (tuple, list)) or len(size) != 2:
        raise ValueError(f"size must be a pair (H, W), got {size!r}")
    return check.positive_int("size[0]", size[0]), check.positive_int("size[1]", size[1])


#: the layouts of ``q, k`` that the standalone ``forward`` accepts, and their shapes
_LAYOUTS = {"bhnd": "[b, h, n, d]", "bnhd": "[b, n, h, d]"}


def _layout(layout: object) -> str:
    """Return ``layout`` if it is one of ``_LAYOUTS``, else raise ``ValueError``."""
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(
            f"layout must be 'bhnd' (q and k as [b, h, n, d], the default) or 'bnhd' "
            f"([b, n, h, d], as flash-attn and torchtune), got {layout!r}"
        )
    return layout


def _seq_axis(layout: str) -> int:
    """The sequence axis of ``q`` and ``k`` in ``layout`` (the heads axis is the other one)."""
    return 2 if layout == "bhnd" else 1


def _check_qk(name: str, x: object, head_dim: int, layout: str) -> Tensor:
    """Raise unless ``x`` is a float tensor of rank 4 with last dimension ``head_dim``."""
    check.floating(name, x)
    if x.ndim != 4:  # type: ignore[union-attr]
        raise ValueError(
            f"{name} must have shape {_LAYOUTS[layout]} (layout={layout!r}), got shape "
            f"{tuple(x.shape)}"  # type: ignore[union-attr]
        )
    check.last_dim(name, x, head_dim, what="head_dim")  # type: ignore[arg-type]
    return x  # type: ignore[return-value]


def _layout_hint(name: str, x: Tensor, layout: str, count: int) -> str:
    """``; pass layout=...`` when ``count`` tokens fit the heads axis of ``x`` instead."""
    other = "bnhd" if layout == "bhnd" else "bhnd"
    if x.shape[3 - _seq_axis(layout)] != count:
        return ""
    return (
        f"; {name} has {count} on its heads axis: if it is {_LAYOUTS[other]}, pass layout={other!r}"
    )


def _prefix(prefix_tokens: object) -> int:
    """Return ``prefix_tokens`` if it is an int >= 0, else raise."""
    if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int):
        raise TypeError(
            f"prefix_tokens must be an int (the number of CLS/register tokens in front of the "
            f"grid, which are not rotated), got {prefix_tokens!r} ({type(prefix_tokens).__name__})"
        )
    if prefix_tokens < 0:
        raise ValueError(
            f"prefix_tokens must be >= 0 (the number of CLS/register tokens in front of the "
            f"grid), got {prefix_tokens}; pass 0 when every token is a grid cell"
        )
    return prefix_tokens
