"""Pictures of the models that ``posenc compare --out DIR`` trained and saved.

``compare`` saves the seed-0 model of every (task, scheme) in ``DIR/checkpoints``; these
functions load them back (:func:`~posenc.experiments.training.load_checkpoint`) and draw
what they learned: their attention maps, and the similarity of a learned position table.

Shape legend: ``h`` heads, ``n`` tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import registry
from ..absolute import LearnedEncoding
from ..experiments.tasks import Task
from ..experiments.training import load_checkpoint, positions_for, scheme_order
from ._figures import pyplot, save


def _scheme_of(path: Path) -> str:
    """The scheme of a checkpoint ``TASK-SCHEME.pt`` (an old name gives today's)."""
    scheme = path.stem.partition("-")[2]
    return registry.ALIASES.get(scheme, scheme)


def checkpoints_in(folder: Path | None) -> dict[str, list[Path]]:
    """The checkpoints in ``folder`` per task, in the order ``compare`` lists the schemes.

    Raises:
        ValueError: no folder, or no checkpoint in it, with the command that makes them.
    """
    fix = "run `posenc compare --out DIR` first and pass --checkpoints DIR/checkpoints"
    if folder is None:
        raise ValueError(f"--checkpoints is needed for this kind: {fix}")
    files = sorted(Path(folder).glob("*.pt"))
    if not files:
        raise ValueError(f"--checkpoints {folder} holds no checkpoint (*.pt): {fix}")
    order = {name: i for i, name in enumerate(scheme_order(registry.names()))}
    found: dict[str, list[Path]] = {}
    for path in files:
        found.setdefault(path.stem.partition("-")[0], []).append(path)
    for paths in found.values():
        paths.sort(key=lambda p: order.get(_scheme_of(p), len(order)))
    return found


@torch.no_grad()
def _maps(path: Path, examples: int, length: int | tuple[int, int] | None) -> tuple[Any, ...]:
    """``(task, scheme, [per layer [examples, h, n, n]])`` of a checkpoint (seeded examples)."""
    model, task, scheme, config = load_checkpoint(path)
    length = task.train_length if length is None else length
    batch = task.sample(examples, length, torch.Generator().manual_seed(0))
    positions = positions_for(task, scheme, config, batch)
    maps = model.attention_maps(
        batch.tokens, causal=task.causal, positions=positions, size=batch.size
    )
    return task, scheme, maps


def attention_of(path: Path) -> tuple[Task, str, np.ndarray]:
    """``(task, scheme, maps [layers, n, n])``: head-averaged attention of one example.

    The example is drawn (seed 0) at the training length of the checkpoint's task.
    """
    task, scheme, maps = _maps(path, 1, None)
    return task, scheme, torch.stack([m[0].mean(0) for m in maps]).numpy()  # [layers, n, n]


def attention_to_offset(path: Path, offset: int, length: int, *, examples: int = 64) -> float:
    """The largest mean attention weight that any head of any layer puts on ``j = i + offset``.

    Averaged over the queries that have such a key and over ``examples`` seeded sequences
    of ``length`` (1-D tasks). docs/compare.md uses it to show how a content-free bias
    dilutes as the sequence grows.
    """
    _, _, maps = _maps(path, examples, length)
    queries = torch.arange(max(0, -offset), min(length, length - offset))  # keys in range
    return max(float(m[:, :, queries, queries + offset].mean(dim=(0, 2)).max()) for m in maps)


def plot_attention(args: argparse.Namespace) -> list[Path]:
    """Attention maps of every trained model, a figure per task: schemes x layers."""
    plt = pyplot()
    # every checkpoint is read (and checked) before anything is drawn
    found = {
        task_name: [attention_of(path) for path in files]
        for task_name, files in checkpoints_in(args.checkpoints).items()
    }
    paths: list[Path] = []
    for task_name, loaded in found.items():
        task = loaded[0][0]
        results = [(scheme, maps) for _, scheme, maps in loaded]
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
        fig.suptitle(
            f"Attention of the trained models on `{task_name}` (one example at "
            f"{task.label(task.train_length)}, mean over heads)"
        )
        if image is not None:
            fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
        paths += save(fig, args.out, f"attention_{task_name}", args.format)
    return paths


def learned_tables(folder: Path | None) -> list[tuple[str, np.ndarray]]:
    """``(task, weight [max_len, dim])`` of every trained learned absolute table (``learned``)."""
    tables = []
    for task_name, files in checkpoints_in(folder).items():
        for path in files:
            entry = registry.SCHEMES.get(_scheme_of(path))
            if entry is None or entry.place != 1 or not entry.learned:
                continue
            model, *_ = load_checkpoint(path)
            if isinstance(model.encoding, LearnedEncoding):
                tables.append((task_name, model.encoding.weight.detach().numpy()))
    return tables
