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


def test_an_unknown_constant_is_refused_by_name(capsys):
    with pytest.raises(ValueError, match="'GEMM_ROWS' is not a tuning constant; one of: .*"):
        constant_ab.measure("relative", (1, 2, 8, 8), "GEMM_ROWS", [1, 8], 1)
    assert constant_ab.main(["--constant", "GEMM_ROWS", "--values", "1,8"]) == 2
    assert "GEMM_COLUMNS" in capsys.readouterr().err


def test_main_prints_a_table(capsys):
    argv = ["--constant", "SHAW_PAIR_VALUES", "--values", "0,4194304", "--schemes", "shaw"]
    assert constant_ab.main([*argv, "--shapes", "2x2x8x8", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| scheme | b x h x n x d | SHAW_PAIR_VALUES=0 / floor")
    assert lines[2].startswith("| shaw | 2x2x8x8 |") and len(lines) == 3


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit, match="two or more"):
        constant_ab.main(["--constant", "GEMM_COLUMNS", "--values", "8"])
    with pytest.raises(SystemExit):
        constant_ab.main(["--constant", "GEMM_COLUMNS", "--values", "1,8", "--shapes", "2x8"])
