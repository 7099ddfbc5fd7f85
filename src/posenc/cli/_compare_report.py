"""The tables, plot and JSON of ``posenc compare``: what its runs become.

:func:`format_markdown` (a table per task: the mean over seeds with the spread when there
are several), :func:`plot_accuracy` (accuracy or perplexity against test length, a line
per scheme) and :func:`to_json` (every run and the configuration).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..experiments.tasks import LanguageModelTask, Task
from ..experiments.training import Config, Run
from ._compare_lm import format_lm_markdown, line_styles, plot_perplexity
from ._figures import pyplot, save


def _mean_spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def over_seeds(seeds: int) -> str:
    """How a table's cells summarise its seeds: ``mean ± std over 3 seeds``, or ``one seed
    (no spread)``."""
    return "one seed (no spread)" if seeds == 1 else f"mean ± std over {seeds} seeds"


def spread_cell(value: tuple[float, float] | None, seeds: int) -> str:
    """A cell of :func:`_mean_spread`'s ``(mean, std)``: ``0.91 ± 0.02``, the mean alone
    for one seed (whose spread is no measurement), ``n/a`` for None."""
    if value is None:
        return "n/a"
    return f"{value[0]:.2f}" if seeds == 1 else f"{value[0]:.2f} ± {value[1]:.2f}"


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
        if isinstance(task, LanguageModelTask):
            parts.append(format_lm_markdown(runs, task, seeds, cell=spread_cell, over=over_seeds))
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
            f"Trained at {train}; accuracy on held-out examples, {over_seeds(seeds)}; "
            f"chance is {task.chance:.2f}.",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
        ]
        for scheme, row in table[task.name].items():
            cells = [f"`{scheme}`"]
            for label in labels:
                value = row["accuracy"][label]
                cells.append(spread_cell(value, seeds))
            cells += [f"{row['parameters']:,}", f"{row['seconds']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def plot_accuracy(
    runs: Sequence[Run], tasks: Sequence[Task], out: Path, formats: Sequence[str] = ("png",)
) -> list[Path]:
    """A line plot per task: accuracy against test length, a line per scheme (the ``lm``
    task: perplexity, :func:`~posenc.cli._compare_lm.plot_perplexity`)."""
    plt = pyplot()
    table = summarise(runs, tasks)
    paths: list[Path] = []
    for task in tasks:
        if task.name not in table:
            continue
        if isinstance(task, LanguageModelTask):
            paths += plot_perplexity(runs, task, out, formats)
            continue
        fig, ax = plt.subplots(figsize=(8, 4.8))
        labels = [task.label(t) for t in task.test_lengths]
        rows = table[task.name]
        styles = line_styles(len(rows))
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
                capsize=3,
                label=scheme,
                **styles[index],
            )
        ax.axhline(task.chance, color="black", linestyle=(0, (1, 4)), linewidth=1, label="chance")
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
            title="2-D schemes last" if task.two_d else None,
            title_fontsize="small",
        )
        paths += save(fig, out, f"compare_{task.name}", formats)
    return paths


def _task_record(task: Task, config: Config) -> dict[str, Any]:
    """What the JSON says of a task (the ``lm`` task: its corpus and files too)."""
    record: dict[str, Any] = {
        "train_length": task.label(task.train_length),
        "test_lengths": [task.label(x) for x in task.test_lengths],
        "vocab": task.vocab,
        "steps": config.steps,
    }
    if isinstance(task, LanguageModelTask):
        record["corpus"] = task.text.describe()
        record["scored_bytes"] = task.test_text(config.eval_examples)[:, 1:].numel()
    return record


def _run_record(run: Run) -> dict[str, Any]:
    """One run in the JSON; an ``lm`` run carries its perplexity (and RoPE scalings)."""
    record = {
        "task": run.task,
        "scheme": run.scheme,
        "seed": run.seed,
        "accuracy": run.accuracy,
        "parameters": run.parameters,
        "seconds": round(run.seconds, 3),
        "final_loss": run.final_loss,
    }
    if run.perplexity is not None:
        record["perplexity"] = run.perplexity
    if run.rope_scaling is not None:
        record["rope_scaling"] = run.rope_scaling
    return record


def to_json(
    runs: Sequence[Run],
    config: Config,
    seeds: int,
    tasks: Sequence[Task],
    configs: Mapping[str, Config] | None = None,
) -> dict:
    """Everything for machines: the configuration and one record per run.

    ``configs``: a task's own set-up where it differs from ``config`` (the ``lm`` task's
    steps); each task's record says its steps.
    """
    configs = configs or {}
    return {
        "config": {
            **asdict(config),
            "seeds": seeds,
            "tasks": {t.name: _task_record(t, configs.get(t.name, config)) for t in tasks},
            "torch": torch.__version__,
        },
        "runs": [_run_record(r) for r in runs],
    }
