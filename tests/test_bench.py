"""``posenc bench`` end to end on tiny sizes: the table, the JSON, the options."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from posenc import registry
from posenc.cli import main
from posenc.cli.bench import default_schemes, run_bench


def test_bench_prints_ratios_and_writes_json(tmp_path, capsys):
    record = tmp_path / "bench.json"
    argv = ["bench", "--schemes", "alibi,shaw", "--lengths", "16,32", "--batch", "1"]
    argv += ["--heads", "2", "--head-dim", "8", "--repeats", "1", "--warmup", "0", "--quiet"]
    assert main([*argv, "--json", str(record)]) == 0
    out = capsys.readouterr().out
    assert "| alibi | 16 |" in out and "| shaw | 32 |" in out
    data = json.loads(record.read_text())
    assert [(c["scheme"], c["n"]) for c in data["cases"]] == [
        ("alibi", 16),
        ("shaw", 16),
        ("alibi", 32),
        ("shaw", 32),
    ]
    for case in data["cases"]:
        assert set(case["fwd_bwd_s"]) == {"floor", "posenc", "reference"}
        assert case["ratios"]["time_vs_floor"] > 0
    assert data["config"]["lengths"] == [16, 32] and data["config"]["backward"] is True


def test_every_scheme_runs_forward_only(capsys):
    argv = ["bench", "--lengths", "8", "--batch", "1", "--heads", "2", "--head-dim", "8"]
    argv += ["--repeats", "1", "--warmup", "0", "--no-backward", "--no-memory", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for name in default_schemes():
        assert f"| {name} | 8 |" in out


def test_default_schemes_are_those_bench_always_ran():
    assert default_schemes() == [
        "rotary",
        "alibi",
        "t5",
        "swin-1d",
        "swin-2d",
        "relative",
        "relative-2d",
        "absolute-query",
        "shaw",
    ]


def test_every_scheme_inside_attention_runs_when_named(capsys):
    """bench takes every registry entry inside attention, variants too; old names give
    today's, with a note."""
    names = registry.names(inside=True)
    argv = ["bench", "--lengths", "8", "--batch", "1", "--heads", "2", "--head-dim", "8"]
    argv += ["--repeats", "1", "--warmup", "0", "--no-backward", "--no-memory", "--quiet"]
    assert main([*argv, "--schemes", ",".join(names)]) == 0
    out = capsys.readouterr().out
    for name in names:
        assert f"| {name} | 8 |" in out
    assert main([*argv, "--schemes", "swin"]) == 0
    captured = capsys.readouterr()
    assert "| swin-1d | 8 |" in captured.out
    assert "scheme 'swin' is now called 'swin-1d'" in captured.err


def test_causal_bench_masks_posenc_and_the_floor(tmp_path, capsys, monkeypatch):
    import posenc.cli._bench_variants as variants
    import posenc.cli.bench as bench

    seen = []
    floor = bench._causal_floor
    monkeypatch.setattr(variants, "_causal_floor", lambda *a: seen.append("floor") or floor(*a))
    record = tmp_path / "bench.json"
    argv = ["bench", "--schemes", "alibi", "--lengths", "16", "--batch", "1", "--heads", "2"]
    argv += ["--head-dim", "8", "--repeats", "1", "--warmup", "0", "--no-memory", "--quiet"]
    assert main([*argv, "--causal", "--json", str(record)]) == 0
    assert "causal, median of 1" in capsys.readouterr().out
    assert json.loads(record.read_text())["config"]["causal"] is True
    assert seen  # the floor ran with SDPA's causal flag
    core = bench._core(bench.build_scheme("alibi", 2, 8, 16), "auto", causal=True)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    expected = bench._core(bench.build_scheme("alibi", 2, 8, 16), "math", causal=True)(q, k, v)
    torch.testing.assert_close(core(q, k, v), expected)
    # causal: the first query sees only the first key
    torch.testing.assert_close(expected[:, :, 0], v[:, :, 0])


