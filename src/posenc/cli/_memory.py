"""Peak memory for ``posenc bench``: the CUDA allocator's peak, or Linux's peak resident set.

On CPU the peak resident set follows what is live only when the allocator returns freed
blocks to the system: glibc's mmap and trim thresholds are set low while memory is
measured, and to the values a long-running program reaches while it is timed
(:func:`set_mmap_threshold`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def status_kib(field_name: str) -> int | None:
    """A field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``), None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


#: glibc's mmap threshold while timing: its largest dynamic value on 64-bit Linux, the
#: steady state of a long-running program (large blocks are reused from the heap)
TIMING_MMAP_THRESHOLD = 32 << 20
#: glibc's trim threshold while timing: twice the mmap threshold, as glibc's dynamic rule
#: sets it whenever it raises the mmap threshold (fixing the mmap threshold by hand froze
#: it at its 128 KiB default: every large block freed at the top of the heap went back to
#: the system and the next one was page-faulted; relative-2d's forward read 1.5x or 2.0x
#: the floor from run to run under it, 1.51-1.52x with this, measured here)
TIMING_TRIM_THRESHOLD = 2 * TIMING_MMAP_THRESHOLD
#: ... and while measuring memory: every block >= 64 KiB its own mmap, returned on free,
#: and glibc's default trim threshold
MEMORY_MMAP_THRESHOLD = 64 << 10
MEMORY_TRIM_THRESHOLD = 128 << 10


def set_mmap_threshold(threshold: int, trim: int) -> None:
    """Fix glibc's mmap and trim thresholds (``mallopt(M_MMAP_THRESHOLD)``,
    ``mallopt(M_TRIM_THRESHOLD)``; no-op elsewhere).

    By default glibc raises its mmap threshold as large blocks are freed and keeps them in
    its heap, so the resident set stops following what is live and a peak reads as 0:
    memory is measured with a low fixed threshold. Timing must not run under it: a fresh
    mmap and its page faults for every block made the lean engine look 35% slower than it
    is (ALiBi at n = 2048: 3.0x the floor instead of 2.2x, measured here); it runs under
    the thresholds a long-running program reaches (:data:`TIMING_MMAP_THRESHOLD`,
    :data:`TIMING_TRIM_THRESHOLD`).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, trim)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc: peaks may read low
        pass


class PeakMemory:
    """Peak memory growth of one call, in MiB: CUDA allocator or Linux peak RSS."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.available = device.type == "cuda" or status_kib("VmHWM") is not None
        if device.type != "cuda" and self.available:
            set_mmap_threshold(TIMING_MMAP_THRESHOLD, TIMING_TRIM_THRESHOLD)

    def measure(self, fn: Callable[[], object]) -> float | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - start) / 2**20
        if not self.available:
            fn()
            return None
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # reset the peak resident set to the current one
        except OSError:
            self.available = False
            fn()
            return None
        set_mmap_threshold(MEMORY_MMAP_THRESHOLD, MEMORY_TRIM_THRESHOLD)
        try:
            start = status_kib("VmRSS") or 0
            fn()
            return ((status_kib("VmHWM") or 0) - start) / 1024
        finally:
            set_mmap_threshold(TIMING_MMAP_THRESHOLD, TIMING_TRIM_THRESHOLD)
