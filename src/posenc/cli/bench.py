"""``posenc bench``: time and memory of every scheme against plain attention, in one run.

For each scheme and length it measures, interleaved in the same run:

- ``floor``: :func:`torch.nn.functional.scaled_dot_product_attention` with no positions;
- ``posenc``: the scheme through posenc's attention core with ``backend="auto"`` (or the
  backend asked for);
- ``reference``: the same scheme with ``backend="math"``, the literal implementation
  (the full ``[n, n]`` scores, Shaw's ``[n, n, d]`` relation tensors), where it fits in
  memory;
- with ``--baselines``: ``flex-floor``, FlexAttention (compiled) with no ``score_mod`` and
  the floor's mask as a ``BlockMask``; ``materialised``, SDPA with the scheme's dense bias
  ``[b|1, h, n, n]`` as a float ``attn_mask`` (what Hugging Face-style code does; rotary
  rotates first; schemes with a content-dependent term are skipped with the reason);
  ``peer``, the scheme the way other code computes it (Hugging Face's T5 bias, Swin's
  gathered table, Shaw's ``[n, n, d]`` relation tensors, the Music Transformer skew,
  rotary-embedding-torch: :mod:`posenc.cli._bench_peers`), the same attention;
  ``copy-floor``, a rotary scheme's yardstick: the floor on copies of ``q`` and ``k``,
  their gradients copied in the backward, what a rotation in eager out-of-place ops pays
  at least.

``--shapes`` runs presets of ``(b, h, n, d)`` (:data:`SHAPES`: Swin's windows, BERT-base,
long sequences) in place of ``--lengths``, ``--batch``, ``--heads`` and ``--head-dim``;
``--compile`` times every variant under :func:`torch.compile` (static shapes; each case
compiles its own graphs in its warm-up); ``--busy N`` measures with ``N`` neighbour
processes spinning matrix products;
``--processes N`` runs the whole measurement in ``N`` fresh processes, one after another,
and reports each ratio's median over them with its range (:mod:`._bench_processes`).

A variant that runs out of CUDA memory is skipped with the reason, the others go on.

Times are medians over repeats after warm-up, forward+backward and forward only; a repeat
times each variant over enough calls in a row to last 20 ms (at most 200, counted from its
warm-up and then from its last repeat: a single call of a small shape would be timed
cold). Peak
memory is measured in one more forward+backward of each variant, apart from the timed
ones: on CPU the peak of the bytes torch allocated during it, from the profiler's
allocation events (``profile_memory=True``); with ``--memory process`` the growth of the
peak resident set in a fresh Python process per variant and case whose allocator returns
freed blocks (Linux: reset through ``/proc/self/clear_refs``); on CUDA
``max_memory_allocated``. Speed
is reported as ratios to the floor (and the baselines) measured beside it, never as
absolute claims.

The schemes are the entries of :mod:`posenc.registry` inside attention, built for each
length (:func:`build_scheme`); the default run takes those whose ``default_in`` names
``bench`` (:func:`default_schemes`).

Shape legend: ``b`` batch, ``h`` heads, ``n`` length, ``d`` head dim.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import sys
from dataclasses import asdict
from typing import Any

import torch

from .. import registry
from ..hooks import hooks_of
from ._bench_measure import (  # noqa: F401  (_peak_*: re-exported, tests import them here)
    MEMORY_FROM,
    Case,
    _peak_in_subprocess,
    _peak_of_case,
    busy_neighbours,
    run_bench,
)
from ._bench_processes import in_processes, merged
from ._bench_report import format_table, to_json
from ._bench_variants import (  # noqa: F401  (_core, the floors: re-exported for the tests)
    BASELINES,
    _causal_floor,
    _copy_floor_of,
    _core,
    _flex_floor_of,
    _floor,
    _floor_of,
    _key_padding,
    _materialised_of,
    _peer_of,
    build_scheme,
    default_schemes,
)
from ._options import (
    aliases_note,
    device,
    non_negative_int,
    output_file,
    positive_int,
    positive_int_list,
    scheme_list,
)
from ._progress import Progress

# ----- the command ---------------------------------------------------------------------------


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"must be a fraction of the keys in [0, 1) (0.25: a quarter), got {text!r}"
        )
    return value


#: how the header names each baseline
_BASELINE_WORDS = {
    "flex": "FlexAttention without a score_mod (flex-floor)",
    "materialised": "SDPA with the dense bias as attn_mask (materialised)",
    "peer": "the scheme as other code computes it (peer)",
    "copies": "SDPA on copies of q and k, their gradients copied back (copy-floor)",
}

#: ``--shapes`` presets: name -> (b, h, n, d)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "swin": (128, 4, 49, 32),  # Swin-T stage 1: 7x7 windows of a 224 image, batch of windows
    "bert": (32, 12, 128, 64),  # BERT-base at 128 tokens
    "small": (2, 8, 64, 64),
    "512": (8, 8, 512, 64),
    "2048": (2, 8, 2048, 64),
    "4096": (2, 8, 4096, 64),
}


def _shape_list(text: str) -> list[str]:
    """``--shapes``: comma-separated names of :data:`SHAPES`, each once."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in SHAPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown shape {(unknown[0] if unknown else text)!r}; use a comma-separated "
            f"list of {', '.join(SHAPES)} (e.g. swin,bert,512)"
        )
    return list(dict.fromkeys(names))