@pytest.mark.parametrize("causal", [False, True])
def test_padding_bench_masks_posenc_and_the_floor(tmp_path, capsys, sdpa_masks, causal):
    import posenc.cli.bench as bench

    masks, sdpa = sdpa_masks
    record = tmp_path / "bench.json"
    argv = ["bench", "--schemes", "t5", "--lengths", "16", "--batch", "2", "--heads", "2"]
    argv += ["--head-dim", "8", "--repeats", "1", "--warmup", "0", "--no-memory", "--quiet"]
    argv += ["--padding", "0.25", "--json", str(record)] + (["--causal"] if causal else [])
    assert main(argv) == 0
    assert "last sequence 25% padding, median of 1" in capsys.readouterr().out
    assert json.loads(record.read_text())["config"]["padding"] == 0.25
    keep = masks[0]  # the floor's: the last sequence's last 4 keys hidden from every query
    assert keep.shape == ((2, 1, 16, 16) if causal else (2, 1, 1, 16))
    assert not keep[1, ..., 12:].any() and keep[0, ..., -1, :].all()
    assert keep[1, ..., -1, :12].all()
    assert bench._key_padding(2, 16, 0.99, torch.device("cpu"))[1].sum() == 15  # a key left
    scheme = bench.build_scheme("t5", 2, 8, 16)
    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))
    out = bench._core(scheme, "auto", causal, 0.25)(q, k, v)
    torch.testing.assert_close(out, bench._core(scheme, "math", causal, 0.25)(q, k, v))
    # the padded keys count for nothing: the same as that sequence cut short
    short = bench._core(scheme, "math", causal)(q[1:, :, :12], k[1:, :, :12], v[1:, :, :12])
    torch.testing.assert_close(out[1:, :, :12], short)
    if not causal:  # the floor's mask likewise
        torch.testing.assert_close(
            bench._floor_of(False, 0.25)(q, k, v)[1:, :, :12],
            sdpa(q[1:, :, :12], k[1:, :, :12], v[1:, :, :12]),
        )


