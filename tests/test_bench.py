"""``posenc bench`` end to end on tiny sizes: the table, the JSON, the options."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from posenc import registry
from posenc.cli import main
from posenc.cli.bench import default_schemes


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
            "flex, materialised, peer, copies (e.g. flex,materialised)",
        ),
        (
            ["--shapes", "swin,vit"],
            "argument --shapes: unknown shape 'vit'; use a comma-separated list of swin, bert, "
            "small, 512, 2048, 4096 (e.g. swin,bert,512)",
        ),
        (["--busy", "-1"], "argument --busy: must be >= 0, got -1"),
        (["--busy", "two"], "argument --busy: must be an integer >= 0"),
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
        header.endswith(
            "| fwd+bwd time / materialised | fwd-only time / materialised "
            "| peak memory / materialised |"
        )
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


@pytest.mark.compile
def test_compile_times_every_variant_compiled(tmp_path, capsys):
    """--compile: each variant (the floor, posenc, the reference, a baseline) runs under
    torch.compile, its graphs built anew for the case; recorded in the header and the
    JSON's config."""
    from torch._dynamo.utils import counters

    import posenc.cli._bench_measure as measure

    record = tmp_path / "bench.json"
    argv = _tiny("--schemes", "rotary", "--baselines", "materialised", "--no-backward")
    argv += ["--warmup", "1"]  # (after _tiny's --warmup 0: the last one counts)
    counters.clear()
    wrapped = []
    real = measure.compiled

    def spy(fn):
        wrapped.append(fn)
        return real(fn)

    measure.compiled = spy
    try:
        assert main([*argv, "--compile", "--json", str(record)]) == 0
    finally:
        measure.compiled = real
        torch._dynamo.reset()
    assert "every variant under torch.compile" in capsys.readouterr().out
    saved = json.loads(record.read_text())
    assert saved["config"]["compile"] is True
    (case,) = saved["cases"]
    assert set(case["fwd_s"]) == {"floor", "posenc", "reference", "materialised"}
    assert len(wrapped) == 4
    assert counters["stats"]["unique_graphs"] >= 4  # a graph at least per variant
    fn = real(measure._variant("floor", None, "auto"))
    assert fn._torchdynamo_orig_callable is not None  # a Dynamo-compiled function


def test_compile_without_a_warmup_is_refused(capsys, no_bench):
    line = refused_before_measuring(["--compile", "--warmup", "0"], capsys)
    assert line == (
        "posenc bench: error: --compile needs --warmup 1 or more, got --warmup 0: each "
        "variant compiles in its first call, which a timed repeat would then include"
    )


def test_compiled_variant_equals_eager():
    """compiled: the variant under torch.compile, the same output."""
    import posenc.cli._bench_measure as measure

    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    fn = measure._variant(
        "posenc", registry.build("alibi", registry.Shape(2, 4, 8, (2, 4))), "auto"
    )
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = measure.compiled(fn)(q, k, v)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, fn(q, k, v))


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


# ----- --shapes and --busy ----------------------------------------------------------------------


@pytest.fixture
def tiny_shapes(monkeypatch):
    """Two tiny presets in place of :data:`SHAPES` (a 3x3 grid and a 4x4 one)."""
    import posenc.cli.bench as bench

    monkeypatch.setattr(bench, "SHAPES", {"wee": (2, 2, 9, 4), "tiny": (1, 4, 16, 8)})


def test_shapes_run_each_preset_in_a_column(tmp_path, capsys, tiny_shapes):
    """Each preset runs with its own b, h, n, d (--lengths and the sizes ignored), a 2-D
    scheme on the squarest grid of its n; the table and the JSON name the preset."""
    record = tmp_path / "bench.json"
    argv = ["bench", "--shapes", "tiny,wee", "--schemes", "alibi,swin-2d", "--lengths", "512"]
    argv += ["--batch", "7", "--repeats", "1", "--warmup", "0", "--no-memory", "--quiet"]
    assert main([*argv, "--json", str(record)]) == 0
    out = capsys.readouterr().out
    assert "posenc bench: shapes tiny: b=1 h=4 n=16 d=8; wee: b=2 h=2 n=9 d=4, float32" in out
    lines = out.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("| shape | scheme | n |")))
    assert lines[head + 1] == "|---|---|---:" + "|---:" * 5 + "|"
    rows = [line.split(" | ")[:3] for line in lines[head + 2 : head + 6]]
    assert rows == [
        ["| tiny", "alibi", "16"],
        ["| tiny", "swin-2d", "16"],
        ["| wee", "alibi", "9"],
        ["| wee", "swin-2d", "9"],
    ]
    data = json.loads(record.read_text())
    assert data["config"]["shapes"] == {
        "tiny": {"b": 1, "h": 4, "n": 16, "d": 8},
        "wee": {"b": 2, "h": 2, "n": 9, "d": 4},
    }
    assert [(c["shape"], c["scheme"], c["n"]) for c in data["cases"]] == [
        ("tiny", "alibi", 16),
        ("tiny", "swin-2d", 16),
        ("wee", "alibi", 9),
        ("wee", "swin-2d", 9),
    ]


