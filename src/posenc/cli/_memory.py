"""Peak memory for ``posenc bench``: the CUDA allocator's peak, or on CPU the peak of the
bytes that torch allocated during the call (:func:`allocation_peak_mib`).

On CPU torch has no allocator statistics; the profiler, with ``profile_memory=True``,
records every allocation and free of its CPU allocator with the block's address and size,
and the peak of the bytes live that the call itself allocated is read from those events
in time order. The other measure, the growth of Linux's peak resident set in a fresh
process (``posenc bench --memory process``, :mod:`posenc.cli._bench_measure`), follows
what is live only when glibc returns freed blocks to the system: glibc's mmap and trim
thresholds are set low there, and to the values a long-running program reaches while
timing (:func:`set_mmap_threshold`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

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


@contextlib.contextmanager
def _quiet_profiler() -> Iterator[None]:
    """Keep kineto, the profiler's library, from printing two lines to stderr for every
    profiled call (``profiler_start``, ``profiler_stop``).

    It reads ``KINETO_LOG_LEVEL`` once, when the first profiler of the process starts; a
    level set by the user is kept. Its levels run from 0 (verbose) to 5 (these lines): 6
    prints nothing.
    """
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


def allocation_peak_mib(fn: Callable[[], object]) -> float:
    """The peak of the CPU bytes allocated by ``fn`` and still live, in MiB (0 or more).

    Run under the profiler with ``profile_memory=True``: its allocation events, each with
    the block's address and signed size, are walked in time order; a free counts only for
    a block allocated during ``fn``. So what was live before (the inputs, what an earlier
    variant or case left) is not counted, and its frees do not lower the figure.

    What it does not see: memory taken outside torch's CPU allocator (MKL's and oneDNN's
    own buffers, Python objects) and allocations made on intra-op worker threads, which
    do not report to the profiler (ATen allocates outputs and scratch before its parallel
    regions; autograd's CPU backward runs on the calling thread). It reads bytes asked
    for, where the resident set reads whole pages.
    """
    from torch.profiler import ProfilerActivity, profile

    with _quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    tree = prof.profiler.kineto_results.experimental_event_tree()  # type: ignore[union-attr]
    allocation = torch._C._profiler._EventType.Allocation
    events = []
    stack = list(tree)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == allocation and node.extra_fields.device.type == "cpu":
            fields = node.extra_fields
            # at the same instant an allocation before a free: the peak is not missed
            events.append(
                (node.start_time_ns, fields.alloc_size < 0, fields.ptr, fields.alloc_size)
            )
    live: dict[int, int] = {}  # address -> bytes of the blocks allocated during fn
    total = peak = 0
    for _, _, ptr, size in sorted(events):
        if size > 0:
            live[ptr] = size
            total += size
            peak = max(peak, total)
        else:
            total -= live.pop(ptr, 0)
    return peak / 2**20


class PeakMemory:
    """Peak memory growth of one call, in MiB: the CUDA allocator's peak, or on CPU the
    peak of the bytes torch allocated during the call (:func:`allocation_peak_mib`).

    Other devices (``mps``) have no measure: :attr:`available` is False. On CPU (glibc) it
    also fixes the allocator's thresholds for the timing runs (:data:`TIMING_MMAP_THRESHOLD`,
    :data:`TIMING_TRIM_THRESHOLD`).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.available = device.type in ("cpu", "cuda")
        if device.type == "cpu":
            set_mmap_threshold(TIMING_MMAP_THRESHOLD, TIMING_TRIM_THRESHOLD)

    def measure(self, fn: Callable[[], object]) -> float | None:
        """Run ``fn`` once; return the growth of its peak memory in MiB (None where there is
        no measure)."""
        if not self.available:
            fn()
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - start) / 2**20
        return allocation_peak_mib(fn)
