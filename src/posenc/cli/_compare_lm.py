"""The report of ``posenc compare --tasks lm`` (perplexity tables and plot), and the line
styles of every ``compare`` plot.

The ``lm`` task (:class:`~posenc.experiments.tasks.LanguageModelTask`) is scored by
perplexity per byte at each test length; a rotary model is scored again with each RoPE
scaling applied at evaluation (:mod:`posenc.experiments.language`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..experiments.tasks import LanguageModelTask
from ..experiments.training import Run
from ._figures import pyplot, save

__all__ = ["format_lm_markdown", "line_styles", "plot_perplexity", "summarise_perplexity"]

#: matplotlib's tab10 colours (ten hues, no two alike) and black
COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#000000",
)
#: line styles and markers, cycled with the colours
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = "osD^vP*"


def line_styles(count: int) -> list[dict[str, str]]:
    """``count`` matplotlib styles (``color``, ``linestyle``, ``marker``): line ``i`` has
    colour ``i % 11``, line style ``i % 4`` and marker ``i % 7``.

    Consecutive lines differ in all three; the first 11 lines have 11 colours, and no two
    of the first 44 share both their colour and their line style.
    """
    return [
        {
            "color": COLOURS[i % len(COLOURS)],
            "linestyle": LINESTYLES[i % len(LINESTYLES)],
            "marker": MARKERS[i % len(MARKERS)],
        }
        for i in range(count)
    ]


def _mean_spread(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _summary(values: Sequence[float | None]) -> tuple[float, float] | None:
    """Mean and spread over seeds, None when any seed has no value."""
    if not values or any(v is None for v in values):
        return None
    return _mean_spread([float(v) for v in values if v is not None])


def summarise_perplexity(runs: Sequence[Run], task: LanguageModelTask) -> dict[str, dict]:
    """Per scheme of ``task``'s runs: perplexity per length (mean, std over seeds, or None),
    the RoPE scalings' perplexity per length (mean, std) where measured, params, seconds."""
    rows: dict[str, dict[str, Any]] = {}
    for run in (r for r in runs if r.task == task.name):
        rows.setdefault(run.scheme, {"runs": [], "parameters": run.parameters})["runs"].append(run)
    labels = [task.label(t) for t in task.test_lengths]
    for row in rows.values():
        row["perplexity"] = {
            lb: _summary([(r.perplexity or {}).get(lb) for r in row["runs"]]) for lb in labels
        }
        scaled = [r.rope_scaling for r in row["runs"] if r.rope_scaling is not None]
        row["rope_scaling"] = {}
        if scaled and len(scaled) == len(row["runs"]):
            for method in scaled[0]:
                row["rope_scaling"][method] = {
                    lb: _summary([s[method][lb] for s in scaled]) for lb in scaled[0][method]
                }
        row["seconds"] = statistics.fmean(r.seconds for r in row["runs"])
    return rows


def _files(names: Sequence[str], what: str) -> str:
    return f"{len(names)} {what} file" + ("" if len(names) == 1 else "s")


