"""``posenc demo``: every picture, a quick benchmark and a quick comparison, in one report.

It runs its phases (:data:`PHASES`) in order: every ``posenc plot`` kind (what each scheme
is), a ``posenc compare`` on the synthetic tasks (which scheme to pick), the plots of the
trained models (what they learned), and a ``posenc bench`` up to n = 1024 (what each scheme
costs). After each phase it writes ``report.md`` (images linked) and ``report.html``
(images inline, viewable offline) into ``--out``, with a table of what each phase took.

A phase that raises is reported with its error and the demo goes on with the phases that
do not need its output; Ctrl-C stops the demo. Either way the report holds the phases that
finished and a line for each one that did not (and why), and the exit status says so: 1
(a phase failed) or 130 (interrupted).
"""

from __future__ import annotations

import argparse
import base64
import html
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
    "distance": (
        "The length-generalisation biases against the distance back to the key, per head: "
        "ALiBi's straight lines, T5's buckets, KERPLE's learned logarithm and power, FIRE's "
        "network of the distance normalised by the query's position (learned ones at "
        "initialisation)."
    ),
    "cope": (
        "CoPE counts positions with gates of `q.k`: a query whose gates open on full stops "
        "gives each key its sentence distance instead of its token distance."
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

LM_TEXT = (
    "Byte-level language models on the Python standard library's own source (held-out "
    "files), trained at 32 bytes and tested at 2, 4 and 8 times that, as Press et al. "
    "(ALiBi, 2022, Figure 1) do on WikiText-103: sinusoidal and rotary get worse past the "
    "training length, ALiBi and KERPLE stay flat; right: the trained rotary model with each "
    "RoPE scaling applied without fine-tuning. The quick form (one seed, 150 steps, four "
    "schemes); `posenc compare --tasks lm` runs the full one (T5, the relative tables and "
    "Shaw too, 1000 steps, 3 seeds), and docs/compare.md has its table."
)

#: the schemes of the demo's lm phase: those that get worse past the training length, and
#: those that stay flat
LM_SCHEMES = ("sinusoidal", "rotary", "alibi", "kerple-log")

BENCH_TEXT = (
    "Time and peak memory of each scheme's attention (forward + backward, float32), as "
    "ratios to plain SDPA without positions measured beside it in the same run, and to the "
    "literal implementation (full scores; Shaw's `[n, n, d]` tensors). Peak memory is the "
    "peak of the bytes torch allocated during one forward + backward."
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
    quick: bool = False  # the quick forms of the phases that have one
    schemes: tuple[str, ...] | None = None  # compare's schemes (None: each task's own)


#: the quick demo's comparison: a scheme of each kind that tells a different story on
#: ``shift`` and ``grid`` (learned: the similarity plot of a learned table)
QUICK_SCHEMES = (
    "none",
    "sinusoidal",
    "learned",
    "rotary",
    "alibi",
    "t5",
    "relative",
    "rotary-2d",
    "relative-2d",
)


def plan_for(quick: bool) -> DemoPlan:
    """The default demo or the ``--quick`` one.

    What each phase takes is in the last table of each report; the plans are sized so that
    on 2 cores the quick demo takes under a minute and the default one under 3, half of
    what the README promises, which leaves room for a slower machine.
    """
    if quick:
        config = Config(steps=compare.QUICK["steps"], eval_examples=compare.QUICK["eval_examples"])
        tasks = (TASKS["shift"], TASKS["grid"])
        return DemoPlan(1, config, tasks, (512,), {"repeats": 2}, True, QUICK_SCHEMES)
    return DemoPlan(1, Config(), tuple(TASKS.values()), (256, 512, 1024))


# ----- the phases ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseContext:
    """What a phase gets: the output folder, the plan, where to log, and ``--quiet``."""

    out: Path
    plan: DemoPlan
    log: Callable[[str], None]
    quiet: bool

    def images(self, paths: Sequence[Path]) -> list[str]:
        """Markdown image lines for ``paths``, relative to the output folder."""
        return [f"![{Path(p).stem}]({p})" for p in _relative(paths, self.out)]


@dataclass(frozen=True)
class Phase:
    """One part of the demo: ``run(context)`` does its work and returns the Markdown lines
    of its section (under the heading ``title``); ``needs`` names the phases whose output
    it reads, without which it is not run."""

    name: str
    title: str
    run: Callable[[PhaseContext], list[str]]
    needs: tuple[str, ...] = ()


def _plots_phase(context: PhaseContext) -> list[str]:
    lines: list[str] = []
    for kind, text in PLOTS.items():
        context.log(f"plot {kind}")
        paths = _plot(kind, context.out / "plots")
        lines += ["", f"### {kind}", "", text, "", *context.images(paths)]
    return lines


def _compare_phase(context: PhaseContext) -> list[str]:
    context.log("compare: one small transformer per task, scheme and seed")
    plan, tasks = context.plan, list(context.plan.tasks)
    runs = compare.compare(
        tasks,
        plan.schemes,
        plan.seeds,
        plan.config,
        checkpoints=context.out / "checkpoints",
        jobs=min(2, os.cpu_count() or 1),
        quiet=context.quiet,
    )
    table = compare.format_markdown(runs, tasks, plan.seeds)
    (context.out / "compare.md").write_text(table)
    plots = compare.plot_accuracy(runs, tasks, context.out / "plots")
    return ["", COMPARE_TEXT, "", table, *context.images(plots)]


def _lm_phase(context: PhaseContext) -> list[str]:
    context.log("lm: byte-level language models trained short, tested long")
    table, plots = compare.lm_demo(
        context.out / "plots",
        quick=True,
        jobs=min(2, os.cpu_count() or 1),
        quiet=context.quiet,
        schemes=LM_SCHEMES,
    )
    return ["", LM_TEXT, "", table, *context.images(plots)]


def _trained_phase(context: PhaseContext) -> list[str]:
    lines: list[str] = []
    for kind, text in TRAINED_PLOTS.items():
        context.log(f"plot {kind}")
        paths = _plot(
            kind, context.out / "plots", ["--checkpoints", str(context.out / "checkpoints")]
        )
        lines += ["", f"### {kind}", "", text, "", *context.images(paths)]
    return lines


def _bench_phase(context: PhaseContext) -> list[str]:
    plan = context.plan
    context.log(f"bench at n = {', '.join(map(str, plan.bench_lengths))}")
    schemes = bench.default_schemes()
    progress = Progress(len(schemes) * len(plan.bench_lengths), quiet=context.quiet)
    cases = bench.run_bench(schemes, list(plan.bench_lengths), progress=progress, **plan.bench)
    table = bench.format_table(cases)
    (context.out / "bench.md").write_text(table)
    return ["", BENCH_TEXT, "", table]


#: the demo's phases, in the order they run and appear in the report; a phase is added by
#: writing its ``run`` and listing it here
PHASES: tuple[Phase, ...] = (
    Phase("plots", "What each scheme is", _plots_phase),
    Phase("compare", "Which scheme for which task", _compare_phase),
    Phase("lm", "Train short, test long: perplexity on real text", _lm_phase),
    Phase("trained", "What the trained models learned", _trained_phase, needs=("compare",)),
    Phase("bench", "What each scheme costs", _bench_phase),
)


# ----- running them into a report -----------------------------------------------------------

DONE, FAILED, INTERRUPTED, NOT_RUN, PENDING = "done", "failed", "interrupted", "not run", "pending"


@dataclass
class PhaseResult:
    """What became of one phase: its status (:data:`DONE`, :data:`FAILED`,
    :data:`INTERRUPTED`, :data:`NOT_RUN`, or :data:`PENDING` while the demo runs), the
    seconds it took, its section's lines, and why it is not done."""

    phase: Phase
    status: str = PENDING
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)
    why: str = ""


@dataclass(frozen=True)
class DemoReport:
    """The report's two files and what became of each phase."""

    markdown: Path
    html: Path
    phases: tuple[PhaseResult, ...]

    @property
    def exit_status(self) -> int:
        """0 when every phase is done, 130 when the demo was interrupted, else 1."""
        statuses = {result.status for result in self.phases}
        if INTERRUPTED in statuses:
            return 130
        return 0 if statuses == {DONE} else 1


def run_demo(
    out: Path,
    plan: DemoPlan,
    *,
    log: Callable[[str], None] = print,
    quiet: bool = False,
    phases: Sequence[Phase] | None = None,
) -> DemoReport:
    """Run ``phases`` (default :data:`PHASES`) into ``out``, writing the report after each;
    return what became of them.

    A phase that raises is recorded as failed (its traceback logged) and the others go on,
    but for those that need it; ``KeyboardInterrupt`` stops the demo, recorded in the
    report, and is not raised.

    Raises:
        ValueError: a phase needs one that does not run before it.
    """
    phases = PHASES if phases is None else phases
    for index, phase in enumerate(phases):
        before = [p.name for p in phases[:index]]
        for name in phase.needs:
            if name not in before:
                raise ValueError(
                    f"phase {phase.name!r} needs {name!r}, which is not a phase before it "
                    f"({', '.join(before) or 'none'}); list {name!r} earlier"
                )
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    context = PhaseContext(out, plan, log, quiet)
    results = [PhaseResult(phase) for phase in phases]
    status_of = {result.phase.name: result for result in results}
    stopped = False
    for result in results:
        phase = result.phase
        missing = [name for name in phase.needs if status_of[name].status != DONE]
        if stopped or missing:
            result.status = NOT_RUN
            result.why = (
                "the demo was interrupted before it"
                if stopped
                else f"it needs {', '.join(missing)}, which did not finish"
            )
            continue
        begun = time.perf_counter()
        try:
            result.lines = phase.run(context)
            result.status = DONE
        except KeyboardInterrupt:
            result.status, result.why, stopped = INTERRUPTED, "interrupted (Ctrl-C)", True
        except Exception as err:  # reported, and the demo goes on
            message = " ".join(str(err).split())  # one line: it goes into a sentence
            result.status, result.why = FAILED, f"{type(err).__name__}: {message}"
            log(f"{phase.name} failed:\n{traceback.format_exc().rstrip()}")
        result.seconds = time.perf_counter() - begun
        try:
            log(f"{phase.name}: {result.status} in {result.seconds:.0f} s")
            _write_report(out, results, time.perf_counter() - started)
        except KeyboardInterrupt:  # between phases: the phases after it are not run
            stopped = True
    markdown, page = _write_report(out, results, time.perf_counter() - started)
    return DemoReport(markdown, page, tuple(results))


def report_markdown(results: Sequence[PhaseResult], seconds: float) -> str:
    """The report: a section per phase (or the line saying why it is not there), then
    what each phase took."""
    sections: list[str] = [
        "# posenc demo report",
        "",
        "Every picture, table and number below was produced by posenc on this machine, "
        "with no download.",
    ]
    missing = [r for r in results if r.status != DONE]
    if missing:
        what = "; ".join(f"{r.phase.name} {_not_done(r)}" for r in missing)
        sections += ["", f"**Incomplete**: {what}."]
    for number, result in enumerate(results, start=1):
        sections += ["", f"## {number}. {result.phase.title}"]
        if result.status == DONE:
            sections += result.lines
        else:
            sections += ["", f"_Not here: this phase {_not_done(result)}._"]
    sections += ["", "## What each phase took", "", "| phase | status | seconds |"]
    sections += ["|---|---|---:|"]
    for result in results:
        took = f"{result.seconds:.0f}" if result.status in (DONE, FAILED, INTERRUPTED) else "-"
        sections.append(f"| {result.phase.name} | {result.status} | {took} |")
    threads = torch.get_num_threads()
    sections += ["", f"_Made in {seconds:.0f} s, torch {torch.__version__}, {threads} threads._"]
    return "\n".join([*sections, ""])


def _not_done(result: PhaseResult) -> str:
    if result.status == FAILED:
        return f"failed after {result.seconds:.0f} s ({result.why})"
    if result.status == INTERRUPTED:
        return f"was interrupted after {result.seconds:.0f} s"
    if result.status == NOT_RUN:
        return f"was not run: {result.why}"
    return "has not run yet (the demo stopped before it, or is still running)"


def _write_report(out: Path, results: Sequence[PhaseResult], seconds: float) -> tuple[Path, Path]:
    """Write ``report.md`` and ``report.html``, each whole or not at all (a temporary file
    renamed over it)."""
    markdown = report_markdown(results, seconds)
    paths = out / "report.md", out / "report.html"
    for path, text in zip(paths, (markdown, markdown_to_html(markdown, out)), strict=True):
        partial = path.with_name(path.name + ".part")
        partial.write_text(text)
        partial.replace(path)
    return paths


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
    """Run ``posenc demo`` and print where the report is; the exit status of
    :attr:`DemoReport.exit_status`."""

    def log(line: str) -> None:
        print(f"posenc demo: {line}", file=sys.stderr, flush=True)

    report = run_demo(args.out, plan_for(args.quick), log=log, quiet=args.quiet)
    not_done = [r.phase.name for r in report.phases if r.status != DONE]
    if not_done:
        log(f"not done: {', '.join(not_done)} (the report says why)")
    print(f"report: {report.markdown}")
    print(f"        {report.html} (images inline, opens offline)")
    return report.exit_status


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
        "--quick",
        action="store_true",
        help="two tasks, fewer schemes, steps and lengths (under 2 minutes; the default: 6)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(run=run)
