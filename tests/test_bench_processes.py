"""``posenc bench --processes N`` (:mod:`posenc.cli._bench_processes`): the measurement in
fresh processes, each ratio the median of theirs with its range."""

from __future__ import annotations

import json

import pytest

import posenc.cli._bench_processes as processes
from posenc.cli import main
from posenc.cli._bench_measure import Case
from posenc.cli.bench import format_table


def _case(floor: float, posenc: float, peer: float | None, skipped: dict | None = None) -> Case:
    times = {"floor": floor, "posenc": posenc} | ({} if peer is None else {"peer": peer})
    return Case(
        "alibi",
        16,
        "auto",
        "small",
        fwd_bwd_s=dict(times),
        fwd_s={k: t / 2 for k, t in times.items()},
        peak_mib={"floor": 10.0, "posenc": 12.0, "peer": 11.0},
        skipped=skipped or {},
    )


def test_merged_takes_each_variants_median_and_every_reason():
    """A variant the first process did not measure (out of memory there) is the median of
    the others'."""
    runs = [
        [_case(3.0, 3.0, None, {"peer": "out of memory"})],
        [_case(1.0, 2.0, 1.0)],
        [_case(2.0, 7.0, 4.0)],
    ]
    (case,) = processes.merged(runs)
    assert case.fwd_bwd_s == {"floor": 2.0, "posenc": 3.0, "peer": 2.5}  # peer: two known
    assert case.fwd_s["posenc"] == 1.5
    assert case.skipped == {"peer": "out of memory"}
    assert (case.scheme, case.n, case.shape) == ("alibi", 16, "small")


def test_spread_is_the_median_ratio_and_its_range():
    rows = [_case(1.0, 2.0, 1.0), _case(3.0, 3.0, None), _case(2.0, 7.0, 4.0)]
    assert processes.spread(rows, "time", "posenc", "floor") == (2.0, 1.0, 3.5)
    assert processes.spread(rows, "time", "posenc", "peer") == (1.875, 1.75, 2.0)
    assert processes.spread(rows, "time", "posenc", "reference") is None


def test_the_table_shows_the_median_and_the_range_of_each_ratio():
    runs = [[_case(1.0, 2.0, 1.0)], [_case(3.0, 3.0, 2.0)], [_case(2.0, 7.0, 4.0)]]
    table = format_table(processes.merged(runs), runs=runs)
    row = table.splitlines()[2]
    assert row.startswith("| small | alibi | 16 | 2.00x (1.00-3.50) | 2.00x (1.00-3.50) |")
    assert "| n/a | n/a |" in row  # no reference measured
    assert row.endswith("| 1.75x (1.50-2.00) | 1.75x (1.50-2.00) | 1.09x (1.09-1.09) |")


def test_processes_measure_in_fresh_processes_and_report_ranges(tmp_path, capsys):
    """Two processes: the table's cells read ``median (lowest-highest)``; the JSON keeps the
    medians, the ranges and each process's cases."""
    record = tmp_path / "bench.json"
    argv = ["bench", "--lengths", "16", "--batch", "1", "--heads", "2", "--head-dim", "8"]
    argv += ["--schemes", "alibi", "--repeats", "1", "--warmup", "0", "--no-memory"]
    argv += ["--quiet", "--no-reference", "--processes", "2", "--json", str(record)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "in each of 2 processes the median of 1" in out
    row = next(line for line in out.splitlines() if line.startswith("| alibi"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    low, high = map(float, cells[2].split("(")[1].rstrip(")").split("-"))
    median = float(cells[2].split("x")[0])
    assert low <= median <= high
    written = json.loads(record.read_text())
    assert written["config"]["processes"] == 2
    assert len(written["processes"]) == 2
    (case,) = written["cases"]
    first, last = case["ranges"]["time_vs_floor"]
    assert first <= case["ratios"]["time_vs_floor"] <= last
    times = [run[0]["fwd_bwd_s"]["posenc"] for run in written["processes"]]
    assert case["fwd_bwd_s"]["posenc"] == pytest.approx(sum(times) / 2)


def test_a_failing_process_is_an_os_error(monkeypatch, capsys):
    monkeypatch.setattr(processes, "CHILD", "import sys; sys.exit(3)")
    argv = ["bench", "--lengths", "16", "--batch", "1", "--heads", "2", "--head-dim", "8"]
    argv += ["--schemes", "alibi", "--quiet", "--processes", "2"]
    assert main(argv) == 1
    assert "measuring process 1 of 2 exited with status 3" in capsys.readouterr().err
