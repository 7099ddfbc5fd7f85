"""``posenc compare``: train a small transformer per scheme and compare them.

For each task (``shift``, ``copy``, ``grid``; see :mod:`posenc.tasks`), each scheme that
makes sense for it, and each seed, a :class:`~posenc.models.TinyTransformer` is trained at
the task's training length and evaluated at that length and longer ones. The output is a
Markdown table (accuracy per test length, mean and spread over seeds, parameters, training
seconds), a line plot of accuracy against test length per task, and optionally JSON.

Tables sized by length: a learned absolute table (``learned``) only has rows for the
training length, so longer tests are "n/a". The relative tables (``swin``, ``relative``,
and the 2-D ones) are built for the longest test length (window, ``max_len`` or grid),
and the rows of offsets that training never reaches keep their initial values: that is
what such a model meets when it is run longer than it was trained. 2-D schemes number the
cells of a grid row-major within the largest test grid, so the cell above is always the
same table row.

Launched with ``torchrun --nproc_per_node N -m posenc compare ...`` it trains with
DistributedDataParallel (gloo on CPU, nccl on CUDA): each rank takes its share of every
global batch; every rank evaluates (the same numbers), and rank 0 prints and writes.

Shape legend: ``b`` batch, ``n`` tokens, ``H x W`` a grid (row-major, ``n = H * W``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import absolute, bias, embedding, rotary, shaw
from ..models import TinyTransformer
from ..tasks import IGNORE, TASKS, Batch, Task, get_task
from ._options import (
    device,
    float_above,
    formats,
    output_dir,
    output_file,
    positive_float,
    positive_int,
)
from ._progress import Progress

# ----- the schemes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """What a scheme is built for: the model shape and the task's lengths."""

    dim: int
    heads: int
    task: Task
    train_tokens: int  # tokens of a training example
    max_tokens: int  # tokens of the longest test example
    max_grid: tuple[int, int] | None  # the largest test grid (2-D tasks)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


@dataclass(frozen=True)
class Scheme:
    """A scheme of ``compare``: how to build it, and which lengths it can serve.

    ``build(setting) -> (input encoding or None, position)``; ``position`` is an object
    shared by every layer, a zero-argument factory (one per layer), or None.
    """

    build: Callable[[Setting], tuple[nn.Module | None, Any]]
    summary: str
    two_d: bool = False  # positions are cells of the largest test grid
    grid_only: bool = False  # makes sense only on a grid task
    max_tokens: Callable[[Setting], int] | None = None  # longest length it serves

    def serves(self, setting: Setting, tokens: int) -> bool:
        return self.max_tokens is None or tokens <= self.max_tokens(setting)


def _two_d(s: Setting) -> tuple[int, int]:
    if s.max_grid is None:
        raise ValueError(f"a 2-D scheme needs a 2-D task, got task {s.task.name!r}")
    return s.max_grid


