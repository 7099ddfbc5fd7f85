"""The buffer the in-place forward writes its scores into, kept between calls.

A forward that records no graph writes its ``[b, h, n_q, n_k]`` scores into one buffer
(:func:`~.reference._forward_in_place`) and returns a new ``[b, h, n_q, d]`` output; the
buffer is dead when the call returns (an attention call without gradients also rotates
its queries and keys into it, :mod:`posenc._rotary_buffer`, and the per-offset bias path
reverses its keys and values into it, forward and backward: :mod:`.offset_bias`).
Allocated afresh each call, a buffer of some hundred KiB or more comes from the system
whenever the C library has handed the previous one back (above its mmap threshold, or
after a trim of its heap), and each of its 4 KiB pages then costs a page fault when
first written, depending on what the process allocated before. Each thread keeps its
buffer instead, one per device, dtype and inference mode, grown to the largest call of
at most :data:`~.tuning.WORKSPACE_ELEMENTS` elements, on the CPU; a larger call borrows a
fresh one, as does a call made while the thread's buffer is lent (a hook that itself runs
attention) or one whose graph may save the buffer. :func:`release_workspace` hands the
kept buffers back.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from . import tuning


class _Kept(threading.local):
    """One thread's kept buffers, by ``(device, dtype, inference mode)``, and whether one
    is lent now."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype, bool], Tensor] = {}
        self.lent = False


_kept = _Kept()


class borrowed:
    """``with borrowed(elements, dtype, device) as flat:`` a flat buffer of at least
    ``elements`` values, uninitialised, to be written and read inside the block only: the
    thread's kept buffer, or a fresh one (see the module docstring) when ``keep`` is False
    (something may hold on to what is written: a graph), off the CPU (a CUDA buffer kept
    across calls may still be read by another stream's kernels), above the cap, or while
    the kept one is lent.

    Args:
        elements: how many values the block needs.
        dtype: their dtype.
        device: where.
        keep: whether the buffer may be the kept one.
    """

    __slots__ = ("_args", "_lent")

    def __init__(
        self, elements: int, dtype: torch.dtype, device: torch.device, *, keep: bool = True
    ) -> None:
        self._args = (elements, dtype, device, keep)
        self._lent = False

    def __enter__(self) -> Tensor:
        elements, dtype, device, keep = self._args
        if not keep or _kept.lent or device.type != "cpu" or elements > tuning.WORKSPACE_ELEMENTS:
            return torch.empty(elements, dtype=dtype, device=device)
        key = (device, dtype, torch.is_inference_mode_enabled())
        flat = _kept.buffers.get(key)
        if flat is None or flat.numel() < elements:
            _kept.buffers.pop(key, None)  # the smaller one goes before the larger comes
            flat = _kept.buffers[key] = torch.empty(elements, dtype=dtype, device=device)
        _kept.lent = self._lent = True
        return flat

    def __exit__(self, *exc: object) -> None:
        if self._lent:
            _kept.lent = self._lent = False


def release_workspace() -> None:
    """Hand back the buffers the calling thread keeps for the in-place forward (they are
    allocated again by the next call that needs one)."""
    _kept.buffers.clear()


def kept_elements() -> int:
    """How many values the calling thread's kept buffers hold, all together."""
    return sum(flat.numel() for flat in _kept.buffers.values())
