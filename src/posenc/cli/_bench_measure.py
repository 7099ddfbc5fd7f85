"""How ``posenc bench`` measures: :func:`run_bench`, which times the variants of
:mod:`posenc.cli._bench_variants` interleaved, case by case, into a :class:`Case` each.

- timing: :func:`_time_once` (the mean of a few calls in a row of the forward, or
  forward+backward: at least :data:`SAMPLE_S` seconds), :func:`_measure_case` (warm-up,
  then the medians over repeats of every variant of a case) and
  :class:`_OutOfMemory` (a variant that runs out of memory is dropped with the reason);
- peak memory, in a run of its own after the timed ones: on CUDA the allocator's peak, on
  CPU the peak of the bytes torch allocated, from the profiler's allocation events
  (:class:`posenc.cli._memory.PeakMemory`); or, with ``memory_from="process"`` (CPU), the
  growth of the peak resident set in a fresh Python process per variant and case
  (:func:`_peak_in_subprocess`, running :func:`_peak_of_case`);
- the literal reference's memory budget (:data:`REFERENCE_BUDGET`), and FlexAttention's
  recompile limit while it runs (:func:`_flex_recompiles`);
- busy neighbours (:func:`busy_neighbours`): processes spinning matrix products beside the
  measurement, as a shared machine has them.

Shape legend: ``b`` batch, ``h`` heads, ``n`` length, ``d`` head dim.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..engine import release_workspace
from ..shaw import ShawRelativePosition
from ._bench_peers import peer_problem
from ._bench_variants import (
    BASELINES,
    _copy_floor_problem,
    _inputs,
    _materialised_problem,
    _variant,
    build_scheme,
    compiled,
)
from ._memory import MEMORY_MMAP_THRESHOLD, MEMORY_TRIM_THRESHOLD, PeakMemory, status_kib
from ._progress import Progress

# ----- the literal reference's budget ------------------------------------------------------


#: bytes a literal reference may need before it is skipped
REFERENCE_BUDGET = 6 * 2**30


def _reference_bytes(scheme: Any, b: int, h: int, n: int, d: int, itemsize: int) -> int:
    """What the literal reference keeps for its backward, roughly."""
    scores = 6 * b * h * n * n * itemsize  # scores, weights, masks and their grads
    if isinstance(scheme, ShawRelativePosition):
        scores += 6 * n * n * d * itemsize  # a^K, a^V and their grads, [n, n, d] each
    return scores


# ----- measuring ---------------------------------------------------------------------------


#: where peak memory on CPU comes from (:func:`run_bench`'s ``memory_from``)
MEMORY_FROM = ("allocations", "process")

# glibc's thresholds are fixed before anything else, torch's import included: from then on
# every block of 64 KiB or more is its own mmap, returned to the system on free
_MEMORY_SCRIPT = f"""
import ctypes, json, sys
try:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, {MEMORY_MMAP_THRESHOLD})  # M_MMAP_THRESHOLD
    libc.mallopt(-1, {MEMORY_TRIM_THRESHOLD})  # M_TRIM_THRESHOLD
except (OSError, AttributeError):
    pass
