"""A content-free scheme (place 3: ALiBi, T5, Swin, your own ``score_bias``) as the dense
float ``attn_mask`` that :func:`torch.nn.functional.scaled_dot_product_attention`,
:class:`torch.nn.MultiheadAttention` and :class:`torch.nn.TransformerEncoderLayer` take,
for code that keeps PyTorch's attention and adds posenc's bias to it.

SDPA and ``nn.MultiheadAttention`` add a float mask to ``q k^T / sqrt(d)``, which is where
a place-3 bias goes, so ``softmax(q k^T / sqrt(d) + mask) v`` is posenc's attention with
the scheme. The mask is ``[n_q, n_k]`` per head: for long sequences
:func:`posenc.attention` computes the same without writing it.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys; ``B'`` 1 (positions
shared by the batch) or ``b``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _validate as check
from ._arguments import check_scheme, default_query_positions
from .engine import Mask
from .hooks import hooks_of

__all__ = ["as_attn_mask"]

#: the layouts :func:`as_attn_mask` writes, and who takes them
_LAYOUTS = {
    "sdpa": "[B', h|1, n_q, n_k] for F.scaled_dot_product_attention",
    "nn": "[b * h, n_q, n_k] for nn.MultiheadAttention / nn.TransformerEncoderLayer",
}


def as_attn_mask(
    position: Any,
    q_len: int,
    k_len: int | None = None,
    *,
    positions: Tensor | None = None,
    key_positions: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    layout: str = "sdpa",
    batch: int | None = None,
    heads: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """The scheme's bias (and a causal mask or a window, as ``-inf``) as a float ``attn_mask``.

    ``F.scaled_dot_product_attention(q, k, v, attn_mask=as_attn_mask(alibi, n, dtype=q.dtype))``
    equals ``posenc.attention(q, k, v, position=alibi)``; with ``layout="nn"`` the mask is
    ``nn.MultiheadAttention``'s ``[b * h, n_q, n_k]`` (batch-major, as it reads it).

    Args:
        position: a content-free scheme: one with a ``score_bias`` hook and no ``rotate``,
            ``score_term``, ``value_term`` or ``contextual_term`` (ALiBi, T5RelativeBias,
            RelativePositionBias, ...).
        q_len: queries ``n_q``.
        k_len: keys ``n_k`` (default ``q_len``).
        positions: ``[n_q]`` or ``[b, n_q]`` query positions (and the keys' when
            ``n_q == n_k`` and no ``key_positions``); default as :func:`posenc.attention`:
            ``arange(n_q)``, shifted to the end when ``causal`` and ``n_q < n_k``.
        key_positions: ``[n_k]`` or ``[b, n_k]`` key positions (default ``arange(n_k)``).
        causal: also mask the keys after each query (``-inf``), aligned at the end as in
            :func:`posenc.attention`. Leave False to combine with SDPA's ``is_causal``.
        window: also mask the keys outside a sliding window, as :func:`posenc.attention`.
        layout: ``"sdpa"`` (``[B', h|1, n_q, n_k]``, broadcast by SDPA) or ``"nn"``
            (``[b * h, n_q, n_k]``; needs ``batch``, and ``heads`` when the scheme's bias
            is shared by the heads).
        batch: ``b`` for ``layout="nn"`` (the mask is repeated per sequence unless the
            positions are per row).
        heads: ``h`` for ``layout="nn"`` when the bias has one head for all.
        dtype: the mask's dtype; SDPA wants the queries' dtype.
        device: where to build it (default the positions', else the scheme's parameters').

    Returns:
        the float mask, ``-inf`` where a query must not look.

    Raises:
        TypeError: a scheme with no ``score_bias``, or with a content-dependent hook; a
            non-float ``dtype``.
        ValueError: an unknown ``layout``; ``layout="nn"`` without ``batch`` (or ``heads``);
            positions that do not fit the lengths.
    """
    check_scheme(position)
    hooks = hooks_of(position)
    name = type(position).__name__
    dependent = [
        h
        for h in ("rotate", "score_term", "value_term", "contextual_term")
        if getattr(hooks, h) is not None
    ]
    if dependent:
        raise TypeError(
            f"{name} has the content-dependent hook(s) {dependent}: its effect on the scores "
            f"depends on q and k, so no attn_mask can carry it; use posenc.attention(q, k, v, "
            f"position=...) or MultiHeadAttention instead"
        )
    if hooks.score_bias is None and not dependent:
        raise TypeError(
            f"{name} adds no score_bias, so it has no dense bias to give; a scheme without "
            f"one (None) needs no attn_mask"
        )
    if layout not in _LAYOUTS:
        raise ValueError(
            f"layout must be one of {list(_LAYOUTS)} ("
            + "; ".join(f"{k!r}: {v}" for k, v in _LAYOUTS.items())
            + f"), got {layout!r}"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    q_len = check.positive_int("q_len", q_len)
    k_len = q_len if k_len is None else check.positive_int("k_len", k_len)
    causal = check.causal_flag(causal)
    window = check.window(window)
    if device is None:
        given = positions if positions is not None else key_positions
        params = [p for p in getattr(position, "parameters", list)() if p.device.type != "meta"]
        device = given.device if given is not None else params[0].device if params else None
    rows = 1 if batch is None else check.positive_int("batch", batch)
    if positions is None:
        q_pos = default_query_positions(q_len, k_len, causal, torch.device(device or "cpu"))
    else:
        q_pos = check.positions(positions, n=q_len, batch=rows, device=device)
    if key_positions is not None:
        k_pos = check.positions(
            key_positions, n=k_len, batch=rows, name="key_positions", device=device
        )
    elif positions is not None and q_len == k_len:
        k_pos = q_pos
    elif positions is not None:
        raise ValueError(
            f"positions covers the {q_len} queries but there are {k_len} keys: pass "
            f"key_positions [{k_len}] too"
        )
    else:
        k_pos = torch.arange(k_len, device=q_pos.device)[None]  # [1, n_k]
    if q_pos.shape[0] != k_pos.shape[0]:
        q_pos, k_pos = q_pos.expand(rows, -1), k_pos.expand(rows, -1)  # [B', n]
    bias = hooks.score_bias(q_pos, k_pos)  # [B', h|1, n_q, n_k]
    bias = bias.to(torch.promote_types(bias.dtype, torch.promote_types(dtype, torch.float32)))
    keep = Mask(q_len, k_len, causal=causal, behind=window, ahead=None if causal else window)
    allowed = keep.shared_keep(device=bias.device)  # [1, 1, n_q, n_k] or None
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    bias = bias.to(dtype)
    if layout == "sdpa":
        return bias
    if batch is None:
        raise ValueError(
            "layout='nn' writes nn.MultiheadAttention's [batch * heads, n_q, n_k]: pass "
            "batch= (the batch size of the call)"
        )
    h = bias.shape[1]
    if h == 1:
        if heads is None:
            raise ValueError(
                f"{name}'s bias is shared by the heads: pass heads= (the attention's number "
                f"of heads) so that layout='nn' can repeat it per head"
            )
        h = check.positive_int("heads", heads)
    elif heads is not None and heads != h:
        raise ValueError(f"{name} was built for {h} heads but heads={heads} was passed")
    full = bias.expand(rows, h, q_len, k_len)  # [B', h|1, n_q, n_k] -> [b, h, n_q, n_k]
    return full.reshape(rows * h, q_len, k_len)  # [b, h, n_q, n_k] -> [b * h, n_q, n_k]
