"""Rotary tables kept between calls for runs of positions, and the rotation that reads them.

:class:`~posenc.rotary.Rotary` rotates queries and keys whose positions are each one run
of consecutive integers with cos and sin spread over the ``r`` rotated channels, the sin
signed by the channel it lands on, built once per run (:func:`_run_tables`): the rotation
is then a swap of each pair's channels, a product and an ``addcmul``
(:func:`_apply_expanded`), where :func:`~posenc.rotary.apply_rotary` takes seven ops.

Shape legend: ``b`` batch, ``h`` heads, ``n`` positions, ``r`` rotated channels.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import forward_ad

from ._memo import memo
from .absolute import inverse_frequencies
from .indices import run_start


def _expanded_tables(cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """``[2, ..., r]``: ``cos`` and ``sin [..., r/2]`` spread over the ``r`` channels that
    :func:`_apply_expanded` multiplies, ``sin`` with the sign of the channel it lands on."""
    if interleaved:  # channel 2i takes -sin_i (times x_2i+1), 2i+1 takes +sin_i (times x_2i)
        return torch.stack((cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)))
    return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)))


@memo(maxsize=16)
def _run_tables(
    rotary_dim: int, base: float, interleaved: bool, first: int, n: int, dtype: torch.dtype,
    device: torch.device,
) -> Tensor:  # fmt: skip
    """``[2, n, r]`` in ``dtype``: the expanded cos and signed sin (:func:`_expanded_tables`)
    of the positions ``first .. first + n - 1``, angles in float64 (float32 on MPS)."""
    inv_freq = inverse_frequencies(rotary_dim, base, device=device)  # [r/2] float64
    positions = torch.arange(first, first + n, dtype=inv_freq.dtype, device=device)  # [n]
    angles = positions[:, None] * inv_freq  # [n, r/2], as rotary_angles
    return _expanded_tables(angles.cos(), angles.sin(), interleaved).to(dtype)  # [2, n, r]


def _apply_expanded(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool) -> Tensor:
    """:func:`apply_rotary` with the tables of :func:`_expanded_tables` (``[..., n, r]``, in
    the dtype the rotation computes in): ``x_r * cos + swapped(x_r) * sin``, where
    ``swapped`` exchanges each pair's two channels; the products and their sum round as
    ``x_i cos - x_j sin`` does.

    Where nothing records a graph or a tangent (:func:`_records`), each pair's second
    channel times its sin is added in place into the first's channel of ``x_r * cos`` and
    the first's into the second's (halves, or even and odd channels): no swapped copy (one
    buffer and two passes over the channels fewer), the same values."""
    rot = cos.shape[-1]
    xr = x[..., :rot].to(torch.promote_types(x.dtype, cos.dtype))  # [b, h, n, r]
    if _records(xr, cos, sin):
        if interleaved:  # (2i, 2i+1) exchanged
            swapped = xr.unflatten(-1, (rot // 2, 2)).flip(-1).flatten(-2)
        else:
            swapped = torch.cat((xr[..., rot // 2 :], xr[..., : rot // 2]), dim=-1)
        rotated = torch.addcmul(xr * cos, swapped, sin)
    else:  # each pair's first and second channels: even and odd, or the two halves
        first, second = (
            (slice(0, rot, 2), slice(1, rot, 2))
            if interleaved
            else (slice(0, rot // 2), slice(rot // 2, rot))
        )
        rotated = xr * cos  # [b, h, n, r]
        rotated[..., first].addcmul_(xr[..., second], sin[..., first])  # x_1 cos - x_2 sin
        rotated[..., second].addcmul_(xr[..., first], sin[..., second])  # x_2 cos + x_1 sin
    rotated = rotated.to(x.dtype)
    if rot == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rot:]), dim=-1)


def _records(*xs: Tensor) -> bool:
    """Whether an op on ``xs`` may record a graph or a tangent, or runs traced
    (``torch.compile``, a ``torch.func`` transform): then the rotation takes out-of-place
    ops alone (the halves written in place would put a copy of each into the graph)."""
    return (
        (torch.is_grad_enabled() and any(x.requires_grad for x in xs))
        or forward_ad._current_level >= 0
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
    )


def run_tables(
    q_pos: Tensor, k_pos: Tensor, rotary_dim: int, base: float, interleaved: bool,
    dtype: torch.dtype, device: torch.device,
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:  # fmt: skip
    """The tables ``(cos_q, sin_q, cos_k, sin_k)``, each ``[n, r]`` in ``dtype``, kept
    between calls (:func:`_run_tables`), when the queries' and the keys' positions are each
    one run (:func:`~posenc.indices.run_start`) on ``device``; else None."""
    if q_pos.device != device or k_pos.device != device:
        return None
    firsts = [run_start(pos) for pos in ((q_pos,) if k_pos is q_pos else (q_pos, k_pos))]
    if None in firsts:
        return None
    tables = [
        _run_tables(rotary_dim, base, interleaved, first, pos.shape[-1], dtype, device).unbind(0)
        for first, pos in zip(firsts, (q_pos, k_pos), strict=False)
    ]
    return (*tables[0], *tables[-1])