from posenc.cli._bench_measure import _peak_of_case
print(json.dumps(_peak_of_case(json.loads(sys.argv[1]))))
"""


def _peak_of_case(spec: dict[str, Any]) -> float | None:
    """Peak resident-set growth (MiB) of one forward(+backward) of one variant, in this process.

    Run by :func:`_peak_in_subprocess` in a fresh interpreter whose allocator returns every
    large block on free, so that the resident set follows what is live.
    """
    dtype = getattr(torch, spec["dtype"])
    scheme = build_scheme(spec["scheme"], spec["heads"], spec["head_dim"], spec["n"])
    masks = {k: spec[k] for k in ("causal", "padding", "documents", "window") if k in spec}
    run = _variant(spec["variant"], scheme, spec["backend"], **masks)
    if spec.get("compile"):
        run = compiled(run)
    args = (spec["batch"], spec["heads"], spec["n"], spec["head_dim"], dtype)
    inputs = _inputs(*args, torch.device("cpu"), spec["backward"])
    _time_once(run, inputs, spec["backward"], torch.device("cpu"))  # warm-up: lazy init
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset the peak resident set to the current one
    except OSError:
        return None
    start = status_kib("VmRSS") or 0
    _time_once(run, inputs, spec["backward"], torch.device("cpu"))
    return ((status_kib("VmHWM") or 0) - start) / 1024


def _peak_in_subprocess(spec: dict[str, Any]) -> float | None:
    """:func:`_peak_of_case` in a fresh Python process (None when it cannot measure).

    One process per variant and case: in a long-running one, blocks freed by earlier cases
    are reused from the heap and a peak reads as 0. Each costs an interpreter and torch's
    import (2-4 s on 2 cores): ``memory_from="process"`` of :func:`run_bench` only.
    """
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0 or not result.stdout.strip():
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


@dataclass
class Case:
    """One (scheme, length) row of the benchmark; ``shape`` names its ``--shapes`` preset
    (``""`` without one)."""

    scheme: str
    n: int
    backend: str
    shape: str = ""
    fwd_bwd_s: dict[str, float] = field(default_factory=dict)
    fwd_s: dict[str, float] = field(default_factory=dict)
    peak_mib: dict[str, float | None] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def ratio(self, what: str, variant: str, against: str = "floor") -> float | None:
        table = {"time": self.fwd_bwd_s, "fwd": self.fwd_s, "memory": self.peak_mib}[what]
        a, b = table.get(variant), table.get(against)
        if a is None or b is None or b <= 0:
            return None
        return a / b


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: the least time one timed sample lasts: a variant faster than this is called that many
#: times more in a row and timed by their mean (a single call of a fraction of a
#: millisecond, run after another variant's, is timed cold, with a timer's resolution)
SAMPLE_S = 0.02

#: the most calls one timed sample takes
SAMPLE_CALLS = 200


def _time_once(
    fn: Callable[..., Tensor], inputs: list[Tensor], backward: bool, device, calls: int = 1
) -> float:
    """The mean time of ``calls`` calls in a row of ``fn`` (and its backward), in seconds."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*inputs)
        if backward:
            out.backward(torch.ones_like(out))
            for t in inputs:
                t.grad = None
        del out  # one call's output alive at a time, as in the memory measurement
    _sync(device)
    elapsed = time.perf_counter() - start
    for t in inputs:
        t.grad = None
    return elapsed / calls


def _calls(seconds: float) -> int:
    """How many calls of a variant that took ``seconds`` make one timed sample."""
    # (rounded first, so that a ratio of 50.000000000001 is 50 calls, not 51)
    return max(1, min(SAMPLE_CALLS, math.ceil(round(SAMPLE_S / max(seconds, 1e-9), 6))))


