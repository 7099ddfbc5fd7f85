"""FlexAttention factories: a posenc scheme as a ``score_mod`` and the masks as a
``BlockMask``, for code that calls :func:`torch.nn.attention.flex_attention.flex_attention`
itself (as attention-gym publishes its factories).

``flex_attention(q, k, v, score_mod=posenc.flex.score_mod(alibi), block_mask=
posenc.flex.block_mask(n, causal=True))`` equals ``posenc.attention(q, k, v, position=alibi,
causal=True)``. On CUDA FlexAttention fuses both into one kernel with a backward, and a
learned table captured by the ``score_mod`` receives its gradient; on CPU (torch 2.13) it
runs compiled, forward only.

What a ``score_mod`` can hold: every content-free bias with a ``flex_score_mod`` (ALiBi, T5,
Swin 1-D and 2-D, every :class:`~posenc.OffsetBias` and :class:`~posenc.GridBias`), and a
query term of bounded reach (:class:`~posenc.OffsetTerm` with a ``reach``: Shaw's key term,
a relative embedding of ``max_len``), read from the ``[b, h, n_q, 2 reach + 1]`` logits of
the queries against its rows, so the factory takes the queries. Not: a value term (Shaw's
``a^V``), a rotation (RoPE rotates ``q`` and ``k`` before attention), a term of the key
alone (pass those schemes to :func:`posenc.attention` with ``backend="flex"``, which folds
it into the keys).

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim;
positions ``[n]``, ``[1, n]`` (shared by the batch) or ``[b, n]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import _validate as check
from ._arguments import check_scheme
from .engine import Mask
from .engine.flex import _block_mask, _chain
from .hooks import hooks_of

__all__ = ["block_mask", "score_mod"]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def score_mod(
    scheme: Any,
    positions: Tensor | None = None,
    key_positions: Tensor | None = None,
    *,
    q: Tensor | None = None,
    k_len: int | None = None,
    offset: int = 0,
    scale: float | None = None,
) -> ScoreMod:
    """The scheme as a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)``.

    Without positions, query ``i`` is at position ``offset + i`` and key ``j`` at ``j``:
    for a decoding step (``n_q`` new queries after cached keys, with
    ``block_mask(n_q, n_k, causal=True)``, which aligns the queries with the last keys)
    pass ``offset = n_k - n_q``, as :func:`posenc.attention` shifts its default positions.
    Give ``q`` (and ``k_len``) to have the positions, the heads and the scheme's range
    checked as :func:`posenc.attention` checks them; without them nothing can be: a table
    too short for the sequence is read at its edge rows.

    Args:
        scheme: a content-free bias (``flex_score_mod``), or a query term of bounded reach
            (``flex_term_mod``), or an object with both.
        positions: ``[n_q]``, ``[1, n_q]`` or ``[b, n_q]`` integer query positions; None:
            ``offset + q_idx``.
        key_positions: the keys' (default: ``arange(k_len)`` when ``k_len`` is given, else
            ``positions`` when given (self-attention), else ``kv_idx``).
        q: ``[b, h, n_q, d]``, the queries FlexAttention gets: needed by a query term.
        k_len: the number of keys ``n_k``, for the default key positions and the checks.
        offset: the position of query 0 when ``positions`` is None.
        scale: the scale FlexAttention applies (default ``1 / sqrt(d)``): a query term is
            scaled with ``q k^T``.

    Returns:
        the ``score_mod``.

    Raises:
        TypeError: a scheme with a rotation, a value term, a contextual term (CoPE) or an
            unbounded / key-only term (none is a ``score_mod``), a query term without ``q``,
            a scheme with no hook.
        ValueError: positions that do not fit ``q`` or ``k_len``, a scheme built for other
            heads, positions the scheme rejects (outside a Swin window or map, past a
            table's ``max_len``, ...).
    """
    check_scheme(scheme)
    if scheme is None:
        raise TypeError("scheme is None: flex_attention needs no score_mod without positions")
    hooks = hooks_of(scheme)
    name = type(scheme).__name__
    if hooks.rotate is not None:
        raise TypeError(
            f"{name} rotates q and k before attention, which no score_mod does: rotate them "
            f"with q, k = {name}(...)(q, k) and call flex_attention without a score_mod"
        )
    if hooks.value_term is not None:
        raise TypeError(
            f"{name} adds a value term (Shaw's a^V), which a score_mod cannot: build it without "
            f"values (ShawRelativePosition(..., values=False)) or use posenc.attention"
        )
    if hooks.contextual_term is not None:
        raise TypeError(
            f"{name} adds a contextual term (CoPE), read from each query's whole row of "
            f"masked logits, which a score_mod (one score at a time) cannot; use "
            f"posenc.attention(q, k, v, position=...)"
        )
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(
            f"offset must be an int >= 0 (the position of query 0: n_k - n_q when decoding), "
            f"got {offset!r}"
        )
    if q is not None:
        check.floating("q", q)
        if q.ndim != 4:
            raise ValueError(
                f"q must have shape [batch, heads, n_q, head_dim], got shape {tuple(q.shape)}"
            )
        validate = getattr(scheme, "validate_attention", None)
        if callable(validate):
            validate(heads=q.shape[1], head_dim=q.shape[-1])
    q_pos, k_pos, shift = _positions(positions, key_positions, q, k_len, offset)
    mods = []
    if hooks.score_term is not None:
        if hooks.flex_term_mod is None:
            raise TypeError(
                f"{name}'s query term has no bounded form for a score_mod (no reach, or a term "
                f"of the key alone); use posenc.attention(q, k, v, position=...), whose "
                f"backend='flex' also serves a term of the key alone (folded into the keys)"
            )
        if q is None:
            raise TypeError(
                f"{name} adds a query term q_i . r(j - i): pass q=, the queries "
                f"flex_attention gets, so that its logits q @ r^T are read per pair"
            )
        check.floating("q", q)
        scale = q.shape[-1] ** -0.5 if scale is None else check.positive_float("scale", scale)
        term = hooks.flex_term_mod(q, q_pos, k_pos, scale)
        if term is None:
            raise TypeError(
                f"{name}'s query term has no reach (its offsets are unbounded): no score_mod "
                f"reads it from a table; use posenc.attention"
            )
        mods.append(term)
    if hooks.score_bias is not None:
        if hooks.flex_score_mod is None:
            raise TypeError(
                f"{name} adds a score_bias but defines no flex_score_mod(q_pos, k_pos); give "
                f"it one, or use posenc.attention"
            )
        bias = hooks.flex_score_mod(q_pos, k_pos)
        mods.append(bias if not shift else _shift_queries(bias, shift))
    chained = _chain(mods)
    if chained is None:
        raise TypeError(f"{name} adds nothing to the scores: flex_attention needs no score_mod")
    return chained


def _positions(
    positions: Tensor | None,
    key_positions: Tensor | None,
    q: Tensor | None,
    k_len: int | None,
    offset: int,
) -> tuple[Tensor | None, Tensor | None, int]:
    """``(q_pos [B', n_q] or None, k_pos [B', n_k] or None, shift)`` for :func:`score_mod`:
    positions checked against ``q`` and ``k_len`` where given, None for the token indices,
    and ``shift`` the offset a ``score_mod`` adds to ``q_idx`` (None query positions, no
    ``q`` to make them from)."""
    device = None if q is None else q.device

    def rows(x: Tensor) -> int:
        return x.shape[0] if x.ndim == 2 else 1

    shift = 0
    if positions is not None:
        check.tensor("positions", positions)
        n_q = positions.shape[-1] if q is None else q.shape[2]
        batch = rows(positions) if q is None else q.shape[0]
        q_pos = check.positions(positions, n=n_q, batch=batch, device=device)
    elif q is not None:
        q_pos = torch.arange(offset, offset + q.shape[2], device=device)[None]  # [1, n_q]
    else:
        q_pos, shift = None, offset
    if key_positions is not None:
        check.tensor("key_positions", key_positions)
        n_k = key_positions.shape[-1] if k_len is None else check.positive_int("k_len", k_len)
        batch = rows(key_positions) if q is None else q.shape[0]
        k_pos = check.positions(
            key_positions, n=n_k, batch=batch, name="key_positions", device=device
        )
    elif positions is not None:  # self-attention: the keys are the queries' tokens
        if k_len is not None and check.positive_int("k_len", k_len) != q_pos.shape[-1]:
            raise ValueError(
                f"positions covers the {q_pos.shape[-1]} queries but k_len={k_len}: pass "
                f"key_positions [{k_len}] too"
            )
        k_pos = q_pos
    elif k_len is not None:
        k_pos = torch.arange(check.positive_int("k_len", k_len), device=device)[None]
    else:
        k_pos = None  # kv_idx
    return q_pos, k_pos, shift


def _shift_queries(mod: ScoreMod, shift: int) -> ScoreMod:
    """``mod`` with query ``q_idx`` at position ``q_idx + shift``."""

    def shifted(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mod(score, b, h, q_idx + shift, kv_idx)

    return shifted


def block_mask(
    q_len: int,
    k_len: int | None = None,
    *,
    causal: bool = False,
    window: int | None = None,
    key_padding_mask: Tensor | None = None,
    valid_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    device: Any = None,
) -> Any:
    """The masks of :func:`posenc.attention` as a FlexAttention ``BlockMask``.

    A mask of the shape alone (``causal``, ``window``) is built once per shape and device
    and reused; one that reads tensors (key padding, lengths, documents) per call.

    Args:
        q_len: queries ``n_q``.
        k_len: keys ``n_k`` (default ``q_len``).
        causal: query ``i`` sees keys ``j <= i + n_k - n_q`` (aligned at the end).
        window: a sliding window, as :func:`posenc.attention`'s.
        key_padding_mask: ``[b, n_k]`` bool, True = padding.
        valid_lens: ``[b]`` integer lengths: keys at or past the length are hidden.
        document_ids: ``[b, n]`` document of each token (``n_q == n_k``).
        device: where to build it (default the tensors', else CPU).

    Returns:
        a ``BlockMask`` for ``flex_attention(..., block_mask=)``, for batch ``b`` (or any
        batch when only the shape is masked).

    Raises:
        ValueError, TypeError: as :func:`posenc.attention` for these arguments.
    """
    q_len = check.positive_int("q_len", q_len)
    k_len = q_len if k_len is None else check.positive_int("k_len", k_len)
    causal = check.causal_flag(causal)
    window = check.window(window)
    given = [t for t in (key_padding_mask, valid_lens, document_ids) if t is not None]
    for t in given:
        check.tensor("mask argument", t)
    batch = given[0].shape[0] if given else 1
    if device is None:
        device = given[0].device if given else "cpu"
    if document_ids is not None and q_len != k_len:
        raise ValueError(
            f"document_ids is for self-attention over packed sequences (n_q == n_k), got "
            f"n_q={q_len}, n_k={k_len}"
        )
    mask = Mask(
        q_len,
        k_len,
        key_padding=check.key_padding_mask(key_padding_mask, batch, k_len),
        lengths=check.valid_lens(valid_lens, batch, q_len),
        causal=causal,
        q_doc=None if document_ids is None else check.document_ids(document_ids, batch, q_len),
        k_doc=document_ids,
        behind=window,
        ahead=None if causal else window,
    )
    return _block_mask(mask, batch if given else None, None, device)
