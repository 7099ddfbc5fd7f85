"""Time the forward without gradients with the kept buffer and with a fresh one per call.

For each scheme and shape ``(b, h, n, d)`` it times, interleaved in one process (each
repeat runs every variant once, in turn), the forward in no-grad mode of:

- ``floor``: :func:`torch.nn.functional.scaled_dot_product_attention` without positions;
- ``peer``: the scheme's peer of ``posenc bench --baselines peer``;
- ``kept``: posenc's attention core (``backend="auto"``) with the buffer each thread
  keeps for the forward in one buffer (``engine/workspace.py``);
- ``fresh``: the same with ``WORKSPACE_ELEMENTS = 0``: a new buffer every call.

A bias alone takes SDPA by default (``OPS_IN_PLACE_BIAS_SCORES = 0``); both posenc
variants lift that limit to ``OPS_IN_PLACE_SCORES``, so that a bias runs in the buffer
this compares.

Prints one line per case: each variant's median time as a ratio to the peer's. Whether a
fresh buffer costs page faults depends on what the process allocated before: run it a few
times (one process each) to see both.

Run: ``.venv/bin/python tools/workspace_ab.py [--schemes alibi] [--shapes 128x4x49x32]
[--repeats 25] [--calls 10]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from posenc.cli._bench_variants import _core, _floor, _peer_of, build_scheme
from posenc.engine import tuning

Run = Callable[[Tensor, Tensor, Tensor], Tensor]


def _with_buffer(run: Run, elements: int) -> Run:
    def timed(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        tuning.WORKSPACE_ELEMENTS = elements
        tuning.OPS_IN_PLACE_BIAS_SCORES = tuning.OPS_IN_PLACE_SCORES  # a bias in the buffer
        return run(q, k, v)

    return timed


def _case(name: str, shape: tuple[int, int, int, int], repeats: int, calls: int) -> str:
    b, h, n, d = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    scheme = build_scheme(name, h, d, n)
    core = _core(scheme, "auto")
    kept_elements, bias_limit = tuning.WORKSPACE_ELEMENTS, tuning.OPS_IN_PLACE_BIAS_SCORES
    variants: dict[str, Run] = {
        "floor": _floor,
        "peer": _peer_of(scheme),
        "kept": _with_buffer(core, kept_elements),
        "fresh": _with_buffer(core, 0),
    }
    times: dict[str, list[float]] = {key: [] for key in variants}
    try:
        with torch.no_grad():
            for _ in range(repeats):
                for key, run in variants.items():
                    run(q, k, v)  # the first call after another variant's
                    start = time.perf_counter()
                    for _ in range(calls):
                        run(q, k, v)
                    times[key].append((time.perf_counter() - start) / calls)
    finally:
        tuning.WORKSPACE_ELEMENTS = kept_elements
        tuning.OPS_IN_PLACE_BIAS_SCORES = bias_limit
    median = {key: statistics.median(t) for key, t in times.items()}
    ratios = " ".join(f"{key}={t / median['peer']:.2f}" for key, t in median.items())
    return f"{name} {b}x{h}x{n}x{d}: {ratios} (peer {median['peer'] * 1e6:.0f} us)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="alibi,swin-1d,t5")
    parser.add_argument("--shapes", default="2x8x64x64,128x4x49x32,32x12x128x64")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args(argv)
    for shape in args.shapes.split(","):
        dims = tuple(int(x) for x in shape.split("x"))
        if len(dims) != 4:
            parser.error(f"--shapes takes BxHxNxD, got {shape!r}")
        for name in args.schemes.split(","):
            print(_case(name, dims, args.repeats, args.calls), flush=True)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
