"""``posenc demo``: every picture, a quick benchmark and a quick comparison, in one report.

It runs, in order: every ``posenc plot`` kind (what each scheme is), a ``posenc compare``
on the synthetic tasks (which scheme to pick), the plots of the trained models (what they
learned), and a ``posenc bench`` up to n = 1024 (what each scheme costs). It writes
``report.md`` (images linked) and ``report.html`` (images inline, viewable offline) into
``--out`` and prints where they are.
"""

from __future__ import annotations

import argparse
import base64
import html
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..experiments.tasks import TASKS, Task
from ..experiments.training import Config
from . import bench, compare, plot
from ._options import output_dir
from ._progress import Progress

#: plots drawn before training, with the sentence the report puts before them
PLOTS: dict[str, str] = {
    "sinusoidal": (
        "The sinusoidal table of Vaswani et al.: each pair of columns is a sine and cosine "
        "of one wavelength, geometric from 2π to 10000·2π, so nearby positions have similar "
        "vectors and the similarity decays with distance."
    ),
    "skew": (
        "How a relative embedding becomes attention logits: `q R^T` gives one column per "
        "offset (`[L, 2L-1]`), and the skew (pad, reshape, slice) moves row i left by i, so "
        "that entry (i, j) holds offset j - i, with no `[L, L]` gather."
    ),
    "swin-index": (
        "Swin's relative position index: every (query, key) pair of a window reads the table "
        "row of its (row, column) offset, so pairs with the same offset share one learned "
        "bias."
    ),
    "bias": (
        "Content-free biases, per head: ALiBi penalises distance linearly with a slope per "
        "head; T5 puts offsets into log-spaced buckets (exact near, coarse far); Swin learns "
        "one value per 2-D offset."
    ),
    "rotary": (
        "RoPE's long-term decay: the relative upper bound of `q.k` falls with distance; "
        "position interpolation, NTK and YaRN scaling stretch the curve to longer contexts."
    ),
}

#: plots of the models that ``compare`` trained
TRAINED_PLOTS: dict[str, str] = {
    "attention": (
        "Attention maps of the trained models (seed 0), per layer, averaged over heads, on "
        "one example at the training length: a scheme that solved `shift` puts its weight "
        "on the diagonal three places back; one without positions spreads it."
    ),
    "similarity": (
        "Cosine similarity of position vectors: the fixed sinusoidal table, whose "
        "similarity depends only on the offset, and the learned absolute table of each "
        "task after training. In 200 steps a learned table barely leaves its random start "
        "(no band along the diagonal), which is why `learned` does not solve `shift`: "
        "Wang and Chen 2020 show the band emerging only after pre-training on a lot of text."
    ),
}

COMPARE_TEXT = (
    "Small transformers (2 pre-norm layers, width 64, 4 heads) trained per scheme at one "
    "length and tested at longer ones. What to read: without positions `shift` is at the "
    "level of guessing from the bag of tokens; relative schemes keep their accuracy at 4x "
    "the length when the offset they need was trained; a learned absolute table cannot go "
    "past its length (n/a); 1-D schemes on the flattened grid learn the offset of the "
    "training width and fail on a wider grid. docs/compare.md explains every row."
)

BENCH_TEXT = (
    "Time and peak memory of each scheme's attention (forward + backward, float32), as "
    "ratios to plain SDPA without positions measured beside it in the same run, and to the "
    "literal implementation (full scores; Shaw's `[n, n, d]` tensors)."
)


def _plot(kind: str, out: Path, extra: Sequence[str] = ()) -> list[Path]:
    """Draw one ``posenc plot`` kind with its defaults; return the files written."""
    parser = argparse.ArgumentParser(prog="posenc")
    plot.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plot", kind, "--out", str(out), *extra])
    return plot.KINDS[kind](args)


def _relative(paths: Sequence[Path], root: Path) -> list[str]:
    return [str(p.relative_to(root)) if p.is_relative_to(root) else str(p) for p in paths]


@dataclass(frozen=True)
class DemoPlan:
    """How much the demo trains and measures (see :func:`plan_for`)."""

    seeds: int
    config: Config
    tasks: tuple[Task, ...]
    bench_lengths: tuple[int, ...]
    bench: dict[str, Any] = field(default_factory=dict)  # more run_bench arguments


def plan_for(quick: bool) -> DemoPlan:
    """The default demo (about 4 minutes here) or the ``--quick`` one (under 2)."""
    if quick:
        config = Config(steps=compare.QUICK["steps"], eval_examples=compare.QUICK["eval_examples"])
        return DemoPlan(1, config, tuple(TASKS.values()), (256, 512), {"repeats": 2})
    return DemoPlan(2, Config(), tuple(TASKS.values()), (256, 512, 1024))


