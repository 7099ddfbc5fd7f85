"""``posenc bench --processes N``: the measurement run in ``N`` fresh Python processes, one
after another, and each ratio read as its median over them, with its range.

Within one process the variants are interleaved, so that its ratios compare like with
like; but a small call's time moves with the process it runs in (where the allocator put
its buffers, whether the C library handed a freed block back to the system between two
calls: page faults on the next), by 5-30% at a few dozen tokens. Several processes show
that spread, and their median is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ._bench_measure import Case

#: the statement a measuring process runs: it reads the options from its standard input
#: (pickled) and writes its cases as JSON where ``child_out`` says
CHILD = "from posenc.cli.bench import measure_as_child; measure_as_child()"


def in_processes(args: argparse.Namespace, count: int) -> list[list[Case]]:
    """The cases of ``count`` fresh processes measuring ``args``, one after another (each
    with one process, no busy neighbours of its own, no JSON file: the caller writes those).

    Raises:
        OSError: a measuring process failed (its error is on standard error above).
    """
    runs = []
    for index in range(count):
        with tempfile.TemporaryDirectory(prefix="posenc-bench-") as folder:
            out = Path(folder) / "cases.json"
            options = argparse.Namespace(
                **{**vars(args), "processes": 1, "busy": 0, "json": None, "child_out": str(out)}
            )
            done = subprocess.run(
                [sys.executable, "-c", CHILD], input=pickle.dumps(options), check=False
            )
            if done.returncode != 0:
                raise OSError(
                    f"measuring process {index + 1} of {count} exited with status "
                    f"{done.returncode} (its error is printed above)"
                )
            runs.append([Case(**case) for case in json.loads(out.read_text())])
    return runs


def merged(runs: list[list[Case]]) -> list[Case]:
    """One case per row: each variant's median time and peak over the processes that
    measured it (the same rows in the same order in each), the reasons a variant was
    skipped in any of them."""
    cases = []
    for rows in zip(*runs, strict=True):
        first = rows[0]
        case = Case(first.scheme, first.n, first.backend, first.shape)
        for name in ("fwd_bwd_s", "fwd_s", "peak_mib"):
            tables = [getattr(row, name) for row in rows]
            for variant in dict.fromkeys(v for table in tables for v in table):
                values = [t.get(variant) for t in tables]
                known = [v for v in values if v is not None]
                getattr(case, name)[variant] = statistics.median(known) if known else None
        for row in rows:
            case.skipped.update(row.skipped)
        cases.append(case)
    return cases


def spread(
    rows: list[Case], what: str, variant: str, against: str
) -> tuple[float, float, float] | None:
    """``(median, lowest, highest)`` of the processes' ratios of ``variant`` to ``against``
    (:meth:`Case.ratio`) for one row, or None when no process has it."""
    ratios = [r for r in (row.ratio(what, variant, against) for row in rows) if r is not None]
    if not ratios:
        return None
    return statistics.median(ratios), min(ratios), max(ratios)