def test_documents_bench_packs_each_sequence(tmp_path, capsys, sdpa_masks):
    import posenc.cli.bench as bench

    masks, _ = sdpa_masks
    record = tmp_path / "bench.json"
    argv = ["bench", "--schemes", "absolute-query", "--lengths", "12", "--batch", "1"]
    argv += ["--heads", "2", "--head-dim", "8", "--repeats", "1", "--warmup", "0"]
    argv += ["--no-memory", "--quiet", "--documents", "3", "--causal", "--json", str(record)]
    assert main(argv) == 0
    assert "causal, 3 documents a sequence, median of 1" in capsys.readouterr().out
    assert json.loads(record.read_text())["config"]["documents"] == 3
    doc = torch.arange(12) // 4
    expected = (doc[:, None] == doc[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    assert torch.equal(masks[0][0, 0], expected)  # the floor's: three causal documents
    # posenc: each document on its own, its positions from 0 (an absolute scheme sees them)
    scheme = bench.build_scheme("absolute-query", 2, 8, 12)
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    out = bench._core(scheme, "auto", True, 0.0, 3)(q, k, v)
    torch.testing.assert_close(out, bench._core(scheme, "math", True, 0.0, 3)(q, k, v))
    for first in (0, 4, 8):
        part = slice(first, first + 4)
        alone = bench._core(scheme, "math", True)(q[:, :, part], k[:, :, part], v[:, :, part])
        torch.testing.assert_close(out[:, :, part], alone)


def test_window_bench_masks_posenc_and_the_floor(tmp_path, capsys, sdpa_masks):
    import posenc.cli.bench as bench

    masks, _ = sdpa_masks
    record = tmp_path / "bench.json"
    argv = ["bench", "--schemes", "alibi", "--lengths", "12", "--batch", "1", "--heads", "2"]
    argv += ["--head-dim", "8", "--repeats", "1", "--warmup", "0", "--no-memory", "--quiet"]
    argv += ["--window", "3", "--causal", "--json", str(record)]
    assert main(argv) == 0
    assert "causal, window 3, median of 1" in capsys.readouterr().out
    assert json.loads(record.read_text())["config"]["window"] == 3
    i = torch.arange(12)
    band = (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < 3)
    assert torch.equal(masks[0][0, 0], band)  # the floor's: the causal window
    scheme = bench.build_scheme("alibi", 2, 8, 12)
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    out = bench._core(scheme, "auto", True, window=3)(q, k, v)
    torch.testing.assert_close(out, bench._core(scheme, "math", True, window=3)(q, k, v))
    # the last query sees its own key and the two before it, nothing else
    alone = bench._core(scheme, "math", True)(q[:, :, 9:], k[:, :, 9:], v[:, :, 9:])
    torch.testing.assert_close(out[:, :, -1], alone[:, :, -1])


@pytest.fixture
def no_bench(monkeypatch):
    """The benchmark fails the test if it starts."""
    import posenc.cli.bench as bench

    def started(*args, **kwargs):
        raise AssertionError("the benchmark started before the arguments were checked")

    monkeypatch.setattr(bench, "run_bench", started)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schemes", "rope"], "argument --schemes: unknown scheme"),
        (["--device", "tpu9"], "argument --device: unknown device 'tpu9'"),
        (["--padding", "1"], "argument --padding: must be a fraction of the keys in [0, 1)"),
        (["--padding", "lots"], "must be a fraction of the keys in [0, 1) (0.25: a quarter), "),
        (["--documents", "0"], "argument --documents: must be >= 1, got 0"),
        (["--documents", "2,3"], "argument --documents: must be an integer >= 1, got '2,3'"),
        (["--batch", "0"], "argument --batch: must be >= 1, got 0"),
        (["--heads", "-2"], "argument --heads: must be >= 1, got -2"),
        (["--head-dim", "0"], "argument --head-dim: must be >= 1, got 0"),
        (["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        (["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
        (["--lengths", "512,0"], "argument --lengths: must be comma-separated integers >= 1"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--backend", "fast"], "argument --backend: invalid choice: 'fast'"),
        (
            ["--baselines", "flex,flx"],
            "argument --baselines: unknown baseline 'flx'; use a comma-separated list of "
            "flex, materialised (e.g. flex,materialised)",
        ),
    ],
)
def test_bad_options(argv, message, capsys, no_bench):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("posenc bench: error: ") and message in err


def refused_before_measuring(argv, capsys) -> str:
    """``posenc bench argv`` ends with status 2 and one error line; return it."""
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("posenc bench: error: ") and err.count("\n") == 1, err
    return err.strip()


def test_flex_with_the_backward_on_cpu_is_refused(capsys, no_bench, tmp_path):
    """FlexAttention has no CPU backward (torch 2.13): bench, which times forward+backward,
    used to fail in torch's code at the first case (the JSON never written)."""
    record = tmp_path / "bench.json"
    argv = ["--backend", "flex", "--schemes", "alibi", "--json", str(record)]
    line = refused_before_measuring(argv, capsys)
    assert line == (
        "posenc bench: error: --backend flex cannot time the backward on CPU (FlexAttention "
        f"in torch {torch.__version__.split('+')[0]} has no CPU backward, and bench times "
        "forward+backward); add --no-backward to time the forward only, run on a GPU with "
        "--device cuda, or use --backend auto, lean or math"
    )
    assert not record.exists()


def test_flex_runs_where_it_can(monkeypatch):
    """Forward only on CPU, and forward+backward on CUDA, flex goes on to the benchmark."""
    import posenc.cli.bench as bench
    from posenc.cli import build_parser

    args = build_parser().parse_args(["bench", "--backend", "flex", "--schemes", "alibi,rotary"])
    bench.check(argparse.Namespace(**{**vars(args), "device": "cuda"}))  # no error
    # on CUDA flex also takes a query term of bounded reach and one of the key alone
    on_cuda = argparse.Namespace(**{**vars(args), "device": "cuda", "schemes": default_schemes()})
    with pytest.raises(ValueError) as refused:
        bench.check(on_cuda)
    assert str(refused.value) == (
        "--backend flex cannot run --schemes relative-2d,shaw (FlexAttention takes a query "
        "term only with a bounded reach (flex_term_mod) or of the key alone (key_shift); "
        "FlexAttention has no value term, which Shaw's a^V needs); use --backend auto, lean "
        "or math, or --schemes rotary,alibi,t5,swin-1d,swin-2d,relative,absolute-query"
    )
    args = build_parser().parse_args(
        ["bench", "--backend", "flex", "--schemes", "alibi", "--no-backward", "--quiet"]
    )
    calls = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: calls.append(kw) or [])
    monkeypatch.setattr(bench, "format_table", lambda *a, **kw: "")
    assert args.run(args) == 0
    assert calls[0]["backend"] == "flex" and calls[0]["backward"] is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--backend", "flex", "--no-backward"],
            "--backend flex cannot run --schemes relative-2d,shaw (FlexAttention takes a query "
            "term only with a bounded reach (flex_term_mod) or of the key alone (key_shift); "
            "FlexAttention has no value term, which Shaw's a^V needs); use --backend auto, lean "
            "or math, or --schemes rotary,alibi,t5,swin-1d,swin-2d,relative,absolute-query",
        ),
        (
            ["--backend", "sdpa", "--schemes", "alibi,shaw"],
            "--backend sdpa cannot run --schemes shaw (SDPA has no value term, which Shaw's "
            "a^V needs); use --backend auto, lean or math, or --schemes rotary,alibi,t5,",
        ),
        (
            ["--head-dim", "7", "--schemes", "alibi,rotary"],
            "--schemes rotary cannot be built with --heads 8 --head-dim 7: head_dim must be "
            "even (channels are rotated in pairs), got 7; use 8 or 6",
        ),
    ],
)
def test_a_scheme_the_run_cannot_serve_is_refused(argv, message, capsys, no_bench):
    """These used to fail at the first case of the scheme, after the others were timed."""
    assert message in refused_before_measuring(argv, capsys)


