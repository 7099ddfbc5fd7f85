"""What the dispatcher does to its inputs before a path runs: the default scale, grouped
key/value heads repeated for their query heads, and non-finite values found and kept from
the queries they must not reach.

Shape legend: ``b`` batch, ``h`` heads, ``h_kv`` key/value heads, ``n_q`` queries, ``n_k``
keys, ``d`` head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import common
from .mask import Mask


def default_scale(d: int) -> float:
    """``1 / sqrt(d)``; 1 for queries with no channels, whose scores are all 0 whatever the
    scale (SDPA's answer: each query gets the mean of the values it sees)."""
    return d**-0.5 if d else 1.0


def repeat_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Grouped-query keys and values ``[b, h_kv, n_k, d]`` repeated for their query heads:
    ``[b, h, n_k, d]`` each (as HF's ``repeat_kv``).

    Raises:
        ValueError: ``k`` and ``v`` of different heads, or heads that do not divide ``h``.
    """
    h, h_kv = q.shape[1], k.shape[1]
    if v.shape[1] != h_kv or h_kv == 0 or h % h_kv:
        raise ValueError(
            f"k and v must have the same number of heads, a divisor of q's {h} (grouped-query "
            f"attention), got k {tuple(k.shape)} and v {tuple(v.shape)}; give them {h} heads "
            "or a divisor of it"
        )
    repeat = h // h_kv
    # [b, h_kv, n_k, d] -> [b, h, n_k, d]: key head g for query heads g*repeat .. (g+1)*repeat-1
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)


def finite(*xs: Tensor) -> bool:
    """Whether every element of every tensor is finite, or perhaps not (one sync with the
    device): True means all are finite; False that one is not, or that a sum overflowed.

    A tensor's sum is NaN or infinite whenever one of its elements is (IEEE arithmetic:
    NaN spreads, an infinity stays or meets its opposite and makes NaN, in any order of
    summation), so one reduction per tensor answers; a sum of finite values beyond the
    largest float (about 3.4e38, accumulated in float32 at least) reads as not finite, and
    the caller's careful path then finds nothing to zero. One pass over each tensor, where
    ``aminmax`` takes two reductions' work and an elementwise ``isfinite`` writes a bool
    tensor and reads it again.
    """
    if torch.is_grad_enabled():  # a check, not part of the graph
        with torch.no_grad():
            return _finite(xs)
    return _finite(xs)


def hideable(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask, contextual: bool = False, finite_keys: int = 0
) -> tuple[Tensor, ...]:
    """What :func:`finite` must read so that a non-finite value the mask hides reaches no
    query: ``q``, ``k`` and ``v``; without gradients (grad mode off), under the causal mask
    alone over fewer queries than keys (aligned at the end: a decoder's chunk over its
    cache) and for a scheme without a contextual term, ``q`` and the last ``n_q`` keys and
    values only. Those are the keys some query does not see, and the last key query 0
    sees: each query then sees a checked, finite key, so that its row's largest score is
    finite and the keys it does not see weigh exactly 0. The keys every query sees before
    that one meet the scores as in an unmasked call, which checks nothing: a NaN there
    makes every query NaN, an infinite key NaN (a score of ``+inf``) or nothing (a score
    of ``-inf``), an infinite value an infinity or NaN in its channel. With gradients all
    are read (a query's NaN would reach the gradients of the keys it does not see), and
    so they are for a contextual term (CoPE's gates index its table with them). The first
    ``finite_keys`` keys and values, known finite (a cache's, checked in an earlier step
    and unchanged since: ``KVCache._finite_keys``), are never read again."""
    n_q, n_k = mask.n_q, mask.n_k
    chunk = mask.causal and mask.causal_at_most and n_q < n_k  # (n_q >= n_k: every key hides)
    first = finite_keys
    if chunk and not (torch.is_grad_enabled() or contextual):
        first = max(first, n_k - n_q)  # keys 0 .. n_k - n_q - 1: seen by every query
    if first <= 0:
        return q, k, v
    return q, k[:, :, first:], v[:, :, first:]  # [b, h, n_k - first, d] each


def _finite(xs: tuple[Tensor, ...]) -> bool:
    """:func:`finite` with no graph recorded."""
    sums = [x.sum(dtype=torch.promote_types(x.dtype, torch.float32)) for x in xs if x.numel()]
    if not sums:
        return True
    if sums[0].is_cpu:  # a float each: no stack, no kernel to combine them
        total = 0.0
        for part in sums:
            total += float(part)
        return math.isfinite(total)
    # float32: a device may have no float64 (MPS); a sum past float32's largest reads
    # as not finite, as above
    return bool(torch.stack([s.float() for s in sums]).sum().isfinite())


def sees_any(mask: Mask, keys: Tensor, device: torch.device) -> Tensor:
    """``[b, h, n_q, 1]`` bool: whether query ``i`` sees any of the ``keys [b, h, n_k]`` (bool)
    that the mask leaves visible to it; in blocks of rows (no ``[n_q, n_k]`` mask at once)."""
    b, h, n_k = keys.shape
    picked = keys.to(torch.float32)[..., None]  # [b, h, n_k, 1]

    def seen(rows: slice | None) -> Tensor:
        keep = mask.shared_keep(rows, device=device)  # [b|1, 1, rows, n_k]
        count = picked.sum(dim=2, keepdim=True) if keep is None else keep.float() @ picked
        return count > 0  # [b, h, rows | 1, 1]

    if torch.compiler.is_compiling():  # one graph for any length: the whole mask at once
        return seen(None).expand(b, h, mask.n_q, 1)
    rows = common.lean_block_rows(b, 1, mask.n_q, n_k)
    parts = [
        seen(slice(start, min(start + rows, mask.n_q))).expand(b, h, -1, 1)
        for start in range(0, mask.n_q, rows)
    ]
    return torch.cat(parts, dim=2) if parts else keys.new_zeros(b, h, 0, 1, dtype=torch.bool)


def zeroed_non_finite(
    q: Tensor, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, k, v, bad [b, h, n_k], bad_q [b, h, n_q, 1])``: every token with a NaN or an
    infinity replaced by zeros, and which those were. A masked key or value must not reach
    any query, not even as 0 x NaN, nor a query's NaN the gradients of the keys it sees
    through a zero gradient; the caller makes the queries they touch NaN after
    (:func:`sees_any`)."""
    bad = ~torch.isfinite(k).all(dim=-1) | ~torch.isfinite(v).all(dim=-1)  # [b, h, n_k]
    bad_q = ~torch.isfinite(q).all(dim=-1, keepdim=True)  # [b, h, n_q, 1]
    k = k.masked_fill(bad[..., None], 0.0)
    v = v.masked_fill(bad[..., None], 0.0)
    return q.masked_fill(bad_q, 0.0), k, v, bad, bad_q
