"""docs/errors.md lists each bad input with the message the code raises today."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import errors_table  # noqa: E402


def test_every_case_raises_a_clear_error():
    for what, call in errors_table.CASES:
        try:
            call()
        except (ValueError, TypeError) as err:
            text = str(err)
            assert len(text) > 20, (what, text)
        else:
            raise AssertionError(f"{what}: no error")


def test_docs_table_matches_the_code():
    doc = (ROOT / "docs" / "errors.md").read_text()
    assert errors_table.table() in doc, (
        "docs/errors.md is stale: regenerate its table with "
        "`.venv/bin/python tools/errors_table.py`"
    )
