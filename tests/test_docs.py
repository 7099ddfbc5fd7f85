"""Every ```python block of the README and docs/*.md runs, in order, per file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


@pytest.mark.parametrize("path", [p for p in DOCS if blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(path):
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for number, code in enumerate(blocks(path), start=1):
        exec(compile(code, f"{path.name}[block {number}]", "exec"), namespace)
