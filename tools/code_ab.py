"""Two versions of posenc in one process: the working tree against a commit, call by call.

A change to the engine's Python moves a small call's time by a few percent, less than this
machine's spread from one process to the next (10-30% at ``b=2 n=64``). This tool loads
the package as it was at ``--base`` (``git archive`` of ``src/posenc`` into a temporary
directory, imported as ``posenc_base``: the package imports itself by relative imports
alone) beside the working tree's ``posenc``, and times, interleaved in one process (each
repeat runs every variant once, in an order drawn anew):

- ``floor``: SDPA without positions;
- ``base`` and ``new``: posenc's attention core as ``posenc bench`` calls it (that
  version's ``_core`` in ``posenc.cli._bench_variants``: the rotation, then the engine's
  ``attend`` on default positions, or the route kept for the inputs alone where that
  version has one), or with ``--entry attention`` the public :func:`posenc.attention`
  (its checks and defaults too), of each version, on the same scheme configuration and
  inputs.

It prints per scheme, shape and mode (``fwd``: forward without gradients; ``fwd+bwd``:
forward, then backward of the output's sum, the gradients set to None after each, as
``zero_grad(set_to_none=True)`` between steps) the medians of ``base / floor``, ``new /
floor`` and of ``new / base`` per repeat.

Run: ``.venv/bin/python tools/code_ab.py --base HEAD [--schemes alibi,none] [--shapes
2x8x64x64,2x8x256x64] [--repeats 300] [--backward] [--entry core|attention]
[--layout bhnd|bnhd] [--causal]``: ``bnhd`` makes ``q, k, v`` views of one ``[b, n, 3, h, d]`` projection
output, as a model's are.

Shape legend: ``b`` batch, ``h`` heads, ``n`` tokens, ``d`` head dim.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import io
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent


def load_base(commit: str, where: Path) -> ModuleType:
    """``src/posenc`` at ``commit``, written under ``where`` and imported as
    ``posenc_base``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "src/posenc"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.10.12+
        tar.extractall(where, **safe)  # an archive of this repository
    (where / "src" / "posenc").rename(where / "posenc_base")
    for name in [name for name in sys.modules if name.partition(".")[0] == "posenc_base"]:
        del sys.modules[name]  # a version loaded before
    sys.path.insert(0, str(where))
    try:
        return importlib.import_module("posenc_base")
    finally:
        sys.path.remove(str(where))


def _core(
    package: str,
    scheme_name: str,
    b: int,
    h: int,
    n: int,
    d: int,
    entry: str = "core",
    causal: bool = False,
) -> Callable:
    """The bench's posenc core of ``package`` for ``scheme_name`` (``none``: no scheme), or
    with ``entry="attention"`` the package's :func:`~posenc.attention` with that scheme;
    ``causal`` or not."""
    variants = importlib.import_module(f"{package}.cli._bench_variants")
    scheme = None if scheme_name == "none" else variants.build_scheme(scheme_name, h, d, n)
    if entry == "attention":
        attention = importlib.import_module(package).attention
        return lambda q, k, v: attention(q, k, v, position=scheme, causal=causal)
    return variants._core(scheme, "auto", causal=causal)


def _floor(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def measure(
    scheme_name: str,
    shape: tuple[int, int, int, int],
    repeats: int,
    backward: bool,
    entry: str = "core",
    layout: str = "bhnd",
    causal: bool = False,
) -> dict[str, Any]:
    """The medians of ``base / floor``, ``new / floor`` and ``new / base`` per repeat."""
    b, h, n, d = shape
    gen = torch.Generator().manual_seed(0)
    if layout == "bhnd":  # leaves of their own
        q, k, v = (
            torch.randn(b, h, n, d, generator=gen).requires_grad_(backward) for _ in range(3)
        )
        leaves = [q, k, v]
    else:  # views of one projection's output [b, n, 3, h, d], as a model's q, k, v
        qkv = torch.randn(b, n, 3, h, d, generator=gen).requires_grad_(backward)
        q, k, v = qkv.unbind(2)  # [b, n, h, d] each
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, n, h, d] -> [b, h, n, d]
        leaves = [qkv]
    calls = {
        "floor": functools.partial(_floor, causal=causal),
        "base": _core("posenc_base", scheme_name, b, h, n, d, entry, causal),
        "new": _core("posenc", scheme_name, b, h, n, d, entry, causal),
    }

    def run(fn: Callable) -> float:
        start = time.perf_counter()
        out = fn(q, k, v)
        if backward:
            out.sum().backward(inputs=leaves)
            for leaf in leaves:  # as zero_grad(set_to_none=True) between steps
                leaf.grad = None
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.set_grad_enabled(backward):
        for fn in calls.values():  # first calls: tables, kept routes
            run(fn)
            run(fn)
        for _ in range(repeats):
            names = list(calls)
            random.shuffle(names)
            for name in names:
                times[name].append(run(calls[name]))
    ratio = lambda a, c: statistics.median(x / y for x, y in zip(times[a], times[c], strict=True))  # noqa: E731
    return {
        "scheme": scheme_name,
        "shape": shape,
        "mode": "fwd+bwd" if backward else "fwd",
        "floor_us": statistics.median(times["floor"]) * 1e6,
        "base/floor": ratio("base", "floor"),
        "new/floor": ratio("new", "floor"),
        "new/base": ratio("new", "base"),
    }


def _shapes(text: str) -> list[tuple[int, int, int, int]]:
    """``--shapes``: ``b x h x n x d`` each, comma-separated."""
    shapes = []
    for part in text.split(","):
        sizes = part.strip().split("x")
        if len(sizes) != 4 or not all(size.isdigit() and int(size) > 0 for size in sizes):
            raise argparse.ArgumentTypeError(
                f"a shape is four positive sizes b x h x n x d, such as 2x8x64x64; got {part!r}"
            )
        shapes.append(tuple(map(int, sizes)))
    return shapes  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare against")
    parser.add_argument("--schemes", default="none,alibi")
    parser.add_argument(
        "--shapes", type=_shapes, default="2x8x64x64", help="b x h x n x d, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--backward", action="store_true", help="time fwd+bwd, not forward")
    parser.add_argument(
        "--layout",
        choices=("bhnd", "bnhd"),
        default="bhnd",
        help="q, k, v as leaves of their own (bhnd), or as views of one projection's "
        "[b, n, 3, h, d] output (bnhd), as in a model",
    )
    parser.add_argument("--causal", action="store_true", help="causal calls (floor: is_causal)")
    parser.add_argument(
        "--entry",
        choices=("core", "attention"),
        default="core",
        help="the bench's core (rotation + attend), or the public posenc.attention",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as where:
        load_base(args.base, Path(where))
        print("| scheme | b h n d | mode | floor us | base / floor | new / floor | new / base |")
        print("|---|---|---|---:|---:|---:|---:|")
        for shape in args.shapes:
            for scheme in args.schemes.split(","):
                row = measure(
                    scheme, shape, args.repeats, args.backward, args.entry, args.layout, args.causal
                )
                print(
                    f"| {scheme} | {' '.join(map(str, shape))} | {row['mode']} | "
                    f"{row['floor_us']:.0f} | {row['base/floor']:.3f} | {row['new/floor']:.3f} | "
                    f"{row['new/base']:.3f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
