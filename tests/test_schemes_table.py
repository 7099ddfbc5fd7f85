"""docs/schemes.md holds the table that tools/schemes_table.py measures from the code today."""

from __future__ import annotations

import sys
from pathlib import Path

from posenc import registry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import schemes_table  # noqa: E402


def test_every_registry_entry_has_a_row_and_every_class_a_paper():
    rows = schemes_table.rows()
    assert len(rows) == len(registry.SCHEMES)
    for name, row in zip(registry.SCHEMES, rows, strict=True):
        assert row.startswith(f"| `{name}` |")
        if name != "none":
            assert row.rstrip(" |").split(" | ")[-1], f"{name}: no paper in PAPERS"


def test_the_table_says_what_the_code_does():
    by_name = {row.split(" | ")[0].strip("| `"): row for row in schemes_table.rows()}
    assert "`offset-bias`" in by_name["alibi"] and "`grid-bias`" in by_name["swin-2d"]
    assert "raises: its table ends" in by_name["learned"]
    assert "any length" in by_name["alibi"] and "any map" in by_name["rotary-2d"]
    assert "`r1` [8], `r2` [8]" in by_name["kerple-log"]


def test_docs_table_matches_the_code():
    doc = (ROOT / "docs" / "schemes.md").read_text()
    assert schemes_table.table() in doc, (
        "docs/schemes.md is stale: paste the output of `.venv/bin/python "
        "tools/schemes_table.py` over its table"
    )
