"""Pictures of the models that ``posenc compare --out DIR`` trained and saved.

``compare`` saves the seed-0 model of every (task, scheme) in ``DIR/checkpoints``; these
functions load them back (:func:`~posenc.cli.compare.load_checkpoint`) and draw what they
learned: their attention maps, and the similarity of a learned position table.

Shape legend: ``h`` heads, ``n`` tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from ..absolute import LearnedEncoding
from . import compare
from ._figures import pyplot, save


def checkpoints_in(folder: Path | None) -> dict[str, list[Path]]:
    """The checkpoints in ``folder`` per task, in the order of ``compare.SCHEMES``.

    Raises:
        ValueError: no folder, or no checkpoint in it, with the command that makes them.
    """
    fix = "run `posenc compare --out DIR` first and pass --checkpoints DIR/checkpoints"
    if folder is None:
        raise ValueError(f"--checkpoints is needed for this kind: {fix}")
    files = sorted(Path(folder).glob("*.pt"))
    if not files:
        raise ValueError(f"--checkpoints {folder} holds no checkpoint (*.pt): {fix}")
    order = {name: i for i, name in enumerate(compare.SCHEMES)}
    found: dict[str, list[Path]] = {}
    for path in files:
        found.setdefault(path.stem.partition("-")[0], []).append(path)
    for paths in found.values():
        paths.sort(key=lambda p: order.get(p.stem.partition("-")[2], len(order)))
    return found


@torch.no_grad()
def attention_of(path: Path) -> tuple[str, np.ndarray]:
    """``(scheme, maps [layers, n, n])``: head-averaged attention of one example.

    The example is drawn (seed 0) at the task's training length, as in training.
    """
    model, task, scheme, config = compare.load_checkpoint(path)
    batch = task.sample(1, task.train_length, torch.Generator().manual_seed(0))
    positions = compare.positions_for(task, scheme, config, batch)
    maps = model.attention_maps(
        batch.tokens, causal=task.causal, positions=positions, size=batch.size
    )  # per layer [1, h, n, n]
    return scheme, torch.stack([m[0].mean(0) for m in maps]).numpy()  # [layers, n, n]


def plot_attention(args: argparse.Namespace) -> list[Path]:
    """Attention maps of every trained model, a figure per task: schemes x layers."""
    plt = pyplot()
    paths: list[Path] = []
    for task_name, files in checkpoints_in(args.checkpoints).items():
        results = [attention_of(path) for path in files]
        layers = results[0][1].shape[0]
        columns = 4  # schemes side by side, each with its layers stacked
        rows = -(-len(results) // columns)
        fig, axes = plt.subplots(
            rows * layers,
            columns,
            figsize=(2.6 * columns, 2.5 * rows * layers + 0.6),
            layout="constrained",
            squeeze=False,
        )
        image = None
        for index in range(rows * columns):
            for layer in range(layers):
                ax = axes[(index // columns) * layers + layer][index % columns]
                if index >= len(results):
                    ax.axis("off")
                    continue
                scheme, maps = results[index]
                image = ax.imshow(maps[layer], cmap="magma", vmin=0, vmax=1)
                ax.set_title(f"{scheme}: layer {layer + 1}", fontsize="small")
                ax.set_xticks([])
                ax.set_yticks([])
                if index % columns == 0:
                    ax.set_ylabel("query", fontsize="small")
                ax.set_xlabel("key", fontsize="small")
        task = compare.TASKS[task_name]
        fig.suptitle(
            f"Attention of the trained models on `{task_name}` (one example at "
            f"{task.label(task.train_length)}, mean over heads)"
        )
        if image is not None:
            fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
        paths += save(fig, args.out, f"attention_{task_name}", args.format)
    return paths


def learned_tables(folder: Path | None) -> list[tuple[str, np.ndarray]]:
    """``(task, weight [max_len, dim])`` of every trained ``learned`` scheme."""
    tables = []
    for task_name, files in checkpoints_in(folder).items():
        for path in files:
            if path.stem.partition("-")[2] != "learned":
                continue
            model, *_ = compare.load_checkpoint(path)
            if isinstance(model.encoding, LearnedEncoding):
                tables.append((task_name, model.encoding.weight.detach().numpy()))
    return tables
