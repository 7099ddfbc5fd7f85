"""``posenc compare``: train a small transformer per scheme and compare them.

For each task (``shift``, ``copy``, ``grid``, and when named ``lm``; see
:mod:`posenc.experiments.tasks`), each scheme that makes sense for it (the names of
:mod:`posenc.registry`), and each seed, a
:class:`~posenc.experiments.models.TinyTransformer` is trained at the task's training
length and evaluated at that length and longer ones (:mod:`posenc.experiments.training`).
The output is a Markdown table (accuracy per test length, mean and spread over seeds,
parameters, training seconds), a line plot of accuracy against test length per task, and
optionally JSON. The ``lm`` task (a byte-level language model on real text) is scored by
perplexity per byte instead, with RoPE scalings tried on the rotary model at evaluation
(its tables and plot: :mod:`posenc.cli._compare_lm`); it trains for :data:`LM_STEPS`
steps unless ``--steps`` says otherwise.

Tables sized by length: a learned absolute table (``learned``) only has rows for the
training length, so longer tests are "n/a". The relative tables (``swin-1d``,
``relative``, and the 2-D ones) are built for the longest test length (window,
``max_len`` or grid), and the rows of offsets that training never reaches keep their
initial values: that is what such a model meets when it is run longer than it was
trained. 2-D schemes number the cells of a grid row-major within the largest test grid,
so the cell above is always the same table row.

Launched with ``torchrun --nproc_per_node N -m posenc compare ...`` it trains with
DistributedDataParallel (gloo on CPU, nccl on CUDA): each rank takes its share of every
global batch; every rank evaluates (the same numbers), and rank 0 prints and writes.

Shape legend: ``b`` batch, ``n`` tokens, ``H x W`` a grid (row-major, ``n = H * W``).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from .. import registry
from ..experiments.tasks import ALL_TASKS, TASKS, LanguageModelTask, Task
from ..experiments.training import (
    Config,
    Run,
    default_schemes,
    rank_and_world,
    run_one,
    schemes_for,
)
from ._compare_report import (
    format_markdown,
    plot_accuracy,
    to_json,
)
from ._options import (
    aliases_note,
    device,
    float_above,
    formats,
    output_dir,
    output_file,
    positive_float,
    positive_int,
    scheme_list,
)
from ._progress import Progress

# ----- the whole comparison ---------------------------------------------------------------


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
        schemes: scheme names (each task takes those that make sense for it), or None
            for the default run (:func:`~posenc.experiments.training.default_schemes`).
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
    rank, world = rank_and_world()
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
    """Run ``plan`` in ``jobs`` worker processes; the bar moves as models finish.

    A failure or Ctrl-C cancels the models not started yet (the workers, which get the
    interrupt too, stop theirs), instead of waiting for the whole queue.
    """
    import concurrent.futures
    import multiprocessing

    threads = max(1, torch.get_num_threads() // jobs)
    context = multiprocessing.get_context("spawn")  # no fork of a threaded torch
    runs: list[Run | None] = [None] * len(plan)
    pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context)
    try:
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
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return [r for r in runs if r is not None]


# ----- the command ------------------------------------------------------------------------
QUICK = {"steps": 120, "seeds": 1, "eval_examples": 64}
#: the ``lm`` task's training steps (default run, ``--quick``) when ``--steps`` is not given
LM_STEPS = {"full": 1000, "quick": 150}
#: the ``lm`` task's lengths with ``--quick`` when ``--lengths`` is not given (train at 32)
LM_QUICK_LENGTHS = (32, 64, 128, 256)


def lm_demo(
    out: Path,
    *,
    quick: bool = True,
    jobs: int = 1,
    quiet: bool = False,
    task: LanguageModelTask | None = None,
    config: Config | None = None,
    schemes: Sequence[str] | None = None,
) -> tuple[str, list[Path]]:
    """The ``lm`` comparison for ``posenc demo``: ``(Markdown, [out/compare_lm.png])``.

    Trains what ``posenc compare --tasks lm [--quick]`` trains (every ``lm`` scheme, or
    ``schemes``, with :data:`LM_STEPS`; with ``quick`` at :data:`LM_QUICK_LENGTHS` with the
    seeds and test examples of :data:`QUICK`) and writes its plot into ``out``. ``task``
    and ``config`` replace the default ones.
    """
    task = task or _lm_task(quick)
    seeds = QUICK["seeds"] if quick else 3
    if config is None:
        examples = QUICK["eval_examples"] if quick else Config.eval_examples
        config = Config(steps=LM_STEPS["quick" if quick else "full"], eval_examples=examples)
    runs = compare([task], schemes, seeds, config, quiet=quiet, jobs=jobs)
    return format_markdown(runs, [task], seeds), plot_accuracy(runs, [task], out)


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(unknown) or text!r}; choose from {', '.join(known)}"
        )
    return names


def _corpus(text: str) -> Path:
    """``--corpus``: a file or a folder that exists (its text is checked when loaded)."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(
            f"no file or folder {text!r}; give a UTF-8 text file or a folder of them"
        )
    return path


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
    """The tasks with the lengths (and the ``lm`` corpus) of the command line."""
    if args.corpus is not None and "lm" not in args.tasks:
        raise ValueError(
            f"--corpus {args.corpus} is the text of the lm task; add lm to --tasks "
            f"(e.g. --tasks lm --corpus {args.corpus})"
        )
    tasks = []
    for name in args.tasks:
        task = ALL_TASKS[name]
        if isinstance(task, LanguageModelTask):
            task = _lm_task(args.quick, args.corpus)
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
        if isinstance(task, LanguageModelTask):
            task.test_text(1)  # reject a corpus without held-out text for the lengths now
        tasks.append(task)
    return tasks


