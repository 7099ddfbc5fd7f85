"""Rotary tables kept between calls for runs of positions, and the rotation that reads them.

:class:`~posenc.rotary.Rotary` rotates queries and keys whose positions are each one run
of consecutive integers with tables built once per run (:func:`rotate_runs`; runs are
found for positions on the CPU, :func:`~posenc.indices.run_start`):

- pairs ``(2i, 2i+1)`` (``interleaved=True``), eager: each pair read as one complex number
  and multiplied by ``cos + i sin`` (:func:`_run_phases`), one kernel per tensor, and a
  backward of one kernel too (the product by the conjugate, :class:`_PhaseRotation`);
- otherwise cos and sin spread over the ``r`` rotated channels, the sin signed by the
  channel it lands on (:func:`_run_tables`): the rotation is then a product and two
  ``addcmul_`` into it, or where it is traced a swap of each pair's channels, a product and
  an ``addcmul`` (:func:`_apply_expanded`),

where :func:`~posenc.rotary.apply_rotary` takes seven ops. Where both ``q`` and ``k`` ask
for a gradient, the two rotations are one node of autograd's graph
(:class:`_PhaseRotationPair`, :class:`_RotationPair`: one Function's call and one
backward's fewer). For an attention call without
gradients, :func:`rotate_runs_into` writes both into a kept buffer instead, each pair one
complex number times its phase (the pairs ``(i, i + r/2)`` side by side:
:mod:`posenc._rotary_buffer`).

Shape legend: ``b`` batch, ``h`` heads, ``n`` positions, ``r`` rotated channels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._memo import eager, memo, plain_autograd
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


@memo(maxsize=16)
def _run_back_sin(
    rotary_dim: int, base: float, interleaved: bool, first: int, n: int, dtype: torch.dtype,
    device: torch.device,
) -> Tensor:  # fmt: skip
    """``[n, r]``: the signed sin of :func:`_run_tables` negated, the backward's (the
    rotation by the opposite angles), kept for :class:`_RotationPair`."""
    tables = _run_tables.__wrapped__(rotary_dim, base, interleaved, first, n, dtype, device)
    return -tables[1]  # [n, r] (built anew: _run_tables's kept entries as they were)


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
    if interleaved:  # (2i, 2i+1) exchanged (reshape: autograd's vmap has no unflatten)
        swapped = x.reshape(*x.shape[:-1], rot // 2, 2).flip(-1).reshape(x.shape)
    else:
        swapped = torch.cat((x[..., rot // 2 :], x[..., : rot // 2]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


def _rotated(
    x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, strides: tuple[int, ...] | None = None
) -> Tensor:
    """:func:`_swapped_sum` in one buffer: each pair's second channel times its sin added
    in place into the first's channel of ``x * cos``, and the first's into the second's
    (even and odd channels, or the two halves): ``[..., r]``, the same values, laid out as
    ``x`` or with dense ``strides``."""
    rot = x.shape[-1]
    if interleaved:
        first, second = slice(0, rot, 2), slice(1, rot, 2)
    else:
        first, second = slice(0, rot // 2), slice(rot // 2, rot)
    if strides is None:
        out = x * cos  # [b, h, n, r]
    else:
        layout = torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device)
        out = torch.mul(x, cos, out=layout)  # [b, h, n, r]
    out[..., first].addcmul_(x[..., second], sin[..., first])  # x_1 cos - x_2 sin
    out[..., second].addcmul_(x[..., first], sin[..., second])  # x_2 cos + x_1 sin
    return out


class _Rotation(torch.autograd.Function):
    """The rotation by constant tables of :func:`_expanded_tables` (a pair's two channels
    share their cos, their sins are opposite) with a backward in one buffer: the gradient
    of a rotation is the rotation of the gradient by the opposite angles (``cos``,
    ``-sin``), written as :func:`_rotated` writes the forward, laid out as the rotation's
    output (its input's layout where that is dense: what autograd's next step reads, a
    leaf's layout or that of the projection ``q`` is a view of); with
    ``create_graph=True`` in out-of-place ops, so that it is differentiable again."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool
    ) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        out = _rotated(x, cos, sin, interleaved)
        ctx.strides = out.stride()  # dense, in x's order of strides
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _turned_back(grad, cos, -sin, ctx.interleaved, ctx.strides), None, None, None