SCHEMES: dict[str, Scheme] = {
    "none": Scheme(lambda s: (None, None), "no positions at all"),
    "sinusoidal": Scheme(
        lambda s: (absolute.SinusoidalEncoding(s.dim), None), "Vaswani sin/cos added to the input"
    ),
    "learned": Scheme(
        lambda s: (absolute.LearnedEncoding(s.dim, s.train_tokens), None),
        "learned absolute table (BERT/GPT), rows for the training length",
        max_tokens=lambda s: s.train_tokens,
    ),
    "rotary": Scheme(lambda s: (None, rotary.Rotary(s.head_dim)), "RoPE (half-split)"),
    "rotary-ntk": Scheme(
        lambda s: (
            None,
            rotary.Rotary(
                s.head_dim, scaling=rotary.DynamicNTKScaling(1.0, original_max_len=s.train_tokens)
            ),
        ),
        "RoPE with dynamic NTK scaling past the training length",
    ),
    "alibi": Scheme(lambda s: (None, bias.ALiBi(s.heads)), "ALiBi linear distance penalty"),
    "t5": Scheme(
        lambda s: (
            None,
            bias.T5RelativeBias(
                s.heads, num_buckets=16, max_distance=64, bidirectional=not s.task.causal
            ),
        ),
        "T5 log-bucketed bias, shared by the layers",
    ),
    "swin": Scheme(
        lambda s: (None, lambda: bias.RelativePositionBias(s.max_tokens, s.heads)),
        "1-D relative bias table (Swin-style), per layer",
    ),
    "relative": Scheme(
        lambda s: (None, lambda: embedding.RelativeQueryEmbedding(s.max_tokens, s.head_dim)),
        "relative embedding q.R[j-i] with the skew, per layer",
    ),
    "shaw": Scheme(
        lambda s: (None, lambda: shaw.ShawRelativePosition(s.head_dim, 8)),
        "Shaw relative keys and values, clipped at 8, per layer",
    ),
    "sinusoidal-2d": Scheme(
        lambda s: (absolute.SinusoidalEncoding2D(s.dim), None),
        "2-D sin/cos added to the input (ViT/MAE)",
        grid_only=True,
    ),
    "rotary-2d": Scheme(
        lambda s: (None, rotary.Rotary2D(s.head_dim, size=_two_d(s))),
        "axial 2-D RoPE",
        two_d=True,
        grid_only=True,
    ),
    "swin-2d": Scheme(
        lambda s: (None, lambda: bias.RelativePositionBias(_two_d(s), s.heads)),
        "Swin 2-D relative bias table, per layer",
        two_d=True,
        grid_only=True,
    ),
    "relative-2d": Scheme(
        lambda s: (None, lambda: embedding.RelativeQueryEmbedding2D(_two_d(s), s.head_dim)),
        "factorised 2-D relative embedding (SASA/BoTNet), per layer",
        two_d=True,
        grid_only=True,
    ),
}


def schemes_for(task: Task, names: Sequence[str] | None = None) -> list[str]:
    """The schemes that make sense for ``task`` (2-D ones only on grids), in order."""
    names = list(SCHEMES) if names is None else list(names)
    return [n for n in names if task.two_d or not SCHEMES[n].grid_only]


# ----- one model --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Training set-up shared by every run."""

    steps: int = 200
    batch: int = 32
    dim: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    table_lr_scale: float = 10.0
    eval_examples: int = 128
    device: str = "cpu"


def setting_for(task: Task, config: Config) -> Setting:
    """The :class:`Setting` of ``task`` under ``config``."""
    grids = [t for t in (task.train_length, *task.test_lengths) if isinstance(t, tuple)]
    max_grid = (max(g[0] for g in grids), max(g[1] for g in grids)) if grids else None
    return Setting(
        dim=config.dim,
        heads=config.heads,
        task=task,
        train_tokens=task.tokens_of(task.train_length),
        max_tokens=max(task.tokens_of(t) for t in (task.train_length, *task.test_lengths)),
        max_grid=max_grid,
    )


def build_model(task: Task, scheme: str, config: Config) -> TinyTransformer:
    """A :class:`TinyTransformer` for ``task`` with ``scheme`` (seed the RNG before)."""
    encoding, position = SCHEMES[scheme].build(setting_for(task, config))
    return TinyTransformer(
        task.vocab,
        dim=config.dim,
        layers=config.layers,
        heads=config.heads,
        encoding=encoding,
        position=position,
    )


def positions_for(task: Task, scheme: str, config: Config, batch: Batch) -> Tensor | None:
    """Token positions for ``scheme``: cells of the largest grid for 2-D schemes, else None.

    A 1-D scheme on a grid sees the flattened sequence (``arange(H * W)``, the default).
    """
    if not SCHEMES[scheme].two_d or batch.size is None:
        return None
    width = _two_d(setting_for(task, config))[1]
    h, w = batch.size
    rows = torch.arange(h)[:, None].expand(h, w)  # [H, W]
    cols = torch.arange(w)[None, :].expand(h, w)  # [H, W]
    return (rows * width + cols).flatten()  # [H*W]


def logits_of(model: nn.Module, task: Task, scheme: str, config: Config, batch: Batch) -> Tensor:
    """``model``'s logits ``[b, n, vocab]`` on ``batch``."""
    device = torch.device(config.device)
    positions = positions_for(task, scheme, config, batch)
    return model(
        batch.tokens.to(device),
        causal=task.causal,
        positions=None if positions is None else positions.to(device),
        size=batch.size,
    )


