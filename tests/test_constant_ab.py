"""tools/constant_ab.py: one tuning constant at several values, timed in one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import constant_ab  # noqa: E402

from posenc.engine import tuning  # noqa: E402


@pytest.mark.parametrize("backward", [False, True])
def test_each_value_is_timed_and_the_constant_restored(monkeypatch, backward):
    before = tuning.GEMM_COLUMNS
    seen = []
    real = constant_ab._core

    def spying(scheme, backend):
        core = real(scheme, backend)
        return lambda q, k, v: seen.append(tuning.GEMM_COLUMNS) or core(q, k, v)

    monkeypatch.setattr(constant_ab, "_core", spying)
    row = constant_ab.measure("relative", (1, 2, 8, 8), "GEMM_COLUMNS", [1, 8], 3, backward)
    assert before == tuning.GEMM_COLUMNS
    assert row["floor"] > 0 and row[1] > 0 and row[8] > 0
    # a first call of each, then the values in turns, their order alternating
    assert seen == [1, 8, 1, 8, 8, 1, 1, 8]
    cells = constant_ab.format_row(row, [1, 8]).split("|")[1:-1]
    assert [c.strip() for c in cells[:2]] == ["relative", "1x2x8x8"] and len(cells) == 5


def _boom(q, k, v):
    raise RuntimeError("boom")


def test_the_constant_is_restored_when_a_call_raises(monkeypatch):
    before = tuning.GEMM_COLUMNS
    monkeypatch.setattr(constant_ab, "_core", lambda scheme, backend: _boom)
    with pytest.raises(RuntimeError, match="boom"):
        constant_ab.measure("relative", (1, 2, 8, 8), "GEMM_COLUMNS", [1, 8], 1)
    assert before == tuning.GEMM_COLUMNS


def test_an_unknown_constant_is_refused_by_name():
    with pytest.raises(ValueError, match="'GEMM_ROWS' is not a tuning constant; one of: .*"):
        constant_ab.measure("relative", (1, 2, 8, 8), "GEMM_ROWS", [1, 8], 1)


def test_main_prints_a_table(capsys):
    argv = ["--constant", "SHAW_PAIR_VALUES", "--values", "0,4194304", "--schemes", "shaw"]
    assert constant_ab.main([*argv, "--shapes", "2x2x8x8", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "| scheme | b x h x n x d | SHAW_PAIR_VALUES=0 / floor | SHAW_PAIR_VALUES=4194304 / "
        "floor | 4194304 / 0 |"
    )
    assert lines[1] == "|---|---|---|---|---|"
    assert lines[2].startswith("| shaw | 2x2x8x8 |") and len(lines[2].split("|")) == 7
    assert len(lines) == 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--constant", "GEMM_ROWS"], "'GEMM_ROWS' is not a tuning constant"),
        (["--values", "8"], "two or more distinct values"),
        (["--values", "8,8"], "two or more distinct values"),
        (["--values", "1.5,8"], "GEMM_COLUMNS is an integer"),
        (["--repeats", "0"], "--repeats must be at least 1, got 0"),
        (["--schemes", "relative,nosuch"], "--schemes: unknown scheme 'nosuch'"),
        (["--shapes", "2x8"], "a shape is b x h x n x d"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_timed(capsys, extra, message):
    argv = ["--constant", "GEMM_COLUMNS", "--values", "1,8"]
    with pytest.raises(SystemExit) as exit_:
        constant_ab.main([*argv, *extra])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