def _turned_back(
    grad: Tensor, cos: Tensor, back: Tensor, interleaved: bool, strides: tuple[int, ...]
) -> Tensor:
    """The backward of a rotation by tables (:class:`_Rotation`, :class:`_RotationPair`):
    ``grad`` rotated by the opposite angles (``back`` is the signed sin negated), laid out
    with ``strides`` (the rotation's output's); with ``create_graph=True`` in out-of-place
    ops, so that it is differentiable again."""
    if torch.is_grad_enabled():  # create_graph=True: a differentiable form
        return _swapped_sum(grad, cos, back, interleaved)
    return _rotated(grad, cos, back, interleaved, strides if _writes_out(grad) else None)


class _RotationPair(torch.autograd.Function):
    """:class:`_Rotation` of ``q`` and of ``k`` as one node of autograd's graph: one
    Function's call and one backward's instead of two, for a call where both ask for a
    gradient; each tensor's tables are ``(cos, sin, -sin)`` (the last the backward's,
    kept too: :func:`_run_back_sin`).

    The tables are constants kept between calls, held by the node itself (not saved
    tensors, which the first backward through the node frees): a backward through the
    rotated ``q`` alone, then another through the rotated ``k`` alone, each gets its
    gradient, as with a node per tensor; and, unlike a node that saves its tensors, a
    second backward through the same output without ``retain_graph`` does not raise here
    (it adds the gradient again; the attention's own nodes after it raise). An output that
    gets no gradient turns none back (no zero gradient is made for it)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        tables_q: tuple[Tensor, Tensor, Tensor],
        tables_k: tuple[Tensor, Tensor, Tensor],
        interleaved: bool,
    ) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)  # an output not read gets no zero gradient
        ctx.tables = (tables_q, tables_k)  # (cos, sin, -sin) [..., n, r] each: constants
        ctx.interleaved = interleaved
        outs = [_rotated(x, t[0], t[1], interleaved) for x, t in ((q, tables_q), (k, tables_k))]
        ctx.strides = [out.stride() for out in outs]  # dense, in q's and k's order of strides
        return outs[0], outs[1]

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_q: Tensor | None, grad_k: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        grads = (grad_q, grad_k)
        back = [
            None if grad is None else _turned_back(grad, t[0], t[2], ctx.interleaved, strides)
            for grad, t, strides in zip(grads, ctx.tables, ctx.strides, strict=True)
        ]
        return back[0], back[1], None, None, None


def _writes_out(grad: Tensor) -> bool:
    """Whether a backward may write ``grad``'s rotation with an ``out=`` product (in the
    rotation's layout): eager, no ``torch.func`` transform, and ``grad`` no batched tensor
    of autograd's own vmap (``is_grads_batched=True``, a vectorized Jacobian or Hessian),
    for which vmap has no rule."""
    return eager() and not _is_legacy_batched(grad)


#: whether a tensor is a batched tensor of autograd's vmap (False where torch has no test)
_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda x: False)


def rotate_runs(
    q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, rotary_dim: int, base: float,
    interleaved: bool, *, heads_after: bool,
) -> tuple[Tensor, Tensor] | None:  # fmt: skip
    """``q`` and ``k`` rotated with tables kept between calls, when the queries' and the
    keys' positions are each one run (:func:`~posenc.indices.run_start`) on their device;
    else None.

    Args:
        q: ``[b, h, n_q, d]`` queries (``[b, n_q, h, d]`` when ``heads_after``).
        k: ``[b, h_kv, n_k, d]`` keys (``[b, n_k, h_kv, d]`` when ``heads_after``).
        q_pos: ``[B', n_q]`` positions of the queries.
        k_pos: ``[B', n_k]`` positions of the keys.
        rotary_dim: ``r``, the rotated channels (the first ``r``).
        base: the wavelength base.
        interleaved: pairs ``(2i, 2i+1)`` if True, else ``(i, i + r/2)``.
        heads_after: the heads follow the sequence axis (``layout="bnhd"``).

    Returns:
        ``(q, k)`` rotated, in their shapes and dtypes, or None.
    """
    device = q.device
    runs = _runs(q_pos, k_pos, device)
    if runs is None:
        return None
    if interleaved and _as_pairs(q, k):
        phases = []
        for x, (first, n) in zip((q, k), (runs[0], runs[-1]), strict=True):
            wide = torch.promote_types(x.dtype, torch.float32) == torch.float64
            dtype = torch.complex128 if wide else torch.complex64
            phase = _run_phases(rotary_dim, base, first, n, dtype, device)  # [n, r/2]
            if heads_after:  # [n, r/2] -> [n, 1, r/2], the heads after the sequence
                phase = phase.unsqueeze(-2)
            phases.append(phase)
        if _as_pair(q, k, _REAL[phases[0].dtype], rotary_dim):
            return _PhaseRotationPair.apply(q, k, phases[0], phases[1])
        return _apply_phases(q, phases[0]), _apply_phases(k, phases[1])
    work = torch.promote_types(q.dtype, torch.float32)  # what apply_rotary computes in
    pair = _as_pair(q, k, work, rotary_dim)
    tables = []
    for first, n in runs:
        args = (rotary_dim, base, interleaved, first, n, work, device)
        cos, sin = _run_tables(*args)  # [n, r] each
        tables.append((cos, sin, _run_back_sin(*args)) if pair else (cos, sin))
    if heads_after:  # [n, r] -> [n, 1, r]
        tables = [tuple(t.unsqueeze(-2) for t in each) for each in tables]
    tables_q, tables_k = tables[0], tables[-1]
    if pair:
        return _RotationPair.apply(q, k, tables_q, tables_k, interleaved)
    return (
        _apply_expanded(q, tables_q[0], tables_q[1], interleaved=interleaved),
        _apply_expanded(k, tables_k[0], tables_k[1], interleaved=interleaved),
    )


def _as_pair(q: Tensor, k: Tensor, work: torch.dtype, rotary_dim: int) -> bool:
    """Whether ``q`` and ``k`` rotate as one node (:class:`_RotationPair`,
    :class:`_PhaseRotationPair`): both ask for a gradient in grad mode, with autograd as
    in eager code, in the dtype the rotation computes in, every channel rotated."""
    return (  # (the modes first: a traced size would be recorded)
        plain_autograd()
        and torch.is_grad_enabled()
        and q.requires_grad
        and k.requires_grad
        and q.dtype == work
        and k.dtype == work
        and q.shape[-1] == rotary_dim
    )


@memo(maxsize=16)
def _run_phases(
    rotary_dim: int, base: float, first: int, n: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``[n, r/2]`` complex ``dtype``: ``cos + i sin`` of the angles of the positions
    ``first .. first + n - 1`` (float64, as :func:`_run_tables`: the same cos and sin
    rounded once)."""
    inv_freq = inverse_frequencies(rotary_dim, base, device=device)  # [r/2] float64
    positions = torch.arange(first, first + n, dtype=inv_freq.dtype, device=device)  # [n]
    angles = positions[:, None] * inv_freq  # [n, r/2], as rotary_angles
    return torch.complex(angles.cos(), angles.sin()).to(dtype)  # [n, r/2]


def _as_pairs(q: Tensor, k: Tensor) -> bool:
    """Whether the complex rotation applies: eager autograd (no ``torch.compile`` trace,
    dispatch or function mode, ``torch.func`` transform or forward-mode AD level) on the
    CPU (where runs of positions are found); and each tensor either cast (a new
    contiguous copy: bfloat16 and float16) or with a view as complex pairs
    (:func:`_viewable`). The two forms differ by at most an ulp, so that a float32 tensor
    without such a view may round unlike a contiguous one."""
    if q.device.type != "cpu" or not eager():
        return False
    return all(_viewable(x) for x in (q, k) if x.dtype in (torch.float32, torch.float64))


def runs_into(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> list[tuple[int, int]] | None:
    """The runs of positions for :func:`rotate_runs_into`, ``[(first, n)]`` for the queries
    then the keys (one entry where ``k_pos is q_pos``), or None where it does not take the
    call: positions that are not each one run, ``q`` and ``k`` not both float32 or both
    float64 on the CPU with elements, or a graph that may be recorded (grad mode on for
    a ``q`` or ``k`` that asks for a gradient, ``torch.compile``, a mode or a transform)."""
    if q.dtype not in _COMPLEX or k.dtype != q.dtype or not (q.numel() and k.numel()):
        return None
    if not _eager_cpu(q, k):
        return None
    return _runs(q_pos, k_pos, q.device)


def _runs(q_pos: Tensor, k_pos: Tensor, device: torch.device) -> list[tuple[int, int]] | None:
    """``[(first, n)]`` of the queries' positions, then the keys' (one entry where ``k_pos
    is q_pos``), where each is one run on ``device`` (:func:`~posenc.indices.run_start`);
    else None."""
    if q_pos.device != device or k_pos.device != device:
        return None
    firsts = [run_start(pos) for pos in ((q_pos,) if k_pos is q_pos else (q_pos, k_pos))]
    if None in firsts:
        return None
    return list(zip(firsts, (q_pos.shape[-1], k_pos.shape[-1]), strict=False))


def rotate_runs_into(
    q: Tensor, k: Tensor, runs: list[tuple[int, int]], rotary_dim: int, base: float,
    interleaved: bool, flat: Tensor,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``q`` and ``k`` rotated as :func:`rotate_runs` rotates them, written into ``flat``,
    for a caller that reads them through their scores ``q_i . k_j`` alone, records no
    graph for them, and lends ``flat`` while it reads them.

    Each pair is multiplied by its phase as one complex number (:func:`_rotate_into`):
    the pairs ``(2i, 2i+1)`` of an ``interleaved`` rotation in place, the pairs ``(i, i +
    r/2)`` side by side (channels ``0, r/2, 1, r/2 + 1, ...`` of the rotated ones: the
    same permutation for ``q`` and ``k``, which keeps every dot product but not the
    channels), so that the rotation costs one or two passes and no new tensor.

    Args:
        q: ``[b, h, n_q, d]`` queries.
        k: ``[b, h_kv, n_k, d]`` keys.
        runs: :func:`runs_into` of the call (not None).
        rotary_dim: ``r``, the rotated channels (the first ``r``).
        base: the wavelength base.
        interleaved: pairs ``(2i, 2i+1)`` if True, else ``(i, i + r/2)``.
        flat: a buffer of at least ``q.numel() + k.numel()`` elements of ``q``'s dtype.

    Returns:
        ``(q, k)`` rotated, contiguous views of ``flat`` in their shapes.
    """
    rotated, start = [], 0
    for x, (first, n) in zip((q, k), (runs[0], runs[-1]), strict=True):
        out = flat[start : start + x.numel()].view(x.shape)  # [b, h, n, d], contiguous
        start += x.numel()
        phase = _run_phases(rotary_dim, base, first, n, _COMPLEX[x.dtype], x.device)  # [n, r/2]
        _rotate_into(x, phase, interleaved, out)
        rotated.append(out)
    return rotated[0], rotated[1]


def _eager_cpu(q: Tensor, k: Tensor) -> bool:
    """Whether a rotation that records no graph may run as plain eager ops on the CPU: no
    ``torch.compile`` trace, dispatch or function mode, ``torch.func`` transform or
    forward-mode AD level, and no graph recorded for ``q`` or ``k``."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return False
    return q.device.type == "cpu" and eager()


def _rotate_into(x: Tensor, phase: Tensor, interleaved: bool, out: Tensor) -> None:
    """Write ``x [..., d]`` rotated by ``phase [..., n, r/2]`` into ``out`` (contiguous, of
    ``x``'s shape and dtype): each pair as one complex number times its phase, ``(x_a cos -
    x_b sin, x_a sin + x_b cos)`` for the pair ``(a, b)``, side by side in ``out`` (the
    pairs ``(2i, 2i+1)`` stay in place), within an ulp of each product rounded before the
    sum (the CPU's kernel may fuse a multiply and an add); the channels past ``r`` copied."""
    half = phase.shape[-1]
    rot = 2 * half
    whole = rot == x.shape[-1]
    pairs = _pairs(out if whole else out[..., :rot])  # [..., r/2] complex
    if interleaved and _viewable(x):
        torch.mul(_pairs(x if whole else x[..., :rot]), phase, out=pairs)  # one pass
    else:
        first, second = (
            (x[..., 0:rot:2], x[..., 1:rot:2]) if interleaved else (x[..., :half], x[..., half:rot])
        )  # [..., r/2] each: the pairs' two channels
        torch.complex(first, second, out=pairs)  # side by side
        pairs.mul_(phase)
    if not whole:
        out[..., rot:].copy_(x[..., rot:])


def _apply_phases(x: Tensor, phase: Tensor) -> Tensor:
    """``x``'s pairs ``(2i, 2i+1)`` of the first ``r = 2 * phase.shape[-1]`` channels
    times ``phase`` (``[..., n, r/2]`` complex), as complex numbers: ``(x_2i cos - x_2i+1
    sin, x_2i sin + x_2i+1 cos)``, within an ulp of each product rounded before the sum
    (the CPU's kernel may fuse a multiply and an add); the other channels passed through;
    computed in the phase's precision (float32 for a bfloat16 ``x``). A new real tensor
    (no view of a complex one), through :class:`_PhaseRotation` where a graph is
    recorded. ``[..., n, d]`` in ``x``'s dtype."""
    rot = 2 * phase.shape[-1]
    xr = x if rot == x.shape[-1] else x[..., :rot]  # [b, h, n, r]
    work = _REAL[phase.dtype]
    if xr.dtype != work:  # a contiguous copy, whatever the strides of x
        xr = xr.to(work, memory_format=torch.contiguous_format)
    if torch.is_grad_enabled() and xr.requires_grad:
        rotated = _PhaseRotation.apply(xr, phase)
    else:
        rotated = _times_phase(xr, phase)
    if rotated.dtype != x.dtype:
        rotated = rotated.to(x.dtype)
    if rot == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rot:]), dim=-1)


def _viewable(x: Tensor) -> bool:
    """Whether ``x [..., r]`` has a view as complex pairs: the last stride 1, every other
    stride and the storage offset even, no lazy negation (``torch._neg_view``)."""
    return (
        not x.is_neg()
        and x.stride(-1) == 1
        and x.storage_offset() % 2 == 0
        and not any(stride % 2 for stride in x.stride()[:-1])
    )


def _pairs(x: Tensor) -> Tensor:
    """``x [..., r]`` float32 or float64 (with :func:`_viewable` strides) as
    ``[..., r/2]`` complex pairs (a view of another dtype, which autograd does not
    differentiate: for the computations it records, ``view_as_complex``)."""
    return x.view(_COMPLEX[x.dtype])  # [..., r/2]


#: the complex dtype of pairs of each real dtype, and back
_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}
_REAL = {complex_dtype: real for real, complex_dtype in _COMPLEX.items()}