def run_bench(
    schemes: Sequence[str],
    lengths: Sequence[int],
    *,
    batch: int = 2,
    heads: int = 8,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backward: bool = True,
    backend: str = "auto",
    repeats: int = 3,
    warmup: int = 1,
    reference: bool = True,
    memory: bool = True,
    memory_from: str = "allocations",
    causal: bool = False,
    padding: float = 0.0,
    documents: int = 1,
    window: int | None = None,
    baselines: Sequence[str] = (),
    compile: bool = False,
    progress: Progress | None = None,
) -> list[Case]:
    """Benchmark ``schemes`` at ``lengths``; see :mod:`posenc.cli.bench` for what is measured.

    ``causal=True`` measures causal attention (a causal mask for posenc and the reference,
    SDPA's own causal flag for the floor). ``padding`` pads the end of the batch's last
    sequence by that fraction of its keys (``key_padding`` for posenc and the reference, a
    boolean mask for the floor); ``documents`` packs that many documents in each sequence
    (``q_doc``/``k_doc``, positions restarting in each; the floor's boolean mask keeps each
    document to itself); ``window`` restricts each query to the keys less than ``window``
    tokens away (behind it, and ahead when not causal). ``memory=False`` skips the
    peak-memory measurement; the memory columns then read n/a. On CPU peak memory is by
    default the peak of the bytes that torch allocated during one forward(+backward)
    (``memory_from="allocations"``, the profiler's allocation events, in this process);
    ``memory_from="process"`` measures instead the growth of the peak resident set in a
    fresh Python process per variant and case (Linux; 2-4 s each). ``baselines`` adds
    variants, from
    :data:`BASELINES`: ``"flex"`` (``flex-floor``), ``"materialised"``, ``"peer"`` (the
    scheme as other code computes it, :mod:`posenc.cli._bench_peers`; skipped with the
    reason where none is written or its package is missing) and ``"copies"``
    (``copy-floor``: the floor on copies of ``q`` and ``k``, for a rotary scheme; skipped
    with the reason for the others); the flex floor times the backward only on CUDA
    (FlexAttention has none on CPU).

    ``compile=True`` times every variant under :func:`torch.compile` (:func:`compiled`:
    static shapes, Dynamo's caches emptied before each case, so that each case compiles
    its own graphs, in its first warm-up call), as in a compiled model.

    On CUDA a variant that runs out of memory is dropped from its case with the reason
    (in :attr:`Case.skipped`), and the others are measured.

    Returns:
        One :class:`Case` per (scheme, length).

    Raises:
        ValueError: ``memory_from`` is not one of :data:`MEMORY_FROM`, or is ``"process"``
            on a device other than the CPU.
    """
    device = torch.device(device)
    if memory_from not in MEMORY_FROM:
        raise ValueError(
            f"memory_from must be one of {', '.join(MEMORY_FROM)}, got {memory_from!r}"
        )
    in_process = memory_from == "allocations"
    if not in_process and device.type != "cpu":
        raise ValueError(
            f"memory_from='process' measures a fresh process's resident set, on CPU only; "
            f"on {device.type} leave memory_from='allocations' (the allocator's peak)"
        )
    peak = PeakMemory(device)
    extra = [BASELINES[b] for b in baselines]
    masks = (causal, padding, documents, window)
    sizes = {"batch": batch, "heads": heads, "head_dim": head_dim, "dtype": dtype}
    cases: list[Case] = []
    with _flex_recompiles(backend == "flex" or "flex-floor" in extra):
        for index, (n, name) in enumerate((n, s) for n in lengths for s in schemes):
            if progress is not None:
                progress.update(index, f"{name:<15} n={n:<5}")
            scheme = build_scheme(name, heads, head_dim, n)
            if isinstance(scheme, torch.nn.Module):
                scheme = scheme.to(device=device)
            case = Case(name, n, backend)
            keys = ["floor", "posenc"]
            itemsize = torch.finfo(dtype).bits // 8
            if reference and _reference_bytes(scheme, batch, heads, n, head_dim, itemsize) <= (
                REFERENCE_BUDGET
            ):
                keys.append("reference")
            elif reference:
                case.skipped["reference"] = REFERENCE_SKIPPED
            for key in extra:
                problem = None
                if key == "materialised":
                    problem = _materialised_problem(scheme)
                elif key == "peer":
                    problem = peer_problem(scheme, documents)
                elif key == "copy-floor":
                    problem = _copy_floor_problem(scheme)
                if problem is None:
                    keys.append(key)
                else:
                    case.skipped[key] = problem
            variants = {key: _variant(key, scheme, backend, *masks) for key in keys}
            if compile:
                torch.compiler.reset()  # this case's graphs alone: no recompile limit
                variants = {key: compiled(fn) for key, fn in variants.items()}
            meter = peak if memory and in_process else None
            _measure_case(case, variants, sizes, device, backward, warmup, repeats, meter)
            if memory and not in_process:
                spec = {"scheme": name, "n": n, "batch": batch, "heads": heads}
                spec |= {"head_dim": head_dim, "dtype": str(dtype).removeprefix("torch.")}
                spec |= {"backward": backward, "backend": backend}
                spec |= {"causal": causal, "padding": padding, "documents": documents}
                spec |= {"window": window, "compile": compile}
                for key in case.fwd_bwd_s:
                    case.peak_mib[key] = _peak_in_subprocess({**spec, "variant": key})
            cases.append(case)
    if progress is not None:
        progress.finish("cases measured")
    return cases


