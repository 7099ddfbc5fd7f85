"""The readable reference path (``backend="math"``): the attention formula, literally.

Every other path is tested against it. Shape legend: ``b`` batch, ``h`` heads, ``n_q``
queries, ``n_k`` keys, ``d`` head dim; positions ``[B', n]`` with ``B'`` 1 or ``b``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._memo import eager
from ..diagonals import pad_rows, skew_rows
from ..hooks import Hooks
from . import tuning
from .mask import Mask
from .workspace import borrowed


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype for softmax and accumulation: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _dense_bias(hooks: Hooks, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """The scheme's ``score_bias`` for a path that only reads it: the tensor it keeps between
    calls where it keeps one (``kept_score_bias``: no allocation), else a new one
    ``[B', h or 1, n_q, n_k]``."""
    return _read_bias(hooks, q_pos, k_pos)[0]


def _read_bias(hooks: Hooks, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, bool]:
    """:func:`_dense_bias`, and whether it is the tensor the scheme keeps between calls."""
    if hooks.kept_score_bias is not None:
        kept = hooks.kept_score_bias(q_pos, k_pos)
        if kept is not None:
            return kept, True
    return hooks.score_bias(q_pos, k_pos), False


def _fold_scores(
    hooks: Hooks,
    q: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scale: float,
    *,
    reference: bool,
    mask: Mask | None = None,
    rows: slice | None = None,
    bias: Tensor | None = None,
) -> Tensor | None:
    """``score_term * scale + score_bias`` plus the float ``attn_mask`` of ``mask`` for query
    ``rows`` (None when nothing is added; ``bias``: the scheme's bias for these positions
    where the caller has it)."""
    extra: Tensor | None = None
    term = (hooks.reference_score_term if reference else None) or hooks.score_term
    if term is not None:
        extra = term(q, q_pos, k_pos) * scale  # [b, h, n_q, n_k]
    if hooks.score_bias is not None:
        if bias is None:
            bias = _dense_bias(hooks, q_pos, k_pos)  # [B', h or 1, n_q, n_k], read only
        extra = bias if extra is None else extra + bias
    added = None if mask is None else mask.added(rows)  # [b|1, h|1, rows|1, n_k|1]
    if added is not None:  # at least the scores' width, and the mask's own if wider
        added = added.to(torch.promote_types(added.dtype, _wide(q.dtype)))
        extra = added if extra is None else extra + added
    return extra


def _run_rows(
    hooks: Hooks, q: Tensor, q_pos: Tensor, k_pos: Tensor
) -> tuple[Tensor, Tensor | None] | None:
    """The rows of the scheme's query term per offset at these positions, for a caller
    that computes ``q`` against them itself: ``offset_term``'s rows ``[(h,) n_q + n_k - 1,
    d]``, or its table ``[(h,) R, d]`` and the index of each offset's row ``[n_q + n_k -
    1]`` (a clipped term, the table cut to the rows the index reads), as
    :func:`~posenc.families.terms.offset_term_logits` tabulates the offsets met and pads
    them with zero rows (:func:`~posenc.diagonals.pad_rows`), in ``q``'s dtype: ``(rows or
    table, index or None)``. ``score_term`` is then the skew (``skew_rows(x, n_k)``) of ``x = q @ rows^T``,
    or of ``x = (q @ table^T)[..., index]``: the values of that form's product and skew,
    or gather. None where the scheme has no such form here: no ``offset_term``, positions
    that are not one run, rows, a table or an index of another shape or an empty index
    (``score_term`` then runs, and raises what it raises), and outside eager code
    (``torch.compile``, ``torch.jit.trace``, a ``torch.func`` transform, a dispatch or
    function mode, forward-mode AD: ``score_term``'s own forms, which read no value)."""
    if hooks.offset_term is None or hooks.score_term is None:
        return None  # (an offset_term without a score_term adds nothing)
    if not eager():
        return None
    rows = hooks.offset_term(q_pos, k_pos)
    index = None
    if isinstance(rows, tuple) and len(rows) == 2:
        rows, index = rows
        if not (
            isinstance(rows, Tensor)
            and isinstance(index, Tensor)
            and index.shape == (q_pos.shape[-1] + k_pos.shape[-1] - 1,)
            and index.dtype == torch.int64
            and index.numel()
        ):
            return None
        low, high = (int(x) for x in torch.aminmax(index))
        if low < 0 or high >= rows.shape[-2]:
            return None  # (score_term raises what it raises)
        if low or high + 1 < rows.shape[-2]:  # the rows the offsets meet, as score_term's
            rows, index = rows[..., low : high + 1, :], index - low
    if not isinstance(rows, Tensor):
        return None
    _, h, n_q, d = q.shape
    shape = rows.shape
    width = n_q + k_pos.shape[-1] - 1 if index is None else shape[-2]
    if shape[-2:] != (width, d) or shape[:-2] not in ((), (h,)):
        return None
    return pad_rows(rows, tuning.GEMM_COLUMNS).to(q.dtype), index  # [(h,) W' | R', d]


def _term_of_rows(q: Tensor, table: Tensor, index: Tensor | None, n_k: int) -> Tensor:
    """``score_term`` from :func:`_run_rows`'s ``(table, index)``: the skew of ``q @
    rows^T``, or each pair's logit gathered from ``q @ table^T``, ``[b, h, n_q, n_k]`` (a
    function of its own, so that the logits and the term are freed once the caller has
    added them to the scores, before the softmax)."""
    logits = _rows_product(q, table)  # [b, h, n_q, W' | R']
    if index is None:
        return _skew(logits, n_k)  # [b, h, n_q, n_k], a view
    b, h, n_q, _ = logits.shape
    pairs = _pair_index(index, n_q, n_k).expand(b, h, n_q, n_k)  # [1, n_q, n_k], a view
    if torch.is_grad_enabled() and logits.requires_grad:
        return _Gathered.apply(logits, pairs)  # [b, h, n_q, n_k], each pair's row
    return logits.gather(-1, pairs)  # [b, h, n_q, n_k]


def _rows_product(q: Tensor, table: Tensor, out: Tensor | None = None) -> Tensor:
    """``q [b, h, n_q, d] @ table^T``, ``[b, h, n_q, W']``, for a shared ``[W', d]`` or a
    per-head ``[h, W', d]`` table (written into ``out``, a contiguous buffer of as many
    elements, where given). A per-head table with more than one batch entry is one product
    per head over the batch's queries, ``[h, b n_q, d] @ [h, d, W']``: ``q`` read head
    first (a copy, but a view for ``q`` laid out ``[b, n_q, h, d]``, as a projection's
    output is), where the product broadcast over the batch copies the table for each batch
    entry (``[b, h, W', d]``, larger than ``q`` from ``W' > n_q``); the result is then a view of
    the ``[h, b, n_q, W']`` logits (:func:`_skew` reads it as it is)."""
    b, h, n_q, d = q.shape
    if table.dim() == 3 and b > 1:
        width = table.shape[-2]
        q_heads = q.transpose(0, 1).reshape(h, b * n_q, d)  # [h, b n_q, d]
        if out is None:
            logits = torch.bmm(q_heads, table.transpose(-2, -1))  # [h, b n_q, W']
        else:
            logits = torch.bmm(q_heads, table.transpose(-2, -1), out=out.view(h, b * n_q, width))
        return logits.view(h, b, n_q, width).transpose(0, 1)  # [b, h, n_q, W'], a view
    if out is None:
        return q @ table.transpose(-2, -1)  # [b, h, n_q, W']
    return torch.matmul(q, table.transpose(-2, -1), out=out.view(b, h, n_q, table.shape[-2]))


def _skew(logits: Tensor, n_k: int) -> Tensor:
    """:func:`~posenc.diagonals.skew_rows` of :func:`_rows_product`'s logits ``[b, h, n_q,
    W']``, contiguous or the view of head-first ones: ``[b, h, n_q, n_k]``, a view (no
    copy)."""
    if logits.is_contiguous() or logits.shape[-2] == 1:
        return skew_rows(logits, n_k)
    return skew_rows(logits.transpose(0, 1), n_k).transpose(0, 1)  # via [h, b, n_q, W']


class _Gathered(torch.autograd.Function):
    """``logits.gather(-1, index)`` whose node keeps the index alone: gather's own node
    keeps its input, the logits ``[b, h, n_q, R']``, until the backward, which reads only
    their shape. The backward adds each pair's gradient into its row (differentiable:
    second-order gradients go through it)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, index: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.shape = logits.shape
        return logits.gather(-1, index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).scatter_add_(-1, index, grad), None


def _pair_index(index: Tensor, n_q: int, n_k: int) -> Tensor:
    """Each pair's row of a clipped term, ``index[j - i + n_q - 1]``, from the row of each
    offset of a run, ``index [n_q + n_k - 1]``: ``[1, n_q, n_k]`` (the skew of the index
    repeated for each query)."""
    return skew_rows(index.expand(n_q, index.shape[0]), n_k)[None]  # [1, n_q, n_k]


def _contextual(
    hooks: Hooks, scores: Tensor, keep: Tensor | None, q: Tensor, q_pos: Tensor, k_pos: Tensor
) -> Tensor:
    """The scheme's ``contextual_term`` of the logits: ``scores [b, h, n_q, n_k]`` with the
    keys that ``keep [b|1, h|1, n_q, n_k]`` hides at ``-inf`` (:class:`~posenc.hooks.
    ContextualTerm`)."""
    logits = scores if keep is None else scores.masked_fill(~keep, float("-inf"))
    return hooks.contextual_term(logits, q, q_pos, k_pos)  # [b|1, h|1, n_q, n_k]


def _contextual_extra(
    hooks: Hooks,
    q: Tensor,
    k: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    scale: float,
) -> Tensor:
    """What a kernel that computes ``q k^T * scale`` itself adds to it, for a scheme with a
    contextual term: ``score_term * scale + score_bias``, the contextual term of the logits
    ``q k^T * scale + score_term * scale + score_bias`` (computed here, once more than the
    kernel does), and the float ``attn_mask``: ``[b, h, n_q, n_k]``."""
    own = _fold_scores(hooks, q, q_pos, k_pos, scale, reference=False)  # the scheme's
    logits = (q @ k.transpose(-2, -1)) * scale  # [b, h, n_q, n_k]
    if own is not None:
        logits = logits + own
    term = _contextual(hooks, logits, mask.shared_keep(device=q.device), q, q_pos, k_pos)
    extra = term if own is None else own + term
    added = mask.added()  # [b|1, h|1, n_q, n_k] or None
    if added is not None:
        extra = extra + added.to(torch.promote_types(added.dtype, _wide(q.dtype)))
    return extra


def _plus(scores: Tensor, x: Tensor, own: bool) -> Tensor:
    """``scores + x``, written into ``scores`` (which the caller owns, if ``own``) where that
    gives the same tensor: ``x`` of its dtype and broadcast to its shape."""
    same = own and x.dtype == scores.dtype and x.dim() <= scores.dim()
    if same and all(a in (1, c) for a, c in zip(x.shape[::-1], scores.shape[::-1], strict=False)):
        return scores.add_(x)
    return scores + x


def _math(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    hooks: Hooks,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    scale: float,
    dropout_p: float,
    *,
    reference: bool = True,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The attention formula, one autograd op at a time: ``(out [b, h, n_q, d], weights
    [b, h, n_q, n_k])``. ``reference``: the scheme's literal hooks where it has them (Shaw's
    ``[n_q, n_k, d]`` relation tensors); False: its fast hooks, the same values (a term
    per offset of a run of positions from ``offset_term``'s rows: :func:`_run_rows`), and
    ``bias`` the scheme's bias for these positions where the caller has it."""
    # the scores are this function's own until the softmax (nothing saves them for a
    # backward but a contextual term, which gets a tensor no later step writes into), so
    # each step writes into them: the same values, two [b, h, n_q, n_k] passes fewer
    own = not torch._C._are_functorch_transforms_active()  # vmap cannot write in place
    scores = q @ k.transpose(-2, -1)  # [b, h, n_q, n_k]
    term = (hooks.reference_score_term if reference else None) or hooks.score_term
    rows = None if reference else _run_rows(hooks, q, q_pos, k_pos)
    if rows is not None:  # score_term's form for a run: the skew of q against the rows
        scores = _plus(scores, _term_of_rows(q, *rows, k.shape[2]), own)
    elif term is not None:
        scores = _plus(scores, term(q, q_pos, k_pos), own)
    scores = scores.mul_(scale) if own else scores * scale
    if hooks.score_bias is not None:
        if reference:
            bias = hooks.score_bias(q_pos, k_pos)
        elif bias is None:
            bias = _dense_bias(hooks, q_pos, k_pos)
        scores = _plus(scores, bias, own)  # reads the bias
    keep = mask.shared_keep(device=q.device)
    if hooks.contextual_term is not None:  # CoPE: a term read from the masked logits
        scores = scores + _contextual(hooks, scores, keep, q, q_pos, k_pos)
    if mask.bias is not None:  # a float attn_mask, added as SDPA adds it
        scores = _plus(scores, mask.bias.to(scores.dtype), own)
    if keep is not None:
        fill = torch.finfo(scores.dtype).min
        scores = scores.masked_fill_(~keep, fill) if own else scores.masked_fill(~keep, fill)
    weights = scores.to(_wide(scores.dtype)).softmax(dim=-1)  # softmax in float32 at least
    if keep is not None and not (mask.causal_at_most and mask.n_q <= mask.n_k):
        # a query with no visible key: its row was uniform over masked keys; make it 0
        # (a causal mask alone, aligned at the end, leaves every query a key)
        weights = weights * keep.any(dim=-1, keepdim=True)
    weights = weights.to(v.dtype)
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = dropped @ v  # [b, h, n_q, d]
    value_term = (hooks.reference_value_term if reference else None) or hooks.value_term
    if value_term is not None:
        out = out + value_term(dropped, q_pos, k_pos)
    return out, weights


#: the in-place softmax along the last dim (``out=`` its input: each row is read before it
#: is written)
_softmax_out = torch.ops.aten._softmax.out


def _forward_in_place(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    hooks: Hooks,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    scale: float,
    dropout_p: float,
    *,
    bias: Tensor | None = None,
    checked: bool = True,
) -> Tensor | None:
    """:func:`_math` with the fast hooks, for a call that records no graph (``bias``: the
    scheme's bias for these positions where the caller has it): ``[b, h, n_q, d_v]``, the
    same values in one ``[b, h, n_q, n_k]`` buffer (in grad mode, where the
    score term or bias requires grad, :func:`_math` itself).

    Where the caller has not checked that ``q`` and ``k`` are finite (``checked`` False,
    a call the mask hides keys from, no graph recorded, a ``scale`` that is a normal
    number of the dtype: a GEMM may skip its inputs where alpha is 0), the logits are
    read for it before the fill, in the sum the fill takes anyway
    (:meth:`~.mask.Mask.filled`): a NaN or an infinity in ``q`` or ``k`` makes a whole
    row or column of the logits non-finite (a NaN spreads through a product and a sum;
    an infinity times a channel's 0 is a NaN, times another value an infinity), and then
    the call returns None, before anything is returned, for the caller's own path (which
    zeroes such tokens). A sum past the dtype's range returns None too, and the caller
    finds nothing to zero.

    The buffer starts as ``score_term * scale + score_bias`` plus the float mask (a term
    per offset of a run of positions from ``offset_term``'s rows, :func:`_run_rows`: the
    queries against them written into the buffer past the scores, skewed and scaled from
    there, with the values of ``score_term``'s product and skew: its bits for a shared
    table), one GEMM
    adds ``scale * q k^T`` to it (``baddbmm_``: no pass of its own for the scale or the
    bias), and the masked fill and the softmax write into it (the softmax only for rows of
    a multiple of :data:`~.tuning.SOFTMAX_IN_PLACE_COLUMNS` keys; others get a second
    buffer). :func:`_math` allocates the scores and the weights apart and passes over them
    three times more. The buffer is the thread's kept one (:mod:`.workspace`): a fresh
    ``[b, h, n_q, n_k]`` allocation costs a page fault per 4 KiB page in a call where the
    C library has handed the last one back to the system. A value term reads the weights
    there during the call only.

    Args:
        q: ``[b, h, n_q, d]`` float32 or float64, as many heads as ``k`` and ``v``.
        k: ``[b, h, n_k, d]``.
        v: ``[b, h, n_k, d_v]``.
        hooks: the scheme's hooks (no contextual term).
        q_pos: ``[B', n_q]`` positions.
        k_pos: ``[B', n_k]`` positions.
        mask: which keys each query may see.
        scale: the scores' scale.
        dropout_p: dropout on the weights.
        bias: the scheme's bias ``[B', h or 1, n_q, n_k]`` for these positions, or None
            (asked for here).

    Returns:
        ``[b, h, n_q, d_v]``; None where ``checked`` is False and the logits are not finite.
    """
    rows = _run_rows(hooks, q, q_pos, k_pos)  # ([(h,) W' | R', d], [W] or None) or None
    term = None
    if rows is None and hooks.score_term is not None:
        term = hooks.score_term(q, q_pos, k_pos)  # [b|1, h|1, n_q, n_k]
    if hooks.score_bias is None:
        bias = None
    elif bias is None:
        bias = _dense_bias(hooks, q_pos, k_pos)
    if torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (None if rows is None else rows[0], term, bias)
    ):
        # grad mode, and the hooks read a tensor that requires grad (not a parameter of the
        # scheme, which the plan saw): the formula in autograd ops differentiates it
        return _math(
            q, k, v, hooks, q_pos, k_pos, mask, scale, dropout_p, reference=False, bias=bias
        )[0]
    b, h, n_q, d = q.shape
    n_k, d_v = k.shape[2], v.shape[3]
    count = b * h * n_q * n_k
    in_place = n_k % tuning.SOFTMAX_IN_PLACE_COLUMNS == 0
    used = count if in_place else 2 * count  # the scores, and the weights apart
    wide = 0 if rows is None else b * h * n_q * rows[0].shape[-2]  # the term's logits
    # in grad mode a value term may read a tensor that requires grad (one the plan did not
    # see), and its graph then saves the weights: a buffer of the call's own
    keep = not (torch.is_grad_enabled() and hooks.value_term is not None)
    with borrowed(used + wide, q.dtype, q.device, keep=keep) as flat:
        scores = flat[:count].view(b * h, n_q, n_k)  # [b h, n_q, n_k]
        full = scores.view(b, h, n_q, n_k)
        start = False  # whether the buffer holds what the GEMM adds to
        if rows is not None:  # the term's logits against each offset's row, then the skew
            table, index = rows
            logits = _rows_product(q, table, out=flat[used : used + wide])  # [.., W' | R']
            if index is None:
                torch.mul(_skew(logits, n_k), scale, out=full)  # [b, h, n_q, n_k]
            else:  # each pair's row's logit
                pairs = _pair_index(index, n_q, n_k).expand(b, h, n_q, n_k)
                torch.gather(logits, -1, pairs, out=full).mul_(scale)  # [b, h, n_q, n_k]
            start = True
        elif term is not None:  # [b|1, h|1, n_q, n_k]
            if term.shape == full.shape:
                torch.mul(term, scale, out=full)
            else:  # shared by the batch or the heads: broadcast into the buffer
                full.copy_(term).mul_(scale)
            start = True
        if bias is not None:  # [B', h or 1, n_q, n_k], read only
            full.add_(bias) if start else full.copy_(bias)
            start = True
        added = mask.added()  # [b|1, h|1, n_q, n_k] or None
        if added is not None:
            full.add_(added) if start else full.copy_(added)
            start = True
        q3 = q.reshape(b * h, n_q, d)  # [b h, n_q, d]
        k3 = k.reshape(b * h, n_k, d)  # [b h, n_k, d]
        scores.baddbmm_(q3, k3.transpose(1, 2), beta=1 if start else 0, alpha=scale)
        keep = mask.shared_keep(device=q.device)  # [b|1, h|1, n_q, n_k] or None
        if keep is not None:
            finite = None if checked else mask.finite_sum(full)
            if finite is False:
                return None  # a NaN or an infinity in q or k (or the term): the caller's path
            mask.filled(full, keep, torch.finfo(scores.dtype).min, in_place=True, finite=finite)
        # a row's partial last vector, written, would stall the next row's first read:
        # such rows are written into the second half of the buffer
        weights = scores if in_place else flat[count : 2 * count].view(b * h, n_q, n_k)
        _softmax_out(scores, -1, False, out=weights)  # [b h, n_q, n_k]
        full = weights.view(b, h, n_q, n_k)
        if keep is not None and not (mask.causal_at_most and mask.n_q <= mask.n_k):
            full.mul_(keep.any(dim=-1, keepdim=True))  # a query with no visible key: 0
        if dropout_p > 0:
            full = F.dropout(full, dropout_p)
        out = torch.bmm(full.reshape(b * h, n_q, n_k), v.reshape(b * h, n_k, d_v))
        out = out.view(b, h, n_q, d_v)  # [b h, n_q, d_v] -> [b, h, n_q, d_v]
        if hooks.value_term is not None:
            out = _plus(out, hooks.value_term(full, q_pos, k_pos), own=True)  # [b, h, n_q, d_v]
    return out
