"""Where a small call's time goes: posenc's Python around SDPA's kernel, hot and in a call.

For each scheme and shape it times, forward without gradients, interleaved in one process
(each repeat runs every variant once, in an order drawn anew):

- ``peer``: the scheme as other code computes it (``posenc bench --baselines peer``; n/a
  for a scheme without one);
- ``posenc``: posenc's attention core as ``posenc bench`` calls it (the rotation, then
  :func:`posenc.engine.attend` on default positions), with the time inside SDPA's kernel
  (``posenc.engine.sdpa._kernel``, called once per call on this route) taken apart; the
  wrapper that times the kernel adds its own small cost to posenc's call;
- ``bound`` (schemes that hand the kernel the same mask tensor in every call, a bias kept
  between calls such as ALiBi's, or none; not a rotation, which is work): SDPA with that
  mask, behind a dict lookup by the inputs' shapes and dtype: a call whose dispatch is
  one lookup (a measure, not a path: it checks nothing).

It prints per scheme and shape, in microseconds: the medians of the peer's call, of
posenc's call, of the kernel inside it and of the rest of each call (the call's time less
its kernel's: its Python and the small ops around the kernel), the median of the bound
call, and posenc's call without the kernel (replaced by returning ``q``), back to back:
the best of five rounds' mean call (a rotation's kernels stay). Schemes whose call does
not run SDPA's kernel exactly once (a term op by op) print n/a for the kernel.

Run: ``.venv/bin/python tools/call_overhead.py [--shapes small,swin] [--schemes
alibi,rotary-interleaved,none] [--repeats 300]``; docs/performance.md ("Fourteenth
pass") has its tables.

Shape legend: ``b`` batch, ``h`` heads, ``n`` tokens, ``d`` head dim.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.cli._bench_peers import peer_of
from posenc.cli._bench_variants import _core, build_scheme
from posenc.cli.bench import SHAPES
from posenc.engine import sdpa


@contextlib.contextmanager
def _kernel_replaced(wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """``sdpa._kernel`` replaced by ``wrap(kernel)`` inside the block, and restored after it
    (an exception too)."""
    kernel = sdpa._kernel
    sdpa._kernel = wrap(kernel)
    try:
        yield
    finally:
        sdpa._kernel = kernel


def _timed(times: list[float]) -> Callable[[Callable], Callable]:
    """A wrapper for :func:`_kernel_replaced` that appends each call's seconds to ``times``."""

    def wrap(kernel: Callable) -> Callable:
        def timed(*args: Any) -> Tensor:
            start = time.perf_counter()
            out = kernel(*args)
            times.append(time.perf_counter() - start)
            return out

        return timed

    return wrap


