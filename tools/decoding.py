"""Time cached decoding: posenc's ``MultiHeadAttention`` against the same steps written
by hand.

For each scheme, batch ``b`` and cache length ``n`` it builds ``MultiHeadAttention(dim=h
* d, heads=h, position=scheme)``, prefills a :class:`~posenc.KVCache` with ``n`` tokens,
and times, interleaved in one process (each repeat runs every variant once, in turn),
``--tokens`` more tokens decoded one at a time (``--chunk``: so many at a time, below),
the cache growing by one each step (no gradients; each run starts from the ``n``
prefilled tokens; ``p`` below is the new token's position, ``n .. n + tokens - 1``, and
``L`` the longest length, ``n + tokens``):

- ``posenc``: ``attn(x_t, causal=True, cache=cache)`` for each token, after
  ``cache.crop(n)`` (which keeps the cache's buffer, each run writing over the last: the
  tool never reads ``cache.keys``, which would hand its tokens out) and
  with no route kept (``posenc.engine.kept.clear()``: the first step walks the
  dispatcher, as a generation's first step past ``n`` keys does; the others replay its
  route, kept per power of two of the key count for up to
  ``posenc.engine.tuning.KEPT_BAND_QUERIES`` tokens a step, per key count for more);
- ``by hand (cat)``: the same module's projections, the keys and values concatenated to
  the cached ones (``torch.cat``, as Hugging Face's ``DynamicCache`` and x-transformers
  do), the bias of the new query as other code writes it, SDPA, the output projection:
  ALiBi's ``[h, L, L]`` bias kept for the longest length and sliced to the new row
  (x-transformers' ``AlibiPositionalBias``), T5's ``compute_bias(1, p + 1,
  past_seen_tokens=p)`` (Hugging Face ``transformers``, when installed), Swin 1-D's table
  gathered at the new query's offsets; rotary: the new query and key rotated by
  rotary-embedding-torch at their position (when installed);
- ``by hand (buffer)``: the same steps with the keys and values written into a buffer of
  ``n + tokens`` made once, the prefilled tokens first (as Hugging Face's
  ``StaticCache``), SDPA over its first ``p + 1`` tokens.

With ``--fresh`` each run starts a generation from the prefill's own tensors: posenc's
cache gets them back by assignment (its first step copies them into a new buffer), and the
buffer by hand is made and the prompt copied into it within the run. Both then pay one
copy of the ``n`` tokens per run, as a generation does once. The tool then calls nothing
of posenc's cache but its attributes and ``posenc.engine.kept.clear``, so it times
commits from before ``KVCache.crop`` too (those with ``posenc.engine.kept.clear``).

With ``--walked`` posenc's steps are timed once more with no route kept
(``posenc.engine.tuning.KEPT_ROUTES`` 0: each call chooses its path anew), and a column
gives ``posenc / posenc walked``: what keeping the routes saves.

With ``--chunk c`` each step takes ``c`` tokens at once under the causal mask (query ``i``
at position ``p + i`` sees the keys ``0 .. p + i``), as a speculative decoder checks its
drafts or a prompt is read in chunks: posenc's ``attn(x[:, t : t + c], causal=True,
cache=cache)``; by hand the rows ``p .. p + c - 1`` of the bias over the keys ``0 .. p + c
- 1`` (T5's ``compute_bias(c, p + c, past_seen_tokens=p)``), ``-inf`` where a key is
hidden, as SDPA's float mask (rotary: the boolean mask alone); the times stay per token.

With ``--padding`` the batch is left-padded, as batched generation pads its prompts:
row ``r`` of ``b`` has its first ``r * n // (2 * b)`` cached tokens padding (none in the
first row, almost a half in the last), which posenc's prefill is given as
``key_padding_mask`` (the cache keeps it) and each step by hand fills with ``-inf`` in
its mask (the default positions: the schemes are relative).

Schemes: ``alibi``, ``t5-decoder``, ``swin-1d``, ``rotary``. The three variants give the
same outputs (checked before timing). Prints a Markdown table: the median over the
repeats of each repeat's ``posenc / by hand``, for both steps by hand (below 1, posenc is
faster), and each variant's median time per token in microseconds.

Run: ``.venv/bin/python tools/decoding.py [--schemes alibi,t5-decoder,swin-1d,rotary]
[--batches 1,8] [--lengths 256,1024,4096] [--tokens 8] [--chunk 1] [--repeats 15]
[--fresh] [--padding]``. To time another
commit's posenc with this tool: ``git archive <commit> src | tar -x -C DIR`` and run it
with ``PYTHONPATH=DIR/src``.

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
from posenc.engine import kept, tuning

#: the schemes with a step by hand
_SCHEMES = ("alibi", "t5-decoder", "swin-1d", "rotary")

#: what is timed, in the order of the functions :func:`_steps` returns
_VARIANTS = ("posenc", "by hand (cat)", "by hand (buffer)")
#: with ``--walked``: posenc's steps with no route kept (``tuning.KEPT_ROUTES`` 0), each
#: call choosing its path anew
_WALKED = "posenc, walked"


def _walked(run: Callable[[], Tensor]) -> Callable[[], Tensor]:
    """``run`` with no route kept: what keeping the routes saves (:mod:`posenc.engine.kept`)."""

    def walked() -> Tensor:
        limit = tuning.KEPT_ROUTES
        tuning.KEPT_ROUTES = 0
        try:
            return run()
        finally:
            tuning.KEPT_ROUTES = limit

    return walked


def _scheme(name: str, h: int, d: int, n: int):
    return registry.build(name, registry.Shape(h, d, n + 1, causal=True))


def _bias_by_hand(
    name: str, scheme, last: int
) -> Callable[[Tensor, int, int], Tensor | None] | None:
    """``bias(q, p, c)``: the bias of ``c`` new queries at positions ``p .. p + c - 1``
    over the keys ``0 .. p + c - 1`` as other code writes it, ``[1, h, c, p + c]`` (None: a
    scheme that rotates instead), for positions up to ``last``; None where no such code is
    installed."""
    if name == "alibi":  # x-transformers' AlibiPositionalBias: one buffer, sliced
        i = torch.arange(last + 1)
        kept = -scheme.slopes(torch.device("cpu"))[:, None, None] * (i[None, :] - i[:, None]).abs()
        return lambda q, p, c: kept[None, :, p : p + c, : p + c]  # [1, h, c, p + c]
    if name == "swin-1d":  # the table gathered by the relative index of the new rows
        width = scheme.window[0]

        def swin(q: Tensor, p: int, c: int) -> Tensor:
            index = torch.arange(p, p + c)[:, None] - torch.arange(p + c) + width - 1  # [c, p + c]
            return scheme.table[index].permute(2, 0, 1)[None]  # [1, h, c, p + c]

        return swin
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
        return lambda q, p, c: hf.compute_bias(c, p + c, device=q.device, past_seen_tokens=p)
    if name == "rotary":
        if importlib.util.find_spec("rotary_embedding_torch") is None:
            return None
        return lambda q, p, c: None
    raise ValueError(
        f"no decoding step by hand for {name!r}; choose from alibi, t5-decoder, swin-1d, rotary"
    )


def _padding(b: int, n: int) -> Tensor:
    """``[b, n]`` bool, True = padding: row ``r``'s first ``r * n // (2 * b)`` tokens."""
    pad = torch.zeros(b, n, dtype=torch.bool)
    for r in range(b):
        pad[r, : r * n // (2 * b)] = True
    return pad


def _steps(
    name: str, b: int, h: int, d: int, n: int, tokens: int, fresh: bool = False, chunk: int = 1,
    padding: bool = False,
):  # fmt: skip
    """The three variants (:data:`_VARIANTS`) of ``tokens`` more tokens, ``chunk`` at a
    time (a multiple of it), after a cache of ``n`` (each returns its outputs ``[b, tokens,
    h * d]``, starting from the ``n`` prefilled tokens; ``fresh``: from the prefill's own
    tensors, each run copying them into a new buffer, see ``--fresh``; ``padding``: the
    prompt left-padded, see ``--padding``); None where the step by hand needs a package
    that is not installed."""
    scheme = _scheme(name, h, d, n + tokens)
    bias = _bias_by_hand(name, scheme, n + tokens - 1)
    if bias is None:
        return None
    dim = h * d
    torch.manual_seed(0)
    attn = MultiHeadAttention(dim, h, position=scheme).eval()
    x, new = torch.randn(b, n, dim), torch.randn(b, tokens, dim)
    pad = _padding(b, n) if padding else None  # [b, n]
    cache = KVCache()
    attn(x, causal=True, cache=cache, key_padding_mask=pad)
    held = (cache.keys.detach(), cache.values.detach())
    # [b, 1, 1, n + tokens]: the keys each step by hand hides (None: none)
    hidden = None if pad is None else torch.cat((pad, torch.zeros(b, tokens, dtype=torch.bool)), 1)
    hidden = None if hidden is None else hidden[:, None, None, :]
    rotate = None
    if name == "rotary":
        from rotary_embedding_torch import RotaryEmbedding

        # posenc's half-split rotation is rotary-embedding-torch's interleaved one on
        # channels in the interleaved order: the new query and key are permuted to it
        rotary = RotaryEmbedding(d, theta=scheme.base)
        order = torch.stack((torch.arange(d // 2), torch.arange(d // 2, d)), dim=-1).flatten()
        back = torch.argsort(order)

        def rotate(t: Tensor, p: int) -> Tensor:  # at position p, in posenc's channel order
            return rotary.rotate_queries_or_keys(t[..., order], offset=p)[..., back]

    positions = cache.positions

    def with_posenc() -> Tensor:
        if fresh:  # the prefill's tensors (assigned: the cache's buffer is let go)
            cache.keys, cache.values = held
            cache.positions, cache.key_padding = positions, pad
        else:
            cache.crop(n)
        kept.clear()  # a generation's first step: no route kept for its key counts yet
        outs = [
            attn(new[:, t : t + chunk], causal=True, cache=cache) for t in range(0, tokens, chunk)
        ]
        return torch.cat(outs, dim=1)  # [b, tokens, dim]

    spare = torch.empty(b, h, tokens, d)
    buffer = [torch.cat((t, spare), dim=2) for t in held]  # keys, values [b, h, n + tokens, d]

    def by_hand(in_buffer: bool) -> Tensor:
        keys, values = held  # [b, h, n, d]
        if in_buffer and fresh:  # a buffer made for the run, the prompt copied in
            buffer[:] = [torch.cat((t, spare), dim=2) for t in held]
        outs = []
        c = chunk
        for t in range(0, tokens, c):
            p, x_t = n + t, new[:, t : t + c]  # [b, c, dim]
            q = attn.q_proj(x_t).view(b, c, h, d).transpose(1, 2)  # [b, h, c, d]
            k = attn.k_proj(x_t).view(b, c, h, d).transpose(1, 2)
            v = attn.v_proj(x_t).view(b, c, h, d).transpose(1, 2)
            if rotate is not None:
                q, k = rotate(q, p), rotate(k, p)
            if in_buffer:
                buffer[0][:, :, p : p + c] = k
                buffer[1][:, :, p : p + c] = v
                keys, values = buffer[0][:, :, : p + c], buffer[1][:, :, : p + c]
            else:
                keys = torch.cat((keys, k), dim=2)  # [b, h, p + c, d]
                values = torch.cat((values, v), dim=2)
            mask = bias(q, p, c)  # (in q's dtype: SDPA's fused CPU kernel misreads another)
            mask = None if mask is None else mask.to(q.dtype)  # [1, h, c, p + c]
            if c > 1:  # query i (position p + i) sees the keys 0 .. p + i
                sees = torch.ones(c, p + c, dtype=torch.bool).tril(p)  # [c, p + c]
                mask = sees if mask is None else mask.masked_fill(~sees, float("-inf"))
            if hidden is not None:  # the padding: [b, 1, 1, p + c]
                hides = hidden[..., : p + c]
                if mask is None or mask.dtype == torch.bool:
                    mask = ~hides if mask is None else mask & ~hides  # True = attend
                else:
                    mask = mask.masked_fill(hides, float("-inf"))  # [b, h, c, p + c]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            outs.append(attn.out_proj(out.transpose(1, 2).reshape(b, c, dim)))  # [b, c, dim]
        return torch.cat(outs, dim=1)

    return with_posenc, lambda: by_hand(False), lambda: by_hand(True)


def measure(name: str, b: int, n: int, args) -> dict | None:
    """Median seconds per token of each variant (``posenc``, ``by hand (cat)``, ``by hand
    (buffer)``, and with ``args.walked`` ``posenc, walked``) and the median ratios ``posenc
    / by hand`` (``ratio cat``, ``ratio buffer``; ``ratio walked``: posenc / posenc walked),
    or None (not installed)."""
    steps = _steps(
        name, b, args.heads, args.head_dim, n, args.tokens, args.fresh, args.chunk,
        getattr(args, "padding", False),
    )  # fmt: skip
    if steps is None:
        return None
    variants = dict(zip(_VARIANTS, steps, strict=True))
    if getattr(args, "walked", False):
        variants[_WALKED] = _walked(variants["posenc"])
    with torch.no_grad():
        got = variants["posenc"]()
        for variant in list(variants)[1:]:
            want = variants[variant]()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        calls = max(1, round(args.least / max(_timed(variants["by hand (cat)"], 1), 1e-6)))
        times: dict[str, list[float]] = {variant: [] for variant in variants}
        for repeat in range(args.repeats):  # each repeat in another order
            order = list(variants.items())
            for variant, run in order if repeat % 2 == 0 else order[::-1]:
                times[variant].append(_timed(run, calls) / args.tokens)
    ratios = {
        "ratio walked" if variant == _WALKED else f"ratio {variant[9:-1]}": statistics.median(
            a / c for a, c in zip(times["posenc"], times[variant], strict=True)
        )
        for variant in list(variants)[1:]
    }
    return {
        "scheme": name, "b": b, "n": n, **ratios,
        **{variant: statistics.median(ts) for variant, ts in times.items()},
    }  # fmt: skip


def _timed(step: Callable[[], Tensor], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--schemes",
        default=",".join(_SCHEMES),
        help="comma-separated, from: " + ", ".join(_SCHEMES),
    )
    parser.add_argument("--batches", default="1,8", help="comma-separated b")
    parser.add_argument("--lengths", default="256,1024,4096", help="cached tokens n")
    parser.add_argument("--tokens", type=int, default=8, help="tokens decoded per run")
    parser.add_argument(
        "--chunk",
        type=int,
        default=1,
        help="tokens per step, under the causal mask (a speculative decoder's drafts checked "
        "at once, a prompt read in chunks); --tokens is a multiple of it",
    )
    parser.add_argument("--heads", type=int, default=8, help="h")
    parser.add_argument("--head-dim", type=int, default=64, help="d")
    parser.add_argument("--repeats", type=int, default=15, help="timings of each variant")
    parser.add_argument("--least", type=float, default=0.02, help="seconds per timing")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start each run as a new generation: posenc's first step copies the prompt "
        "into a new buffer, and the buffer by hand is made and filled inside the timed run "
        "(default: both kept from run to run); the only mode for commits before "
        "KVCache.crop",
    )
    parser.add_argument(
        "--padding",
        action="store_true",
        help="left-pad the batch as batched generation does: row r's first r * n // (2 * b) "
        "cached tokens are padding, given to posenc's prefill as key_padding_mask and "
        "hidden by each step by hand",
    )
    parser.add_argument(
        "--walked",
        action="store_true",
        help="also time posenc's steps with no route kept (posenc.engine.tuning.KEPT_ROUTES "
        "0), each call choosing its path anew, and print posenc / posenc walked",
    )
    args = parser.parse_args()
    if args.chunk < 1:
        parser.error(f"--chunk must be at least 1, got {args.chunk}")
    if args.tokens % args.chunk:
        parser.error(f"--tokens {args.tokens} is not a multiple of --chunk {args.chunk}")
    names = args.schemes.split(",")
    unknown = [name for name in names if name not in _SCHEMES]
    if unknown:
        parser.error(f"no decoding step by hand for {unknown}; choose from {list(_SCHEMES)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    print(
        f"--tokens {args.tokens} --chunk {args.chunk} --repeats {args.repeats}"
        + (" --fresh" if args.fresh else "")
        + (" --padding" if args.padding else "")
        + f", h={args.heads} d={args.head_dim}; times per token"
    )
    walked = " posenc / posenc walked |" if args.walked else ""
    print(
        "| scheme | b | n | posenc / by hand (cat) | posenc / by hand (buffer) |"
        f"{walked} posenc (us per token) | by hand, cat | by hand, buffer |"
    )
    print(
        "|---|---|---|---:|---:|" + ("---:|" if args.walked else "") + "---:|---:|---:|", flush=True
    )
    for name in names:
        for b in (int(x) for x in args.batches.split(",")):
            for n in (int(x) for x in args.lengths.split(",")):
                r = measure(name, b, n, args)
                if r is None:
                    print(f"| {name} | {b} | {n} | (its package is not installed) | | | | |")
                    continue
                times = " | ".join(f"{r[variant] * 1e6:.0f}" for variant in _VARIANTS)
                ratio_walked = f" {r['ratio walked']:.2f} |" if args.walked else ""
                print(
                    f"| {name} | {b} | {n} | **{r['ratio cat']:.2f}** | **{r['ratio buffer']:.2f}** "
                    f"|{ratio_walked} {times} |",
                    flush=True,
                )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