def _measure_case(
    case: Case,
    variants: dict[str, Callable[..., Tensor]],
    sizes: dict[str, Any],
    device: torch.device,
    backward: bool,
    warmup: int,
    repeats: int,
    peak: PeakMemory | None,
) -> None:
    """Time ``variants`` interleaved into ``case``, then measure their peak memory with
    ``peak`` (one more run each, apart from the timed ones); a variant that runs out of
    memory is dropped with the reason."""
    b, h, d, dtype = sizes["batch"], sizes["heads"], sizes["head_dim"], sizes["dtype"]
    inputs = _inputs(b, h, case.n, d, dtype, device, backward)
    guard = _OutOfMemory(case, variants, inputs, device)
    samples: dict[str, list[float]] = {k: [] for k in variants}
    fwd_samples: dict[str, list[float]] = {k: [] for k in variants}

    # calls per timed sample: from each variant's last warm-up (one call without one),
    # then from its last sample (a first call that compiled or initialised something
    # lazily sets one call for the first sample only)
    calls: dict[str, tuple[int, int]] = {k: (1, 1) for k in variants}

    def warm(key: str, fn: Callable[..., Tensor]) -> None:
        fwd_bwd = _time_once(fn, inputs, backward, device)
        with torch.no_grad():
            fwd = _time_once(fn, inputs, False, device)
        calls[key] = (_calls(fwd_bwd), _calls(fwd))

    def timed(key: str, fn: Callable[..., Tensor]) -> None:
        fwd_bwd = _time_once(fn, inputs, backward, device, calls[key][0])
        with torch.no_grad():
            fwd = _time_once(fn, inputs, False, device, calls[key][1])
        samples[key].append(fwd_bwd)
        fwd_samples[key].append(fwd)
        if warmup:
            calls[key] = (_calls(fwd_bwd), _calls(fwd))

    def measured(meter: PeakMemory, key: str, fn: Callable[..., Tensor]) -> None:
        release_workspace()  # the buffer a forward without gradients keeps counts as its own
        case.peak_mib[key] = meter.measure(lambda: _time_once(fn, inputs, backward, device))

    for _ in range(warmup):
        for key, fn in list(variants.items()):
            guard(key, functools.partial(warm, key, fn))
    for _ in range(repeats):  # interleaved: each repeat runs every variant once
        for key, fn in list(variants.items()):
            guard(key, functools.partial(timed, key, fn))
    if peak is not None:
        for key, fn in list(variants.items()):
            guard(key, functools.partial(measured, peak, key, fn))
    for key in variants:  # those that did not run out of memory
        case.fwd_bwd_s[key] = statistics.median(samples[key])
        case.fwd_s[key] = statistics.median(fwd_samples[key])


#: why a reference is skipped in a run that keeps it
REFERENCE_SKIPPED = "does not fit the memory budget"


class _OutOfMemory:
    """``guard(key, run)`` calls ``run`` (a step of variant ``key``); if it runs out of
    memory, the variant is dropped from ``variants`` with the reason in ``case.skipped``,
    the inputs' gradients and the allocator's cache freed, and the run goes on."""

    def __init__(
        self, case: Case, variants: dict[str, Any], inputs: list[Tensor], device: torch.device
    ) -> None:
        self.case, self.variants, self.inputs, self.device = case, variants, inputs, device

    def __call__(self, key: str, run: Callable[[], object]) -> None:
        try:
            run()
            return
        except torch.OutOfMemoryError as err:
            # "CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has ...": the first two
            failed = ". ".join(str(err).split(". ")[:2]).strip() or "out of memory"
        # out of the except block: the traceback's frames (and their tensors) are gone
        self.variants.pop(key, None)
        self.case.peak_mib.pop(key, None)
        self.case.skipped[key] = f"out of memory on {self.device}: {failed}"
        for t in self.inputs:
            t.grad = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def _flex_recompiles(flex: bool, limit: int = 64):
    """Raise dynamo's recompile limit while FlexAttention runs: the compiled function is
    shared by every scheme, length and the flex floor (one graph each, ``dynamic=False``);
    past the default limit (8) dynamo falls back to eager FlexAttention, which writes the
    full scores and would be timed in place of the kernel."""
    if not flex:
        yield
        return
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(recompile_limit=max(limit, dynamo_config.recompile_limit)):
        yield


# ----- busy neighbours --------------------------------------------------------------------

# one thread spinning float32 matrix products until it is stopped
_BUSY_SCRIPT = """
import numpy as np
a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
while True:
    a = np.tanh(a @ a)
"""


@contextlib.contextmanager
def busy_neighbours(count: int):
    """Run ``count`` neighbour processes while the block runs, each one thread spinning
    matrix products (numpy, ``OMP_NUM_THREADS=1``), and stop them after it, whatever
    happens in it.

    Yields:
        The neighbours' :class:`subprocess.Popen` objects (none for ``count == 0``).

    Raises:
        ValueError: ``count < 0``.
    """
    import os
    import subprocess
    import sys

    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0 (0: no neighbours), got {count!r}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    env |= {"MKL_NUM_THREADS": "1"}
    neighbours: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            neighbours.append(
                subprocess.Popen(
                    [sys.executable, "-c", _BUSY_SCRIPT],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield neighbours
    finally:
        for process in neighbours:
            process.terminate()
        for process in neighbours:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
