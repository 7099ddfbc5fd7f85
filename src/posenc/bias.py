"""Place 3: content-free biases added to the scores, ``s_ij += B[h, i, j]``.

- :class:`RelativePositionBias`: Swin's learned table over 2-D (or 1-D) window offsets
  (Liu et al. 2021, "Swin Transformer"), in Swin's layout so checkpoints load as they are.
- :class:`T5RelativeBias`: T5's learned bias per log-spaced distance bucket (Raffel et al.
  2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
  Transformer").
- :class:`ALiBi`: a fixed linear penalty ``-slope_h * |j - i|`` (Press et al. 2022, "Train
  Short, Test Long"), defined in :mod:`posenc.alibi` and re-exported here.

Each is an ``nn.Module`` usable on its own (``forward`` returns the dense bias), and a
scheme for :class:`~posenc.MultiHeadAttention`. Each writes one primitive, the bias of an
offset (:class:`~posenc.families.OffsetBias`: ALiBi, T5, 1-D Swin) or of a 2-D offset
(:class:`~posenc.families.GridBias`: 2-D Swin); the family derives the hooks from it:
``score_bias`` (the bias for any query and key positions, added *after* the
``1/sqrt(d)`` scaling), ``offset_bias`` / ``grid_bias`` (the forms of the per-offset and
grid fast paths) and ``flex_score_mod`` (the same bias computed on the fly by
FlexAttention).

Shape legend: ``B'`` batch of positions (1 when shared), ``h`` heads, ``n_q`` queries,
``n_k`` keys, ``N = Wh * Ww`` tokens of a window, ``R`` rows of a table.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _validate as check
from ._memo import memo
from .alibi import ALiBi, alibi_slopes
from .families import GridBias, OffsetBias
from .families.biases import _KEPT_RUN, _own_bias, _run_of
from .indices import (
    _known_run,
    position_extremes,
    select_rows,
    t5_bucket,
    toeplitz,
    value_range,
    window_relative_index,
    window_size,
)

__all__ = [
    "ALiBi",
    "RelativePositionBias",
    "RelativePositionBias1D",
    "RelativePositionBias2D",
    "T5RelativeBias",
    "alibi_slopes",
    "load_relative_position_bias",
    "resize_relative_position_table",
]


def _check_heads(scheme: str, built: int, heads: int) -> None:
    if heads != built:
        raise ValueError(
            f"{scheme} was built for heads={built} but the attention has heads={heads}; "
            f"build it with heads={heads}"
        )


def _check_range(name: str, pos: Tensor, stop: int, what: str) -> None:
    if not check._can_inspect(pos):
        return
    low, high = value_range(pos)
    if low < 0 or high >= stop:
        raise ValueError(f"{name} must be in [0, {stop}) ({what}), got values from {low} to {high}")


# ----- Swin ------------------------------------------------------------------------------------


def _table_grid(window: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(2 * w - 1 for w in window)


def resize_relative_position_table(
    table: Tensor, old_window: int | tuple[int, int], new_window: int | tuple[int, int]
) -> Tensor:
    """Interpolate a Swin table ``[(2Wh-1)*(2Ww-1), heads]`` to another window.

    The table is a function on the grid of offsets ``(dr, dc)``; it is resampled bicubically
    over that grid (``F.interpolate``, ``align_corners=False``, as timm does for Swin
    fine-tuning at a new window size), linearly for 1-D windows. The same window returns
    the table unchanged.

    Args:
        table: ``[R, heads]``.
        old_window: the window the table was trained for.
        new_window: the window to produce.

    Returns:
        ``[R', heads]`` in ``table``'s dtype.

    Raises:
        ValueError: the table's length does not fit ``old_window``, or the windows differ
            in dimension.
    """
    old, new = window_size(old_window, "old_window"), window_size(new_window, "new_window")
    if len(old) != len(new):
        raise ValueError(f"old_window {old} and new_window {new} must both be 1-D or both 2-D")
    old_grid, new_grid = _table_grid(old), _table_grid(new)
    if table.ndim != 2 or table.shape[0] != math.prod(old_grid):
        raise ValueError(
            f"table must have shape [{math.prod(old_grid)}, heads] for window {old}, got shape "
            f"{tuple(table.shape)}"
        )
    if old == new:
        return table
    heads = table.shape[1]
    grid = table.float().t().reshape(1, heads, *old_grid)  # [R, h] -> [1, h, 2Wh-1, 2Ww-1]
    mode = "bicubic" if len(old) == 2 else "linear"
    resized = F.interpolate(grid, size=new_grid, mode=mode, align_corners=False)
    return resized.reshape(heads, -1).t().contiguous().to(table.dtype)  # [R', h]


class RelativePositionBias(nn.Module):
    """Swin's relative position bias: one learned value per (window offset, head).

    ``B[h, i, j] = table[index[i, j], h]`` with Swin's index (query minus key,
    :func:`~posenc.relative_position_index`), so a Swin checkpoint's
    ``relative_position_bias_table`` loads as it is. Tokens are numbered row-major inside
    the window. The table is initialised from a truncated ``N(0, 0.02**2)`` (Swin).

    ``RelativePositionBias(window, heads)`` builds a :class:`RelativePositionBias1D` for a
    1-D window (an :class:`~posenc.families.OffsetBias`: the bias of ``j - i``, any
    positions within the window of each other) and a :class:`RelativePositionBias2D` for a
    2-D one (a :class:`~posenc.families.GridBias`: token indices of the window); both are
    instances of this class, which holds what they share (the table, :meth:`resize`, the
    standalone :meth:`forward`).

    A 2-D window keeps Swin's index ``[N, N]`` as the non-persistent buffer ``index``. A
    1-D window keeps no index: its bias ``table[i - j + W - 1]`` is constant along each
    diagonal, read from the ``2W - 1`` rows directly (:func:`~posenc.indices.toeplitz`), so
    the module's state is ``O(W)``, not ``O(W**2)`` (an int64 ``[4096, 4096]`` index would
    be 128 MB).

    Args:
        window: ``W`` (1-D) or ``(Wh, Ww)``.
        heads: number of heads.

    Raises:
        ValueError: a bad window or head count.
    """

    #: the window's dimension a subclass handles
    dims: int = 0

    def __new__(cls, *args: object, **kwargs: object) -> RelativePositionBias:
        if cls is RelativePositionBias:  # pick the family from the window's dimension
            window = window_size(args[0] if args else kwargs.get("window"))
            cls = RelativePositionBias1D if len(window) == 1 else RelativePositionBias2D
        return super().__new__(cls)

    def __init__(self, window: int | tuple[int, int], heads: int) -> None:
        super().__init__()
        self.window = window_size(window)
        if len(self.window) != self.dims:
            raise ValueError(
                f"{type(self).__name__} takes a {self.dims}-D window, got window={window!r}; "
                f"build RelativePositionBias(window, heads), which picks the class"
            )
        self.heads = check.positive_int("heads", heads)
        self.table = nn.Parameter(torch.empty(math.prod(_table_grid(self.window)), heads))
        if len(self.window) == 2:
            self.register_buffer("index", torch.empty(0, dtype=torch.long), persistent=False)
        self.reset_parameters()

    @property
    def tokens(self) -> int:
        """``N``: the number of tokens in a window."""
        return math.prod(self.window)

    def reset_parameters(self) -> None:
        """Draw the table from a truncated ``N(0, 0.02**2)`` and rebuild the index (2-D)."""
        nn.init.trunc_normal_(self.table, std=0.02)
        self._build_index()

    def _build_index(self) -> None:
        if len(self.window) == 1:
            return  # no index: forward reads the table's rows along the diagonals
        tokens = torch.arange(self.tokens, device=self.table.device)
        self.index = window_relative_index(tokens, tokens, self.window)  # [N, N]

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        # The index is derived and not saved. Rebuild it with the loaded table, so that a
        # module built on the meta device and then loaded (after ``to_empty``, or with
        # ``load_state_dict(assign=True)``) has a real index, not uninitialised memory.
        super()._load_from_state_dict(*args, **kwargs)  # type: ignore[arg-type]
        self._build_index()

    def forward(self) -> Tensor:  # type: ignore[override]
        """The dense bias ``[heads, N, N]``."""
        if len(self.window) == 1:
            width = self.window[0]
            # column m of toeplitz is the offset j - i = m - (W - 1), i.e. row i - j + W - 1
            # = 2W - 2 - m of the table: the table's rows in reverse
            return toeplitz(self.table.flip(0).t(), width, width)  # [h, 2W-1] -> [h, W, W]
        return F.embedding(self.index, self.table).permute(2, 0, 1)  # [N, N, h] -> [h, N, N]

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention with another number of heads."""
        _check_heads("RelativePositionBias", self.heads, heads)

    @torch.no_grad()
    def resize(self, new_window: int | tuple[int, int]) -> RelativePositionBias:
        """Interpolate the table to ``new_window`` (see :func:`resize_relative_position_table`).

        The parameter is replaced: build the optimizer after resizing.

        Returns:
            ``self``.
        """
        new = window_size(new_window, "new_window")
        table = resize_relative_position_table(self.table.detach(), self.window, new)
        self.window = new
        self.table = nn.Parameter(table, requires_grad=self.table.requires_grad)
        self._build_index()
        return self

    def extra_repr(self) -> str:
        return f"window={self.window}, heads={self.heads}"