def test_a_preset_a_scheme_cannot_take_is_refused(capsys, no_bench, monkeypatch):
    import posenc.cli.bench as bench

    monkeypatch.setattr(bench, "SHAPES", {"odd": (1, 2, 8, 3)})
    line = refused_before_measuring(["--shapes", "odd", "--schemes", "rotary"], capsys)
    assert line.startswith(
        "posenc bench: error: --shapes odd (b=1 h=2 n=8 d=3): --schemes rotary cannot be built "
        "with --heads 2 --head-dim 3: head_dim must be even"
    )


def test_busy_neighbours_run_during_the_block_and_stop_after():
    from posenc.cli._bench_measure import busy_neighbours

    with busy_neighbours(2) as neighbours:
        assert len(neighbours) == 2 and all(p.poll() is None for p in neighbours)
    assert all(p.poll() is not None for p in neighbours)
    with pytest.raises(RuntimeError, match="measurement failed"), busy_neighbours(1) as neighbours:
        raise RuntimeError("measurement failed")
    assert neighbours[0].poll() is not None  # stopped all the same
    with busy_neighbours(0) as neighbours:
        assert neighbours == []
    no = r"count must be an int >= 0 \(0: no neighbours\), got -1"
    with pytest.raises(ValueError, match=no), busy_neighbours(-1):
        pass


def test_bench_with_a_busy_neighbour(tmp_path, capsys, monkeypatch):
    """``--busy 1``: one neighbour while the cases are measured, gone afterwards; the
    header and the JSON record it."""
    import posenc.cli.bench as bench

    started = []
    real = bench.busy_neighbours

    def spy(count):
        manager = real(count)
        neighbours = manager.__enter__()
        started.extend(neighbours)
        assert all(p.poll() is None for p in neighbours)
        return _Entered(manager, neighbours)

    monkeypatch.setattr(bench, "busy_neighbours", spy)
    record = tmp_path / "bench.json"
    assert main(_tiny("--schemes", "alibi", "--busy", "1", "--json", str(record))) == 0
    assert "1 busy neighbour process, median of 1" in capsys.readouterr().out
    assert json.loads(record.read_text())["config"]["busy"] == 1
    assert len(started) == 1 and started[0].poll() is not None


def test_the_openmp_settings_are_recorded(monkeypatch, tmp_path, capsys):
    """How OpenMP's threads wait (set in the environment) moves the figures taken beside
    busy neighbours: the header and the JSON say what was set, and only that."""
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    record = tmp_path / "bench.json"
    assert main(_tiny("--schemes", "alibi", "--json", str(record))) == 0
    assert "GOMP_SPINCOUNT" not in capsys.readouterr().out
    assert json.loads(record.read_text())["config"]["openmp"] == {}
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    assert main(_tiny("--schemes", "alibi", "--json", str(record))) == 0
    assert "GOMP_SPINCOUNT=10000, median of 1" in capsys.readouterr().out
    assert json.loads(record.read_text())["config"]["openmp"] == {"GOMP_SPINCOUNT": "10000"}


class _Entered:
    """A context manager already entered: ``with`` gives ``value`` and exits ``manager``."""

    def __init__(self, manager, value):
        self.manager, self.value = manager, value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return self.manager.__exit__(*exc)