# ----- peak memory: in this process from the allocation events, or in a fresh process ------


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


def _tiny(*extra: str) -> list[str]:
    argv = ["bench", "--lengths", "16", "--batch", "2", "--heads", "2", "--head-dim", "8"]
    return [*argv, "--repeats", "1", "--warmup", "0", "--no-memory", "--quiet", *extra]


def test_materialised_baseline_columns_json_and_skip_reason(tmp_path, capsys):
    """materialised runs forward+backward on CPU; a scheme with a content term is skipped
    with its reason, in the JSON and under the table."""
    record = tmp_path / "bench.json"
    argv = _tiny("--schemes", "alibi,rotary,shaw", "--baselines", "materialised", "--causal")
    assert main([*argv, "--json", str(record)]) == 0
    out = capsys.readouterr().out
    assert "to SDPA with the dense bias as attn_mask (materialised)" in out
    header = next(line for line in out.splitlines() if line.startswith("| scheme"))
    assert (
        header.endswith("| fwd+bwd time / materialised | peak memory / materialised |")
        and "flex-floor" not in header
    )
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert all(row.count("|") == header.count("|") for row in rows)
    assert "| shaw | 16 |" in out and out.count("| n/a | n/a |") >= 1
    reason = "a content-dependent term (score_term, value_term): no attn_mask can carry it"
    assert f"materialised skipped for shaw (n = 16): {reason}" in out
    data = json.loads(record.read_text())
    assert data["config"]["baselines"] == ["materialised"]
    cases = {c["scheme"]: c for c in data["cases"]}
    for name in ("alibi", "rotary"):
        assert set(cases[name]["fwd_bwd_s"]) == {"floor", "posenc", "reference", "materialised"}
        assert cases[name]["ratios"]["time_vs_materialised"] > 0
        assert cases[name]["ratios"]["fwd_time_vs_materialised"] > 0
        assert "time_vs_flex_floor" not in cases[name]["ratios"]
    assert "materialised" not in cases["shaw"]["fwd_bwd_s"]
    assert cases["shaw"]["skipped"]["materialised"].startswith(reason)
    assert cases["shaw"]["ratios"]["time_vs_materialised"] is None


def test_no_baselines_keep_the_table_as_it_was(capsys):
    assert main(_tiny("--schemes", "alibi")) == 0
    out = capsys.readouterr().out
    assert "materialised" not in out and "flex-floor" not in out
    assert (
        "| scheme | n | fwd+bwd time / floor | fwd-only time / floor | peak memory / floor "
        "| fwd+bwd time / reference | peak memory / reference |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n| alibi | 16 |"
    ) in out