class RelativePositionBias1D(RelativePositionBias, OffsetBias):
    """Swin's table over a 1-D window: the bias of ``j - i`` is ``table[i - j + W - 1]``.

    Any positions (shifted, per sequence) whose query and key lie within ``W - 1`` of each
    other in every sequence; every hook comes from :class:`~posenc.families.OffsetBias`.
    Build it as ``RelativePositionBias(W, heads)``.
    """

    dims = 1

    @property
    def reach(self) -> int:  # type: ignore[override]
        """Offsets up to ``W - 1`` have a row (further ones are rejected)."""
        return self.window[0] - 1

    def bias(self, offsets: Tensor) -> Tensor:
        """``table[i - j + W - 1]`` (Swin's row, query minus key) for offsets ``j - i``.

        Args:
            offsets: integer ``[*S]`` in ``[-(W-1), W-1]`` (clamped into it).

        Returns:
            ``[*S, heads]``, a new tensor: for a run of offsets within the window that
            :func:`~posenc.indices.run_offsets` built, its rows' slice in reverse order
            (one copy; no clamp nor gather).
        """
        width = self.window[0]
        run = _known_run(offsets) if offsets.ndim == 1 else None
        if run is not None and 1 - width <= run[0] and run[1] <= width - 1:
            # rows W - 1 - first down to W - 1 - last: a slice of the table, reversed
            return self.table[width - 1 - run[1] : width - run[0]].flip(0)  # [W', h]
        return select_rows(self.table, (width - 1 - offsets).clamp(0, 2 * width - 2))  # [*S, h]

    def check_positions(self, q_pos: Tensor, k_pos: Tensor) -> None:
        """Raise when query and key positions of one sequence lie ``W`` or more apart
        (each sequence is checked on its own: sequences of a batch may lie far apart)."""
        if not (check._can_inspect(q_pos) and check._can_inspect(k_pos)):
            return
        (q_low, q_high), (k_low, k_high) = position_extremes(q_pos), position_extremes(k_pos)
        behind, ahead = q_high - k_low, k_high - q_low  # [B'] tensors, or ints for one row
        rows = 1
        if isinstance(behind, int) and isinstance(ahead, int):
            row, span = 0, max(behind, ahead)
        else:
            spans = torch.maximum(torch.as_tensor(behind), torch.as_tensor(ahead))  # [B']
            rows, row = spans.numel(), int(spans.argmax())
            span = int(spans.flatten()[row])
        if span >= self.window[0]:
            where = f" in sequence {row} of the batch" if rows > 1 else ""
            raise ValueError(
                f"positions are up to {span} apart{where} but this 1-D RelativePositionBias "
                f"has window={self.window[0]} (offsets up to {self.window[0] - 1}); build it "
                f"with a window of at least {span + 1} or .resize({span + 1})"
            )

    def grid_bias(self, q_pos: Tensor, k_pos: Tensor) -> None:
        """None: a 1-D window has no 2-D grid (the hook of the 2-D class)."""
        return None