def _lm_task(quick: bool, corpus: Path | None = None) -> LanguageModelTask:
    """The ``lm`` task, at :data:`LM_QUICK_LENGTHS` when ``quick``, on ``corpus``."""
    task = LanguageModelTask(corpus=None if corpus is None else str(corpus))
    if quick:
        task = replace(task, train_length=LM_QUICK_LENGTHS[0], test_lengths=LM_QUICK_LENGTHS)
    return task


def _task_configs(args: argparse.Namespace, config: Config, tasks: Sequence[Task]) -> dict:
    """The set-up of each task that differs from ``config``: the ``lm`` task trains for
    :data:`LM_STEPS` unless ``--steps`` is given."""
    if args.steps is not None:
        return {}
    steps = LM_STEPS["quick" if args.quick else "full"]
    return {t.name: replace(config, steps=steps) for t in tasks if isinstance(t, LanguageModelTask)}


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
        args.seeds = args.seeds or QUICK["seeds"]
        args.eval_examples = args.eval_examples or QUICK["eval_examples"]
    config = Config(
        steps=args.steps or (QUICK["steps"] if args.quick else Config.steps),
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
    configs = _task_configs(args, config, tasks)
    plan = [s for t in tasks for s in schemes_for(t, args.schemes)]
    if not plan:
        raise ValueError(
            f"no scheme of --schemes {','.join(args.schemes or [])} fits the tasks "
            f"{','.join(t.name for t in tasks)} (the 2-D schemes need --tasks grid)"
        )
    if config.dim % config.heads:
        raise ValueError(f"--dim {config.dim} must be divisible by --heads {config.heads}")
    if any(registry.get(s).two_d for s in plan) and (config.dim // config.heads) % 4:
        raise ValueError(
            f"--dim {config.dim} / --heads {config.heads} must give a head dim that is a "
            f"multiple of 4 for the 2-D schemes (they split it in quarters)"
        )
    started_group = _init_distributed(args.device)
    try:
        rank, world = rank_and_world()
        groups: list[tuple[Config, list[Task]]] = []  # tasks with the same set-up together
        for task in tasks:
            task_config = configs.get(task.name, config)
            if groups and groups[-1][0] == task_config:
                groups[-1][1].append(task)
            else:
                groups.append((task_config, [task]))
        runs = []
        for task_config, group in groups:
            runs += compare(
                group,
                args.schemes,
                seeds,
                task_config,
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
            record = to_json(runs, config, seeds, tasks, configs)
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
            "copy, grid), at one length, and test it at longer ones. --tasks lm: a "
            "byte-level language model on real text (Python's standard library source, or "
            "--corpus), scored by perplexity at 1, 2, 4 and 8 times its training length. "
            "Prints a Markdown table; with --out also writes it with a plot. Launch with "
            "torchrun --nproc_per_node N -m posenc compare ... for DistributedDataParallel."
        ),
    )
    parser.add_argument(
        "--tasks",
        type=lambda t: _names(t, list(ALL_TASKS), "task(s)"),
        default=list(TASKS),
        help=f"comma-separated, from {','.join(ALL_TASKS)} (default {','.join(TASKS)}; lm: a "
        f"byte-level language model on real text, see --corpus)",
    )
    parser.add_argument(
        "--corpus",
        type=_corpus,
        default=None,
        help="the lm task's text: a UTF-8 text file or a folder of them (default: the top-level "
        "modules of Python's standard library; see docs/compare.md)",
    )
    parser.add_argument(
        "--schemes",
        type=scheme_list(registry.names()),
        default=None,
        help=f"comma-separated, from: {', '.join(registry.names())} (default all that fit "
        f"each task of: {','.join(default_schemes())}){aliases_note(registry.names())}",
    )
    parser.add_argument(
        "--lengths",
        type=_lengths,
        default=None,
        help="1-D tasks: train at the first, test at all (default 32,64,128; lm: 64,128,256,512)",
    )
    parser.add_argument(
        "--grid-lengths",
        type=_lengths,
        default=None,
        help="grid task: train at the first, test at all (default 6x6,9x9,12x12)",
    )
    parser.add_argument("--seeds", type=positive_int, default=None, help="seeds per scheme (3)")
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help=f"training steps (200; lm: {LM_STEPS['full']}, with --quick {LM_STEPS['quick']})",
    )
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
        "--eval-examples",
        type=positive_int,
        default=None,
        help="test examples per length (128; lm: held-out windows of the longest length, the "
        "same text cut into shorter windows for the shorter lengths)",
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
            f"{QUICK['eval_examples']} test examples (lm: {LM_STEPS['quick']} steps at "
            f"{','.join(map(str, LM_QUICK_LENGTHS))}; explicit flags win)"
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