def accuracy(logits: Tensor, targets: Tensor) -> float:
    """The fraction of scored positions (target != IGNORE) whose argmax is the target."""
    scored = targets != IGNORE
    hits = (logits.argmax(-1) == targets) & scored
    return float(hits.sum()) / max(1, int(scored.sum()))


def parameter_groups(model: nn.Module, config: Config) -> list[dict[str, Any]]:
    """AdamW groups: the positional tables inside attention at ``table_lr_scale * lr``.

    A bias table holds one scalar per offset and head, and Adam moves each parameter by
    about ``lr`` per step: at ``lr = 3e-3`` a Swin or T5 bias cannot grow past about 0.6
    in 200 steps (less with the warm-up and decay), too flat to stand out among many more keys at a longer test length.
    The faster rate lets such tables reach the size that a longer training would give.
    """
    tables = [p for n, p in model.named_parameters() if ".attn.position." in n]
    ids = {id(p) for p in tables}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups = [{"params": rest, "lr": config.lr}]
    if tables:
        groups.append({"params": tables, "lr": config.lr * config.table_lr_scale})
    return groups


def _distributed() -> tuple[int, int]:
    """``(rank, world)`` of the process group, ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def train(
    task: Task,
    scheme: str,
    seed: int,
    config: Config,
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[nn.Module, list[float]]:
    """Train one model; return it (unwrapped) and its loss per step.

    Every rank builds the same model (same seed) and draws the same global batch; under
    DistributedDataParallel each rank trains on its slice of the batch and the gradients
    are averaged, which equals one process on the whole batch.
    """
    rank, world = _distributed()
    if config.batch % world:
        raise ValueError(
            f"--batch {config.batch} must be divisible by the number of processes ({world})"
        )
    torch.manual_seed(seed)
    device = torch.device(config.device)
    model = build_model(task, scheme, config).to(device)
    net: nn.Module = model
    if world > 1:
        net = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(parameter_groups(model, config), weight_decay=0.01, fused=True)
    warmup = max(1, config.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(step, config.steps) / config.steps))
        ),
    )
    generator = torch.Generator().manual_seed(10_000 + seed)
    share = slice(rank * config.batch // world, (rank + 1) * config.batch // world)
    losses = []
    model.train()
    for step in range(config.steps):
        full = task.sample(config.batch, task.train_length, generator)
        batch = Batch(full.tokens[share], full.targets[share], full.size)
        logits = logits_of(net, task, scheme, config, batch)
        loss = F.cross_entropy(
            logits.flatten(0, 1), batch.targets.to(device).flatten(), ignore_index=IGNORE
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return model.eval(), losses


@torch.no_grad()
def evaluate(
    model: nn.Module, task: Task, scheme: str, seed: int, config: Config
) -> dict[str, float | None]:
    """Accuracy at every test length (None where the scheme cannot serve the length)."""
    setting = setting_for(task, config)
    results: dict[str, float | None] = {}
    for length in task.test_lengths:
        label = task.label(length)
        if not SCHEMES[scheme].serves(setting, task.tokens_of(length)):
            results[label] = None
            continue
        generator = torch.Generator().manual_seed(20_000 + seed)
        batch = task.sample(config.eval_examples, length, generator)
        results[label] = accuracy(logits_of(model, task, scheme, config, batch), batch.targets)
    return results


# ----- the whole comparison ---------------------------------------------------------------


@dataclass
class Run:
    """One trained model: its task, scheme, seed and results."""

    task: str
    scheme: str
    seed: int
    accuracy: dict[str, float | None]
    parameters: int
    seconds: float
    final_loss: float


def run_one(
    task: Task,
    scheme: str,
    seed: int,
    config: Config,
    *,
    checkpoints: Path | None = None,
    on_step: Callable[[int, float], None] | None = None,
    threads: int | None = None,
) -> Run:
    """Train and evaluate one model (and save it when ``seed == 0`` and ``checkpoints``)."""
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    model, losses = train(task, scheme, seed, config, on_step=on_step)
    seconds = time.perf_counter() - started
    if checkpoints is not None and seed == 0 and _distributed()[0] == 0:
        save_checkpoint(checkpoints, model, task, scheme, config)
    return Run(
        task=task.name,
        scheme=scheme,
        seed=seed,
        accuracy=evaluate(model, task, scheme, seed, config),
        parameters=sum(p.numel() for p in model.parameters()),
        seconds=seconds,
        final_loss=statistics.fmean(losses[-10:]),
    )


def compare(
    tasks: Sequence[Task],
    schemes: Sequence[str] | None,
    seeds: int,
    config: Config,
    *,
    quiet: bool = False,
    checkpoints: Path | None = None,
    jobs: int = 1,
) -> list[Run]:
    """Train and evaluate every (task, scheme, seed); see the module docstring.

    Args:
        tasks: the tasks.
        schemes: scheme names (each task takes those that make sense for it), or all.
        seeds: seeds per (task, scheme): 0 .. seeds-1.
        config: the training set-up.
        quiet: no progress bar.
        checkpoints: a folder where the seed-0 model of each (task, scheme) is saved
            (for ``posenc plot attention``), or None.
        jobs: models trained at once, in worker processes with an equal share of the CPU
            threads (1: in this process, with a bar that moves per step). Results do not
            depend on it: every model is seeded by its own seed.

    Returns:
        One :class:`Run` per trained model, in plan order (every rank gets the list).
    """
    rank, world = _distributed()
    plan = [(t, s, seed) for t in tasks for s in schemes_for(t, schemes) for seed in range(seeds)]
    progress = Progress(len(plan), quiet=quiet or rank != 0)
    if jobs > 1 and world == 1 and len(plan) > 1:
        runs = _compare_in_workers(plan, config, progress, checkpoints, jobs)
    else:
        runs = []
        for index, (task, scheme, seed) in enumerate(plan):
            label = f"{task.name:<5} {scheme:<13} seed {seed}"
            progress.update(index, label)

            def on_step(step: int, loss: float, index: int = index, label: str = label) -> None:
                if step and step % 25 == 0:
                    progress.update(index + step / config.steps, f"{label} loss {loss:.2f}")

            runs.append(
                run_one(task, scheme, seed, config, checkpoints=checkpoints, on_step=on_step)
            )
    progress.finish(f"{len(plan)} models trained")
    return runs


def _compare_in_workers(
    plan: list[tuple[Task, str, int]],
    config: Config,
    progress: Progress,
    checkpoints: Path | None,
    jobs: int,
) -> list[Run]:
    """Run ``plan`` in ``jobs`` worker processes; the bar moves as models finish."""
    import concurrent.futures
    import multiprocessing

    threads = max(1, torch.get_num_threads() // jobs)
    context = multiprocessing.get_context("spawn")  # no fork of a threaded torch
    runs: list[Run | None] = [None] * len(plan)
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {
            pool.submit(
                run_one, task, scheme, seed, config, checkpoints=checkpoints, threads=threads
            ): index
            for index, (task, scheme, seed) in enumerate(plan)
        }
        progress.update(0, f"{jobs} workers")
        for done, future in enumerate(concurrent.futures.as_completed(futures), start=1):
            index = futures[future]
            runs[index] = future.result()
            task, scheme, seed = plan[index]
            progress.update(done, f"{task.name:<5} {scheme:<13} seed {seed} done")
    return [r for r in runs if r is not None]


def save_checkpoint(
    folder: Path, model: nn.Module, task: Task, scheme: str, config: Config
) -> Path:
    """Save a trained model with what rebuilds it (see :func:`load_checkpoint`)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{task.name}-{scheme}.pt"
    config_dict = asdict(config)
    lengths = {"train_length": task.train_length, "test_lengths": task.test_lengths}
    torch.save(
        {
            "task": task.name,
            "lengths": lengths,
            "scheme": scheme,
            "config": config_dict,
            "state": model.state_dict(),
        },
        path,
    )
    return path


