"""Rotary tables kept between calls for runs of positions, and the rotation that reads them.

:class:`~posenc.rotary.Rotary` rotates queries and keys whose positions are each one run
of consecutive integers with cos and sin spread over the ``r`` rotated channels, the sin
signed by the channel it lands on, built once per run (:func:`_run_tables`): the rotation
is then a product and two ``addcmul_`` into it, or where it is traced a swap of each pair's
channels, a product and an ``addcmul`` (:func:`_apply_expanded`), where
:func:`~posenc.rotary.apply_rotary` takes seven ops.

Shape legend: ``b`` batch, ``h`` heads, ``n`` positions, ``r`` rotated channels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._memo import memo, plain_autograd
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
    ``swapped`` exchanges each pair's two channels: ``x_i cos`` rounded, then ``x_j (-sin)``
    added (``addcmul``: in one rounding where the CPU's kernel fuses the multiply-add, so
    it may differ from :func:`apply_rotary`'s ``x_i cos - x_j sin`` by an ulp).

    Eager, with constant tables, the rotation writes each pair's products in place into
    ``x_r * cos`` (:func:`_rotated`: no swapped copy, one buffer and two passes over the
    channels fewer), through :class:`_Rotation` where a graph is recorded (its backward,
    the rotation by the opposite angles, in one buffer too); otherwise (inside a
    forward-AD dual level, ``torch.compile``, ``torch.jit.trace``, a ``torch.func``
    transform, tables that ask for a gradient) in out-of-place ops."""
    rot = cos.shape[-1]
    xr = x if rot == x.shape[-1] else x[..., :rot]  # [b, h, n, r]
    wide = torch.promote_types(x.dtype, cos.dtype)
    if xr.dtype != wide:
        xr = xr.to(wide)
    if not plain_autograd() or (
        torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    ):
        rotated = _swapped_sum(xr, cos, sin, interleaved)
    elif torch.is_grad_enabled() and xr.requires_grad:
        rotated = _Rotation.apply(xr, cos, sin, interleaved)
    else:
        rotated = _rotated(xr, cos, sin, interleaved)
    if rotated.dtype != x.dtype:
        rotated = rotated.to(x.dtype)
    if rot == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rot:]), dim=-1)


def _swapped_sum(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """``x * cos + swapped(x) * sin`` in out-of-place ops: ``[..., r]``."""
    rot = x.shape[-1]
    if interleaved:  # (2i, 2i+1) exchanged
        swapped = x.unflatten(-1, (rot // 2, 2)).flip(-1).flatten(-2)
    else:
        swapped = torch.cat((x[..., rot // 2 :], x[..., : rot // 2]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


def _rotated(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """:func:`_swapped_sum` in one buffer: each pair's second channel times its sin added
    in place into the first's channel of ``x * cos``, and the first's into the second's
    (even and odd channels, or the two halves): ``[..., r]``, the same values."""
    rot = x.shape[-1]
    if interleaved:
        first, second = slice(0, rot, 2), slice(1, rot, 2)
    else:
        first, second = slice(0, rot // 2), slice(rot // 2, rot)
    out = x * cos  # [b, h, n, r]
    out[..., first].addcmul_(x[..., second], sin[..., first])  # x_1 cos - x_2 sin
    out[..., second].addcmul_(x[..., first], sin[..., second])  # x_2 cos + x_1 sin
    return out


class _Rotation(torch.autograd.Function):
    """The rotation by constant tables of :func:`_expanded_tables` (a pair's two channels
    share their cos, their sins are opposite) with a backward in one buffer: the gradient
    of a rotation is the rotation of the gradient by the opposite angles (``cos``,
    ``-sin``), written as :func:`_rotated` writes the forward; with ``create_graph=True``
    in out-of-place ops, so that it is differentiable again."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool
    ) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotated(x, cos, sin, interleaved)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a differentiable form
            return _swapped_sum(grad, cos, -sin, ctx.interleaved), None, None, None
        return _rotated(grad, cos, -sin, ctx.interleaved), None, None, None


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