def run_demo(
    out: Path,
    plan: DemoPlan,
    *,
    log: Callable[[str], None] = print,
    quiet: bool = False,
) -> tuple[Path, Path]:
    """Run the demo into ``out``; return ``(report.md, report.html)``."""
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    sections: list[str] = [
        "# posenc demo report",
        "",
        "Every picture, table and number below was produced by posenc on this machine, "
        "with no download.",
    ]

    def images(paths: Sequence[Path]) -> list[str]:
        return [f"![{Path(p).stem}]({p})" for p in _relative(paths, out)]

    sections += ["", "## 1. What each scheme is"]
    for kind, text in PLOTS.items():
        log(f"plot {kind}")
        paths = _plot(kind, out / "plots")
        sections += ["", f"### {kind}", "", text, "", *images(paths)]

    log("compare: one small transformer per task, scheme and seed")
    tasks = list(plan.tasks)
    checkpoints = out / "checkpoints"
    runs = compare.compare(
        tasks,
        None,
        plan.seeds,
        plan.config,
        checkpoints=checkpoints,
        jobs=min(2, os.cpu_count() or 1),
        quiet=quiet,
    )
    table = compare.format_markdown(runs, tasks, plan.seeds)
    (out / "compare.md").write_text(table)
    plots = compare.plot_accuracy(runs, tasks, out / "plots")
    sections += ["", "## 2. Which scheme for which task", "", COMPARE_TEXT, "", table]
    sections += images(plots)

    sections += ["", "## 3. What the trained models learned"]
    for kind, text in TRAINED_PLOTS.items():
        log(f"plot {kind}")
        paths = _plot(kind, out / "plots", ["--checkpoints", str(checkpoints)])
        sections += ["", f"### {kind}", "", text, "", *images(paths)]

    log(f"bench at n = {', '.join(map(str, plan.bench_lengths))}")
    schemes = bench.default_schemes()
    progress = Progress(len(schemes) * len(plan.bench_lengths), quiet=quiet)
    cases = bench.run_bench(
        schemes,
        list(plan.bench_lengths),
        progress=progress,
        **plan.bench,
    )
    bench_table = bench.format_table(cases)
    (out / "bench.md").write_text(bench_table)
    sections += ["", "## 4. What each scheme costs", "", BENCH_TEXT, "", bench_table]

    sections += ["", f"_Made in {time.perf_counter() - started:.0f} s._", ""]
    markdown = "\n".join(sections)
    report_md = out / "report.md"
    report_md.write_text(markdown)
    report_html = out / "report.html"
    report_html.write_text(markdown_to_html(markdown, out))
    return report_md, report_html


# ----- Markdown to self-contained HTML ----------------------------------------------------

_IMAGE = re.compile(r"^!\[([^\]]*)\]\(([^)]+)\)$")
_CODE = re.compile(r"`([^`]+)`")
_STRONG = re.compile(r"\*\*([^*]+)\*\*")
_EMPHASIS = re.compile(r"(?<![\w*])_([^_]+)_(?![\w*])")

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       line-height: 1.5; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; display: block; margin: 0.5em 0 1.5em; }
code { background: #f3f3f3; padding: 0 0.2em; }
"""


def _inline(text: str) -> str:
    text = html.escape(text, quote=False)
    text = _CODE.sub(r"<code>\1</code>", text)
    text = _STRONG.sub(r"<strong>\1</strong>", text)
    return _EMPHASIS.sub(r"<em>\1</em>", text)


def _image(alt: str, src: str, root: Path) -> str:
    path = root / src
    kind = {"png": "image/png", "svg": "image/svg+xml"}.get(path.suffix.lstrip("."), "")
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:{kind};base64,{data}">'


def _table(rows: list[str]) -> str:
    def cells(row: str) -> list[str]:
        return [c.strip() for c in row.strip().strip("|").split("|")]

    header, aligns, body = cells(rows[0]), cells(rows[1]), [cells(r) for r in rows[2:]]
    right = [a.endswith(":") for a in aligns]
    out = ["<table>", "<tr>" + "".join(f"<th>{_inline(c)}</th>" for c in header) + "</tr>"]
    for row in body:
        tds = (
            f'<td class="num">{_inline(c)}</td>' if r else f"<td>{_inline(c)}</td>"
            for c, r in zip(row, right, strict=False)
        )
        out.append("<tr>" + "".join(tds) + "</tr>")
    return "\n".join([*out, "</table>"])


def markdown_to_html(markdown: str, root: Path) -> str:
    """The report's Markdown as one HTML page, images inlined from files under ``root``.

    Handles what the report uses: headings, paragraphs, pipe tables, image lines, inline
    code, bold and italics.
    """
    body: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
            i += 1
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(lines[i])
                i += 1
            body.append(_table(rows))
        elif match := _IMAGE.match(line.strip()):
            body.append(_image(match.group(1), match.group(2), root))
            i += 1
        else:
            paragraph = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "|")):
                if _IMAGE.match(lines[i].strip()):
                    break
                paragraph.append(lines[i])
                i += 1
            body.append(f"<p>{_inline(' '.join(paragraph))}</p>")
    title = "posenc demo report"
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{title}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


# ----- the command ------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run ``posenc demo`` and print where the report is."""

    def log(line: str) -> None:
        print(f"posenc demo: {line}", file=sys.stderr, flush=True)

    report_md, report_html = run_demo(args.out, plan_for(args.quick), log=log, quiet=args.quiet)
    print(f"report: {report_md}")
    print(f"        {report_html} (images inline, opens offline)")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``posenc demo``."""
    parser = commands.add_parser(
        "demo",
        help="every picture, a quick bench and a quick compare, in one report",
        description=__doc__.split("\n\n")[1].replace("``", "") if __doc__ else None,
    )
    # a string default goes through the type too: a file named posenc-out is caught
    parser.add_argument(
        "--out",
        type=output_dir(
            files=("compare.md", "bench.md", "report.md", "report.html"),
            folders=("plots", "checkpoints"),
        ),
        default="posenc-out",
        help="output folder (posenc-out)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer steps, seeds and lengths (under 2 minutes)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(run=run)