def test_a_fast_variant_is_timed_over_calls_in_a_row(monkeypatch):
    """A timed sample of a variant faster than SAMPLE_S is the mean of enough calls in a row
    to last SAMPLE_S (counted from its warm-up, then from its last sample: a slow first
    call, as a compilation makes, sets one call for the first sample only), each call's
    gradients cleared before the next, the forward-only sample without grad; without a
    warm-up each sample is one call."""
    from posenc.cli import _bench_measure as measure

    counts = {"fast": 0, "slow": 0, "cold": 0}
    modes = []
    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])

    def variant(key, seconds, first=None):
        def run(q, k, v):
            assert q.grad is None  # the last call's gradient cleared
            counts[key] += 1
            clock[0] += first if first is not None and counts[key] == 1 else seconds
            modes.append(torch.is_grad_enabled())
            return (q * k * v).sum()

        return run

    fast = measure.SAMPLE_S / 50
    variants = {
        "fast": variant("fast", fast),
        "slow": variant("slow", 1.0),
        "cold": variant("cold", fast, first=2.0),
    }
    sizes = {"batch": 1, "heads": 1, "head_dim": 2, "dtype": torch.float32}
    case = measure.Case("none", 3, "auto")
    device = torch.device("cpu")
    measure._measure_case(case, variants, sizes, device, True, 1, 3, None)
    # one warm-up (fwd+bwd and fwd), then three repeats of 50 calls each way; the cold
    # variant's first fwd+bwd sample is one call, from its 2 s warm-up
    assert counts == {"fast": 2 + 3 * 2 * 50, "slow": 2 + 3 * 2, "cold": 2 + 1 + 50 * 5}
    assert modes.count(False) == counts["fast"] // 2 + counts["slow"] // 2 + 1 + 50 * 3
    assert case.fwd_bwd_s["fast"] == pytest.approx(fast)
    assert case.fwd_bwd_s["cold"] == pytest.approx(fast)  # the median of three
    assert case.fwd_s["slow"] == pytest.approx(1.0)
    counts.update(fast=0, slow=0, cold=0)
    measure._measure_case(case, variants, sizes, device, False, 0, 3, None)
    assert counts == {"fast": 6, "slow": 6, "cold": 6}
    assert measure._calls(0.0) == measure.SAMPLE_CALLS
    assert measure._calls(measure.SAMPLE_S * 0.67) == 2  # at least SAMPLE_S: rounded up


def test_copy_floor_baseline_columns_ratio_line_and_skip_reason(tmp_path, capsys):
    """copies adds the copy floor for a rotary scheme (its columns, its ratio to the floor
    under the table, the JSON's ratios) and skips a scheme without a rotation with why."""
    record = tmp_path / "bench.json"
    argv = _tiny("--schemes", "rotary,alibi", "--baselines", "copies", "--json", str(record))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "to SDPA on copies of q and k, their gradients copied back (copy-floor)" in out
    header = next(line for line in out.splitlines() if line.startswith("| scheme"))
    assert header.endswith(
        "| fwd+bwd time / copy-floor | fwd-only time / copy-floor | peak memory / copy-floor |"
    )
    assert "copy-floor (the floor on copies of q and k) / floor at n=16: fwd+bwd " in out
    reason = "no rotation: the copy floor is a yardstick for rotating q and k"
    assert f"copy-floor skipped for alibi (n = 16): {reason}" in out
    cases = {c["scheme"]: c for c in json.loads(record.read_text())["cases"]}
    assert set(cases["rotary"]["fwd_bwd_s"]) == {"floor", "posenc", "reference", "copy-floor"}
    assert cases["rotary"]["ratios"]["time_vs_copy_floor"] > 0
    assert cases["rotary"]["ratios"]["fwd_time_vs_copy_floor"] > 0
    assert cases["alibi"]["skipped"]["copy-floor"] == reason
    assert cases["alibi"]["ratios"]["time_vs_copy_floor"] is None


@pytest.mark.parametrize(
    "masks",
    [{}, {"causal": True, "padding": 0.25}, {"causal": True, "documents": 2}, {"window": 3}],
)
def test_copy_floor_is_the_floor_on_copies(masks, monkeypatch):
    """The copy floor hands SDPA copies of q and k (v as it is) made by :class:`_Copied`,
    and computes the floor's attention, the floor's gradients too, each passed back
    through a copy of its own."""
    import torch.nn.functional as F

    import posenc.cli.bench as bench
    from posenc.cli._bench_variants import _Copied

    q, k, v = (torch.randn(2, 2, 16, 8, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    expected = bench._floor_of(**masks)(q, k, v)
    wanted = torch.autograd.grad(expected.square().sum(), (q, k, v))
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(args[:3])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out = bench._copy_floor_of(**masks)(q, k, v)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (got_q, got_k, got_v), *_ = seen
    assert got_q.data_ptr() != q.data_ptr() and got_k.data_ptr() != k.data_ptr()
    assert got_v is v and torch.equal(got_q, q) and torch.equal(got_k, k)
    assert {type(x.grad_fn).__name__ for x in (got_q, got_k)} == {"_CopiedBackward"}
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    for a, b in zip(got, wanted, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    grad = torch.randn(3, 4)
    back = _Copied.backward(None, grad)
    assert back.data_ptr() != grad.data_ptr() and torch.equal(back, grad)


def test_lengths_and_schemes_named_twice_are_measured_once(capsys):
    """``--lengths`` and ``--schemes`` keep each value once, in the order first given (an old
    scheme name and today's are one scheme), as ``--shapes`` and ``--baselines`` do: a row
    each, and one cell each in the peer's grid."""
    from posenc.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "--lengths", "512,64,512", "--schemes", "swin,t5,swin-1d,t5"]
    )
    assert args.lengths == [512, 64]
    assert args.schemes == ["swin-1d", "t5"]
    assert "now called 'swin-1d'" in capsys.readouterr().err