def _bound(posenc_call: Callable, q: Tensor, k: Tensor, v: Tensor) -> Callable | None:
    """SDPA with the mask that ``posenc_call`` hands the kernel, behind a dict lookup; None
    unless two calls run the kernel once each, with the same mask tensor (or none), no
    dropout and no causal flag."""
    seen: list[tuple[Any, ...]] = []

    def spy(kernel: Callable) -> Callable:
        def seeing(
            q_: Tensor,
            k_: Tensor,
            v_: Tensor,
            attn_mask: Tensor | None,
            dropout_p: float,
            is_causal: bool,
            scale: float,
        ) -> Tensor:
            seen.append((attn_mask, dropout_p, is_causal, scale))
            return kernel(q_, k_, v_, attn_mask, dropout_p, is_causal, scale)

        return seeing

    with _kernel_replaced(spy), torch.no_grad():
        posenc_call(q, k, v)
        posenc_call(q, k, v)
    if len(seen) != 2 or seen[0][0] is not seen[1][0] or seen[0][1:3] != (0.0, False):
        return None
    mask, scale = seen[0][0], seen[0][3]
    kept: dict[tuple, tuple[Tensor | None, float]] = {}

    def bound(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        key = (q.shape, k.shape, v.shape, q.dtype)
        entry = kept.get(key)
        if entry is None:
            entry = kept[key] = (mask, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=entry[0], scale=entry[1])

    return bound


def _without_kernel(call: Callable, q: Tensor, k: Tensor, v: Tensor, calls: int) -> float:
    """Seconds per call of ``call`` with SDPA's kernel replaced by returning ``q``, back to
    back (the best of five rounds of ``calls``)."""
    with _kernel_replaced(lambda kernel: lambda q_, *args: q_), torch.no_grad():
        for _ in range(20):
            call(q, k, v)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                call(q, k, v)
            best = min(best, (time.perf_counter() - start) / calls)
    return best


def _median(values: list[float]) -> float:
    """The median in microseconds; NaN if any value is NaN (a call off the kernel's route)."""
    return float("nan") if any(x != x for x in values) else statistics.median(values) * 1e6


def _peer(scheme: Any) -> Callable | None:
    if scheme is None:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
    try:
        return peer_of(scheme, lambda q: None)
    except ValueError:  # no peer for this scheme
        return None


def measure(scheme_name: str, shape: tuple[int, int, int, int], repeats: int) -> dict[str, Any]:
    """One scheme at one shape, in microseconds; see the module docstring. Variants that do
    not apply are missing from the result."""
    b, h, n, d = shape
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    scheme = None if scheme_name == "none" else build_scheme(scheme_name, h, d, n)
    posenc_call = _core(scheme, "auto")
    calls: dict[str, Callable | None] = {
        "peer": _peer(scheme),
        "posenc": posenc_call,
        # a rotation is work, not dispatch: no bound call for a rotating scheme
        "bound": None if hasattr(scheme, "rotate") else _bound(posenc_call, q, k, v),
    }
    present = {name: fn for name, fn in calls.items() if fn is not None}
    times: dict[str, list[float]] = {name: [] for name in present}
    inside: list[float] = []
    kernels: list[float] = []
    rests: list[float] = []
    with _kernel_replaced(_timed(inside)), torch.no_grad():
        for fn in present.values():
            for _ in range(10):
                fn(q, k, v)
        for _ in range(repeats):
            order = list(present)
            random.shuffle(order)
            for name in order:
                inside.clear()
                start = time.perf_counter()
                out = present[name](q, k, v)
                elapsed = time.perf_counter() - start
                del out  # freed outside the timed call
                times[name].append(elapsed)
                if name == "posenc":
                    kernel = inside[0] if len(inside) == 1 else float("nan")
                    kernels.append(kernel)
                    rests.append(elapsed - kernel)
    kernel = _median(kernels)
    return {
        "scheme": scheme_name,
        "shape": shape,
        **{name: _median(ts) for name, ts in times.items()},
        "kernel": kernel,
        "outside": _median(rests),
        "without_kernel": _without_kernel(posenc_call, q, k, v, 500) * 1e6
        if kernel == kernel  # not NaN: the call runs the kernel once
        else float("nan"),
    }


def _cell(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:.0f}"


def _ratio(value: float | None, peer: float | None) -> str:
    return "n/a" if value is None or peer is None or value != value else f"{value / peer:.3f}"


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of :func:`measure`'s rows, in microseconds."""
    lines = [
        "| scheme | b h n d | peer | posenc | kernel inside | outside the kernel | bound "
        "| posenc / peer | bound / peer | posenc without the kernel, hot |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        peer, bound = row.get("peer"), row.get("bound")
        lines.append(
            f"| {row['scheme']} | {' '.join(map(str, row['shape']))} | {_cell(peer)} "
            f"| {_cell(row['posenc'])} | {_cell(row['kernel'])} | {_cell(row['outside'])} "
            f"| {_cell(bound)} | {_ratio(row['posenc'], peer)} | {_ratio(bound, peer)} "
            f"| {_cell(row['without_kernel'])} |"
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
