"""Matplotlib set-up shared by the commands that draw: off-screen backend, saving."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """Import matplotlib's pyplot with the off-screen Agg backend.

    Raises:
        ImportError: matplotlib is missing, with the command that installs it.
    """
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("plotting needs matplotlib: pip install 'posenc[plot]'") from err
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, out: Path, name: str, formats: Sequence[str]) -> list[Path]:
    """Save ``fig`` as ``out/name.<fmt>`` for each format, close it, return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out / f"{name}.{fmt}"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        paths.append(path)
    pyplot().close(fig)
    return paths