class RelativePositionBias2D(RelativePositionBias, GridBias):
    """Swin's table over a 2-D window ``(Wh, Ww)``, for token indices of the window.

    Every hook comes from :class:`~posenc.families.GridBias`; the table keeps Swin's
    layout (query minus key), so checkpoints load as they are. Build it as
    ``RelativePositionBias((Wh, Ww), heads)``.
    """

    dims = 2

    @property
    def size(self) -> tuple[int, int]:  # type: ignore[override]
        """``(Wh, Ww)``: the window is the map."""
        return self.window  # type: ignore[return-value]

    def bias(self, rows: Tensor, cols: Tensor) -> Tensor:
        """Swin's row ``(-dr + Wh - 1) * (2Ww - 1) + (-dc + Ww - 1)`` for offsets ``(dr, dc)``
        key minus query (Swin's rows are query minus key).

        Args:
            rows: integer ``[*S]`` row offsets in ``[-(Wh-1), Wh-1]`` (clamped into it).
            cols: integer ``[*S]`` column offsets in ``[-(Ww-1), Ww-1]`` (clamped into it).

        Returns:
            ``[*S, heads]``.
        """
        wh, ww = self.window
        row = (wh - 1 - rows).clamp(0, 2 * wh - 2) * (2 * ww - 1)
        return select_rows(self.table, row + (ww - 1 - cols).clamp(0, 2 * ww - 2))  # [*S, h]

    def grid_table(self, device: torch.device | None = None) -> Tensor:
        """The bias of every offset (see :meth:`~posenc.families.GridBias.grid_table`):
        ``[2Wh-1, 2Ww-1, heads]``. Swin's row of the offset ``(dr, dc)`` counts from the
        other end, so this is the table with its rows reversed (one small copy); a
        :meth:`bias` of a subclass's, or set on the instance, takes the family's form."""
        if _own_bias(self, RelativePositionBias2D):
            return super().grid_table(device)
        wh, ww = self.window
        rows = self.table.flip(0)  # [R, h]: row (dr + Wh - 1) * (2Ww - 1) + dc + Ww - 1
        return rows.view(2 * wh - 1, 2 * ww - 1, -1)  # [2Wh-1, 2Ww-1, h]

    def check_positions(self, q_pos: Tensor, k_pos: Tensor) -> None:
        """Raise unless the positions are token indices of the window, ``[0, N)``."""
        for name, pos in (("q_pos", q_pos), ("k_pos", k_pos))[: 1 if k_pos is q_pos else 2]:
            _check_range(name, pos, self.tokens, f"token indices of a {self.window} window")

    def offset_bias(self, q_pos: Tensor, k_pos: Tensor) -> None:
        """None: a 2-D window has no bias per 1-D offset (the hook of the 1-D class)."""
        return None


