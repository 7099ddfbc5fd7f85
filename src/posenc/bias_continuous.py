"""Place 3, a continuous 2-D bias: an MLP of log-spaced window offsets, ``s_ij += B[h, i, j]``.

- :class:`ContinuousPositionBias`: Swin Transformer V2's log-spaced continuous position
  bias (Liu et al. 2022, "Swin Transformer V2: Scaling Up Capacity and Resolution", CVPR
  2022, arXiv 2111.09883, section 3.3). A small network maps the 2-D offset between two
  tokens of a window to one bias per head, so the bias of any window comes from the same
  parameters: a model trained on one window runs on a larger one (another image
  resolution) with no table to resize.

The maths is in two pure functions, :func:`log_spaced_coordinates` and
:func:`continuous_position_bias`; the module holds the network's parameters in Swin V2's
layout (``cpb_mlp.0.weight``, ``cpb_mlp.0.bias``, ``cpb_mlp.2.weight``), so the official
checkpoints' ``cpb_mlp`` weights load as they are (HF transformers names the same
``nn.Sequential`` ``continuous_position_bias_mlp``). It is a
:class:`~posenc.families.GridBias`: it writes the bias of a 2-D offset, and the family
derives every hook (the grid fast path of a whole map, the dense bias, the FlexAttention
``score_mod``) from it.

Shape legend: ``S`` any shape of offsets, ``h`` heads, ``k`` hidden units of the network,
``H x W`` the window (a row-major map of ``N = H * W`` tokens).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _validate as check
from .families import GridBias, map_size
from .indices import gather_rows, grid_offset_index

__all__ = ["ContinuousPositionBias", "continuous_position_bias", "log_spaced_coordinates"]

#: Swin V2 scales the normalised offsets to ``[-8, 8]`` before the logarithm
_SPREAD = 8.0


def log_spaced_coordinates(
    rows: Tensor,
    cols: Tensor,
    pretrained_window: tuple[int, int],
    *,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Swin V2's log-spaced coordinates of 2-D offsets (Liu et al. 2022, eq. 4 and its code).

    The paper's ``sign(x) * log(1 + |x|)`` of each coordinate, as the official code writes
    it (microsoft/Swin-Transformer, ``models/swin_transformer_v2.py``, ``WindowAttention``):
    the offset ``x`` is query minus key (Swin's layout), normalised by
    ``pretrained_window - 1`` per axis and times 8, then
    ``sign(x) * log2(|x| + 1) / log2(8)``. Offsets within the pretrained window map into
    ``[-log2(9)/3, log2(9)/3]``, about ``[-1.06, 1.06]``; farther ones continue the same
    curve. An axis of one cell (whose only offset is 0) is divided by 1.

    Args:
        rows: integer ``[*S]`` row offsets ``r_j - r_i``, key minus query.
        cols: integer ``[*S]`` column offsets ``c_j - c_i``, key minus query.
        pretrained_window: ``(H, W)`` the offsets are normalised by.
        dtype: the dtype to compute in.

    Returns:
        ``[*S, 2]``: the (row, column) coordinates of ``(r_i - r_j, c_i - c_j)``.
    """
    offsets = torch.stack((-rows, -cols), dim=-1).to(dtype)  # [*S, 2], query minus key
    scale = [float(max(w - 1, 1)) for w in pretrained_window]
    x = offsets / torch.tensor(scale, dtype=dtype, device=offsets.device) * _SPREAD  # [*S, 2]
    return torch.sign(x) * torch.log2(x.abs() + 1.0) / math.log2(_SPREAD)


def continuous_position_bias(
    coords: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor
) -> Tensor:
    """Swin V2's bias network: ``16 * sigmoid(W2 relu(W1 x + b1))`` per head.

    Liu et al. 2022, eq. 3 (``B(dx, dy) = G(dx, dy)``, a two-layer MLP with a ReLU) and
    the official code's ``16 * sigmoid`` of the network's output (bias in ``(0, 16)``).

    Args:
        coords: ``[*S, 2]`` coordinates (:func:`log_spaced_coordinates`).
        weight1: ``[k, 2]``, the first layer's weight.
        bias1: ``[k]``, the first layer's bias.
        weight2: ``[h, k]``, the second layer's weight (no bias).

    Returns:
        ``[*S, h]`` in the dtype of the inputs.
    """
    hidden = F.relu(F.linear(coords, weight1, bias1))  # [*S, k]
    return 16.0 * torch.sigmoid(F.linear(hidden, weight2))  # [*S, h]


class ContinuousPositionBias(GridBias):
    """Swin V2's log-spaced continuous position bias (Liu et al. 2022, arXiv 2111.09883).

    ``B[h, i, j] = 16 * sigmoid(MLP(c(r_i - r_j, c_i - c_j)))[h]`` for tokens ``i, j`` of a
    row-major ``H x W`` window, with ``c`` the log-spaced coordinates of
    :func:`log_spaced_coordinates` and ``MLP = Linear(2, hidden) -> ReLU -> Linear(hidden,
    heads, bias=False)`` (:func:`continuous_position_bias`). Equal to HF transformers'
    ``Swinv2SelfAttention`` bias (``16 * sigmoid`` of ``continuous_position_bias_mlp`` on
    ``relative_coords_table``, read at ``relative_position_index``) with the same weights.

    The window ``size`` may change after construction (set ``.size``, or pass
    ``forward(window=...)``): the network is evaluated on the offsets of the new window,
    which are still normalised by ``pretrained_window`` (the window the network was trained
    on), as Swin V2 transfers a model to a larger window. ``pretrained_window`` defaults to
    the window built for; give it to load weights trained on another window (Swin V2's
    ``pretrained_window_size``).

    Initialisation as the official model: weights from a truncated ``N(0, 0.02**2)``, the
    first layer's bias 0. The bias is computed in float32 (float64 for float64
    parameters), also for a module cast to bfloat16.

    Args:
        window: ``(H, W)``, the window (map) the token indices number.
        heads: number of heads.
        hidden: hidden units of the network (512 in Swin V2).
        pretrained_window: ``(H, W)`` the offsets are normalised by; default ``window``.

    Raises:
        ValueError: a window that is not a pair of ints >= 1, ``heads`` or ``hidden`` < 1.
        TypeError: a count that is not an int.
    """

    def __init__(
        self,
        window: tuple[int, int],
        heads: int,
        *,
        hidden: int = 512,
        pretrained_window: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.window = map_size(window, "window")
        self.heads = check.positive_int("heads", heads)
        self.hidden = check.positive_int("hidden", hidden)
        self.pretrained_window = (
            self.window
            if pretrained_window is None
            else map_size(pretrained_window, "pretrained_window")
        )
        self.size = self.window
        self.cpb_mlp = nn.Sequential(
            nn.Linear(2, self.hidden, bias=True),
            nn.ReLU(),
            nn.Linear(self.hidden, self.heads, bias=False),
        )
        self.reset_parameters()

    @property  # type: ignore[override]
    def size(self) -> tuple[int, int]:
        """``(H, W)``: the window the token indices number now (settable, checked)."""
        return self._size

    @size.setter
    def size(self, value: tuple[int, int]) -> None:
        self._size = map_size(value, "size")

    def reset_parameters(self) -> None:
        """Weights from a truncated ``N(0, 0.02**2)``, the first layer's bias 0 (Swin V2)."""
        nn.init.trunc_normal_(self.cpb_mlp[0].weight, std=0.02)
        nn.init.zeros_(self.cpb_mlp[0].bias)
        nn.init.trunc_normal_(self.cpb_mlp[2].weight, std=0.02)

    def bias(self, rows: Tensor, cols: Tensor) -> Tensor:
        """The bias of each 2-D offset, key minus query; any offsets (no window bound).

        Args:
            rows: integer ``[*S]`` row offsets ``r_j - r_i``.
            cols: integer ``[*S]`` column offsets ``c_j - c_i``.

        Returns:
            ``[*S, heads]``, float32 (float64 for float64 parameters).
        """
        first, last = self.cpb_mlp[0], self.cpb_mlp[2]
        dtype = torch.promote_types(first.weight.dtype, torch.float32)
        coords = log_spaced_coordinates(rows, cols, self.pretrained_window, dtype=dtype)
        return continuous_position_bias(
            coords, first.weight.to(dtype), first.bias.to(dtype), last.weight.to(dtype)
        )  # [*S, h]

    def forward(self, window: tuple[int, int] | None = None) -> Tensor:  # type: ignore[override]
        """The dense bias of a whole window: ``[heads, N, N]``, ``N = H * W``.

        Args:
            window: ``(H, W)`` for this call; default ``size`` (left as it is).

        Returns:
            ``[heads, N, N]``, entry ``[h, i, j]`` the bias of key ``j`` for query ``i``.

        Raises:
            ValueError: a window that is not a pair of ints >= 1.
            TypeError: an entry that is not an int.
        """
        size = self.size if window is None else map_size(window, "window")
        device = self.cpb_mlp[0].weight.device
        height, width = size
        rows = torch.arange(1 - height, height, device=device)  # [2H-1]
        cols = torch.arange(1 - width, width, device=device)  # [2W-1]
        shape = (2 * height - 1, 2 * width - 1)
        table = self.bias(rows[:, None].expand(shape), cols[None, :].expand(shape))  # [..., h]
        table = table.flatten(0, 1)  # [2H-1, 2W-1, h] -> [R, h]
        tokens = torch.arange(height * width, device=device)[None]  # [1, N]
        return gather_rows(table, grid_offset_index(tokens, tokens, size))[0]  # [h, N, N]

    def extra_repr(self) -> str:
        text = f"window={self.window}, heads={self.heads}, hidden={self.hidden}"
        if self.pretrained_window != self.window:
            text += f", pretrained_window={self.pretrained_window}"
        if self.size != self.window:
            text += f", size={self.size}"
        return text
