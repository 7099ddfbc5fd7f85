"""Time a cached decoding step: posenc's ``MultiHeadAttention`` against the same step
written by hand.

For each scheme, batch ``b`` and cache length ``n`` it builds ``MultiHeadAttention(dim=h
* d, heads=h, position=scheme)``, prefills a :class:`~posenc.KVCache` with ``n`` tokens,
and times, interleaved in one process (each repeat runs both variants once, in turn),
one more token (no gradients, the cache put back to its ``n`` tokens before each step):

- ``posenc``: ``attn(x, causal=True, cache=cache)``;
- ``by hand``: the same module's projections, the cached keys and values concatenated
  with the new ones, the scheme's bias for the new query as other code writes it, SDPA,
  the output projection: ALiBi's ``[h, n+1, n+1]`` bias kept per length and sliced to its
  last row (x-transformers' ``AlibiPositionalBias``), T5's ``compute_bias(1, n + 1,
  past_seen_tokens=n)`` (Hugging Face ``transformers``, when installed), Swin 1-D's table
  gathered at the new query's offsets; rotary: the new query and key rotated by
  rotary-embedding-torch at position ``n`` (when installed).

Both give the same output (checked before timing). Prints a Markdown table: the median
over the repeats of each repeat's ``posenc / by hand``, and each variant's median time.

Run: ``.venv/bin/python tools/decoding.py [--schemes alibi,t5-decoder,swin-1d,rotary]
[--batches 1,8] [--lengths 256,1024,4096] [--repeats 15]``.

Shape legend: ``b`` batch, ``h`` heads, ``n`` cached tokens, ``d`` head dim.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc import KVCache, MultiHeadAttention, registry


def _scheme(name: str, h: int, d: int, n: int):
    return registry.build(name, registry.Shape(h, d, n + 1, causal=True))


def _bias_by_hand(name: str, scheme, n: int) -> Callable[[Tensor], Tensor | None] | None:
    """The new query's bias as other code writes it, ``[1, h, 1, n + 1]``, from the new
    query (None: a scheme that rotates instead); None where no such code is installed."""
    if name == "alibi":
        i = torch.arange(n + 1)
        kept = -scheme.slopes(torch.device("cpu"))[:, None, None] * (i[None, :] - i[:, None]).abs()
        return lambda q: kept[None, :, -1:, :]  # [1, h, 1, n + 1]
    if name == "swin-1d":
        offsets = (n - torch.arange(n + 1) + scheme.window[0] - 1).flatten()  # [n + 1]
        return lambda q: scheme.table[offsets].t()[None, :, None, :]  # [1, h, 1, n + 1]
    if name == "t5-decoder":
        if importlib.util.find_spec("transformers") is None:
            return None
        from transformers import T5Config
        from transformers.models.t5.modeling_t5 import T5Attention

        config = T5Config(
            d_model=scheme.heads, d_kv=1, num_heads=scheme.heads, is_decoder=True,
            relative_attention_num_buckets=scheme.num_buckets,
            relative_attention_max_distance=scheme.max_distance, dropout_rate=0.0,
        )  # fmt: skip
        hf = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
        hf.relative_attention_bias.weight = scheme.embedding.weight  # posenc's table
        return lambda q: hf.compute_bias(1, n + 1, device=q.device, past_seen_tokens=n)
    if name == "rotary":
        if importlib.util.find_spec("rotary_embedding_torch") is None:
            return None
        return lambda q: None
    raise ValueError(f"no decoding step by hand for {name!r}")


def _steps(name: str, b: int, h: int, d: int, n: int):
    """The two variants of one more token after ``n``, and the scheme; None where the step
    by hand needs a package that is not installed."""
    scheme = _scheme(name, h, d, n)
    bias = _bias_by_hand(name, scheme, n)
    if bias is None:
        return None
    dim = h * d
    torch.manual_seed(0)
    attn = MultiHeadAttention(dim, h, position=scheme).eval()
    x, new = torch.randn(b, n, dim), torch.randn(b, 1, dim)
    cache = KVCache()
    attn(x, causal=True, cache=cache)
    held = (cache.keys, cache.values, cache.positions, cache.key_padding)
    rotate = None
    if name == "rotary":
        from rotary_embedding_torch import RotaryEmbedding

        # posenc's half-split rotation is rotary-embedding-torch's interleaved one on
        # channels in the interleaved order: the new query and key are permuted to it
        rotary = RotaryEmbedding(d, theta=scheme.base)
        order = torch.stack((torch.arange(d // 2), torch.arange(d // 2, d)), dim=-1).flatten()
        back = torch.argsort(order)

        def rotate(t: Tensor) -> Tensor:  # at position n, in posenc's channel order
            return rotary.rotate_queries_or_keys(t[..., order], offset=n)[..., back]

    def posenc_step() -> Tensor:
        cache.keys, cache.values, cache.positions, cache.key_padding = held
        return attn(new, causal=True, cache=cache)

    def by_hand() -> Tensor:
        q = attn.q_proj(new).view(b, 1, h, d).transpose(1, 2)  # [b, h, 1, d]
        k = attn.k_proj(new).view(b, 1, h, d).transpose(1, 2)
        v = attn.v_proj(new).view(b, 1, h, d).transpose(1, 2)
        if rotate is not None:
            q, k = rotate(q), rotate(k)
        keys = torch.cat((held[0], k), dim=2)  # [b, h, n + 1, d]
        values = torch.cat((held[1], v), dim=2)
        mask = bias(q)  # (in q's dtype: SDPA's fused CPU kernel misreads another one)
        mask = None if mask is None else mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return attn.out_proj(out.transpose(1, 2).reshape(b, 1, dim))  # [b, 1, dim]

    return posenc_step, by_hand


def measure(name: str, b: int, n: int, args) -> dict | None:
    """Median seconds of each variant and the median ratio, or None (not installed)."""
    steps = _steps(name, b, args.heads, args.head_dim, n)
    if steps is None:
        return None
    posenc_step, by_hand = steps
    with torch.no_grad():
        got, want = posenc_step(), by_hand()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        calls = max(1, round(args.least / max(_timed(by_hand, 1), 1e-6)))
        times: dict[str, list[float]] = {"posenc": [], "by hand": []}
        for repeat in range(args.repeats):  # each repeat in another order
            order = [("posenc", posenc_step), ("by hand", by_hand)]
            for variant, step in order if repeat % 2 == 0 else order[::-1]:
                times[variant].append(_timed(step, calls))
    ratio = statistics.median(a / c for a, c in zip(times["posenc"], times["by hand"], strict=True))
    return {
        "scheme": name, "b": b, "n": n, "ratio": ratio,
        **{variant: statistics.median(ts) for variant, ts in times.items()},
    }  # fmt: skip


def _timed(step: Callable[[], Tensor], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="alibi,t5-decoder,swin-1d,rotary")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--lengths", default="256,1024,4096", help="cached tokens n")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--least", type=float, default=0.02, help="seconds per timing")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    print("| scheme | b | n | posenc / by hand | posenc (us) | by hand (us) |")
    print("|---|---|---|---:|---:|---:|", flush=True)
    for name in args.schemes.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            for n in (int(x) for x in args.lengths.split(",")):
                r = measure(name, b, n, args)
                if r is None:
                    print(f"| {name} | {b} | {n} | (its package is not installed) | | |")
                    continue
                print(
                    f"| {name} | {b} | {n} | **{r['ratio']:.2f}** | {r['posenc'] * 1e6:.0f} "
                    f"| {r['by hand'] * 1e6:.0f} |",
                    flush=True,
                )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