def _runs(args: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """``(preset name, args with its b, h, n, d)`` for each of ``--shapes``, or
    ``("", args)`` without it."""
    if not args.shapes:
        return [("", args)]
    runs = []
    for name in args.shapes:
        b, h, n, d = SHAPES[name]
        sizes = {"batch": b, "heads": h, "lengths": [n], "head_dim": d}
        runs.append((name, argparse.Namespace(**{**vars(args), **sizes})))
    return runs


def _baseline_list(text: str) -> list[str]:
    """``--baselines``: comma-separated names of :data:`BASELINES`, each once."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in BASELINES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown baseline {(unknown[0] if unknown else text)!r}; use a comma-separated "
            f"list of {', '.join(BASELINES)} (e.g. flex,materialised)"
        )
    return list(dict.fromkeys(names))


#: the backends that serve every scheme, offered instead of one that cannot
_GENERAL_BACKENDS = "auto, lean or math"


def _backend_problem(scheme: Any, backend: str, device_type: str = "cpu") -> str | None:
    """Why ``backend`` cannot run ``scheme`` on ``device_type`` (the rules of
    :mod:`posenc.engine`), or None."""
    hooks = hooks_of(scheme)
    if backend == "sdpa" and hooks.value_term is not None:
        return "SDPA has no value term, which Shaw's a^V needs"
    if backend == "flex" and hooks.value_term is not None:
        return "FlexAttention has no value term, which Shaw's a^V needs"
    if backend == "flex" and hooks.contextual_term is not None:
        return "FlexAttention has no contextual term, which CoPE's counts of the logits need"
    if (
        backend == "flex"
        and hooks.score_term is not None
        and hooks.flex_term_mod is None
        and hooks.key_shift is None
    ):
        return (
            "FlexAttention takes a query term only with a bounded reach (flex_term_mod) or "
            "of the key alone (key_shift)"
        )
    if backend == "flex" and hooks.score_bias is not None and hooks.flex_score_mod is None:
        return "FlexAttention needs a flex_score_mod, which the scheme lacks"
    return None


def check(args: argparse.Namespace) -> None:
    """Refuse, before anything is measured, what would fail part-way through the run.

    Raises:
        ValueError: ``--memory process`` on a GPU; ``--backend flex`` or ``--baselines
            flex`` with the backward on CPU, where FlexAttention has none; ``--compile``
            with ``--warmup 0`` (the first timed call would compile); a scheme that
            cannot be built with ``--heads`` and ``--head-dim``; a ``--backend`` that
            cannot run one of ``--schemes``.
    """
    device_type = torch.device(args.device).type
    if args.compile and args.warmup < 1:
        raise ValueError(
            f"--compile needs --warmup 1 or more, got --warmup {args.warmup}: each variant "
            "compiles in its first call, which a timed repeat would then include"
        )
    on_cpu = device_type == "cpu"
    if args.memory == "process" and not on_cpu:
        raise ValueError(
            f"--memory process measures a fresh process's resident set, on CPU only; on "
            f"--device {args.device} leave --memory out (the allocator's peak is measured)"
        )
    if args.backend == "flex" and not args.no_backward and on_cpu:
        raise ValueError(
            f"--backend flex cannot time the backward on CPU (FlexAttention in torch "
            f"{torch.__version__.split('+')[0]} has no CPU backward, and bench times "
            "forward+backward); add --no-backward to time the forward only, run on a GPU "
            f"with --device cuda, or use --backend {_GENERAL_BACKENDS}"
        )
    if "flex" in args.baselines and not args.no_backward and on_cpu:
        others = [b for b in args.baselines if b != "flex"]
        raise ValueError(
            f"--baselines flex cannot time the backward on CPU (FlexAttention in torch "
            f"{torch.__version__.split('+')[0]} has no CPU backward, and bench times "
            "forward+backward); add --no-backward to time the forward only, run on a GPU "
            "with --device cuda, or leave flex out"
            + (f" (--baselines {','.join(others)})" if others else "")
        )
    # built at a small length: the length only sizes the tables, what can be refused is
    # --heads or --head-dim (a table for n = 16384 would take a minute to build here)
    small = min(16, *args.lengths)
    problems: dict[str, str | None] = {}
    for name in args.schemes:
        try:
            scheme = build_scheme(name, args.heads, args.head_dim, small)
        except ValueError as err:
            raise ValueError(
                f"--schemes {name} cannot be built with --heads {args.heads} "
                f"--head-dim {args.head_dim}: {err}"
            ) from None
        problems[name] = _backend_problem(scheme, args.backend, device_type)
    unfit = [name for name in args.schemes if problems[name] is not None]
    if unfit:
        reasons = dict.fromkeys(problems[name] for name in unfit)
        # the hooks a scheme has do not depend on its sizes
        fit = [
            name
            for name in default_schemes()
            if _backend_problem(build_scheme(name, 1, 2, 1), args.backend, device_type) is None
        ]
        raise ValueError(
            f"--backend {args.backend} cannot run --schemes {','.join(unfit)} "
            f"({'; '.join(reasons)}); use --backend {_GENERAL_BACKENDS}, or --schemes "
            f"{','.join(fit)}"
        )


def run(args: argparse.Namespace) -> int:
    """Run ``posenc bench`` and print the table."""
    runs = _runs(args)
    for name, sized in runs:
        try:
            check(sized)
        except ValueError as err:
            if not name:
                raise
            raise ValueError(f"--shapes {name} ({_sizes(name)}): {err}") from None
    dtype = getattr(torch, args.dtype)
    config = {
        "schemes": args.schemes,
        "lengths": args.lengths,
        "batch": args.batch,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "device": args.device,
        "backward": not args.no_backward,
        "backend": args.backend,
        "repeats": args.repeats,
        "memory": not args.no_memory,
        "memory_from": args.memory,
        "causal": args.causal,
        "padding": args.padding,
        "documents": args.documents,
        "window": args.window,
        "baselines": args.baselines,
        "compile": args.compile,
        "shapes": {name: dict(zip("bhnd", SHAPES[name], strict=True)) for name in args.shapes},
        "busy": args.busy,
        "processes": args.processes,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "openmp": _openmp_settings(),
    }
    if torch.device(args.device).type == "cuda":
        config["gpu"] = torch.cuda.get_device_name(torch.device(args.device))

    processes: list[list[Case]] | None = None
    with busy_neighbours(args.busy):  # stopped whatever happens
        if args.processes == 1:
            cases = _measured(runs, dtype)
        else:
            processes = in_processes(args, args.processes)
            cases = merged(processes)
    print(_header(args, config.get("gpu")) + "\n")
    print(format_table(cases, backward=not args.no_backward, runs=processes))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(cases, config, processes), indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _measured(runs: list[tuple[str, argparse.Namespace]], dtype: torch.dtype) -> list[Case]:
    """The cases of each run of :func:`_runs`, named by its preset."""
    cases: list[Case] = []
    for name, sized in runs:
        for case in _bench(sized, dtype):
            case.shape = name
            cases.append(case)
    return cases


def measure_as_child() -> None:
    """A measuring process of ``--processes``: the options pickled on standard input, the
    cases written as JSON to their ``child_out`` (:func:`._bench_processes.in_processes`)."""
    args = pickle.loads(sys.stdin.buffer.read())
    cases = _measured(_runs(args), getattr(torch, args.dtype))
    with open(args.child_out, "w") as out:
        json.dump([asdict(case) for case in cases], out)


def _bench(args: argparse.Namespace, dtype: torch.dtype) -> list[Case]:
    """:func:`run_bench` with the options of ``args`` (one preset's sizes under --shapes)."""
    progress = Progress(len(args.schemes) * len(args.lengths), quiet=args.quiet)
    return run_bench(
        args.schemes,
        args.lengths,
        batch=args.batch,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=dtype,
        device=args.device,
        backward=not args.no_backward,
        backend=args.backend,
        repeats=args.repeats,
        warmup=args.warmup,
        reference=not args.no_reference,
        memory=not args.no_memory,
        memory_from=args.memory,
        causal=args.causal,
        padding=args.padding,
        documents=args.documents,
        window=args.window,
        baselines=args.baselines,
        compile=args.compile,
        progress=progress,
    )


#: the environment variables that set how torch's OpenMP threads wait at each kernel's end
#: (GNU OpenMP's, which torch's CPU wheels use on Linux): with busy neighbours, threads that
#: spin there take the cores a preempted thread of the same kernel waits for
_OPENMP_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _openmp_settings() -> dict[str, str]:
    """The OpenMP settings of this process's environment (:data:`_OPENMP_VARIABLES`, those
    set), recorded beside the thread count: a figure taken with busy neighbours depends on
    them (docs/performance.md, "Thirty-second pass")."""
    return {name: os.environ[name] for name in _OPENMP_VARIABLES if name in os.environ}


def _sizes(name: str) -> str:
    return " ".join(f"{k}={v}" for k, v in zip("bhnd", SHAPES[name], strict=True))


def _header(args: argparse.Namespace, gpu: str | None) -> str:
    """The line above the table: the sizes, the masks, the references of the ratios."""
    masks = "causal, " if args.causal else ""
    if args.documents > 1:
        masks += f"{args.documents} documents a sequence, "
    if args.padding:
        masks += f"last sequence {args.padding:.0%} padding, "
    if args.window is not None:
        masks += f"window {args.window}, "
    if args.compile:
        masks += "every variant under torch.compile, "
    if args.busy:
        masks += f"{args.busy} busy neighbour process{'es' if args.busy > 1 else ''}, "
    masks += "".join(f"{name}={value}, " for name, value in _openmp_settings().items())
    if args.processes > 1:
        masks += f"in each of {args.processes} processes the "
    baselines = "".join(f", to {_BASELINE_WORDS[b]}" for b in args.baselines)
    on = args.device + (f" ({gpu})" if gpu else "")
    if args.shapes:
        sizes = "shapes " + "; ".join(f"{name}: {_sizes(name)}" for name in args.shapes) + ","
    else:
        sizes = f"b={args.batch} h={args.heads} d={args.head_dim}"
    return (
        f"posenc bench: {sizes} {args.dtype} on {on}, backend={args.backend}, {masks}median "
        f"of {args.repeats}; ratios to plain SDPA without positions (floor){baselines} and "
        f"to the literal implementation (reference)"
        + (
            f"; each ratio the median over the {args.processes} processes (lowest-highest)"
            if args.processes > 1
            else ""
        )
    )


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``posenc bench``."""
    parser = commands.add_parser(
        "bench",
        help="time and memory of every scheme against plain attention",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument(
        "--schemes",
        type=scheme_list(registry.names(inside=True)),
        default=default_schemes(),
        help=f"comma-separated, from: {', '.join(registry.names(inside=True))} (default: "
        f"{','.join(default_schemes())}){aliases_note(registry.names(inside=True))}",
    )
    parser.add_argument(
        "--lengths",
        type=positive_int_list,
        default=[512, 1024, 2048, 4096],
        help="comma-separated n (512,1024,2048,4096)",
    )
    parser.add_argument("--batch", type=positive_int, default=2, help="b (2)")
    parser.add_argument("--heads", type=positive_int, default=8, help="h (8)")
    parser.add_argument("--head-dim", type=positive_int, default=64, help="d (64)")
    parser.add_argument(
        "--dtype", choices=["float32", "float64", "bfloat16", "float16"], default="float32"
    )
    parser.add_argument("--device", type=device, default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--backend",
        choices=["auto", "math", "sdpa", "lean", "flex"],
        default="auto",
        help="posenc's path (auto); flex times the backward only on CUDA: on CPU add --no-backward",
    )
    parser.add_argument("--no-backward", action="store_true", help="time the forward only")
    parser.add_argument("--no-reference", action="store_true", help="skip the literal reference")
    parser.add_argument("--no-memory", action="store_true", help="skip peak memory")
    parser.add_argument(
        "--memory",
        choices=MEMORY_FROM,
        default="allocations",
        help="where the CPU's peak memory comes from: allocations (the peak of the bytes torch "
        "allocated, from the profiler's allocation events, in this process; the default) or "
        "process (the growth of the peak resident set in a fresh Python process per variant "
        "and case, Linux only, 2-4 s each)",
    )
    parser.add_argument(
        "--causal",
        action="store_true",
        help="causal attention (the floor then uses SDPA's is_causal)",
    )
    parser.add_argument(
        "--padding",
        type=_fraction,
        default=0.0,
        help="pad the end of the batch's last sequence by this fraction of its keys "
        "(key_padding; the floor takes SDPA's boolean mask), e.g. 0.25",
    )
    parser.add_argument(
        "--documents",
        type=positive_int,
        default=1,
        help="pack this many documents of equal length in each sequence (q_doc/k_doc, "
        "positions restarting in each; the floor takes SDPA's boolean mask)",
    )
    parser.add_argument(
        "--window",
        type=positive_int,
        default=None,
        help="a sliding window of this many keys per query (behind it, and ahead when not "
        "--causal; the floor takes SDPA's boolean mask)",
    )
    parser.add_argument(
        "--baselines",
        type=_baseline_list,
        default=[],
        help="also time, beside the floor, comma-separated: flex (FlexAttention compiled, "
        "no score_mod, the mask as a BlockMask: flex-floor; times the backward only on "
        "CUDA: on CPU add --no-backward), materialised (SDPA with the scheme's dense bias "
        "as a float attn_mask, as Hugging Face-style code does; skipped for content terms), "
        "peer (the scheme as other code computes it: HF T5Attention.compute_bias for t5, "
        "the gathered table for swin-1d, timm's relative_position_index for swin-2d, the "
        "written-out bias for alibi, Shaw's [n, n, d] relation tensors, the Music "
        "Transformer skew for relative, rotary-embedding-torch for rotary; skipped with the "
        "reason for the others or when the package is missing), copies (the floor on "
        "copies of q and k, their gradients copied back, each through an autograd Function: "
        "what a rotation in eager out-of-place ops pays at least, copy-floor; rotary "
        "schemes only)",
    )
    parser.add_argument(
        "--shapes",
        type=_shape_list,
        default=[],
        help="comma-separated presets of (b, h, n, d), each run in turn, a column of the "
        "table: " + "; ".join(f"{name} = {_sizes(name)}" for name in SHAPES) + ". They "
        "replace --lengths, --batch, --heads and --head-dim (ignored then)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="time every variant (posenc, the floor, the reference, the baselines) under "
        "torch.compile with static shapes, as in a compiled model; each case compiles its "
        "own graphs in its warm-up (seconds per variant; needs --warmup 1 or more)",
    )
    parser.add_argument(
        "--busy",
        type=non_negative_int,
        default=0,
        help="measure with this many busy neighbour processes (each one thread spinning "
        "matrix products), stopped after the run (0)",
    )
    parser.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        help="run the measurement in this many fresh processes, one after another, and "
        "report each ratio's median over them with its range: a small call's time moves "
        "with the process it runs in (1)",
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs (3)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed runs (1)")
    parser.add_argument(
        "--json",
        type=output_file("bench.json"),
        default=None,
        help="also write the results as JSON",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)