def load_relative_position_bias(
    module: RelativePositionBias,
    table: Tensor,
    old_window: int | tuple[int, int] | None = None,
) -> RelativePositionBias:
    """Load a checkpoint's ``relative_position_bias_table`` trained at another window size.

    The classic failure is a size mismatch when a 7x7-window Swin checkpoint is loaded into
    a 12x12-window model; this resizes the checkpoint's table to the module's window first.

    Args:
        module: the module to load into (its window is kept).
        table: ``[(2Wh-1)*(2Ww-1), heads]`` from the checkpoint.
        old_window: the checkpoint's window; inferred from the table length when the window
            is square (or 1-D for a 1-D module).

    Returns:
        ``module``, with the resized table copied in.

    Raises:
        ValueError: the heads differ, or the old window cannot be inferred.
    """
    check.tensor("table", table)
    if table.ndim != 2 or table.shape[1] != module.heads:
        raise ValueError(
            f"table must have shape [rows, heads={module.heads}], got shape {tuple(table.shape)}; "
            f"the checkpoint was trained with another number of heads"
        )
    if old_window is None:
        side = math.isqrt(table.shape[0]) if len(module.window) == 2 else table.shape[0]
        if (len(module.window) == 2 and side * side != table.shape[0]) or side % 2 == 0:
            raise ValueError(
                f"cannot infer the window of a table with {table.shape[0]} rows; pass "
                f"old_window=(Wh, Ww)"
            )
        width = (side + 1) // 2
        old_window = (width, width) if len(module.window) == 2 else width
    resized = resize_relative_position_table(table, old_window, module.window)
    with torch.no_grad():
        module.table.copy_(resized)
    return module


# ----- T5 ------------------------------------------------------------------------------------------


