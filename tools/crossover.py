"""Time the materialised path against the lean one: where ``backend="auto"`` switches.

For each scheme, shape ``(b, h, n, d)`` and mask (none, causal) it times, interleaved in
one process (each repeat runs every variant once, in turn), forward+backward (the
gradients of ``q, k, v`` and of the scheme's tables) and forward only (no grad), or one of
them (``--modes``), of:

- ``floor``: :func:`torch.nn.functional.scaled_dot_product_attention` without positions
  (its own ``is_causal``);
- ``materialised``: ``backend="auto"`` with every ``MATERIALISED_*`` limit lifted, so that
  it takes its ``materialised`` path: the scheme's ``[b, h, n_q, n]`` bias or term written
  out (a value term, or a bias or term that asks for a gradient itself: the formula op by
  op; otherwise SDPA with it as the float ``attn_mask``);
- ``lean``: ``backend="lean"``: the lean path (named in the table) that ``auto`` takes
  above the crossover;
- ``ops``: ``materialised`` with ``OPS_FORWARD_SCORES``, ``OPS_IN_PLACE_SCORES``,
  ``OPS_IN_PLACE_BIAS_SCORES`` and ``OPS_GRAD_BIAS_SCORES`` lifted too (and ``OPS_FORWARD_THREADS`` at 1, at any ``--threads``), so that a call SDPA's
  fused kernel could run (no gradients; a constant bias such as ALiBi's with gradients for
  ``q, k, v`` alone) runs op by op rather than through SDPA (``materialised`` sets it to
  0): the last two columns, below 1 where op by op wins (about 1 where both run op by op:
  a learned table or a term with gradients).

With ``--queries``, each shape is timed for each count ``n_q`` of queries given (a count
above ``n`` is skipped, and the table says so) at the end of its ``n`` keys (positions ``n - n_q .. n - 1`` against
``0 .. n - 1``; a causal mask aligned at the end): cross-attention, a few tokens decoded
at once, a prompt read in chunks. The floor then takes the causal band as SDPA's boolean
mask where ``n_q < n``.

Each time is the mean of enough calls to last ``--least`` seconds; each repeat times every
variant once, in an order that turns from one repeat to the next. Prints a Markdown
table: the median over the repeats of each repeat's ratios (to the floor; and the
materialised path's time to the lean path's: below 1, materialised wins).

Run: ``.venv/bin/python tools/crossover.py [--schemes t5,alibi] [--shapes 2x8x64x64]
[--queries 16,128] [--modes fwd] [--repeats 5] [--threads 2] [--json out.json]``; the
``MATERIALISED_*`` thresholds in ``posenc.engine.tuning`` were chosen from its tables
(docs/performance.md, "Small calls: the materialised path").

Shape legend: ``b`` batch, ``h`` heads, ``n`` tokens, ``d`` head dim.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import posenc
from posenc import registry
from posenc.engine import tuning

#: the issue's shapes ``(b, h, n, d)``: Swin windows, BERT-size, small, mid, long
SHAPES = [
    (128, 4, 49, 32),
    (32, 12, 128, 64),
    (2, 8, 64, 64),
    (8, 8, 256, 64),
    (8, 8, 512, 64),
    (2, 8, 1024, 64),
    (2, 8, 2048, 64),
]
SCHEMES = [
    "t5", "swin-1d", "alibi", "relative", "shaw-keys-only", "shaw", "swin-2d", "relative-2d"
]  # fmt: skip
#: the limits of the materialised path, lifted for its variant
LIMITS = [name for name in dir(tuning) if name.startswith("MATERIALISED_")]
#: the materialised path's two kernels where SDPA's could run (no gradients, or a constant
#: bias with gradients for q, k, v alone): "materialised" through SDPA, "ops" op by op
VARIANTS = ("floor", "materialised", "lean", "ops")


def _scheme(name: str, h: int, d: int, n: int, causal: bool):
    shape = registry.Shape(h, d, n, grid=registry.squarest_grid(n), causal=causal)
    return registry.build(name, shape)


#: the limits of the op-by-op forward, lifted for ``ops`` and set to 0 for ``materialised``
OPS = (
    "OPS_FORWARD_SCORES",
    "OPS_IN_PLACE_SCORES",
    "OPS_IN_PLACE_BIAS_SCORES",
    "OPS_GRAD_BIAS_SCORES",
    "OPS_FORWARD_THREADS",
)


def _call(variant: str, scheme, causal: bool, n_q: int, n: int) -> Callable:
    at = {}  # n_q queries at the end of n keys: their positions, and the floor's band
    if n_q < n:
        at = {"positions": torch.arange(n - n_q, n), "key_positions": torch.arange(n)}
    if variant == "floor":
        if causal and at:  # SDPA's is_causal aligns at the start: the band, at the end
            band = torch.arange(n)[None, :] <= torch.arange(n - n_q, n)[:, None]  # [n_q, n]
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if variant == "lean":
        return lambda q, k, v: posenc.attention(
            q, k, v, position=scheme, causal=causal, backend="lean", **at
        )

    ops = 1 << 62 if variant == "ops" else 0  # the forward op by op, or through SDPA

    def materialised(q, k, v):
        saved = {name: getattr(tuning, name) for name in (*LIMITS, *OPS)}
        try:
            for name in LIMITS:
                setattr(tuning, name, 1 << 62)
            tuning.OPS_FORWARD_SCORES = tuning.OPS_IN_PLACE_SCORES = ops
            tuning.OPS_IN_PLACE_BIAS_SCORES = tuning.OPS_GRAD_BIAS_SCORES = ops
            tuning.OPS_FORWARD_THREADS = 1  # the thread count measured is the one set
            return posenc.attention(q, k, v, position=scheme, causal=causal, **at)
        finally:
            for name, value in saved.items():
                setattr(tuning, name, value)

    return materialised


def _timer(fn: Callable, q, k, v, params, backward: bool) -> Callable[[int], float]:
    """``timed(calls)``: seconds per call, the mean over ``calls`` calls."""
    grad = torch.randn_like(q)

    def once() -> None:
        if backward:
            for x in (q, k, v, *params):
                x.grad = None
            fn(q, k, v).backward(grad)
        else:
            with torch.no_grad():
                fn(q, k, v)

    def timed(calls: int) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            once()
        return (time.perf_counter() - start) / calls

    return timed


def measure(
    name: str, shape: tuple[int, int, int, int], causal: bool, args, n_q: int | None = None
) -> dict:
    """Median seconds per call of each variant, fwd+bwd and forward only (``args.modes``),
    and the lean path; ``n_q`` queries at the end of the ``n`` keys (None: ``n``)."""
    b, h, n, d = shape
    n_q = n if n_q is None else n_q
    scheme = _scheme(name, h, d, n, causal)
    params = [p for p in scheme.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, n_q, d, generator=gen).requires_grad_()
    k, v = (torch.randn(b, h, n, d, generator=gen).requires_grad_() for _ in range(2))
    at = {}
    if n_q < n:
        at = {"positions": torch.arange(n - n_q, n), "key_positions": torch.arange(n)}
    path = posenc.explain(q, k, v, position=scheme, causal=causal, backend="lean", **at).path
    result: dict = {
        "scheme": name, "shape": list(shape), "queries": n_q, "causal": causal, "lean_path": path
    }  # fmt: skip
    modes = [(mode, mode == "fwd+bwd") for mode in ("fwd+bwd", "fwd") if mode in args.modes]
    for mode, backward in modes:
        variants = VARIANTS
        timers = {
            variant: _timer(_call(variant, scheme, causal, n_q, n), q, k, v, params, backward)
            for variant in variants
        }
        calls = {}
        for variant, timed in timers.items():  # warm up, then enough calls for --least s
            timed(1)
            calls[variant] = max(1, round(args.least / max(timed(1), 1e-6)))
        times: dict[str, list[float]] = {variant: [] for variant in variants}
        for repeat in range(args.repeats):  # each repeat in another order
            turn = repeat % len(variants)
            for variant in variants[turn:] + variants[:turn]:
                times[variant].append(timers[variant](calls[variant]))
        pairs = [("materialised", "floor"), ("lean", "floor"), ("materialised", "lean")]
        pairs.append(("ops", "materialised"))
        ratios = {  # the median of each repeat's ratio: a burst of load hits a repeat
            f"{a}/{c}": statistics.median(x / y for x, y in zip(times[a], times[c], strict=True))
            for a, c in pairs
        }
        result[mode] = {v: statistics.median(ts) for v, ts in times.items()} | ratios
    return result


def _row(r: dict) -> str:
    b, h, n, d = r["shape"]
    n_q = r["queries"]
    cells = [r["scheme"], f"{b}x{h}x{n}x{d}", str(n_q), "yes" if r["causal"] else "no"]
    cells += [f"2^{(b * h * n_q * n).bit_length() - 1}", r["lean_path"]]
    for mode in ("fwd+bwd", "fwd"):
        t = r.get(mode)
        if t is None:  # (not timed: --modes)
            cells += ["", "", ""]
            continue
        cells += [f"{t['materialised/floor']:.2f}", f"{t['lean/floor']:.2f}"]
        cells.append(f"**{t['materialised/lean']:.2f}**")
    cells += [
        f"**{r[mode]['ops/materialised']:.2f}**" if mode in r else "" for mode in ("fwd+bwd", "fwd")
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| scheme | b x h x n x d | n_q | causal | scores | lean path | fwd+bwd: materialised / "
    "floor | lean / floor | materialised / lean | fwd: materialised / floor | lean / floor "
    "| materialised / lean | fwd+bwd: ops / SDPA kernel | fwd: ops / SDPA kernel |"
    "\n|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument(
        "--shapes",
        default=",".join("x".join(map(str, s)) for s in SHAPES),
        help="b x h x n x d, comma-separated (e.g. 2x8x64x64)",
    )
    parser.add_argument(
        "--queries",
        default=None,
        help="queries at the end of the n keys, comma-separated (default: n, self-attention)",
    )
    parser.add_argument("--masks", default="none,causal", help="comma-separated: none,causal")
    parser.add_argument("--modes", default="fwd+bwd,fwd", help="comma-separated: fwd+bwd,fwd")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--least", type=float, default=0.05, help="seconds per timing")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the raw medians here")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    args.modes = args.modes.split(",")
    for value, allowed, name in (
        (args.modes, ("fwd+bwd", "fwd"), "--modes"),
        (args.masks.split(","), ("none", "causal"), "--masks"),
    ):
        if not set(value) <= set(allowed):
            parser.error(f"{name} takes comma-separated {', '.join(allowed)}; got {value}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    print(HEADER, flush=True)
    results = []
    for shape in shapes:
        n = shape[2]
        queries = [n] if args.queries is None else [int(x) for x in args.queries.split(",")]
        for n_q in queries:
            if n_q > n:
                print(f"(skipped: {n_q} queries over {n} keys; --queries counts at most n)")
                continue
            for causal in [m == "causal" for m in args.masks.split(",")]:
                for name in args.schemes.split(","):
                    if causal and registry.get(name).two_d:
                        continue  # a causal 2-D map is rare (docs/performance.md)
                    result = measure(name, shape, causal, args, n_q)
                    results.append(result)
                    print(_row(result), flush=True)
    print(f"load after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
