"""Matplotlib set-up shared by the commands that draw: off-screen backend, saving, heat maps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


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


def annotate(
    ax: Any,
    image: Any,
    values: np.ndarray,
    labels: np.ndarray | None = None,
    *,
    fontsize: float = 9,
    muted: np.ndarray | None = None,
) -> None:
    """Write a label in every cell of a heat map drawn by ``ax.imshow``.

    The text is black on light cells and white on dark ones (by the cell colour's
    luminance), so every number stays readable whatever the colour map.

    Args:
        ax: the axes the heat map is on.
        image: what ``ax.imshow`` returned (its colour map and norm colour the cells).
        values: ``[rows, cols]`` the values drawn.
        labels: ``[rows, cols]`` strings to write; default ``values`` formatted with ``:g``.
        fontsize: text size in points.
        muted: ``[rows, cols]`` bool, True where the label is written in grey (cells
            drawn faded).
    """
    for (row, col), value in np.ndenumerate(values):
        red, green, blue, _ = image.cmap(image.norm(value))
        light = 0.299 * red + 0.587 * green + 0.114 * blue > 0.5
        if muted is not None and muted[row, col]:
            color = "0.45"
        else:
            color = "black" if light else "white"
        text = f"{value:g}" if labels is None else str(labels[row, col])
        ax.text(
            col,
            row,
            text,
            ha="center",
            va="center",
            fontsize=fontsize,
            color=color,
        )


def fade(ax: Any, mask: np.ndarray, *, strength: float = 0.75) -> None:
    """Cover the cells of a heat map where ``mask [rows, cols]`` is True with translucent white."""
    overlay = np.zeros((*mask.shape, 4))
    overlay[mask] = (1.0, 1.0, 1.0, strength)
    ax.imshow(overlay, interpolation="nearest")


def outline_rows(ax: Any, mask: np.ndarray, *, color: str = "black", width: float = 2.0) -> None:
    """Draw a box around the run of True cells of each row of ``mask [rows, cols]``."""
    from matplotlib.patches import Rectangle

    for row, cols in enumerate(mask):
        hits = np.flatnonzero(cols)
        if hits.size:
            ax.add_patch(
                Rectangle(
                    (hits[0] - 0.5, row - 0.5),
                    hits[-1] - hits[0] + 1,
                    1,
                    fill=False,
                    edgecolor=color,
                    linewidth=width,
                    zorder=3,
                    clip_on=False,
                )
            )


def cell_grid(ax: Any, rows: int, cols: int, *, color: str = "white", width: float = 0.8) -> None:
    """Draw thin lines between the cells of a ``[rows, cols]`` heat map."""
    ax.set_xticks(np.arange(cols + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(rows + 1) - 0.5, minor=True)
    ax.grid(which="minor", color=color, linewidth=width)
    ax.tick_params(which="minor", length=0)
