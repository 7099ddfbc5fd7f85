"""``posenc bench``'s report: the Markdown table of ratios, the peer's grid (a row per
shape or length, a column per scheme), the floor's own times under it, why a baseline
was skipped, and the JSON record (:func:`format_table`, :func:`format_grid`,
:func:`to_json`).

Each ratio divides a variant's time or peak memory by the floor's (plain SDPA without
positions), the literal reference's or a baseline's, measured beside it in the same run;
with ``--processes`` the median over the processes and the range
(:func:`~posenc.cli._bench_processes.spread`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ._bench_measure import REFERENCE_SKIPPED, Case
from ._bench_processes import spread
from ._bench_variants import BASELINES


def _fmt(value: float | None, suffix: str = "x") -> str:
    return "n/a" if value is None else f"{value:.2f}{suffix}"


def _baselines_in(cases: Sequence[Case]) -> list[str]:
    """The baseline variants (:data:`BASELINES`) that the run had, measured or skipped."""
    return [
        key
        for key in BASELINES.values()
        if any(key in case.fwd_bwd_s or key in case.skipped for case in cases)
    ]


def _cell(case: Case, rows: list[Case] | None, what: str, variant: str, against: str) -> str:
    """A table cell: ``variant``'s ratio to ``against``; with several processes' ``rows``,
    the median of their ratios and the range (``1.02x (0.97-1.06)``)."""
    if rows is None:
        return _fmt(case.ratio(what, variant, against))
    found = spread(rows, what, variant, against)
    if found is None:
        return "n/a"
    median, low, high = found
    return f"{median:.2f}x ({low:.2f}-{high:.2f})"


def format_table(
    cases: Sequence[Case], *, backward: bool = True, runs: Sequence[Sequence[Case]] | None = None
) -> str:
    """A Markdown table: ratios to the floor, and to the literal reference (and to each
    baseline of the run: time, forward-only time when the backward is timed, and peak
    memory); where the peer was timed (for one row at least), its time ratios again as a
    grid of shapes (or lengths) and schemes (:func:`format_grid`); the floor's own times;
    then why a baseline (or a variant that ran out of memory) was skipped. With ``runs``
    (the cases of each process of ``--processes``, row for row as ``cases``) each ratio is
    their median, with its range."""
    what = "fwd+bwd" if backward else "fwd"
    baselines = _baselines_in(cases)
    shaped = any(case.shape for case in cases)  # --shapes: a first column names the preset
    head = (
        f"| {'shape | ' if shaped else ''}scheme | n | {what} time / floor "
        f"| fwd-only time / floor | peak memory / floor "
        f"| {what} time / reference | peak memory / reference |"
    )
    per_baseline = [("time", what)] + ([("fwd", "fwd-only")] if backward else [])
    per_baseline.append(("memory", "peak memory"))
    head += "".join(
        f" {label} {'' if kind == 'memory' else 'time '}/ {key} |"
        for key in baselines
        for kind, label in per_baseline
    )
    columns = 5 + len(per_baseline) * len(baselines)
    rule = ("|---" if shaped else "") + "|---|---:" + "|---:" * columns + "|"
    lines = [head, rule]
    for index, case in enumerate(cases):
        rows = None if runs is None else [run[index] for run in runs]
        cells = [
            _cell(case, rows, "time", "posenc", "floor"),
            _cell(case, rows, "fwd", "posenc", "floor"),
            _cell(case, rows, "memory", "posenc", "floor"),
            _cell(case, rows, "time", "posenc", "reference"),
            _cell(case, rows, "memory", "posenc", "reference"),
        ]
        cells += [
            _cell(case, rows, kind, "posenc", key) for key in baselines for kind, _ in per_baseline
        ]
        shape = f"{case.shape} | " if shaped else ""
        lines.append(f"| {shape}{case.scheme} | {case.n} | " + " | ".join(cells) + " |")
    timed = cases if runs is None else [case for run in runs for case in run]
    if any("peer" in case.fwd_bwd_s for case in timed):  # not where it was skipped throughout
        lines += ["", *format_grid(cases, "peer", backward=backward, runs=runs)]
    floors = _floor_lines(cases, backward=backward, runs=runs)
    if floors:
        lines += ["", *floors]
    # why, grouped: "materialised skipped for shaw (n = 16, 32): ..."
    skipped: dict[tuple[str, str], dict[str, list[int]]] = {}
    for case in cases:
        for key, reason in case.skipped.items():
            if key == "reference" and reason == REFERENCE_SKIPPED:
                continue  # as it always was: n/a in the reference's columns
            skipped.setdefault((key, reason), {}).setdefault(case.scheme, []).append(case.n)
    if skipped:
        lines.append("")
    for (key, reason), where in skipped.items():
        at = ", ".join(f"{s} (n = {', '.join(map(str, ns))})" for s, ns in where.items())
        lines.append(f"{key} skipped for {at}: {reason}")
    return "\n".join(lines)


def format_grid(
    cases: Sequence[Case],
    against: str,
    *,
    backward: bool = True,
    runs: Sequence[Sequence[Case]] | None = None,
) -> list[str]:
    """posenc's time as a ratio to a baseline's, as a Markdown grid: a row per shape (per
    length without ``--shapes``) and a column per scheme, the layout of a sweep over
    ``--shapes``.

    Args:
        cases: the rows of :func:`format_table`, one per shape (or length) and scheme.
        against: the baseline (``"peer"``).
        backward: whether the backward was timed: each cell is then ``fwd+bwd (forward
            only)``, the table's two time columns for the baseline; else its one, the
            forward's.
        runs: the cases of each process of ``--processes``, row for row as ``cases``: each
            cell is then the median of their ratios (as :func:`format_table`'s).

    Returns:
        The grid's lines, its title first; empty cells where the run has no ratio (the
        baseline skipped, or a variant out of memory).
    """
    what = "fwd+bwd" if backward else "fwd"
    schemes = list(dict.fromkeys(case.scheme for case in cases))
    grid: dict[str, dict[str, str]] = {}
    for index, case in enumerate(cases):
        rows = [case] if runs is None else [run[index] for run in runs]
        ratios = [spread(rows, kind, "posenc", against) for kind in ("time", "fwd")]
        time, fwd = (None if found is None else found[0] for found in ratios)
        cell = ""
        if time is not None:
            cell = f"{time:.2f}" + (f" ({fwd:.2f})" if backward and fwd is not None else "")
        grid.setdefault(case.shape or f"n={case.n}", {})[case.scheme] = cell
    shaped = any(case.shape for case in cases)
    title = f"{what} time / {against}" + (f" (fwd-only time / {against})" if backward else "")
    medians = "the medians, " if runs is not None else ""
    lines = [
        f"{title}, {medians}a row per {'shape' if shaped else 'length'}:",
        "",
        f"| {'shape' if shaped else 'n'} | " + " | ".join(schemes) + " |",
        "|---|" + "---:|" * len(schemes),
    ]
    for shape, cells in grid.items():
        lines.append(f"| {shape} | " + " | ".join(cells.get(s, "") for s in schemes) + " |")
    return lines


def _floor_lines(
    cases: Sequence[Case], *, backward: bool, runs: Sequence[Sequence[Case]] | None
) -> list[str]:
    """A line per shape and length: the floor's own time per call in milliseconds, which
    every ratio divides by (each row measures it beside its scheme: the median over the
    rows and processes, and the range), so that a process whose floor ran slow can be
    told from a scheme that did: on a shared CPU a process keeps one state, and the
    ratios of small calls move with it. Where rows measured the copy floor, a second line
    gives its time as a ratio to the floor (:func:`_copy_floor_part`)."""
    kinds = [("fwd+bwd", "fwd_bwd_s"), ("forward", "fwd_s")] if backward else [("fwd", "fwd_bwd_s")]
    seen: dict[tuple[str, int], list[Case]] = {}  # every row's floor, of every process
    for index, case in enumerate(cases):
        rows = [case] if runs is None else [run[index] for run in runs]
        seen.setdefault((case.shape, case.n), []).extend(rows)
    lines = []
    for (shape, n), rows in seen.items():
        parts = []
        for label, attr in kinds:
            times = sorted(t * 1e3 for t in (getattr(r, attr).get("floor") for r in rows) if t)
            if not times:
                continue
            low_high = f" ({times[0]:.3f}-{times[-1]:.3f})" if len(times) > 1 else ""
            parts.append(f"{label} {statistics.median(times):.3f} ms{low_high}")
        where = f"{shape} n={n}" if shape else f"n={n}"
        if parts:
            lines.append(f"floor (plain SDPA) per call at {where}: " + ", ".join(parts))
        copies = _copy_floor_part(rows, kinds)
        if copies:
            lines.append(
                f"copy-floor (the floor on copies of q and k) / floor at {where}: {copies}"
            )
    return lines


def _copy_floor_part(rows: list[Case], kinds: list[tuple[str, str]]) -> str:
    """The copy floor's time as a ratio to the floor, each kind's median over ``rows``
    (the rotary schemes' rows of a shape and length, of every process) with the range;
    empty where no row measured it."""
    parts = []
    for label, attr in kinds:
        what = "fwd" if attr == "fwd_s" else "time"
        ratios = sorted(
            r for r in (row.ratio(what, "copy-floor", "floor") for row in rows) if r is not None
        )
        if ratios:
            low_high = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else ""
            parts.append(f"{label} {statistics.median(ratios):.2f}x{low_high}")
    return ", ".join(parts)


def to_json(
    cases: Sequence[Case],
    config: dict[str, Any],
    runs: Sequence[Sequence[Case]] | None = None,
) -> dict[str, Any]:
    """The cases with their ratios (with ``runs``, the processes of ``--processes``: the
    median of their ratios, their range under ``"ranges"``, and each process's cases)."""
    baselines = _baselines_in(cases)
    named = [
        ("time_vs_floor", "time", "floor"),
        ("fwd_time_vs_floor", "fwd", "floor"),
        ("memory_vs_floor", "memory", "floor"),
        ("time_vs_reference", "time", "reference"),
        ("memory_vs_reference", "memory", "reference"),
    ]
    for key in baselines:  # time_vs_flex_floor, ..., memory_vs_materialised
        name = key.replace("-", "_")
        named += [
            (f"time_vs_{name}", "time", key),
            (f"fwd_time_vs_{name}", "fwd", key),
            (f"memory_vs_{name}", "memory", key),
        ]
    out_rows = []
    for index, case in enumerate(cases):
        row = asdict(case)
        if runs is None:
            row["ratios"] = {label: case.ratio(w, "posenc", a) for label, w, a in named}
        else:
            rows = [run[index] for run in runs]
            found = {label: spread(rows, w, "posenc", a) for label, w, a in named}
            row["ratios"] = {label: None if f is None else f[0] for label, f in found.items()}
            row["ranges"] = {label: None if f is None else f[1:] for label, f in found.items()}
        out_rows.append(row)
    result: dict[str, Any] = {"config": config, "cases": out_rows}
    if runs is not None:
        result["processes"] = [[asdict(case) for case in run] for run in runs]
    return result