@memo(maxsize=16)
def _run_buckets(
    first: int,
    count: int,
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
    device: torch.device,
) -> Tensor:
    """:func:`~posenc.t5_bucket` of the offsets ``first .. first + count - 1``: ``[count]``
    int64, kept per run and configuration (shared: read, never written)."""
    offsets = torch.arange(first, first + count, device=device)  # [count]
    return t5_bucket(
        offsets, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )


class T5RelativeBias(OffsetBias):
    """T5's bucketed relative position bias: ``B[h, i, j] = embedding[bucket(j - i), h]``.

    ``forward(q_len, k_len, offset)`` equals HF transformers'
    ``T5Attention.compute_bias(q_len, k_len, past_seen_tokens=offset)[0]``.

    Scaling: T5 itself does not divide ``q.k`` by ``sqrt(d)`` (it folds the factor into the
    initialisation of its query projection), and adds this bias to the unscaled logits.
    posenc's :class:`~posenc.MultiHeadAttention` scales ``q.k`` by ``1/sqrt(d)`` and adds the
    bias after the scaling, which is the same model if the query projection is
    ``sqrt(d)`` times larger: to load T5 weights, multiply ``q_proj.weight`` by
    ``sqrt(head_dim)``. The table is initialised from ``N(0, 0.02**2)``.

    Args:
        heads: number of heads.
        num_buckets: number of buckets (32 in T5).
        max_distance: distance from which all offsets share the last bucket (128 in T5).
        bidirectional: True for encoders; False for decoders (only ``j <= i`` is
            distinguished).

    Raises:
        ValueError: bad counts (see :func:`~posenc.t5_bucket`).
    """

    def __init__(
        self,
        heads: int,
        *,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
    ) -> None:
        super().__init__()
        self.heads = check.positive_int("heads", heads)
        self.num_buckets = check.positive_int("num_buckets", num_buckets)
        self.max_distance = check.positive_int("max_distance", max_distance)
        self.bidirectional = bool(bidirectional)
        t5_bucket(torch.zeros(1, dtype=torch.long), **self._bucket_args())  # validates counts
        self.embedding = nn.Embedding(num_buckets, heads)
        self.reset_parameters()

    def _bucket_args(self) -> dict[str, int | bool]:
        return dict(
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )

    def reset_parameters(self) -> None:
        """Draw the table from ``N(0, 0.02**2)``."""
        nn.init.normal_(self.embedding.weight, std=0.02)

    @property
    def reach(self) -> int:  # type: ignore[override]
        """``max_distance``: further offsets share the last bucket."""
        return self.max_distance

    def bias(self, offsets: Tensor) -> Tensor:
        """``embedding[bucket(offset)]``: the bias of each offset ``j - i``.

        Args:
            offsets: integer ``[*S]``.

        Returns:
            ``[*S, heads]``.
        """
        return self.embedding(t5_bucket(offsets, **self._bucket_args()))  # [*S, h]

    def offset_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """The bias per offset of a consecutive run of positions (see
        :meth:`~posenc.families.OffsetBias.offset_bias`): ``[h, n_q + n_k - 1]``, or None.

        The buckets of a run depend on its first offset and its length alone: they are
        kept between calls (:func:`_run_buckets`), and each call reads the table once. A
        :meth:`bias` of a subclass's or set on the instance takes the family's form, which
        calls it.
        """
        if _own_bias(self, T5RelativeBias):
            return super().offset_bias(q_pos, k_pos)
        run = _run_of(self, q_pos, k_pos)
        if run is None:
            return None
        first, count = run
        build = _run_buckets if count <= _KEPT_RUN else _run_buckets.__wrapped__
        buckets = build(
            first, count, self.bidirectional, self.num_buckets, self.max_distance,
            self.embedding.weight.device,
        )  # fmt: skip
        return self.embedding(buckets).t().contiguous()  # [W, h] -> [h, W]

    def offset_table(self) -> Tensor:
        """The bias of each offset ``-max_distance .. max_distance``: ``[2 * max_distance + 1, h]``.

        Offsets beyond ``max_distance`` share the last bucket, so this table is the whole
        bias: computing the buckets (a logarithm) once per offset instead of once per
        (query, key) pair is what makes the bias cheap at long lengths.
        """
        reach = self.max_distance
        offsets = torch.arange(-reach, reach + 1, device=self.embedding.weight.device)
        return self.bias(offsets)  # [2 reach + 1, h]

    def extra_repr(self) -> str:
        return (
            f"heads={self.heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )
