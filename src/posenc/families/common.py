"""What the scheme families share: the checks of a hook's inputs, and which offsets to tabulate.

Public helpers for the scheme modules of places 3-5 (no private imports between them).

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim,
``B'`` the batch of the positions (1 when shared, else ``b``), ``S`` any shape of offsets.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .. import _validate as check
from ..indices import value_range

__all__ = [
    "check_cells",
    "check_heads",
    "check_queries",
    "hook_positions",
    "lengths_positions",
    "map_size",
    "module_device",
    "offset_span",
    "table_of",
]

Primitive = Callable[[Tensor], Tensor]


def check_queries(q: object, head_dim: int, name: str = "q") -> Tensor:
    """``q`` must be a float ``[b, h, n, d]`` tensor with ``d == head_dim``.

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: not 4-D, or another last dimension.
    """
    check.floating(name, q)
    if q.ndim != 4:  # type: ignore[union-attr]
        raise ValueError(
            f"{name} must have shape [b, h, n, d] (split the heads first), got shape "
            f"{tuple(q.shape)}"  # type: ignore[union-attr]
        )
    check.last_dim(name, q, head_dim, what="head_dim")  # type: ignore[arg-type]
    return q  # type: ignore[return-value]


def _check_pos(name: str, pos: object, n: int, batch: int) -> Tensor:
    """A hook's positions: integer ``[n]`` or ``[B', n]`` with ``B'`` in ``{1, b}``."""
    check.tensor(name, pos)
    p: Tensor = pos  # type: ignore[assignment]
    if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
        raise TypeError(
            f"{name} must be an integer tensor of positions, got dtype {p.dtype}; pass "
            f"{name}.long() if the values are whole numbers"
        )
    if p.ndim == 1:
        p = p.unsqueeze(0)  # [n] -> [1, n]
    if p.ndim != 2 or p.shape[-1] != n or p.shape[0] not in (1, batch):
        raise ValueError(
            f"{name} must have shape [{n}] or [1 or {batch}, {n}] (one position per token, "
            f"shared by the batch or per row), got shape {tuple(pos.shape)}"  # type: ignore[union-attr]
        )
    return p.long()


def hook_positions(x: Tensor, q_pos: object, k_pos: object) -> tuple[Tensor, Tensor]:
    """Check the positions a hook receives against ``x [b, h, n_q, *]``.

    For a score term ``x`` is ``q [b, h, n_q, d]`` and ``k_pos`` may have any length;
    for a value term ``x`` is the weights ``[b, h, n_q, n_k]`` and ``k_pos`` must cover
    ``n_k`` (checked by the caller).

    Returns:
        ``(q_pos [B', n_q], k_pos [B', n_k])`` int64.

    Raises:
        TypeError: positions that are not integer tensors.
        ValueError: positions not ``[n]`` or ``[1 or b, n]``.
    """
    q_pos = _check_pos("q_pos", q_pos, x.shape[-2], x.shape[0])
    check.tensor("k_pos", k_pos)
    k_pos = _check_pos("k_pos", k_pos, k_pos.shape[-1], x.shape[0])  # type: ignore[union-attr]
    return q_pos, k_pos


def lengths_positions(
    q_len: int, k_len: int, offset: int, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """Positions of a standalone dense bias: queries ``offset + arange(q_len)``, keys
    ``arange(k_len)``, as ``([1, q_len], [1, k_len])``.

    Raises:
        TypeError: a length or offset that is not an int.
        ValueError: a negative one.
    """
    for name, value in (("q_len", q_len), ("k_len", k_len), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    q_pos = torch.arange(q_len, device=device)[None] + offset  # [1, q_len]
    return q_pos, torch.arange(k_len, device=device)[None]  # [1, k_len]


def check_heads(scheme: object, heads: int) -> None:
    built = getattr(scheme, "heads", None)
    if built is not None and built != heads:
        raise ValueError(
            f"{type(scheme).__name__} was built for heads={built} but the attention has "
            f"heads={heads}; build it with heads={heads}"
        )


def check_cells(size: tuple[int, int], q_pos: Tensor, k_pos: Tensor) -> None:
    """Raise unless both are token indices of a row-major ``H x W`` map, ``[0, H*W)``."""
    cells = math.prod(size)
    for name, pos in (("q_pos", q_pos), ("k_pos", k_pos))[: 1 if k_pos is q_pos else 2]:
        if not check._can_inspect(pos):
            continue
        low, high = value_range(pos)
        if low < 0 or high >= cells:
            raise ValueError(
                f"{name} must be in [0, {cells}) (row-major token indices of a {size[0]}x"
                f"{size[1]} map), got values from {low} to {high}"
            )


def map_size(size: object, name: str = "size") -> tuple[int, int]:
    """Check a 2-D map size ``(H, W)`` and return it as a tuple.

    Raises:
        ValueError: not a pair, or an entry < 1.
        TypeError: an entry that is not an int.
    """
    if not isinstance(size, (tuple, list)) or len(size) != 2:
        raise ValueError(f"{name} must be a pair (H, W), got {size!r}")
    return check.positive_int(f"{name}[0]", size[0]), check.positive_int(f"{name}[1]", size[1])


def module_device(module: nn.Module) -> torch.device:
    """Where the module's state lives (CPU for a module without any)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def offset_span(q_pos: Tensor, k_pos: Tensor, reach: int | None) -> tuple[int, int] | None:
    """The offsets worth tabulating for these positions: ``(low, high)`` or None.

    Every offset ``k_pos_j - q_pos_i`` clamped into ``[low, high]`` keeps its value: on CPU
    the extreme offsets of each sequence, ``min k - max q`` to ``max k - min q`` (read in
    ``O(n_q + n_k)``), clamped into ``[-reach, reach]``; elsewhere ``[-reach, reach]``,
    read without a device sync; None when neither is known.

    Args:
        q_pos: ``[B', n_q]`` int64 positions.
        k_pos: ``[B', n_k]`` int64 positions.
        reach: offsets beyond ``+-reach`` share the value at ``+-reach``; None: no bound.

    Returns:
        ``(low, high)`` with ``low <= high``, or None.
    """
    inspect = q_pos.device.type == "cpu" and check._can_inspect(q_pos) and check._can_inspect(k_pos)
    if not inspect:
        return None if reach is None else (-reach, reach)
    low = int((k_pos.amin(-1) - q_pos.amax(-1)).min())  # [B'] -> scalar
    high = int((k_pos.amax(-1) - q_pos.amin(-1)).max())  # [B'] -> scalar
    if reach is not None:
        low, high = min(max(low, -reach), reach), max(min(high, reach), -reach)
    return low, high


def table_of(primitive: Primitive, low: int, high: int, device: torch.device) -> Tensor:
    """The primitive on the offsets ``low .. high``: ``[(h,) high - low + 1, ...]``."""
    return primitive(torch.arange(low, high + 1, device=device))
