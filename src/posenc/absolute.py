"""Place 1: positional encodings added to the input, ``x + P[pos]``.

Vaswani et al. 2017, "Attention Is All You Need" (sinusoidal); Devlin et al. 2019 / GPT
(learned table); Dosovitskiy et al. 2021 and He et al. 2022 (2-D sin-cos for ViT/MAE).

Shape legend: ``b`` batch, ``n`` sequence length, ``H, W`` feature-map height and width,
``dim`` model width, ``P`` prefix tokens (class token, registers) before a grid of
patches.

Precision: the angles ``p * base**(-2j/dim)`` are computed in float64 and only the
sin/cos values are cast to float32 (then to the input dtype). Plain float32 angles are
off by about 1e-2 at position 100,000, bf16 angles are wrong from position ~256 on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _validate as check
from ._tables import realized

__all__ = [
    "LearnedEncoding",
    "SinusoidalEncoding",
    "SinusoidalEncoding2D",
    "angle_dtype",
    "inverse_frequencies",
    "resample_position_embeddings",
    "sinusoidal",
    "sinusoidal_2d",
    "sinusoidal_shift",
]


def angle_dtype(device: torch.device | str | None) -> torch.dtype:
    """The dtype in which angles are computed on ``device``: float64 where supported."""
    return torch.float32 if torch.device(device or "cpu").type == "mps" else torch.float64


def inverse_frequencies(
    dim: int, base: float = 10000.0, *, device: torch.device | str | None = None
) -> Tensor:
    """The frequencies ``base ** (-2j / dim)`` for ``j = 0 .. dim/2 - 1``.

    One function for every sinusoid in posenc: :func:`sinusoidal`,
    :class:`SinusoidalEncoding2D`, :class:`~posenc.Rotary` and :class:`~posenc.Rotary2D`.

    Args:
        dim: the number of channels the frequencies serve (even).
        base: the wavelength scale (10,000 in the Transformer paper).
        device: where to build the result.

    Returns:
        ``[dim // 2]`` in float64 (float32 on MPS, which has no float64).

    Raises:
        ValueError: ``dim`` is odd or < 2, or ``base`` <= 0.
    """
    check.even_int("dim", dim, why="channels come in (sin, cos) pairs")
    base = check.positive_float("base", base)
    exponents = torch.arange(0, dim, 2, dtype=angle_dtype(device), device=device) / dim  # [dim/2]
    return base**-exponents


def sinusoidal(positions: Tensor, dim: int, *, base: float = 10000.0) -> Tensor:
    """The Transformer's sinusoidal table, interleaved.

    ``P[..., 2j] = sin(p / base**(2j/dim))`` and ``P[..., 2j+1] = cos(p / base**(2j/dim))``
    (Vaswani et al. 2017, section 3.5).

    Args:
        positions: integer or float positions of any shape, e.g. ``[n]`` or ``[b, n]``.
        dim: the encoding width (even).
        base: the wavelength scale.

    Returns:
        ``[*positions.shape, dim]`` float32 (angles computed in float64).

    Raises:
        TypeError: ``positions`` is not a real tensor.
        ValueError: ``dim`` is odd (every frequency needs a sin and a cos column).
    """
    check.tensor("positions", positions)
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must be an integer or float tensor, got {positions.dtype}")
    inv_freq = inverse_frequencies(dim, base, device=positions.device)  # [dim/2]
    angles = positions.to(inv_freq.dtype).unsqueeze(-1) * inv_freq  # [..., dim/2]
    table = torch.stack((angles.sin(), angles.cos()), dim=-1)  # [..., dim/2, 2]
    return realized(table.flatten(-2).float())[0]  # [..., dim]


def sinusoidal_shift(offset: int, dim: int, *, base: float = 10000.0) -> Tensor:
    """The linear map that moves the sinusoidal table by ``offset`` positions.

    ``sinusoidal(p + offset) == M @ sinusoidal(p)`` for every ``p``: ``M`` is block
    diagonal with one 2x2 rotation ``[[cos wk, sin wk], [-sin wk, cos wk]]`` per
    frequency ``w`` (the "relative position as a linear function" remark of Vaswani et
    al. 2017, section 3.5). ``sinusoidal_shift(-k) == sinusoidal_shift(k).T``.

    Args:
        offset: the shift ``k`` (any integer, negative included).
        dim: the encoding width (even).
        base: the wavelength scale.

    Returns:
        ``[dim, dim]`` float32.

    Raises:
        TypeError: ``offset`` is not an int.
        ValueError: ``dim`` is odd.
    """
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {offset!r}")
    angle = offset * inverse_frequencies(dim, base)  # [dim/2], float64
    cos, sin = angle.cos(), angle.sin()
    blocks = torch.stack((torch.stack((cos, sin), -1), torch.stack((-sin, cos), -1)), -2)
    return torch.block_diag(*blocks).float()  # [dim/2, 2, 2] -> [dim, dim]


def sinusoidal_2d(
    size: tuple[int, int], dim: int, *, base: float = 10000.0, device: torch.device | None = None
) -> Tensor:
    """The 2-D sin-cos table of ViT/MAE: rows in the first half of the channels.

    ``P[r, c] = concat(sinusoidal(r, dim/2), sinusoidal(c, dim/2))``. (MAE orders the
    halves width first and writes each half as ``[sin..., cos...]``; posenc keeps the
    interleaved layout of :func:`sinusoidal` and rows first. The set of functions is the
    same; only the channel order differs.)

    Args:
        size: ``(H, W)``.
        dim: the encoding width, a multiple of 4 (two halves of (sin, cos) pairs).
        base: the wavelength scale.
        device: where to build the table.

    Returns:
        ``[H, W, dim]`` float32.

    Raises:
        ValueError: ``dim % 4 != 0`` or a bad ``size``.
    """
    height, width = _size2d(size)
    _dim2d(dim)
    rows = torch.arange(height, device=device)
    cols = torch.arange(width, device=device)
    return _table2d(
        rows[:, None].expand(height, width), cols[None, :].expand(height, width), dim, base
    )


def _size2d(size: object, name: str = "size") -> tuple[int, int]:
    if not isinstance(size, (tuple, list)) or len(size) != 2:
        raise ValueError(f"{name} must be a pair (H, W), got {size!r}")
    return check.positive_int(f"{name}[0]", size[0]), check.positive_int(f"{name}[1]", size[1])


def _dim2d(dim: int) -> int:
    check.positive_int("dim", dim)
    if dim % 4:
        raise ValueError(
            f"dim must be a multiple of 4 for a 2-D encoding (half the channels for rows, "
            f"half for columns, each in (sin, cos) pairs), got {dim}; use {dim + 4 - dim % 4}"
        )
    return dim


def _table2d(rows: Tensor, cols: Tensor, dim: int, base: float) -> Tensor:
    # rows, cols: [..., H, W] -> [..., H, W, dim]
    return torch.cat(
        (sinusoidal(rows, dim // 2, base=base), sinusoidal(cols, dim // 2, base=base)), -1
    )


def _check_input(x: object, dim: int, *, min_ndim: int, layout: str) -> Tensor:
    check.floating("x", x)
    if x.ndim < min_ndim:  # type: ignore[union-attr]
        raise ValueError(f"x must have shape {layout}, got shape {tuple(x.shape)}")  # type: ignore[union-attr]
    check.last_dim("x", x, dim)  # type: ignore[arg-type]
    return x  # type: ignore[return-value]


class SinusoidalEncoding(nn.Module):
    """``x + sinusoidal(positions)``, then dropout (Vaswani et al. 2017).

    No length limit and no stored table: the table is computed for the positions at
    hand, in float64 angles, and cast to the input dtype at the end.

    Args:
        dim: the model width (even).
        dropout: dropout probability applied after the addition (training only).
        base: the wavelength scale.

    Raises:
        ValueError: odd ``dim``, ``dropout`` outside [0, 1), ``base`` <= 0.
    """

    def __init__(self, dim: int, *, dropout: float = 0.0, base: float = 10000.0) -> None:
        super().__init__()
        self.dim = check.even_int("dim", dim, why="every frequency needs a sin and a cos column")
        self.base = check.positive_float("base", base)
        self.dropout = nn.Dropout(check.probability("dropout", dropout))

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Add the encoding.

        Args:
            x: ``[b, n, dim]`` (or ``[n, dim]``).
            positions: ``[n]`` or ``[b, n]`` integer or float positions; default
                ``arange(n)``.

        Returns:
            ``dropout(x + P)``, same shape and dtype as ``x``.
        """
        x = _check_input(x, self.dim, min_ndim=2, layout="[b, n, dim] or [n, dim]")
        n = x.shape[-2]
        if positions is None:
            positions = torch.arange(n, device=x.device)  # [n]
        else:
            batch = x.shape[0] if x.ndim == 3 else None
            positions = check.positions(positions, n=n, batch=batch, integer=False, device=x.device)
            if x.ndim == 2:
                positions = positions[0] if positions.shape[0] == 1 else positions
        table = sinusoidal(positions, self.dim, base=self.base)  # [n, dim] or [b, n, dim]
        return self.dropout(x + table.to(x.dtype))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


class LearnedEncoding(nn.Module):
    """``x + weight[positions]``, then dropout: the learned table of BERT and GPT.

    The table is a parameter ``weight [max_len, dim]`` initialised from
    ``N(0, 0.02**2)`` (BERT's and GPT-2's initialiser). A table cannot encode a position
    it has no row for: a longer sequence raises. :meth:`resize` interpolates the table to
    a new length for fine-tuning on longer sequences.

    Args:
        dim: the model width.
        max_len: the number of positions the table holds.
        dropout: dropout probability applied after the addition (training only).

    Raises:
        ValueError: ``dim`` or ``max_len`` < 1, ``dropout`` outside [0, 1).
    """

    def __init__(self, dim: int, max_len: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.dim = check.positive_int("dim", dim)
        self.max_len = check.positive_int("max_len", max_len)
        self.weight = nn.Parameter(torch.empty(max_len, dim))
        self.dropout = nn.Dropout(check.probability("dropout", dropout))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the table from ``N(0, 0.02**2)``."""
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Add the encoding.

        Args:
            x: ``[b, n, dim]`` (or ``[n, dim]``).
            positions: ``[n]`` or ``[b, n]`` integer positions in ``[0, max_len)``;
                default ``arange(n)``.

        Returns:
            ``dropout(x + weight[positions])``, same shape and dtype as ``x``.

        Raises:
            ValueError: ``n > max_len`` or a position outside ``[0, max_len)``.
            TypeError: float positions.
        """
        x = _check_input(x, self.dim, min_ndim=2, layout="[b, n, dim] or [n, dim]")
        n = x.shape[-2]
        if positions is None:
            if n > self.max_len:
                raise ValueError(
                    f"sequence length {n} exceeds max_len={self.max_len} of this learned table; "
                    f"build LearnedEncoding with max_len >= {n}, call .resize({n}) to interpolate "
                    f"the table, or use SinusoidalEncoding, which has no length limit"
                )
            table = self.weight[:n]  # [n, dim]
        else:
            batch = x.shape[0] if x.ndim == 3 else None
            positions = check.positions(
                positions, n=n, batch=batch, nonnegative=True, device=x.device
            )
            if check._can_inspect(positions) and int(positions.max()) >= self.max_len:
                raise ValueError(
                    f"positions reach {int(positions.max())} but this learned table has max_len="
                    f"{self.max_len} (rows 0..{self.max_len - 1}); build it with a larger max_len "
                    f"or call .resize(new_max_len)"
                )
            table = F.embedding(positions, self.weight)  # [1|b, n, dim]
            if x.ndim == 2:
                table = table[0]
        return self.dropout(x + table.to(x.dtype))

    @torch.no_grad()
    def resize(self, new_max_len: int) -> LearnedEncoding:
        """Interpolate the table linearly along positions to ``new_max_len`` rows.

        Row ``r`` of the new table is the old table at fractional position
        ``r * (max_len - 1) / (new_max_len - 1)``: the first and last rows are kept, and the
        rows between are linear mixes (position interpolation for a learned table). The
        parameter is replaced, so build the optimizer after resizing.

        Args:
            new_max_len: the new number of rows.

        Returns:
            ``self``.
        """
        check.positive_int("new_max_len", new_max_len)
        old = self.weight.detach().float().t().unsqueeze(0)  # [max_len, dim] -> [1, dim, max_len]
        if self.max_len == 1:
            new = old.expand(1, self.dim, new_max_len)
        else:
            new = F.interpolate(old, size=new_max_len, mode="linear", align_corners=True)
        new = new[0].t().contiguous().to(self.weight.dtype)  # [1, dim, new] -> [new, dim]
        self.weight = nn.Parameter(new, requires_grad=self.weight.requires_grad)
        self.max_len = new_max_len
        return self

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_len={self.max_len}"


class SinusoidalEncoding2D(nn.Module):
    """``x + P`` for feature maps ``[b, H, W, dim]``: the 2-D sin-cos of ViT/MAE.

    The first ``dim/2`` channels encode the row with :func:`sinusoidal`, the last
    ``dim/2`` the column (see :func:`sinusoidal_2d`). Any ``H, W``: no stored table.

    Args:
        dim: the model width, a multiple of 4.
        base: the wavelength scale.

    Raises:
        ValueError: ``dim % 4 != 0``.
    """

    def __init__(self, dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        self.dim = _dim2d(dim)
        self.base = check.positive_float("base", base)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Add the encoding.

        Args:
            x: ``[b, H, W, dim]``, exactly rank 4 (a rank-3 ``[b, n, dim]`` sequence and an
                unbatched ``[H, W, dim]`` map look alike, so neither is guessed).
            positions: optional ``[H, W, 2]`` or ``[b or 1, H, W, 2]`` (row, column)
                positions; default the grid ``(r, c)``.

        Returns:
            ``x + P``, same shape and dtype as ``x``.

        Raises:
            TypeError: ``x`` is not a float tensor, ``positions`` is not a tensor.
            ValueError: ``x`` is not rank 4 or its last dimension is not ``dim``;
                ``positions`` of another shape.
        """
        check.floating("x", x)
        if x.ndim != 4:
            raise ValueError(
                f"x must have shape [b, H, W, dim] (rank 4), got shape {tuple(x.shape)}; "
                f"reshape a token sequence [b, H*W, dim] with x.view(b, H, W, dim), and add "
                f"a batch dimension to a single map [H, W, dim] with x.unsqueeze(0)"
            )
        check.last_dim("x", x, self.dim)
        height, width = x.shape[1], x.shape[2]
        if positions is None:
            table = sinusoidal_2d((height, width), self.dim, base=self.base, device=x.device)
        else:
            check.tensor("positions", positions)
            if (
                positions.shape[-3:] != (height, width, 2)
                or positions.ndim not in (3, 4)
                or (positions.ndim == 4 and positions.shape[0] not in (1, x.shape[0]))
            ):
                raise ValueError(
                    f"positions must have shape [H, W, 2] or [b or 1, H, W, 2] with "
                    f"b={x.shape[0]}, H={height}, W={width} (row, column per cell), got shape "
                    f"{tuple(positions.shape)}"
                )
            positions = positions.to(x.device)
            table = _table2d(positions[..., 0], positions[..., 1], self.dim, self.base)
        return x + table.to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


# ----- learned 2-D tables at another resolution ---------------------------------------------------


def _grid_size(name: str, value: object) -> tuple[int, int]:
    """``value`` as ``(H, W)``: an int is a square grid."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be an int or a pair (H, W) of patches, got {value!r}")
    return check.positive_int(f"{name}[0]", value[0]), check.positive_int(f"{name}[1]", value[1])


def resample_position_embeddings(
    table: Tensor,
    new_size: int | tuple[int, int],
    *,
    old_size: int | tuple[int, int] | None = None,
    prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = False,
) -> Tensor:
    """Resample a ViT's learned position embeddings to another grid of patches.

    A ViT fine-tuned at a higher resolution than it was pre-trained at keeps its patch size,
    so it sees a larger grid of patches, for which the learned table has no rows. Dosovitskiy
    et al. 2021 ("An Image is Worth 16x16 Words", section 3.2, "Fine-tuning and higher
    resolution") interpolate the pre-trained embeddings in 2-D, according to their location
    in the image. The table's rows are a ``[P + H*W, dim]`` sequence: ``P`` prefix tokens
    (the class token, DeiT's distillation token, registers) with no place in the grid, kept
    as they are, then the ``H x W`` grid row-major, resampled here to ``new_size`` with
    ``F.interpolate`` (``align_corners=False``: pixel centres at half-integers, as
    transformers' ``ViTEmbeddings.interpolate_pos_encoding``, timm and DINO do).

    Args:
        table: ``[1, P + H*W, dim]`` (a checkpoint's ``position_embeddings``) or
            ``[P + H*W, dim]``, floating point.
        new_size: ``(H', W')`` patches (an int: square).
        old_size: ``(H, W)``, the grid the table was trained for; default a square grid
            from the number of rows.
        prefix_tokens: ``P``, the rows before the grid (1 for a class token; 0 for none).
        mode: ``"bicubic"`` (ViT, DeiT, DINOv2) or ``"bilinear"``.
        antialias: low-pass filter before downsampling (``F.interpolate``'s ``antialias``;
            DINOv2 sets it). With ``"bicubic"`` it changes upsampling too: the antialiased
            kernel is Keys' cubic with ``a = -0.5``, the plain one ``a = -0.75``.

    Returns:
        ``[1, P + H'*W', dim]`` or ``[P + H'*W', dim]`` (``table``'s layout) in ``table``'s
        dtype, computed in float32 (float64 for a float64 table). ``table`` itself when the
        size is unchanged.

    Raises:
        TypeError: ``table`` is not a floating-point tensor, or ``prefix_tokens`` /
            ``antialias`` of the wrong type.
        ValueError: a table of another shape, a bad size or mode, ``old_size`` that does not
            fit the rows, or rows that are not a square grid when ``old_size`` is not given.
    """
    check.floating("table", table)
    if table.ndim not in (2, 3) or (table.ndim == 3 and table.shape[0] != 1):
        raise ValueError(
            f"table must have shape [1, P + H*W, dim] or [P + H*W, dim], got shape "
            f"{tuple(table.shape)}; a batch of tables is resampled one at a time"
        )
    if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int):
        raise TypeError(f"prefix_tokens must be an int, got {prefix_tokens!r}")
    if mode not in ("bilinear", "bicubic"):
        raise ValueError(f"mode must be 'bilinear' or 'bicubic', got {mode!r}")
    if not isinstance(antialias, bool):
        raise TypeError(f"antialias must be a bool, got {antialias!r}")
    tokens, dim = table.shape[-2], table.shape[-1]
    cells = tokens - prefix_tokens
    if prefix_tokens < 0 or cells < 1:
        raise ValueError(
            f"prefix_tokens must be in [0, {tokens - 1}] for a table of {tokens} rows (at "
            f"least one grid row left), got {prefix_tokens}"
        )
    new = _grid_size("new_size", new_size)
    if old_size is None:
        side = math.isqrt(cells)
        if side * side != cells:
            raise ValueError(
                f"the table has {cells} grid rows after prefix_tokens={prefix_tokens}, not a "
                f"square grid; pass old_size=(H, W), or the right prefix_tokens"
            )
        old = (side, side)
    else:
        old = _grid_size("old_size", old_size)
        if old[0] * old[1] != cells:
            raise ValueError(
                f"old_size={old} has {old[0] * old[1]} cells but the table has {cells} grid "
                f"rows ({tokens} rows minus prefix_tokens={prefix_tokens})"
            )
    if new == old:
        return table
    rows = table.reshape(tokens, dim)  # [1, P + H*W, dim] or [P + H*W, dim] -> [P + H*W, dim]
    prefix, grid = rows[:prefix_tokens], rows[prefix_tokens:]  # [P, dim], [H*W, dim]
    work = torch.promote_types(table.dtype, torch.float32)
    # [H*W, dim] -> [1, H, W, dim] -> [1, dim, H, W] (a view: the same channels-last
    # strides as transformers' ViT, so F.interpolate takes the same kernel)
    grid = grid.to(work).reshape(1, *old, dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new, mode=mode, align_corners=False, antialias=antialias)
    # [1, dim, H', W'] -> [1, H', W', dim] -> [H'*W', dim]
    grid = grid.permute(0, 2, 3, 1).reshape(new[0] * new[1], dim).to(table.dtype)
    out = torch.cat((prefix, grid))  # [P + H'*W', dim]
    return out.unsqueeze(0) if table.ndim == 3 else out  # [1, P + H'*W', dim] or as given