@pytest.mark.parametrize(
    ("masks", "schemes"),
    [
        ({}, ["alibi", "t5", "swin-1d", "swin-2d", "rotary"]),
        ({"causal": True, "padding": 0.25}, ["t5", "swin-2d", "rotary"]),
        ({"causal": True, "documents": 2}, ["alibi", "rotary"]),
        ({"window": 3}, ["t5"]),
    ],
)
def test_materialised_baseline_is_the_same_attention(masks, schemes):
    """SDPA with the dense bias computes what posenc does, masks and restarting positions
    included; the bias's gradient reaches a learned table."""
    import posenc.cli.bench as bench

    q, k, v = (torch.randn(2, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    for name in schemes:
        scheme = bench.build_scheme(name, 2, 8, 16).double()
        expected = bench._core(scheme, "math", **masks)(q, k, v)
        torch.testing.assert_close(bench._materialised_of(scheme, **masks)(q, k, v), expected)
    scheme = bench.build_scheme("t5", 2, 8, 16)
    bench._materialised_of(scheme, **masks)(q.float(), k.float(), v.float()).sum().backward()
    assert all(p.grad is not None for p in scheme.parameters())


def test_materialised_peak_is_measured_like_the_others():
    """The fresh-process memory measurement knows the new variants."""
    from posenc.cli.bench import _peak_of_case

    spec = {"scheme": "alibi", "n": 64, "batch": 1, "heads": 2, "head_dim": 8}
    spec |= {"dtype": "float32", "backward": True, "backend": "auto", "causal": True}
    peak = _peak_of_case({**spec, "variant": "materialised"})
    assert peak is None or peak >= 0


@pytest.mark.compile
def test_flex_floor_baseline_forward_on_cpu(tmp_path, capsys):
    """The flex floor: compiled FlexAttention, no score_mod, the floor's mask as a BlockMask
    (the same attention as the floor); on CPU forward only."""
    import posenc.cli.bench as bench

    record = tmp_path / "bench.json"
    argv = _tiny("--schemes", "alibi", "--baselines", "flex,materialised", "--no-backward")
    argv += ["--causal", "--documents", "2", "--padding", "0.25", "--json", str(record)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "to FlexAttention without a score_mod (flex-floor), to SDPA with" in out
    assert (
        "| fwd time / reference | peak memory / reference | fwd time / flex-floor "
        "| peak memory / flex-floor | fwd time / materialised | peak memory / materialised |"
    ) in out
    (case,) = json.loads(record.read_text())["cases"]
    assert set(case["fwd_bwd_s"]) == {"floor", "posenc", "reference", "flex-floor", "materialised"}
    assert case["ratios"]["time_vs_flex_floor"] > 0 and case["skipped"] == {}
    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))
    with torch.no_grad():
        flex = bench._flex_floor_of(True, 0.25, 2)(q, k, v)
    torch.testing.assert_close(flex, bench._floor_of(True, 0.25, 2)(q, k, v))


def test_flex_baseline_with_the_backward_on_cpu_is_refused(capsys, no_bench):
    line = refused_before_measuring(["--baselines", "flex,materialised"], capsys)
    assert line == (
        "posenc bench: error: --baselines flex cannot time the backward on CPU (FlexAttention "
        f"in torch {torch.__version__.split('+')[0]} has no CPU backward, and bench times "
        "forward+backward); add --no-backward to time the forward only, run on a GPU with "
        "--device cuda, or leave flex out (--baselines materialised)"
    )


def test_a_variant_out_of_memory_is_skipped_with_the_reason(monkeypatch):
    """On a GPU the materialised bias at n = 16384 may not fit: that variant is dropped from
    its case with the reason (here after its warm-up), the others measured."""
    import posenc.cli._bench_variants as variants
    import posenc.cli.bench as bench

    calls = []

    def materialised_of(scheme, *masks):
        def run(q, k, v):
            calls.append(1)
            if len(calls) > 1:
                raise torch.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total "
                    "capacity of 79.19 GiB of which 1.00 GiB is free."
                )
            return bench._floor(q, k, v)

        return run

    monkeypatch.setattr(variants, "_materialised_of", materialised_of)
    cases = bench.run_bench(
        ["alibi"], [16], batch=1, heads=2, head_dim=8, repeats=2, warmup=1, memory=False,
        baselines=["materialised"],
    )  # fmt: skip
    (case,) = cases
    assert set(case.fwd_bwd_s) == {"floor", "posenc", "reference"}
    assert case.skipped == {
        "materialised": "out of memory on cpu: CUDA out of memory. Tried to allocate 8.00 GiB"
    }
    table = bench.format_table(cases)
    assert "| alibi | 16 |" in table and table.splitlines()[2].endswith("| n/a | n/a |")
    assert table.splitlines()[-1] == (
        "materialised skipped for alibi (n = 16): out of memory on cpu: CUDA out of memory. "
        "Tried to allocate 8.00 GiB"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bench_with_every_baseline(tmp_path, capsys):
    """What tools/gpu_check.sh runs, small: on the GPU, forward+backward, memory."""
    record = tmp_path / "bench.json"
    argv = ["bench", "--device", "cuda", "--dtype", "bfloat16", "--schemes", "alibi,rotary"]
    argv += ["--lengths", "256", "--repeats", "2", "--causal", "--no-reference", "--quiet"]
    argv += ["--baselines", "flex,materialised", "--json", str(record)]
    for backend in ("auto", "flex"):
        assert main([*argv, "--backend", backend]) == 0
        assert "on cuda (" in capsys.readouterr().out
        data = json.loads(record.read_text())
        assert data["config"]["gpu"]
        for case in data["cases"]:
            assert set(case["fwd_bwd_s"]) == {"floor", "posenc", "flex-floor", "materialised"}
            assert all(case["peak_mib"][k] > 0 for k in case["fwd_bwd_s"]), case
            assert case["ratios"]["time_vs_flex_floor"] > 0