def load_checkpoint(path: Path) -> tuple[TinyTransformer, Task, str, Config]:
    """``(model in eval mode, task, scheme, config)`` from :func:`save_checkpoint`."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        config = Config(**{**saved["config"], "device": "cpu"})
        lengths = saved["lengths"]
        task = replace(
            get_task(saved["task"]),
            train_length=_length(lengths["train_length"]),
            test_lengths=tuple(_length(x) for x in lengths["test_lengths"]),
        )
        model = build_model(task, saved["scheme"], config)
        model.load_state_dict(saved["state"])
    except Exception as err:  # any file that is not one of ours: say which, and why
        raise ValueError(
            f"{path} is not a checkpoint of this posenc's `compare` ({type(err).__name__}: "
            f"{err}); run `posenc compare --out DIR` again to make new ones"
        ) from err
    return model.eval(), task, saved["scheme"], config


def _length(value: Any) -> int | tuple[int, int]:
    """A length read back from a checkpoint (grids may come back as lists)."""
    return int(value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _mean_spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(runs: Sequence[Run], tasks: Sequence[Task]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per task and scheme: mean and spread of the accuracy per length, params, seconds."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for task in tasks:
        for run in (r for r in runs if r.task == task.name):
            row = table.setdefault(task.name, {}).setdefault(
                run.scheme, {"accuracy": {}, "runs": [], "parameters": run.parameters}
            )
            row["runs"].append(run)
        for row in table.get(task.name, {}).values():
            for length in task.test_lengths:
                label = task.label(length)
                values = [r.accuracy[label] for r in row["runs"]]
                if any(v is None for v in values):
                    row["accuracy"][label] = None
                else:
                    row["accuracy"][label] = _mean_spread([float(v) for v in values])
            row["seconds"] = statistics.fmean(r.seconds for r in row["runs"])
    return table


def format_markdown(runs: Sequence[Run], tasks: Sequence[Task], seeds: int) -> str:
    """The Markdown tables: one per task, a row per scheme."""
    table = summarise(runs, tasks)
    parts = []
    for task in tasks:
        if task.name not in table:
            continue
        train = task.label(task.train_length)
        labels = [task.label(t) for t in task.test_lengths]
        header = [
            "scheme",
            *[f"acc @ {lb}" + (" (train)" if lb == train else "") for lb in labels],
            "params",
            "train s",
        ]
        lines = [
            f"### {task.name}: {task.summary}",
            "",
            f"Trained at {train}; accuracy on held-out examples, mean ± std over {seeds} "
            f"seed(s); chance is {task.chance:.2f}.",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
        ]
        for scheme, row in table[task.name].items():
            cells = [f"`{scheme}`"]
            for label in labels:
                value = row["accuracy"][label]
                cells.append("n/a" if value is None else f"{value[0]:.2f} ± {value[1]:.2f}")
            cells += [f"{row['parameters']:,}", f"{row['seconds']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def plot_accuracy(
    runs: Sequence[Run], tasks: Sequence[Task], out: Path, formats: Sequence[str] = ("png",)
) -> list[Path]:
    """A line plot per task: accuracy against test length, a line per scheme."""
    from ._figures import pyplot, save

    plt = pyplot()
    table = summarise(runs, tasks)
    paths: list[Path] = []
    for task in tasks:
        if task.name not in table:
            continue
        fig, ax = plt.subplots(figsize=(8, 4.8))
        labels = [task.label(t) for t in task.test_lengths]
        rows = table[task.name]
        colours = plt.get_cmap("tab20").colors
        markers = "osD^vP*Xh<>p"
        for index, (scheme, row) in enumerate(rows.items()):
            # dodge the lines sideways a little: schemes with equal accuracy stay visible
            dodge = (index - (len(rows) - 1) / 2) * 0.007 * len(labels)
            points = [(x + dodge, row["accuracy"][lb]) for x, lb in enumerate(labels)]
            points = [(x, v) for x, v in points if v is not None]
            if not points:
                continue
            ax.errorbar(
                [p[0] for p in points],
                [p[1][0] for p in points],
                yerr=[p[1][1] for p in points],
                color=colours[index % len(colours)],
                marker=markers[index % len(markers)],
                linestyle="--" if SCHEMES[scheme].grid_only else "-",
                capsize=3,
                label=scheme,
            )
        ax.axhline(task.chance, color="grey", linestyle=":", label="chance")
        ax.set_xticks(
            range(len(labels)), [lb + (" (train)" if i == 0 else "") for i, lb in enumerate(labels)]
        )
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("test length" + (" (grid)" if task.two_d else " (tokens)"))
        ax.set_ylabel("accuracy")
        ax.set_title(f"{task.name}: accuracy against test length (trained at {labels[0]})")
        ax.legend(
            fontsize="small",
            ncol=2,
            loc="center left",
            bbox_to_anchor=(1.0, 0.5),
            title="dashed: 2-D schemes" if task.two_d else None,
            title_fontsize="small",
        )
        paths += save(fig, out, f"compare_{task.name}", formats)
    return paths


def to_json(runs: Sequence[Run], config: Config, seeds: int, tasks: Sequence[Task]) -> dict:
    """Everything for machines: the configuration and one record per run."""
    return {
        "config": {
            **asdict(config),
            "seeds": seeds,
            "tasks": {
                t.name: {
                    "train_length": t.label(t.train_length),
                    "test_lengths": [t.label(x) for x in t.test_lengths],
                    "vocab": t.vocab,
                }
                for t in tasks
            },
            "torch": torch.__version__,
        },
        "runs": [
            {
                "task": r.task,
                "scheme": r.scheme,
                "seed": r.seed,
                "accuracy": r.accuracy,
                "parameters": r.parameters,
                "seconds": round(r.seconds, 3),
                "final_loss": r.final_loss,
            }
            for r in runs
        ],
    }


# ----- the command ------------------------------------------------------------------------

QUICK = {"steps": 120, "seeds": 1, "eval_examples": 64}


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(unknown) or text!r}; choose from {', '.join(known)}"
        )
    return names


def _lengths(text: str) -> list[int | tuple[int, int]]:
    lengths: list[int | tuple[int, int]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            if "x" in part:
                h, w = (int(v) for v in part.split("x"))
                if h < 1 or w < 1:
                    raise ValueError
                lengths.append((h, w))
            else:
                value = int(part)
                if value < 1:
                    raise ValueError
                lengths.append(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"lengths are positive integers or HxW grids separated by commas, got {part!r}"
            ) from None
    if not lengths:
        raise argparse.ArgumentTypeError("give at least one length")
    return lengths


def _tasks(args: argparse.Namespace) -> list[Task]:
    """The tasks with the lengths of the command line."""
    tasks = []
    for name in args.tasks:
        task = TASKS[name]
        grid = task.two_d
        lengths = args.grid_lengths if grid else args.lengths
        if lengths is not None:
            if any(isinstance(x, tuple) != grid for x in lengths):
                option = "--grid-lengths" if grid else "--lengths"
                raise ValueError(
                    f"{option} for task {name!r} must be "
                    + ("HxW grids, e.g. 6x6,9x9" if grid else "token counts, e.g. 32,64")
                )
            task = replace(task, train_length=lengths[0], test_lengths=tuple(lengths))
        for length in task.test_lengths:
            task.sample(1, length, torch.Generator().manual_seed(0))  # reject bad lengths now
        tasks.append(task)
    return tasks


def _init_distributed(device: str) -> bool:
    """Join the process group when launched by torchrun (``WORLD_SIZE`` > 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.distributed.is_initialized():
        return False
    backend = "nccl" if device.startswith("cuda") else "gloo"
    torch.distributed.init_process_group(backend)
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return True


def _leave_distributed() -> None:
    """Leave the process group together: a barrier first, so that no rank tears its gloo
    connections down while a peer still talks on them (seen as an occasional SIGABRT,
    "terminate called without an active exception", on a loaded 2-core machine)."""
    try:
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    """Run ``posenc compare``: train, then print and write the results."""
    if args.quick:
        args.steps = args.steps or QUICK["steps"]
        args.seeds = args.seeds or QUICK["seeds"]
        args.eval_examples = args.eval_examples or QUICK["eval_examples"]
    config = Config(
        steps=args.steps or Config.steps,
        batch=args.batch,
        dim=args.dim,
        layers=args.layers,
        heads=args.heads,
        lr=args.lr,
        table_lr_scale=args.table_lr_scale,
        eval_examples=args.eval_examples or Config.eval_examples,
        device=args.device,
    )
    seeds = args.seeds or 3
    tasks = _tasks(args)
    plan = [s for t in tasks for s in schemes_for(t, args.schemes)]
    if not plan:
        raise ValueError(
            f"no scheme of --schemes {','.join(args.schemes or [])} fits the tasks "
            f"{','.join(t.name for t in tasks)} (the 2-D schemes need --tasks grid)"
        )
    if config.dim % config.heads:
        raise ValueError(f"--dim {config.dim} must be divisible by --heads {config.heads}")
    if any(SCHEMES[s].grid_only for s in plan) and (config.dim // config.heads) % 4:
        raise ValueError(
            f"--dim {config.dim} / --heads {config.heads} must give a head dim that is a "
            f"multiple of 4 for the 2-D schemes (they split it in quarters)"
        )
    started_group = _init_distributed(args.device)
    try:
        rank, world = _distributed()
        runs = compare(
            tasks,
            args.schemes,
            seeds,
            config,
            quiet=args.quiet,
            checkpoints=None if args.out is None else args.out / "checkpoints",
            jobs=args.jobs,
        )
        if rank != 0:
            return 0
        text = format_markdown(runs, tasks, seeds)
        print(text)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "compare.md").write_text(text)
            for path in plot_accuracy(runs, tasks, args.out, args.format):
                print(f"wrote {path}")
        if args.json is not None:
            record = to_json(runs, config, seeds, tasks)
            record["config"]["processes"] = world
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record, indent=2))
            print(f"wrote {args.json}")
    finally:
        if started_group:
            _leave_distributed()
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``posenc compare``."""
    parser = commands.add_parser(
        "compare",
        help="train a small transformer per scheme on synthetic tasks and compare them",
        description=(
            "Train a small transformer per positional scheme on synthetic tasks (shift, "
            "copy, grid), at one length, and test it at longer ones. Prints a Markdown "
            "table; with --out also writes it with a plot. Launch with torchrun "
            "--nproc_per_node N -m posenc compare ... for DistributedDataParallel."
        ),
    )
    parser.add_argument(
        "--tasks",
        type=lambda t: _names(t, list(TASKS), "task(s)"),
        default=list(TASKS),
        help=f"comma-separated tasks (default all: {','.join(TASKS)})",
    )
    parser.add_argument(
        "--schemes",
        type=lambda t: _names(t, list(SCHEMES), "scheme(s)"),
        default=None,
        help=f"comma-separated schemes (default all that fit each task: {','.join(SCHEMES)})",
    )
    parser.add_argument(
        "--lengths",
        type=_lengths,
        default=None,
        help="1-D tasks: train at the first, test at all (default 32,64,128)",
    )
    parser.add_argument(
        "--grid-lengths",
        type=_lengths,
        default=None,
        help="grid task: train at the first, test at all (default 6x6,9x9,12x12)",
    )
    parser.add_argument("--seeds", type=positive_int, default=None, help="seeds per scheme (3)")
    parser.add_argument("--steps", type=positive_int, default=None, help="training steps (200)")
    parser.add_argument("--batch", type=positive_int, default=32, help="global batch (32)")
    parser.add_argument("--dim", type=positive_int, default=64, help="model width (64)")
    parser.add_argument("--layers", type=positive_int, default=2, help="blocks (2)")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads (4)")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate (3e-3)")
    parser.add_argument(
        "--table-lr-scale",
        type=float_above(0.0, inclusive=True),
        default=10.0,
        help="learning rate of the positional tables inside attention, as a multiple of "
        "--lr (10; 0 freezes them; see docs/compare.md)",
    )
    parser.add_argument(
        "--eval-examples", type=positive_int, default=None, help="test examples per length (128)"
    )
    parser.add_argument("--device", type=device, default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=min(2, os.cpu_count() or 1),
        help="models trained at once in worker processes (default: 2, or 1 on one core; "
        "under torchrun always 1 per rank)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=(
            f"a fast run: {QUICK['steps']} steps, {QUICK['seeds']} seed, "
            f"{QUICK['eval_examples']} test examples (explicit flags win)"
        ),
    )
    parser.add_argument(
        "--out",
        type=output_dir(files=("compare.md",), folders=("checkpoints",)),
        default=None,
        help="write compare.md, the plots and checkpoints/ here",
    )
    parser.add_argument(
        "--json", type=output_file("compare.json"), default=None, help="write the results as JSON"
    )
    parser.add_argument(
        "--format", type=formats, default=["png"], help="png, svg or png,svg (default png)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)
