"""Place 2: rotary embeddings over several coordinates: RoPE-Mixed and N-D RoPE.

A token has ``N`` coordinates (an image patch its row and column, a video patch its frame,
row and column); each channel pair of ``q`` and ``k`` is rotated by an angle that is a
linear function of them, so that ``(R q_i) . (R k_j)`` depends only on the coordinate
differences ``c_j - c_i``.

- :class:`RotaryMixed`: Heo et al. 2024, "Rotary Position Embedding for Vision
  Transformer" (ECCV 2024, arXiv 2403.13298), RoPE-Mixed: pair ``t`` of head ``h`` turns
  by ``theta_x[h, t] * x + theta_y[h, t] * y`` with learned frequencies, ``(x, y)`` the
  patch's column and row.
- :class:`RotaryND`: RoPE with a share of the channel pairs per axis: ``style="axial"``
  gives each axis its own frequency ladder (:class:`~posenc.Rotary2D` for two axes);
  ``style="mrope"`` is Qwen2-VL's M-RoPE (Wang et al. 2024, "Qwen2-VL: Enhancing
  Vision-Language Model's Perception of the World at Any Resolution", arXiv 2409.12191),
  where the axes share out the frequencies of one 1-D RoPE.

Inside :class:`~posenc.MultiHeadAttention` (the ``rotate`` hook) positions are flat indices:
``P = prefix_tokens`` tokens that are not rotated (CLS, registers), then the grid cells in
row-major order (the last axis fastest). ``rotate_at`` takes the coordinates themselves
(M-RoPE's text tokens, packed images of several sizes).

Shape legend: ``b`` batch, ``h`` heads, ``n`` tokens, ``d`` head dim, ``F = d/2`` rotated
channel pairs, ``B'`` 1 or ``b`` (positions shared by the batch or per row), ``N`` axes,
``S_0 .. S_{N-1}`` the grid (``size``), ``P`` prefix tokens (``n = P + S_0 * ... * S_{N-1}``
for a whole grid).

Precision: angles in float64 (float32 on MPS), the rotation in float32 (float64 for
float64 inputs), the result cast to the input dtype, as in :mod:`posenc.rotary`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from . import _validate as check
from ._tables import realized
from .absolute import angle_dtype, inverse_frequencies
from .rotary import apply_rotary, check_grid_positions, rotary_angles

__all__ = [
    "STYLES",
    "RotaryMixed",
    "RotaryND",
    "grid_coordinates",
    "mixed_angles",
    "mixed_frequencies",
]

#: the frequency layouts of :class:`RotaryND`
STYLES = ("axial", "mrope")

#: the layouts of ``q, k`` that the standalone methods accept, and their shapes
_LAYOUTS = {"bhnd": "[b, h, n, d]", "bnhd": "[b, n, h, d]"}


# ----- pure functions ----------------------------------------------------------------------


def grid_coordinates(cells: Tensor, size: Sequence[int]) -> Tensor:
    """Row-major cell indices -> their coordinates on a grid of ``size`` (last axis fastest).

    Args:
        cells: ``[*S]`` integer cell indices in ``[0, prod(size))``.
        size: ``(S_0, ..., S_{N-1})``.

    Returns:
        ``[*S, N]``: ``cells = sum_a coords[..., a] * prod(size[a+1:])``.
    """
    coords = []
    rest = cells
    for extent in reversed(size[1:]):
        coords.append(rest % extent)
        rest = rest // extent
    coords.append(rest)
    return torch.stack(coords[::-1], dim=-1)  # N x [*S] -> [*S, N]


def mixed_frequencies(head_dim: int, angles: Tensor, base: float = 10.0) -> Tensor:
    """RoPE-Mixed's initial frequencies (naver-ai/rope-vit, ``init_random_2d_freqs``).

    Pair ``t < d/4`` of head ``h`` points at ``angles[h]``, pair ``t + d/4`` a quarter turn
    further, each with the magnitude ``base ** (-4t/d)``:
    ``theta_x = m cos(phi)``, ``theta_y = m sin(phi)`` with ``phi = angles[h]`` or
    ``angles[h] + pi/2``.

    Args:
        head_dim: ``d``, a multiple of 4.
        angles: ``[h]`` one direction per head (the official code draws ``U(0, 2 pi)``).
        base: the wavelength base (10 in the paper's RoPE-Mixed ViTs).

    Returns:
        ``[2, h, d/2]`` in the angle dtype: ``[0]`` the x (column) frequencies, ``[1]`` the
        y (row) ones.
    """
    magnitude = inverse_frequencies(head_dim // 2, base, device=angles.device)  # [d/4]
    phi = angles.to(magnitude.dtype)[:, None]  # [h] -> [h, 1]
    phi = torch.cat(
        (phi.expand(-1, head_dim // 4), phi.expand(-1, head_dim // 4) + math.pi / 2), -1
    )
    magnitude = torch.cat((magnitude, magnitude))  # [d/4] -> [d/2]
    return torch.stack((magnitude * phi.cos(), magnitude * phi.sin()))  # [2, h, d/2]


def mixed_angles(x: Tensor, y: Tensor, freqs: Tensor) -> Tensor:
    """RoPE-Mixed's angles ``theta_x[h, t] * x + theta_y[h, t] * y``.

    Args:
        x: ``[B', n]`` columns.
        y: ``[B', n]`` rows.
        freqs: ``[2, h, F]`` (x frequencies, y frequencies).

    Returns:
        ``[B', h, n, F]`` in the dtype of ``freqs``.
    """
    fx, fy = freqs[0][:, None], freqs[1][:, None]  # [h, F] -> [h, 1, F]
    x = x.to(freqs.dtype)[:, None, :, None]  # [B', n] -> [B', 1, n, 1]
    y = y.to(freqs.dtype)[:, None, :, None]
    return x * fx + y * fy  # [B', h, n, F]


# ----- the grid, shared by both schemes --------------------------------------------------------


class _GridRotary(nn.Module):
    """Flat positions to grid coordinates, prefix tokens, ``forward`` and ``rotate_at``;
    a subclass sets ``head_dim``, ``size``, ``prefix_tokens`` and defines ``_tables`` and
    ``_rotated``."""

    head_dim: int
    size: tuple[int, ...] | None
    prefix_tokens: int
    axis_names: tuple[str, ...]

    def _tables(self, coords: Tensor) -> tuple[Tensor, ...]:
        """``(cos, sin)`` of the angles at ``coords [B', n, N]``."""
        raise NotImplementedError

    def _rotated(self, name: str, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate ``x [b, h, n, d]`` (``name``: ``"q"`` or ``"k"``, for messages) by the
        tables of :meth:`_tables`."""
        raise NotImplementedError

    def _rotate_at(self, name: str, x: Tensor, coords: Tensor) -> Tensor:
        """Rotate ``x [b, h, n, d]`` at ``coords [B', n, N]``."""
        return self._rotated(name, x, *self._tables(coords))

    def _flat_tables(
        self, pos: Tensor, size: tuple[int, ...]
    ) -> tuple[tuple[Tensor, ...], Tensor | None]:
        """The rotation at flat positions ``pos [B', n]``, for :meth:`_rotate_flat`: the
        :meth:`_tables` of their coordinates, and the prefix tokens' mask ``[B', 1, n, 1]``
        (None without prefix tokens)."""
        cell = pos - self.prefix_tokens  # [B', n] row-major cell index, < 0 for prefix tokens
        coords = grid_coordinates(cell.clamp(min=0) if self.prefix_tokens else cell, size)
        prefix = (cell < 0)[:, None, :, None] if self.prefix_tokens else None  # [B', 1, n, 1]
        return self._tables(coords), prefix

    def _rotate_flat(
        self, name: str, x: Tensor, tables: tuple[tuple[Tensor, ...], Tensor | None]
    ) -> Tensor:
        """Rotate ``x [b, h, n, d]`` by the :meth:`_flat_tables` of its positions; prefix
        tokens pass unchanged."""
        (cos, sin), prefix = tables
        rotated = self._rotated(name, x, cos, sin)
        if prefix is None:
            return rotated
        return torch.where(prefix, x, rotated)  # prefix tokens exactly unchanged

    def _check_positions(self, what: str, pos: Tensor, size: tuple[int, ...]) -> None:
        """Raise when a position falls outside the prefix tokens and the grid."""
        check_grid_positions(type(self).__name__, what, pos, size, self.prefix_tokens)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The attention hook: positions are flat indices of the prefix tokens and the grid.

        Args:
            q: ``[b, h, n_q, d]``.
            k: ``[b, h_kv, n_k, d]``.
            q_pos: ``[B', n_q]`` integer positions in ``[0, P + prod(size))``.
            k_pos: ``[B', n_k]`` likewise.

        Returns:
            ``(q, k)`` rotated, in their dtypes.

        Raises:
            ValueError: no ``size``, or a position outside ``[0, P + prod(size))``
                (checked where values can be read: not on the meta device nor while
                compiling).
        """
        if self.size is None:
            raise ValueError(
                f"{type(self).__name__} needs the grid size to turn token indices into "
                f"coordinates: build it with size=({', '.join(self.axis_names)}) or set "
                f".size"
            )
        size = _sizes(self.size, self.axis_names)
        self._check_positions("query", q_pos, size)
        if k_pos is not q_pos:
            self._check_positions("key", k_pos, size)
        tables = self._flat_tables(q_pos, size)
        # self-attention at the same positions: the same tables
        k_tables = tables if k_pos is q_pos else self._flat_tables(k_pos, size)
        return self._rotate_flat("q", q, tables), self._rotate_flat("k", k, k_tables)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        size: Sequence[int] | None = None,
        *,
        layout: str = "bhnd",
    ) -> tuple[Tensor, Tensor]:
        """Rotate the queries and keys of one whole grid (after the prefix tokens).

        Args:
            q: ``[b, h, P + prod(size), d]`` (or ``[b, n, h, d]`` with ``layout="bnhd"``).
            k: same layout and token count as ``q``.
            size: the grid for this call (another resolution); default the constructor's
                ``size``, which is left as it is.
            layout: ``"bhnd"`` (the default) or ``"bnhd"``.

        Returns:
            ``(q, k)`` rotated, in their shapes, layout and dtypes.

        Raises:
            ValueError: no size, an unknown ``layout``, wrong ranks or head dim, a token
                count other than ``P + prod(size)``.
            TypeError: non-float ``q`` or ``k``.
        """
        layout = _layout(layout)
        size = self.size if size is None else size
        if size is None:
            raise ValueError(
                f"{type(self).__name__}.forward needs the grid size: pass size=("
                f"{', '.join(self.axis_names)}) or build the module with size="
            )
        size = _sizes(size, self.axis_names)
        total = self.prefix_tokens + math.prod(size)
        q, k = (self._as_bhnd(name, x, layout) for name, x in (("q", q), ("k", k)))
        for name, x in (("q", q), ("k", k)):
            if x.shape[2] != total:
                raise ValueError(
                    f"{name} has {x.shape[2]} tokens (shape {tuple(x.shape)} as [b, h, n, d]) "
                    f"but size={size} with prefix_tokens={self.prefix_tokens} needs {total} = "
                    f"{self.prefix_tokens} + {'*'.join(map(str, size))}; pass the size of the "
                    f"grid the tokens come from (and layout='bnhd' for [b, n, h, d])"
                )
        pos = torch.arange(total, device=q.device)[None]  # [1, P + prod(size)]
        tables = self._flat_tables(pos, size)  # q and k: the same positions
        out = (self._rotate_flat(name, x, tables) for name, x in (("q", q), ("k", k)))
        rq, rk = (x.transpose(1, 2) if layout == "bnhd" else x for x in out)
        return rq, rk

    def rotate_at(
        self,
        q: Tensor,
        k: Tensor,
        q_coords: Tensor,
        k_coords: Tensor,
        *,
        layout: str = "bhnd",
    ) -> tuple[Tensor, Tensor]:
        """Rotate queries and keys at explicit coordinates (no grid, no prefix tokens).

        Every token is rotated by its coordinates; zero coordinates rotate by nothing.
        M-RoPE gives a text token at position ``p`` the coordinates ``(p, p, p)``.

        Args:
            q: ``[b, h, n_q, d]`` (or ``[b, n_q, h, d]`` with ``layout="bnhd"``).
            k: ``[b, h_kv, n_k, d]`` likewise.
            q_coords: ``[n_q, N]`` or ``[B', n_q, N]``, integer or float, in the order of
                ``size``'s axes.
            k_coords: ``[n_k, N]`` or ``[B', n_k, N]``.
            layout: ``"bhnd"`` (the default) or ``"bnhd"``.

        Returns:
            ``(q, k)`` rotated, in their shapes, layout and dtypes.

        Raises:
            ValueError: an unknown ``layout``, wrong ranks, head dim or coordinate shapes.
            TypeError: non-float ``q`` or ``k``, non-tensor or bool/complex coordinates.
        """
        layout = _layout(layout)
        q, k = (self._as_bhnd(name, x, layout) for name, x in (("q", q), ("k", k)))
        out = []
        for name, x, coords in (("q", q, q_coords), ("k", k, k_coords)):
            coords = self._check_coords(f"{name}_coords", coords, x)
            out.append(self._rotate_at(name, x, coords))
        rq, rk = (x.transpose(1, 2) if layout == "bnhd" else x for x in out)
        return rq, rk

    def _as_bhnd(self, name: str, x: object, layout: str) -> Tensor:
        """``x`` checked (a float ``[b, h, n, d]`` tensor in ``layout``) as ``[b, h, n, d]``."""
        check.floating(name, x)
        if x.ndim != 4:  # type: ignore[union-attr]
            raise ValueError(
                f"{name} must have shape {_LAYOUTS[layout]} (layout={layout!r}), got shape "
                f"{tuple(x.shape)}"  # type: ignore[union-attr]
            )
        check.last_dim(name, x, self.head_dim, what="head_dim")  # type: ignore[arg-type]
        return x.transpose(1, 2) if layout == "bnhd" else x  # type: ignore[union-attr]

    def _check_coords(self, name: str, coords: object, x: Tensor) -> Tensor:
        """``coords`` as ``[B', n, N]`` on ``x``'s device, or raise."""
        check.tensor(name, coords)
        c: Tensor = coords  # type: ignore[assignment]
        if c.dtype == torch.bool or c.is_complex():
            raise TypeError(f"{name} must be an integer or float tensor, got dtype {c.dtype}")
        axes = len(self.axis_names)
        if c.ndim == 2:
            c = c[None]  # [n, N] -> [1, n, N]
        b, n = x.shape[0], x.shape[2]
        if c.ndim != 3 or c.shape[1:] != (n, axes) or c.shape[0] not in (1, b):
            raise ValueError(
                f"{name} must have shape [n, N] or [B', n, N] with n={n} tokens, N={axes} "
                f"coordinates ({', '.join(self.axis_names)}) and B' 1 or b={b}, got shape "
                f"{tuple(coords.shape)}"  # type: ignore[union-attr]
            )
        return c.to(x.device)


# ----- RoPE-Mixed ------------------------------------------------------------------------------


class RotaryMixed(_GridRotary):
    """RoPE-Mixed: 2-D RoPE with learned frequencies per head mixing the two axes.

    Heo et al. 2024, "Rotary Position Embedding for Vision Transformer" (ECCV 2024, arXiv
    2403.13298), RoPE-Mixed: channel pair ``t`` of head ``h`` is rotated by the angle
    ``theta_x[h, t] * x + theta_y[h, t] * y``, ``(x, y)`` the patch's column and row, with
    the frequencies learned. Pairs are adjacent channels ``(2t, 2t+1)`` (the official
    code's ``view_as_complex``). The scores depend on ``(x_j - x_i, y_j - y_i)`` only.

    The parameter ``freqs [2, heads, d/2]`` (``[0]`` x, ``[1]`` y) is the official
    per-layer ``init_random_2d_freqs`` output; the official ViT keeps all layers in one
    ``[2, depth, heads * d/2]`` tensor (``freqs.view(2, depth, heads, d/2)[:, layer]`` is one
    layer's). Initialised as there (:func:`mixed_frequencies`): per head a direction
    ``phi ~ U(0, 2 pi)``, pairs ``t < d/4`` along it and pairs ``t + d/4`` at
    ``phi + pi/2``, magnitudes ``base ** (-4t/d)``.

    Tokens are a row-major ``H x W`` grid after ``P = prefix_tokens`` tokens that are not
    rotated (the official ViT leaves its CLS token unrotated: ``prefix_tokens=1``). The
    grid ``size`` is the default; :meth:`forward` takes another per call, the attention
    hook reads ``.size``, which may be set. A position outside ``[0, P + H*W)`` raises.

    Each head rotates its queries and keys with its own frequencies, so keys shared by
    several query heads (grouped-query attention) cannot be rotated: use ``kv_heads=heads``.
    The angles are computed in float64 from ``freqs``, but ``freqs`` is a parameter:
    ``module.to(torch.bfloat16)`` rounds the frequencies themselves.

    Args:
        head_dim: ``d``, a multiple of 4.
        heads: ``h``, the attention's heads.
        base: the wavelength base of the initial magnitudes (the official RoPE-Mixed ViTs
            use 10).
        size: ``(H, W)`` of the token grid; needed for the attention hook.
        prefix_tokens: ``P``, the tokens in front of the grid that are not rotated.

    Raises:
        ValueError: ``head_dim % 4 != 0``, a bad ``size``, ``prefix_tokens < 0``.
        TypeError: non-int ``head_dim``, ``heads`` or ``prefix_tokens``.
    """

    axis_names = ("H", "W")

    def __init__(
        self,
        head_dim: int,
        heads: int,
        *,
        base: float = 10.0,
        size: Sequence[int] | None = None,
        prefix_tokens: int = 0,
    ) -> None:
        super().__init__()
        check.positive_int("head_dim", head_dim)
        if head_dim % 4:
            raise ValueError(
                f"head_dim must be a multiple of 4 for RoPE-Mixed (pairs of channels, half of "
                f"them a quarter turn from the other half), got {head_dim}"
            )
        self.head_dim = head_dim
        self.heads = check.positive_int("heads", heads)
        self.base = check.positive_float("base", base)
        self.size = None if size is None else _sizes(size, self.axis_names)
        self.prefix_tokens = _prefix(prefix_tokens)
        self.freqs = nn.Parameter(torch.empty(2, heads, head_dim // 2))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the official initialisation: a random direction per head."""
        with torch.no_grad():
            angles = torch.rand(self.heads, device=self.freqs.device) * 2 * math.pi  # [h]
            self.freqs.copy_(mixed_frequencies(self.head_dim, angles, self.base))

    def _tables(self, coords: Tensor) -> tuple[Tensor, ...]:
        dtype = torch.promote_types(self.freqs.dtype, angle_dtype(coords.device))
        angles = mixed_angles(coords[..., 1], coords[..., 0], self.freqs.to(dtype))
        return realized(angles.cos(), angles.sin())  # each [B', h, n, d/2]

    def _rotated(self, name: str, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if x.shape[1] != self.heads:
            raise ValueError(
                f"RotaryMixed has frequencies for heads={self.heads} but {name} has "
                f"{x.shape[1]} heads (shape {tuple(x.shape)}); each head rotates with its own "
                f"frequencies, so keys shared by several query heads cannot be rotated for "
                f"each: use kv_heads=heads, or build RotaryMixed(head_dim, {x.shape[1]})"
            )
        # a 4-D cos broadcasts over [b, h, n, d/2]: one angle per head
        return apply_rotary(x, cos, sin, interleaved=True)

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention with other heads or another head dim."""
        if heads != self.heads or head_dim != self.head_dim:
            raise ValueError(
                f"RotaryMixed was built for heads={self.heads}, head_dim={self.head_dim} but "
                f"the attention has heads={heads}, head_dim={head_dim}; build "
                f"RotaryMixed({head_dim}, {heads})"
            )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, heads={self.heads}, base={self.base}, size={self.size}, "
            f"prefix_tokens={self.prefix_tokens}"
        )


# ----- N-D RoPE: axial and M-RoPE --------------------------------------------------------------


class RotaryND(_GridRotary):
    """RoPE over ``N`` axes, each axis rotating ``axes[a]`` channel pairs with its coordinate.

    ``axes`` counts channel pairs (frequencies) per axis, as Qwen2-VL's ``mrope_section``
    (``[16, 24, 24]`` for the time, height and width of ``head_dim=128``); they must add up
    to ``d/2``. Two layouts of the frequencies and channels (``style``):

    - ``"axial"``: axis ``a`` owns a block of ``2 * axes[a]`` consecutive channels, pairs
      ``(i, i + axes[a])`` within the block (half-split), with its own ladder
      ``inverse_frequencies(2 * axes[a], base)``: each axis is a 1-D RoPE of its coordinate
      (:class:`~posenc.Rotary2D` is ``RotaryND(d, (d/4, d/4))``; Heo et al. 2024's
      RoPE-Axial).
    - ``"mrope"``: Qwen2-VL's M-RoPE (Wang et al. 2024, arXiv 2409.12191, as HF
      transformers' ``Qwen2VLRotaryEmbedding``): one 1-D ladder
      ``inverse_frequencies(d, base)``; frequency ``j`` is taken by the axis whose section
      covers it (the first ``axes[0]`` by axis 0, and so on), and pairs are ``(j, j + d/2)``
      over the whole head (Llama's ``rotate_half``). Equal coordinates on every axis give
      the 1-D RoPE of that position (M-RoPE's text tokens).

    Tokens inside attention are a row-major grid of ``size = (S_0, ..., S_{N-1})`` (the last
    axis fastest: a video ``(T, H, W)`` frame by frame) after ``prefix_tokens`` that are not
    rotated; ``size`` may be set or given per :meth:`forward` call, and a position outside
    the prefix and the grid raises. :meth:`rotate_at` takes explicit coordinates.

    Args:
        head_dim: ``d`` (even).
        axes: channel pairs per axis, positive ints adding up to ``d/2``.
        base: the wavelength base (Qwen2-VL: 1,000,000).
        size: the grid, one extent per axis; needed for the attention hook.
        prefix_tokens: tokens in front of the grid that are not rotated.
        style: ``"axial"`` or ``"mrope"``.

    Raises:
        ValueError: odd ``head_dim``, ``axes`` empty, non-positive or not adding up to
            ``d/2``, a ``size`` of another length, ``prefix_tokens < 0``, an unknown
            ``style``.
        TypeError: non-int ``head_dim``, ``axes`` entries or ``prefix_tokens``.
    """

    def __init__(
        self,
        head_dim: int,
        axes: Sequence[int],
        *,
        base: float = 10000.0,
        size: Sequence[int] | None = None,
        prefix_tokens: int = 0,
        style: str = "axial",
    ) -> None:
        super().__init__()
        self.head_dim = check.even_int("head_dim", head_dim, why="channels are rotated in pairs")
        self.axes = _axes(axes, head_dim)
        self.axis_names = tuple(f"S_{a}" for a in range(len(self.axes)))
        self.base = check.positive_float("base", base)
        if style not in STYLES:
            raise ValueError(
                f"style must be 'axial' (a frequency ladder per axis) or 'mrope' (Qwen2-VL's "
                f"sections of one ladder), got {style!r}"
            )
        self.style = style
        self.size = None if size is None else _sizes(size, self.axis_names)
        self.prefix_tokens = _prefix(prefix_tokens)

    def angles(self, coords: Tensor) -> Tensor:
        """The rotation angle of each channel pair at the given coordinates.

        ``"mrope"``: angle ``j`` is ``coords[..., axis(j)] * base ** (-2j/d)``, ``axis(j)``
        the axis whose section covers ``j``. ``"axial"``: axis ``a``'s ``axes[a]`` angles
        one after the other, angle ``i`` of axis ``a`` being
        ``coords[..., a] * base ** (-2i / (2 * axes[a]))``.

        Args:
            coords: ``[B', n, N]`` integer or float coordinates, in the order of ``size``.

        Returns:
            ``[B', n, d/2]`` in float64 (float32 on MPS).
        """
        device = coords.device
        if self.style == "mrope":
            inv_freq = inverse_frequencies(self.head_dim, self.base, device=device)  # [d/2]
            owner = [a for a, pairs in enumerate(self.axes) for _ in range(pairs)]
            owner_index = torch.tensor(owner, device=device)  # [d/2] the axis of each frequency
            return coords.to(inv_freq.dtype).index_select(-1, owner_index) * inv_freq
        parts = [
            rotary_angles(coords[..., a], inverse_frequencies(2 * pairs, self.base, device=device))
            for a, pairs in enumerate(self.axes)
        ]  # N x [B', n, axes[a]]
        return torch.cat(parts, -1)  # [B', n, d/2]

    def _tables(self, coords: Tensor) -> tuple[Tensor, ...]:
        angles = self.angles(coords)  # [B', n, d/2]
        return realized(angles.cos(), angles.sin())

    def _rotated(self, name: str, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.style == "mrope":
            return apply_rotary(x, cos, sin)  # pairs (j, j + d/2)
        out, start = [], 0
        for pairs in self.axes:  # each axis a half-split RoPE on its own block of channels
            block = x[..., 2 * start : 2 * (start + pairs)]  # [b, h, n, 2 * axes[a]]
            end = start + pairs
            out.append(apply_rotary(block, cos[..., start:end], sin[..., start:end]))
            start = end
        return torch.cat(out, -1)

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention whose head dim differs from ``head_dim``."""
        if head_dim != self.head_dim:
            raise ValueError(
                f"RotaryND was built for head_dim={self.head_dim} but the attention has "
                f"head_dim={head_dim}; build RotaryND({head_dim}, axes) with axes adding up "
                f"to {head_dim // 2}"
            )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, axes={self.axes}, base={self.base}, style={self.style!r}, "
            f"size={self.size}, prefix_tokens={self.prefix_tokens}"
        )


# ----- argument checks -------------------------------------------------------------------------


def _sizes(size: object, names: tuple[str, ...]) -> tuple[int, ...]:
    """``size`` as a tuple of ``len(names)`` positive ints, or raise."""
    if not isinstance(size, (tuple, list)) or len(size) != len(names):
        raise ValueError(
            f"size must be a tuple of {len(names)} extents ({', '.join(names)}), one per axis, "
            f"got {size!r}"
        )
    return tuple(check.positive_int(f"size[{i}]", s) for i, s in enumerate(size))


def _axes(axes: object, head_dim: int) -> tuple[int, ...]:
    """``axes`` as a tuple of positive ints adding up to ``head_dim / 2``, or raise."""
    if not isinstance(axes, (tuple, list)) or not axes:
        raise ValueError(
            f"axes must be a non-empty tuple of channel pairs per axis (e.g. Qwen2-VL's "
            f"mrope_section (16, 24, 24) for head_dim=128), got {axes!r}"
        )
    axes = tuple(check.positive_int(f"axes[{i}]", a) for i, a in enumerate(axes))
    if 2 * sum(axes) != head_dim:
        raise ValueError(
            f"axes counts channel pairs per axis and must add up to head_dim/2={head_dim // 2}, "
            f"got {axes} (sum {sum(axes)}); e.g. ({head_dim // 4}, {head_dim // 2 - head_dim // 4})"
        )
    return axes


def _prefix(prefix_tokens: object) -> int:
    """``prefix_tokens`` if it is an int >= 0, else raise."""
    if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int):
        raise TypeError(
            f"prefix_tokens must be an int (the CLS/register tokens in front of the grid, which "
            f"are not rotated), got {prefix_tokens!r} ({type(prefix_tokens).__name__})"
        )
    if prefix_tokens < 0:
        raise ValueError(
            f"prefix_tokens must be >= 0 (the CLS/register tokens in front of the grid), got "
            f"{prefix_tokens}; pass 0 when every token is a grid cell"
        )
    return prefix_tokens


def _layout(layout: object) -> str:
    """``layout`` if it is one of ``_LAYOUTS``, else raise ``ValueError``."""
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(
            f"layout must be 'bhnd' (q and k as [b, h, n, d], the default) or 'bnhd' "
            f"([b, n, h, d]), got {layout!r}"
        )
    return layout
