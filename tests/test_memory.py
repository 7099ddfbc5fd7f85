"""Peak memory of ``posenc bench`` (posenc/cli/_memory.py): the in-process figure from the
profiler's allocation events against hand-written allocations and the fresh-process
resident set, and how the bench measures it."""

from __future__ import annotations

import argparse

import pytest
import torch

from posenc.cli.bench import run_bench


def _mib(nbytes: int) -> torch.Tensor:
    """A float32 tensor of ``nbytes`` bytes."""
    return torch.empty(nbytes // 4, dtype=torch.float32)


def test_allocation_peak_is_the_peak_of_the_bytes_the_call_allocated():
    from posenc.cli._memory import allocation_peak_mib

    def steps():
        a = _mib(2 << 20)
        b = _mib(1 << 20)
        del a  # 3 MiB live before this free
        c = _mib(3 << 19)  # 1 + 1.5 MiB live
        return b, c

    assert allocation_peak_mib(steps) == 3.0
    before = _mib(8 << 20)  # live before the call: not counted ...
    assert allocation_peak_mib(lambda: _mib(1 << 20)) == 1.0
    held = [before]
    del before

    def frees_an_older_block():
        held.clear()  # ... and its free does not lower the count
        return _mib(1 << 20)

    assert allocation_peak_mib(frees_an_older_block) == 1.0
    assert allocation_peak_mib(lambda: None) == 0.0


def _variant_run(name: str, variant: str, n: int):
    """One fwd+bwd of ``variant`` of scheme ``name`` at b = 1, h = 2, d = 32, warmed up."""
    from posenc.cli._bench_measure import _time_once
    from posenc.cli._bench_variants import _inputs, _variant, build_scheme

    cpu = torch.device("cpu")
    run = _variant(variant, build_scheme(name, 2, 32, n), "auto")
    inputs = _inputs(1, 2, n, 32, torch.float32, cpu, True)
    _time_once(run, inputs, True, cpu)  # lazy tables, as the bench's warm-up
    return lambda: _time_once(run, inputs, True, cpu)


def test_allocation_peak_does_not_depend_on_what_ran_before():
    """The resident set of a long-running process read about 0 after earlier cases (their
    freed blocks reused from the heap); the allocation count reads the same either way."""
    from posenc.cli._memory import PeakMemory

    meter = PeakMemory(torch.device("cpu"))
    floor = _variant_run("t5", "floor", 256)
    alone = meter.measure(floor)
    meter.measure(_variant_run("t5", "reference", 512))
    kept = _variant_run("shaw", "posenc", 256)  # its tables stay allocated
    assert meter.measure(floor) == alone
    one_output_and_its_grads_mib = 4 * 1 * 2 * 256 * 32 * 4 / 2**20  # out, dq, dk, dv
    assert alone >= one_output_and_its_grads_mib, alone
    del kept


def test_bench_peak_memory_in_process():
    """The literal reference keeps the scores; posenc's lean engine does not."""
    (case,) = run_bench(["t5"], [2048], batch=1, heads=2, head_dim=32, repeats=1)
    peaks = case.peak_mib
    one_score_matrix_mib = 1 * 2 * 2048 * 2048 * 4 / 2**20
    assert peaks["floor"] > 0
    assert peaks["reference"] > 2 * one_score_matrix_mib > peaks["posenc"], peaks


def _events_at_peak(fn) -> tuple[int, int, int]:
    """The test's own reading of the profiler's CPU memory events (``[memory]``, signed
    sizes, no addresses) in time order: the peak bytes, and at the peak the blocks of at
    least 64 KiB live and the bytes of the smaller ones."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    )
    total = peak = large = small = 0
    at_peak = (0, 0)
    for _, nbytes in events:
        total += nbytes
        if abs(nbytes) >= 64 << 10:
            large += 1 if nbytes > 0 else -1
        else:
            small += nbytes
        if total > peak:
            peak, at_peak = total, (large, small)
    return peak, *at_peak


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="Linux")
def test_allocation_peak_agrees_with_the_fresh_process_resident_set(monkeypatch):
    """``--memory allocations`` (this process) against ``--memory process`` (the peak
    resident set of a fresh one), within what the two count differently:

    - the resident set counts pages: each block live at the peak (glibc's mmap of 64 KiB or
      more, with its 16-byte header) reads up to a page more;
    - blocks under 64 KiB come from glibc's heap, whose pages may be resident already: up
      to their bytes less;
    - Linux batches its resident-set counters per CPU (``percpu_counter_batch``, max(32,
      2 * CPUs) pages, lib/percpu_counter.c): each of the two readings (start, peak) may
      be off by a batch per CPU; and both read KiB;
    - pages a call allocates but never writes are not resident: the fresh process runs
      with ``MALLOC_PERTURB_``, which makes glibc write every block it hands out. Without
      it the resident set reads only lower.
    """
    from posenc.cli._memory import allocation_peak_mib
    from posenc.cli.bench import _peak_in_subprocess

    os = __import__("os")
    page, cpus = os.sysconf("SC_PAGE_SIZE"), os.cpu_count() or 1
    counters = 2 * max(32, 2 * cpus) * cpus * page + 2 * 1024
    spec = {"scheme": "t5", "n": 2048, "batch": 1, "heads": 2, "head_dim": 32}
    spec |= {"dtype": "float32", "backward": True, "backend": "auto"}
    for variant in ("floor", "posenc", "reference"):
        run = _variant_run("t5", variant, 2048)
        peak, blocks, small = _events_at_peak(run)
        assert allocation_peak_mib(run) == peak / 2**20  # the bench's reading, by address
        tolerance = (blocks * (page + 16) + max(small, 0) + counters) / 2**20
        with monkeypatch.context() as env:
            env.setenv("MALLOC_PERTURB_", "165")
            resident = _peak_in_subprocess({**spec, "variant": variant})
        assert abs(resident - peak / 2**20) <= tolerance, (variant, resident, peak, tolerance)
        if variant == "reference":  # the largest blocks: the most pages
            untouched = _peak_in_subprocess({**spec, "variant": variant})
            assert untouched <= peak / 2**20 + tolerance, (untouched, peak, tolerance)


def test_memory_from_process_is_refused_off_the_cpu():
    import posenc.cli.bench as bench
    from posenc.cli import build_parser

    with pytest.raises(ValueError, match="memory_from must be one of allocations, process"):
        run_bench(["alibi"], [8], memory_from="rss")
    with pytest.raises(ValueError, match="memory_from='process' measures a fresh process's"):
        run_bench(["alibi"], [8], device="meta", memory_from="process")
    args = build_parser().parse_args(["bench", "--memory", "process", "--schemes", "alibi"])
    bench.check(args)  # on CPU
    with pytest.raises(ValueError) as refused:
        bench.check(argparse.Namespace(**{**vars(args), "device": "cuda"}))
    assert str(refused.value) == (
        "--memory process measures a fresh process's resident set, on CPU only; on --device "
        "cuda leave --memory out (the allocator's peak is measured)"
    )


def test_allocator_thresholds_for_timing_and_memory(monkeypatch):
    """Timing runs under the thresholds glibc reaches by itself in a long-running program
    (mmap 32 MiB, trim twice that); memory under a low mmap threshold and the default trim
    threshold. Both are set together: fixing one by hand freezes glibc's rule for both."""
    import ctypes

    from posenc.cli import _memory

    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibc())
    _memory.set_mmap_threshold(_memory.TIMING_MMAP_THRESHOLD, _memory.TIMING_TRIM_THRESHOLD)
    _memory.set_mmap_threshold(_memory.MEMORY_MMAP_THRESHOLD, _memory.MEMORY_TRIM_THRESHOLD)
    m_mmap_threshold, m_trim_threshold = -3, -1
    assert calls == [
        (m_mmap_threshold, 32 << 20),
        (m_trim_threshold, 64 << 20),
        (m_mmap_threshold, 64 << 10),
        (m_trim_threshold, 128 << 10),
    ]


# ----- the baselines: FlexAttention without a score_mod, the materialised bias ----------------