def _times_phase(x: Tensor, phase: Tensor, strides: tuple[int, ...] | None = None) -> Tensor:
    """``x [..., r]``'s pairs times ``phase [..., r/2]``, written into a new real tensor
    ``[..., r]`` laid out as ``x`` (as a contiguous copy of ``x`` where its strides have no
    complex view), or with ``strides`` (dense, with a complex view)."""
    if not x.numel():  # no elements: strides of any kind (0 where expanded)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not _viewable(x):
        x = x.contiguous()
    if strides is None:
        out = torch.empty_like(x)  # x's strides where dense, else contiguous: viewable both
    else:
        out = torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device)
    torch.mul(_pairs(x), phase, out=_pairs(out))
    return out


class _PhaseRotation(torch.autograd.Function):
    """The rotation of :func:`_times_phase` by a constant phase, whose output is no view
    and whose backward is the rotation of the gradient by the conjugate phase (the
    opposite angles), laid out as the rotation's output (as :class:`_Rotation`'s); with
    ``create_graph=True`` in autograd's differentiable ops; for a batched gradient of
    autograd's vmap (``is_grads_batched=True``, a vectorized Jacobian), which has no rule
    for a view of another dtype, with the phase's cos and sin spread over the channels
    (:func:`_swapped_sum`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, phase: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(phase)
        out = _times_phase(x, phase)
        ctx.strides = out.stride()  # dense, in x's order where x is viewable, else contiguous
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:  # type: ignore[override]
        (phase,) = ctx.saved_tensors
        return _phased_back(grad, phase, ctx.strides), None


def _phased_back(grad: Tensor, phase: Tensor, strides: tuple[int, ...]) -> Tensor:
    """The backward of a rotation by a phase (:class:`_PhaseRotation`,
    :class:`_PhaseRotationPair`): ``grad`` times the conjugate phase, laid out with
    ``strides`` (the rotation's output's); see :class:`_PhaseRotation` for
    ``create_graph=True`` and autograd's batched gradients."""
    back = phase.conj().resolve_conj()  # [..., n, r/2]
    if torch.is_grad_enabled() and grad.numel():  # create_graph=True: differentiable
        grad = grad if _viewable(grad) else grad.contiguous()
        pairs = torch.view_as_complex(grad.unflatten(-1, (back.shape[-1], 2)))  # [..., r/2]
        return torch.view_as_real(pairs * back).flatten(-2)  # differentiable views
    if not _writes_out(grad):
        cos, sin = _expanded_tables(back.real, back.imag, True).unbind(0)  # [..., n, r]
        return _swapped_sum(grad, cos, sin, True)
    return _times_phase(grad, back, strides)


class _PhaseRotationPair(torch.autograd.Function):
    """:class:`_PhaseRotation` of ``q`` and of ``k`` as one node of autograd's graph (one
    Function's call and one backward's instead of two), for a call where both ask for a
    gradient; its constant phases held by the node, as :class:`_RotationPair` holds its
    tables (with the same backwards: each output's alone, none for an output not read)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, phase_q: Tensor, phase_k: Tensor
    ) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)  # an output not read gets no zero gradient
        ctx.phases = (phase_q, phase_k)  # [..., n, r/2] each: constants
        outs = [_times_phase(q, phase_q), _times_phase(k, phase_k)]
        ctx.strides = [out.stride() for out in outs]  # as _PhaseRotation's
        return outs[0], outs[1]

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_q: Tensor | None, grad_k: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        back = [
            None if grad is None else _phased_back(grad, phase, strides)
            for grad, phase, strides in zip((grad_q, grad_k), ctx.phases, ctx.strides, strict=True)
        ]
        return back[0], back[1], None, None
