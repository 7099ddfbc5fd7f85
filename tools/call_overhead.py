"""Where a small call's time goes: posenc's Python around SDPA's kernel, hot and in a call.

For each scheme and shape it times, forward without gradients, interleaved in one process
(each repeat runs every variant once, in an order drawn anew):

- ``peer``: the scheme as other code computes it (``posenc bench --baselines peer``);
- ``posenc``: posenc's attention core as ``posenc bench`` calls it (the rotation, then
  :func:`posenc.engine.attend` on default positions), with the time inside SDPA's kernel
  (``posenc.engine.sdpa._kernel``, called once per call on this route) taken apart;
- ``bound`` (schemes that do not rotate): SDPA with the bias that posenc's call hands its
  kernel, looked up in a dict by the inputs' shapes, dtype and grad state: the time of a
  call whose dispatch is one lookup, the least a dispatcher can take (a measure, not a
  path: it checks nothing).

It prints per scheme and shape the medians of the peer's call, posenc's call, the kernel
inside posenc's call and posenc's time outside it (its Python and the small ops around
the kernel), the bound call, and posenc's call without the kernel (the same call with the
kernel replaced by returning ``q``, run back to back: hot caches; a rotation's kernels
stay). Outside the kernel a call takes more than without it: the kernel's working set
has evicted the code and data that the Python touches from the caches, so each call pays
to bring them back.

Only schemes whose call runs SDPA's kernel once, on posenc's SDPA route (ALiBi's kept
bias, rotary, no scheme), are taken apart; others print n/a for the kernel.

Run: ``.venv/bin/python tools/call_overhead.py [--shapes small,swin] [--schemes
alibi,rotary-interleaved,none] [--repeats 300]``; docs/performance.md ("Fourteenth
pass") has its tables.

Shape legend: ``b`` batch, ``h`` heads, ``n`` tokens, ``d`` head dim.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.cli._bench_peers import peer_of
from posenc.cli._bench_variants import _core, build_scheme
from posenc.cli.bench import SHAPES
from posenc.engine import sdpa


def _kernel_timer() -> tuple[list[float], Callable[[], None]]:
    """``(times, restore)``: ``sdpa._kernel`` wrapped so that each call appends its seconds
    to ``times``; ``restore()`` unwraps it."""
    times: list[float] = []
    kernel = sdpa._kernel

    def timed(*args: Any) -> Tensor:
        start = time.perf_counter()
        out = kernel(*args)
        times.append(time.perf_counter() - start)
        return out

    sdpa._kernel = timed

    def restore() -> None:
        sdpa._kernel = kernel

    return times, restore


def _bound(posenc_call: Callable, q: Tensor, k: Tensor, v: Tensor) -> Callable | None:
    """SDPA with the mask that ``posenc_call`` hands the kernel, behind a dict lookup; None
    where the call does not run the kernel exactly once."""
    seen: list[tuple[Tensor | None, float]] = []
    kernel = sdpa._kernel

    def spy(q_: Tensor, k_: Tensor, v_: Tensor, attn_mask: Tensor | None, *args: Any) -> Tensor:
        seen.append((attn_mask, args[-1]))
        return kernel(q_, k_, v_, attn_mask, *args)

    sdpa._kernel = spy
    try:
        with torch.no_grad():
            posenc_call(q, k, v)
    finally:
        sdpa._kernel = kernel
    if len(seen) != 1:
        return None
    kept: dict[tuple, tuple[Tensor | None, float]] = {}

    def bound(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        key = (q.shape, k.shape, v.shape, q.dtype, torch.is_grad_enabled(), q.requires_grad)
        entry = kept.get(key)
        if entry is None:
            entry = kept[key] = seen[0]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=entry[0], scale=entry[1])

    return bound


def _without_kernel(call: Callable, q: Tensor, k: Tensor, v: Tensor, calls: int) -> float:
    """Seconds per call of ``call`` with SDPA's kernel replaced by returning ``q``, back to
    back (the best of five rounds of ``calls``)."""
    kernel = sdpa._kernel
    sdpa._kernel = lambda q_, *args: q_
    try:
        with torch.no_grad():
            for _ in range(20):
                call(q, k, v)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(calls):
                    call(q, k, v)
                best = min(best, (time.perf_counter() - start) / calls)
    finally:
        sdpa._kernel = kernel
    return best


def measure(scheme_name: str, shape: tuple[int, int, int, int], repeats: int) -> dict[str, Any]:
    """The medians (microseconds) of one scheme at one shape; see the module docstring."""
    b, h, n, d = shape
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    scheme = None if scheme_name == "none" else build_scheme(scheme_name, h, d, n)
    posenc_call = _core(scheme, "auto")
    calls: dict[str, Callable | None] = {
        "peer": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
        if scheme is None
        else peer_of(scheme, lambda q: None),
        "posenc": posenc_call,
        # a rotation is work, not dispatch: no bound call for a rotating scheme
        "bound": None if hasattr(scheme, "rotate") else _bound(posenc_call, q, k, v),
    }
    present = {name: fn for name, fn in calls.items() if fn is not None}
    times: dict[str, list[float]] = {name: [] for name in present}
    inside, restore = _kernel_timer()
    kernel_times: list[float] = []
    try:
        with torch.no_grad():
            for fn in present.values():
                for _ in range(10):
                    fn(q, k, v)
            for _ in range(repeats):
                order = list(present)
                random.shuffle(order)
                for name in order:
                    inside.clear()
                    start = time.perf_counter()
                    present[name](q, k, v)
                    times[name].append(time.perf_counter() - start)
                    if name == "posenc":
                        kernel_times.append(inside[0] if len(inside) == 1 else float("nan"))
    finally:
        restore()
    medians = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
    kernel = statistics.median(kernel_times) * 1e6 if kernel_times else float("nan")
    return {
        "scheme": scheme_name,
        "shape": shape,
        **medians,
        "kernel": kernel,
        "outside": medians["posenc"] - kernel,
        "without_kernel": _without_kernel(posenc_call, q, k, v, 500) * 1e6
        if kernel == kernel  # not NaN: the call runs the kernel once
        else float("nan"),
    }


def _cell(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:.0f}"


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of :func:`measure`'s rows, in microseconds."""
    lines = [
        "| scheme | b h n d | peer | posenc | kernel inside | outside the kernel | bound "
        "| posenc / peer | bound / peer | posenc without the kernel, hot |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        peer = row.get("peer")
        bound = row.get("bound")
        lines.append(
            f"| {row['scheme']} | {' '.join(map(str, row['shape']))} | {_cell(peer)} "
            f"| {_cell(row['posenc'])} | {_cell(row['kernel'])} | {_cell(row['outside'])} "
            f"| {_cell(bound)} | {row['posenc'] / peer:.3f} | "
            f"{'n/a' if bound is None else f'{bound / peer:.3f}'} | {_cell(row['without_kernel'])} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="small,swin", help=f"from {', '.join(SHAPES)}")
    parser.add_argument(
        "--schemes", default="alibi,rotary-interleaved,none", help="bench names, or none"
    )
    parser.add_argument("--repeats", type=int, default=300)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = [
        measure(scheme, SHAPES[shape], args.repeats)
        for shape in args.shapes.split(",")
        for scheme in args.schemes.split(",")
    ]
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
