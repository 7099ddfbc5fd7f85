"""Time posenc's attention core with one tuning constant at two or more values, in one process.

For each scheme and shape ``(b, h, n, d)`` it builds the scheme as ``posenc bench`` does
and times, interleaved call by call (the order of the values alternating from one repeat
to the next), posenc's attention core (``backend="auto"``) with
``posenc.engine.tuning.<constant>`` set to each value, and plain SDPA without positions
(the floor) after each round. Forward only in no-grad mode, or with ``--backward`` forward
and backward. The constants are read at call time, so the values share one process, its
allocator and its caches: a ratio between them is what the constant changes.

Prints one row per case: each value's median time as a ratio to the floor, and each
value after the first as a ratio to the first's. The constant is restored afterwards.

Run: ``.venv/bin/python tools/constant_ab.py --constant GEMM_COLUMNS --values 1,8
[--schemes relative] [--shapes 2x8x2048x64] [--repeats 9] [--backward]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from posenc import registry
from posenc.cli._bench_variants import _core, _floor, _inputs, build_scheme
from posenc.engine import tuning


def _constant(name: str) -> int | float:
    """The constant's value now.

    Raises:
        ValueError: ``tuning`` has no numeric constant ``name``.
    """
    value = getattr(tuning, name, None) if name.isupper() else None
    if not isinstance(value, int | float) or isinstance(value, bool):
        known = ", ".join(n for n in vars(tuning) if n.isupper())
        raise ValueError(f"--constant {name!r} is not a tuning constant; one of: {known}")
    return value


def _timed(fn: Callable[[], Any], backward: bool) -> float:
    start = time.perf_counter()
    if backward:
        fn().sum().backward()
    else:
        with torch.no_grad():
            fn()
    return time.perf_counter() - start


def measure(
    scheme_name: str,
    shape: tuple[int, int, int, int],
    constant: str,
    values: list[int | float],
    repeats: int,
    backward: bool = False,
) -> dict[str, Any]:
    """Median seconds of the attention core at each value of ``constant`` (keyed by the
    value) and of the floor (``"floor"``), for one scheme at one shape.

    Raises:
        ValueError: ``constant`` is not a tuning constant.
    """
    original = _constant(constant)
    b, h, n, d = shape
    q, k, v = _inputs(b, h, n, d, torch.float32, torch.device("cpu"), backward)
    core = _core(build_scheme(scheme_name, h, d, n), "auto")

    def run_core() -> Tensor:
        return core(q, k, v)

    times: dict[Any, list[float]] = {value: [] for value in values}
    floor: list[float] = []
    try:
        for value in values:  # a first call of each: anything made lazily, made
            setattr(tuning, constant, value)
            _timed(run_core, backward)
        for repeat in range(repeats):
            for value in values if repeat % 2 == 0 else values[::-1]:
                setattr(tuning, constant, value)
                times[value].append(_timed(run_core, backward))
            floor.append(_timed(lambda: _floor(q, k, v), backward))
    finally:
        setattr(tuning, constant, original)
    return {
        "scheme": scheme_name,
        "shape": shape,
        "floor": statistics.median(floor),
        **{value: statistics.median(ts) for value, ts in times.items()},
    }


def format_row(row: dict[str, Any], values: list[int | float]) -> str:
    """One markdown row: the case, each value over the floor, each later value over the
    first."""
    over_floor = [f"{row[value] / row['floor']:.2f}" for value in values]
    over_first = [f"{row[value] / row[values[0]]:.3f}" for value in values[1:]]
    shape = "x".join(map(str, row["shape"]))
    return f"| {row['scheme']} | {shape} | " + " | ".join(over_floor + over_first) + " |"


def _shape(text: str) -> tuple[int, int, int, int]:
    parts = text.split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is b x h x n x d, e.g. 2x8x64x64; got {text!r}")
    b, h, n, d = map(int, parts)
    return b, h, n, d


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--constant", required=True, help="a name in posenc.engine.tuning")
    parser.add_argument(
        "--values", required=True, type=lambda s: [_number(x) for x in s.split(",")],
        help="two or more distinct values, comma-separated (the first is the baseline)",
    )  # fmt: skip
    parser.add_argument(
        "--schemes", default="relative", type=lambda s: s.split(","),
        help="names of posenc.registry, comma-separated (default: relative)",
    )  # fmt: skip
    parser.add_argument(
        "--shapes", default=[(2, 8, 64, 64)], type=lambda s: [_shape(x) for x in s.split(",")],
        help="b x h x n x d, comma-separated (default: 2x8x64x64)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per value (default: 9)")
    parser.add_argument("--backward", action="store_true", help="time forward and backward")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every argument usable before anything is timed (``parser.error`` otherwise: exit 2)."""
    try:
        current = _constant(args.constant)
    except ValueError as error:
        parser.error(str(error))
    values = args.values
    if len(values) < 2 or len(set(values)) != len(values):
        parser.error(f"--values: give two or more distinct values, got {values}")
    if isinstance(current, int) and not all(isinstance(v, int) for v in values):
        parser.error(f"--values: {args.constant} is an integer ({current}), got {values}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    for scheme in args.schemes:
        try:
            registry.resolve(scheme)
        except ValueError as error:
            parser.error(f"--schemes: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    values = args.values
    head = [f"{args.constant}={value} / floor" for value in values]
    head += [f"{value} / {values[0]}" for value in values[1:]]
    print(f"| scheme | b x h x n x d | {' | '.join(head)} |")
    print("|" + "---|" * (2 + len(head)))
    for scheme in args.schemes:
        for shape in args.shapes:
            row = measure(scheme, shape, args.constant, values, args.repeats, args.backward)
            print(format_row(row, values), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
