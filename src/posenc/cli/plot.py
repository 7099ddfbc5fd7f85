"""``posenc plot KIND --out DIR``: the pictures people draw to understand positional encodings.

Each kind is a function ``plot_<kind>(args) -> list[Path]`` registered in ``KINDS``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..absolute import sinusoidal
from ._figures import pyplot, save


def _cosine_similarity_matrix(table: np.ndarray) -> np.ndarray:
    """``[n, dim] -> [n, n]`` cosine similarity between the position vectors."""
    unit = table / np.linalg.norm(table, axis=-1, keepdims=True).clip(min=1e-12)  # [n, dim]
    return unit @ unit.T  # [n, n]


def plot_sinusoidal(args: argparse.Namespace) -> list[Path]:
    """Three pictures of the sinusoidal table: curves, heat map, cosine similarity."""
    plt = pyplot()
    dim, length = args.dim, args.length
    if dim < 10:
        raise ValueError(f"--dim must be at least 10 to show columns 6-9, got {dim}")
    positions = torch.arange(length)
    table = sinusoidal(positions, dim, base=args.base).numpy()  # [length, dim]
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for col in range(6, 10):
        ax.plot(
            positions, table[:, col], label=f"column {col} ({'sin' if col % 2 == 0 else 'cos'})"
        )
    ax.set_title(f"Sinusoidal encoding: columns 6-9 against position (dim={dim})")
    ax.set_xlabel("position")
    ax.set_ylabel("value")
    ax.legend(loc="upper right", fontsize="small")
    paths += save(fig, args.out, "sinusoidal_columns", args.format)

    fig, ax = plt.subplots(figsize=(7, 4))
    image = ax.imshow(table.T, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, origin="lower")
    ax.set_title(f"Sinusoidal table P (dim={dim}, base={args.base:g})")
    ax.set_xlabel("position")
    ax.set_ylabel("dimension (even: sin, odd: cos)")
    fig.colorbar(image, ax=ax, label="P[position, dimension]")
    paths += save(fig, args.out, "sinusoidal_heatmap", args.format)

    fig, ax = plt.subplots(figsize=(5, 4.3))
    image = ax.imshow(_cosine_similarity_matrix(table), cmap="viridis", vmin=-1, vmax=1)
    ax.set_title("Cosine similarity of position vectors")
    ax.set_xlabel("position j")
    ax.set_ylabel("position i")
    fig.colorbar(image, ax=ax, label="cos(P[i], P[j])")
    paths += save(fig, args.out, "sinusoidal_similarity", args.format)
    return paths


KINDS: dict[str, Callable[[argparse.Namespace], list[Path]]] = {
    "sinusoidal": plot_sinusoidal,
}


def _formats(text: str) -> list[str]:
    formats = [f.strip().lower() for f in text.split(",") if f.strip()]
    bad = [f for f in formats if f not in ("png", "svg")]
    if bad or not formats:
        raise argparse.ArgumentTypeError(f"--format takes png, svg or png,svg; got {text!r}")
    return formats


def run(args: argparse.Namespace) -> int:
    """Run ``posenc plot``: draw the requested kind and print the files written."""
    for path in KINDS[args.kind](args):
        print(path)
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``posenc plot``."""
    parser = commands.add_parser(
        "plot",
        help="draw the pictures that explain a positional scheme",
        description="Draw the pictures that explain a positional scheme, as PNG (or SVG).",
    )
    parser.add_argument("kind", choices=sorted(KINDS), help="what to draw")
    parser.add_argument("--out", type=Path, default=Path("posenc-out"), help="output folder")
    parser.add_argument("--dim", type=int, default=32, help="encoding width (default 32)")
    parser.add_argument("--length", type=int, default=60, help="number of positions (default 60)")
    parser.add_argument("--base", type=float, default=10000.0, help="wavelength base")
    parser.add_argument(
        "--format", type=_formats, default=["png"], help="png, svg or png,svg (default png)"
    )
    parser.set_defaults(run=run)
