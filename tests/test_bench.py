"""``posenc bench`` end to end on tiny sizes: the table, the JSON, the options."""

from __future__ import annotations

import json

import pytest
import torch

from posenc.cli import main
from posenc.cli.bench import SCHEMES


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
    for name in SCHEMES:
        assert f"| {name} | 8 |" in out


def test_causal_bench_masks_posenc_and_the_floor(tmp_path, capsys, monkeypatch):
    import posenc.cli.bench as bench

    seen = []
    floor = bench._causal_floor
    monkeypatch.setattr(bench, "_causal_floor", lambda *a: seen.append("floor") or floor(*a))
    record = tmp_path / "bench.json"
    argv = ["bench", "--schemes", "alibi", "--lengths", "16", "--batch", "1", "--heads", "2"]
    argv += ["--head-dim", "8", "--repeats", "1", "--warmup", "0", "--no-memory", "--quiet"]
    assert main([*argv, "--causal", "--json", str(record)]) == 0
    assert "causal, median of 1" in capsys.readouterr().out
    assert json.loads(record.read_text())["config"]["causal"] is True
    assert seen  # the floor ran with SDPA's causal flag
    core = bench._core(bench.SCHEMES["alibi"](2, 8, 16), "auto", causal=True)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    expected = bench._core(bench.SCHEMES["alibi"](2, 8, 16), "math", causal=True)(q, k, v)
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
    scheme = bench.SCHEMES["t5"](2, 8, 16)
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
    scheme = bench.SCHEMES["absolute-query"](2, 8, 12)
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    out = bench._core(scheme, "auto", True, 0.0, 3)(q, k, v)
    torch.testing.assert_close(out, bench._core(scheme, "math", True, 0.0, 3)(q, k, v))
    for first in (0, 4, 8):
        part = slice(first, first + 4)
        alone = bench._core(scheme, "math", True)(q[:, :, part], k[:, :, part], v[:, :, part])
        torch.testing.assert_close(out[:, :, part], alone)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schemes", "rope"], "unknown scheme"),
        (["--device", "tpu9"], "unknown device 'tpu9'"),
        (["--padding", "1"], "expected a fraction of the keys in [0, 1)"),
        (["--padding", "lots"], "expected a number, got 'lots'"),
        (["--documents", "0"], "expected a positive integer, got '0'"),
        (["--documents", "2,3"], "expected a positive integer, got '2,3'"),
    ],
)
def test_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="Linux")
def test_peak_memory_is_measured_in_a_fresh_process():
    """The floor's peak is positive and the literal reference's is above the lean engine's."""
    from posenc.cli.bench import _peak_in_subprocess

    spec = {"scheme": "t5", "n": 2048, "batch": 1, "heads": 2, "head_dim": 32}
    spec |= {"dtype": "float32", "backward": True, "backend": "auto"}
    peaks = {
        v: _peak_in_subprocess({**spec, "variant": v}) for v in ("floor", "posenc", "reference")
    }
    assert peaks["floor"] is not None and peaks["floor"] > 0
    one_score_matrix_mib = 1 * 2 * 2048 * 2048 * 4 / 2**20
    assert peaks["reference"] > 2 * one_score_matrix_mib > peaks["posenc"], peaks


def test_allocator_thresholds_for_timing_and_memory(monkeypatch):
    """Timing runs under the thresholds glibc reaches by itself in a long-running program
    (mmap 32 MiB, trim twice that); memory under a low mmap threshold and the default trim
    threshold. Both are set together: fixing one by hand freezes glibc's rule for both."""
    import ctypes

    from posenc.cli import bench

    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibc())
    bench._set_mmap_threshold(bench.TIMING_MMAP_THRESHOLD, bench.TIMING_TRIM_THRESHOLD)
    bench._set_mmap_threshold(bench.MEMORY_MMAP_THRESHOLD, bench.MEMORY_TRIM_THRESHOLD)
    m_mmap_threshold, m_trim_threshold = -3, -1
    assert calls == [
        (m_mmap_threshold, 32 << 20),
        (m_trim_threshold, 64 << 20),
        (m_mmap_threshold, 64 << 10),
        (m_trim_threshold, 128 << 10),
    ]
