"""A rotation of queries and keys into the thread's kept buffer, for an attention call
that reads them through their scores alone.

An attention call without gradients rotates ``q`` and ``k`` into new tensors, reads them
in SDPA's kernel and drops them. Where they are large, their pages come from the system
again in each call (the C library hands a freed block of some hundred KiB back), and each
page costs a fault when first written (the module docstring of
:mod:`posenc.engine.workspace`). :func:`rotated` writes them instead into the buffer the
thread keeps for the in-place forward, lent for the call, with a rotation of one or two
passes (:func:`~posenc._rotary_runs.rotate_runs_into`): each pair one complex number
times its phase, the pairs ``(i, i + r/2)`` of a half-split rotation side by side, which
permutes the channels of ``q`` and ``k`` alike and keeps every score ``q_i . k_j``, to
rounding: SDPA sums a score over the channels in the permuted order, and each pair rounds
as one complex product, so that such a call may differ in its last bits from the same
call with gradients, with a KV cache or below the threshold (the pairs ``(2i, 2i+1)`` keep
their order and round as with gradients: the same bits).

Shape legend: ``b`` batch, ``h`` heads, ``h_kv`` key heads, ``n_q`` queries, ``n_k`` keys,
``d`` head dim; positions ``[B', n]`` with ``B'`` 1 or ``b``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._rotary_runs import rotate_runs_into
from ._rotary_runs import runs_into as _runs_into
from .engine import tuning
from .engine.workspace import borrowed
from .hooks import _HOOK_SET, attribute
from .rotary import Rotary

#: what :func:`runs_into` must find on the class, not set on the instance
_INSTANCE_SET = _HOOK_SET | {"cos_sin"}


def rotated(
    position: Any, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scores_only: bool
) -> tuple[Tensor, Tensor, borrowed | None]:
    """``q [b, h, n_q, d]`` and ``k [b, h_kv, n_k, d]`` rotated by the scheme's ``rotate``
    hook at ``q_pos`` and ``k_pos`` (unchanged without one), and the kept buffer they were
    written into, lent until the caller hands it back (``lent.__exit__(None, None,
    None)``, once it has read them), or None.

    Where the attention reads them through its scores alone and keeps nothing of them
    (``scores_only``: no KV cache, which stores the keys), no graph is recorded (grad mode
    off: SDPA would save them for a backward), the queries have at least
    :data:`~posenc.engine.tuning.ROTATION_BUFFER_ELEMENTS` elements and ``position`` is a
    plain :class:`~posenc.Rotary` on runs of positions (:func:`runs_into`), they are
    written into the thread's kept buffer (:class:`~posenc.engine.workspace.borrowed`):
    contiguous, float32 or float64, their channels in the order the rotation gives
    (:func:`rotate_into`).
    """
    rotate = attribute(position, "rotate")
    if rotate is None:
        return q, k, None
    if (
        scores_only
        and type(position) is Rotary
        and not torch.is_grad_enabled()
        and not torch.jit.is_tracing()  # (before numel: a trace records the rotation alone)
        and q.numel() >= tuning.ROTATION_BUFFER_ELEMENTS
    ):
        runs = runs_into(position, q, k, q_pos, k_pos)
        if runs is not None:
            lent = borrowed(q.numel() + k.numel(), q.dtype, q.device)
            flat = lent.__enter__()
            try:
                return (*rotate_into(position, q, k, runs, flat), lent)
            except BaseException:
                lent.__exit__(None, None, None)
                raise
    q, k = rotate(q, k, q_pos, k_pos)
    return q, k, None


def runs_into(
    position: Rotary, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor
) -> list[tuple[int, int]] | None:
    """Whether :func:`rotate_into` takes the call: the runs of positions it reads
    (:func:`~posenc._rotary_runs.runs_into`), or None where it does not take it, or where
    ``position`` is not a plain :class:`~posenc.Rotary` (of the class itself, no scaling,
    no hook nor ``cos_sin`` set on the instance)."""
    if type(position) is not Rotary or position.scaling is not None:
        return None
    own = vars(position)
    if _INSTANCE_SET & own.keys() or _HOOK_SET & own["_modules"].keys():
        return None  # a hook, or the tables, set on the instance: the attention calls them
    if not _plain_class():
        return None  # the class's methods patched (a spy, a mock): the attention calls them
    return _runs_into(q, k, q_pos, k_pos)


def _plain_class() -> bool:
    """Whether :class:`~posenc.Rotary` is as posenc defines it: the methods the rotation
    reads are its own (none replaced on the class since import) and it defines no other
    hook."""
    found = vars(Rotary)
    return all(found.get(name) is method for name, method in _OWN.items()) and not (
        _OTHER_HOOKS & found.keys()
    )


#: the methods of Rotary a rotation into the buffer stands for, as posenc defines them
_OWN = {name: vars(Rotary)[name] for name in ("rotate", "_rotate", "cos_sin")}
#: the hooks other than the rotation (a patch that adds one to the class reads q or k)
_OTHER_HOOKS = _HOOK_SET - {"rotate"}


def rotate_into(
    position: Rotary, q: Tensor, k: Tensor, runs: list[tuple[int, int]], flat: Tensor
) -> tuple[Tensor, Tensor]:
    """``q [b, h, n_q, d]`` and ``k [b, h_kv, n_k, d]`` rotated by ``position`` into
    ``flat`` (at least ``q.numel() + k.numel()`` elements of their dtype) at the ``runs``
    :func:`runs_into` gave: contiguous views of ``flat``, the channels in the order of
    :func:`~posenc._rotary_runs.rotate_runs_into` (the pairs ``(i, i + r/2)`` side by
    side), the same for ``q`` and ``k``."""
    return rotate_runs_into(
        q, k, runs, position.rotary_dim, position.base, position.interleaved, flat
    )