def format_lm_markdown(
    runs: Sequence[Run],
    task: LanguageModelTask,
    seeds: int,
    *,
    cell: Callable[[tuple[float, float] | None, int], str],
    over: Callable[[int], str],
) -> str:
    """The Markdown of the ``lm`` task: a perplexity table (a row per scheme) and a table of
    RoPE scalings per rotary scheme.

    ``cell(value, seeds)`` writes a ``(mean, std)`` (or None) and ``over(seeds)`` says how
    the cells summarise the seeds, as in the other tasks' tables.
    """

    def _cell(value: tuple[float, float] | None) -> str:
        return cell(value, seeds)

    rows = summarise_perplexity(runs, task)
    if not rows:
        return ""
    corpus = task.text
    train = task.label(task.train_length)
    labels = [task.label(t) for t in task.test_lengths]
    source = "the Python standard library's source" if corpus.source == "stdlib" else corpus.source
    header = [
        "scheme",
        *[f"ppl @ {lb}" + (" (train)" if lb == train else "") for lb in labels],
        "params",
        "train s",
    ]
    lines = [
        f"### {task.name}: {task.summary}",
        "",
        f"Trained at {train} bytes on {source} ({_files(corpus.train_files, 'training')}); "
        f"perplexity per byte on held-out text ({_files(corpus.held_out_files, 'held-out')}), "
        f"the same bytes at every length in non-overlapping windows, every byte "
        f"scored; {over(seeds)}. Lower is better; a uniform guess is "
        f"{task.vocab}.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    for scheme, row in rows.items():
        cells = [f"`{scheme}`", *[_cell(row["perplexity"][lb]) for lb in labels]]
        cells += [f"{row['parameters']:,}", f"{row['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    for scheme, row in rows.items():
        if not row["rope_scaling"]:
            continue
        longer = list(next(iter(row["rope_scaling"].values())))
        lines += [
            "",
            f"#### {task.name}: `{scheme}` with RoPE scaling at evaluation (no fine-tuning)",
            "",
            f"The `{scheme}` models above (trained at {train}), evaluated at each longer "
            f"length n with the scaling's factor n / {train} applied to their rotary "
            f"attention; perplexity per byte, {over(seeds)}.",
            "",
            "| scaling | " + " | ".join(f"ppl @ {lb}" for lb in longer) + " |",
            "|---|" + "---:|" * len(longer),
            f"| none | {' | '.join(_cell(row['perplexity'][lb]) for lb in longer)} |",
        ]
        for method, values in row["rope_scaling"].items():
            lines.append(f"| {method} | {' | '.join(_cell(values[lb]) for lb in longer)} |")
    return "\n".join(lines)


def plot_perplexity(
    runs: Sequence[Run], task: LanguageModelTask, out: Path, formats: Sequence[str] = ("png",)
) -> list[Path]:
    """``compare_<task>``: perplexity against test length, a line per scheme (left), and
    the rotary model with each RoPE scaling (right, when measured)."""
    rows = summarise_perplexity(runs, task)
    if not rows:
        return []
    plt = pyplot()
    from matplotlib import ticker

    scaled = {s: row for s, row in rows.items() if row["rope_scaling"]}
    fig, axes = plt.subplots(
        1, 2 if scaled else 1, figsize=(13, 4.8) if scaled else (8, 4.8), squeeze=False
    )
    lengths = [task.tokens_of(t) for t in task.test_lengths]
    labels = [task.label(t) for t in task.test_lengths]
    train = task.label(task.train_length)

    def draw(ax: Any, lines: dict[str, dict[str, tuple[float, float] | None]]) -> None:
        for (name, values), style in zip(lines.items(), line_styles(len(lines)), strict=True):
            points = [(x, values[lb]) for x, lb in zip(lengths, labels, strict=True)]
            points = [(x, v) for x, v in points if v is not None]
            if points:
                ax.errorbar(
                    [p[0] for p in points],
                    [p[1][0] for p in points],
                    yerr=[p[1][1] for p in points],
                    capsize=3,
                    label=name,
                    **style,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [lb + ("\n(train)" if lb == train else "") for lb in labels])
        drawn = [v[0] for line in lines.values() for v in line.values() if v is not None]
        # ~6 ticks spread evenly on the log axis, at 2 significant digits
        ticks = sorted({float(f"{v:.2g}") for v in np.geomspace(min(drawn), max(drawn), 6)})
        ax.set_yticks(ticks, [f"{v:g}" for v in ticks])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.yaxis.set_minor_locator(ticker.NullLocator())
        ax.set_xlabel("evaluation length (bytes)")
        ax.set_ylabel("perplexity per byte (log scale)")
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))

    draw(axes[0][0], {s: row["perplexity"] for s, row in rows.items()})
    axes[0][0].set_title(f"{task.name}: perplexity against length (trained at {train})")
    if scaled:
        scheme, row = next(iter(scaled.items()))
        lines = {"none": row["perplexity"]}
        for method, values in row["rope_scaling"].items():
            lines[method] = {lb: values.get(lb, row["perplexity"][lb]) for lb in labels}
        draw(axes[0][1], lines)
        axes[0][1].set_title(f"`{scheme}` with RoPE scaling at evaluation (factor n / {train})")
    fig.tight_layout()
    return save(fig, out, f"compare_{task.name}", formats)
