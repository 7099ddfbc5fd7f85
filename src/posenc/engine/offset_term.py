"""The per-offset query-term path: ``q_i . r_(j-i)`` (the 1-D relative embedding, Shaw's
key term) and Shaw's value term, from the rows per offset, in strips of offsets; a
clipped table's constant far pairs take the fused kernels without a mask.

Shape legend: ``b`` batch, ``h`` heads, ``g`` a head group, ``rows`` a block's queries,
``n_q`` queries, ``n_k`` keys, ``d`` head dim, ``W = n_q + n_k - 1`` offsets, ``R`` the
distinct rows of a clipped table (``2k + 1`` for Shaw).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..diagonals import pad_rows, padded_count
from ..indices import skew_rows
from . import common, tuning
from .common import _SHARE_FLOOR, _block_grads, _Buffers, _KeyGrads, _reused, _widen


def _wider(table: Tensor, start: int, count: int) -> Tensor | None:
    """The ``count`` rows of ``table [(h,) R, d]`` from ``start`` with the rows after them up
    to :func:`~posenc.diagonals.padded_count` (a multiple of :data:`tuning.GEMM_COLUMNS`
    where that adds at most an eighth), a view (a product's columns past ``count`` are
    never read); None where the table ends first."""
    stop = start + padded_count(count, tuning.GEMM_COLUMNS)
    return None if stop > table.shape[-2] else table[..., start:stop, :]  # [(h,) W', d]


def _clipped_runs(idx: Tensor) -> tuple[int, int] | None:
    """``(lead, tail)`` when ``idx [W]`` is a clipped run: ``lead`` times its first row, each
    row between once, ``tail`` times its last (``tail`` 0 when all rows are the first), as
    ``clip(offset, -k, k) + k`` over increasing offsets is; else None."""
    first, last = int(idx[0]), int(idx[-1])
    if last < first:  # clipped runs increase
        return None
    lead, tail = int((idx == first).sum()), int((idx == last).sum())
    parts = [torch.full((lead,), first, dtype=idx.dtype, device=idx.device)]
    if first != last:  # a run of first, first + 1 .. last - 1 once each, a run of last
        parts.append(torch.arange(first + 1, last, dtype=idx.dtype, device=idx.device))
        parts.append(torch.full((tail,), last, dtype=idx.dtype, device=idx.device))
    clipped = torch.cat(parts)
    if clipped.shape != idx.shape or not torch.equal(clipped, idx):
        return None
    return lead, tail if first != last else 0


class _Rows:
    """The rows ``r_m`` of the offsets a block of queries meets, for :class:`_OffsetTermAttention`.

    Given as rows ``[(h,) W, d]``, or as a table ``[(h,) R, d]`` with an index per offset
    (``r_m = table[index[m]]``). A clipped index (Shaw: ``clip(offset, -k, k) + k``: a run
    of the first row, single rows, a run of the last row) is kept as its ``R`` distinct rows
    and the runs' lengths: ``x @ r^T`` is then a product with ``R`` rows spread over the
    runs, and ``x @ r`` the runs' sums times ``R`` rows, not products over all ``W`` offsets.
    """

    def __init__(self, table: Tensor, index: Tensor | None, cols: slice) -> None:
        self.runs: tuple[int, int] | None = None
        self.target: slice | Tensor = cols
        self.width = cols.stop - cols.start  # W: the offsets (columns) covered
        if index is None:
            self.rows = table[..., cols, :]  # [(h,) W, d]
            self.wide: Tensor | None = _wider(table, cols.start, self.width)  # [(h,) W', d]
            return
        idx = index[cols]  # [W] rows of the table
        self.runs = _clipped_runs(idx)
        if self.runs is None:  # any index: the rows themselves
            self.rows, self.target = table[..., idx, :], idx
            self.wide = self.rows
            return
        first, last = int(idx[0]), int(idx[-1])
        self.rows, self.target = table[..., first : last + 1, :], slice(first, last + 1)
        self.wide = self.rows
        if self.runs[0] == 1 and self.runs[1] <= 1:  # one row per offset: nothing to spread
            self.runs = None
            self.wide = _wider(table, first, last + 1 - first)

    def of(self, heads: slice) -> Tensor:
        """``[(g,) R | W, d]``: the rows of these heads (all of a shared table)."""
        return self.rows if self.rows.ndim == 2 else self.rows[heads]

    def spread(self, x: Tensor) -> Tensor:
        """``[..., R]`` per distinct row -> ``[..., W]`` per offset (a copy)."""
        if self.runs is None:
            return x
        lead, tail = self.runs
        if tail == 0:  # one row for every offset
            return x.expand(*x.shape[:-1], lead).contiguous()
        left = x[..., :1].expand(*x.shape[:-1], lead)
        right = x[..., -1:].expand(*x.shape[:-1], tail)
        return torch.cat((left, x[..., 1:-1], right), dim=-1)

    def gather(self, x: Tensor) -> Tensor:
        """``[..., W]`` per offset -> ``[..., R]`` summed per distinct row (the adjoint)."""
        if self.runs is None:
            return x
        lead, tail = self.runs
        if tail == 0:
            return x.sum(dim=-1, keepdim=True)
        width = x.shape[-1]
        left = x[..., :lead].sum(dim=-1, keepdim=True)
        right = x[..., width - tail :].sum(dim=-1, keepdim=True)
        return torch.cat((left, x[..., lead : width - tail], right), dim=-1)

    def logits(self, x: Tensor, heads: slice) -> Tensor:
        """``x @ r^T``: ``[b, g, rows, d] -> [b, g, rows, W']``, its first ``W`` columns the
        offsets'. A run of the table's rows (no index, or one row per offset) is multiplied
        with the rows after it up to a multiple of :data:`tuning.GEMM_COLUMNS` (:func:`_wider`:
        where the table ends first, padded with zero rows in each call: a copy of ``g`` heads'
        rows, never kept), the product kept whole for :func:`_skewed`, which reads only its
        first ``W`` columns; rows picked by any other index, ``W' = W``; spread rows, the
        spread."""
        if self.runs is not None:
            return self.spread(x @ self.of(heads).transpose(-2, -1))
        if self.wide is None:  # the table ends first: these heads' rows padded, for this call
            wide = pad_rows(self.of(heads), tuning.GEMM_COLUMNS)  # [(g,) W', d]
        else:
            wide = self.wide if self.wide.ndim == 2 else self.wide[heads]  # [(g,) W', d]
        return x @ wide.transpose(-2, -1)  # [b, g, rows, W']

    def combine(self, x: Tensor, heads: slice) -> Tensor:
        """``x @ r``: ``[b, g, rows, W] -> [b, g, rows, d]``."""
        return self.gather(x) @ self.of(heads)

    def add_grad(self, grad: Tensor, heads: slice, x: Tensor, y: Tensor, scale: float) -> None:
        """Add ``scale * x^T @ y`` (``x [b, g, rows, W]``, ``y [b, g, rows, d]``) to the
        whole table's gradient ``grad``, summed over the batch (and the heads, if shared)."""
        rows = (self.gather(x).transpose(-2, -1) @ y).sum(dim=0).mul_(scale)  # [g, R | W, d]
        if grad.ndim == 2:
            rows = rows.sum(dim=0)  # [R | W, d]
            if isinstance(self.target, slice):
                grad[self.target] += rows
            else:
                grad.index_add_(0, self.target, rows)
        elif isinstance(self.target, slice):
            grad[heads, self.target] += rows
        else:
            grad[heads].index_add_(1, self.target, rows)


def _lead_pieces(n_q: int, n_k: int, delta: int) -> list[tuple[slice, slice, bool]]:
    """``(query rows, keys, causal)`` calls of the fused kernel covering exactly the pairs
    ``j <= i + delta - 1`` (query ``i``, key ``j``), with the kernel's causal mask, which is
    top-left (query ``i'`` of a call sees its keys ``j' <= i'``): rows from the first with
    such a key; keys that all those rows see in one call without a mask, the rest causal."""
    first = max(0, 1 - delta)  # the first row with a key
    if first >= n_q or n_k == 0:
        return []
    last_of_first = first + delta - 1  # the first row's last key (>= 0)
    rows = slice(first, n_q)
    pieces = []
    if last_of_first > 0:  # keys every row from the first sees: no mask
        pieces.append((rows, slice(0, min(last_of_first, n_k)), False))
    if last_of_first < n_k:
        pieces.append((rows, slice(last_of_first, n_k), True))
    return pieces


class _FarPart:
    """The keys of one constant end of a clipped table (Shaw's first or last row): pairs
    ``j <= i + delta - 1`` (the lead), or, on the sequences reversed, ``j >= i + delta'``
    (the tail). Their term is one number per query, ``q_i . a^K``, and their value term one
    row, ``a^V``: the fused kernel runs over them without a mask (:func:`_lead_pieces`)."""

    def __init__(
        self, table: Tensor, value_table: Tensor | None, row: int, delta: int, flip: bool
    ) -> None:
        self.row, self.delta, self.flip = row, delta, flip
        self.keys = table[..., row, :]  # [(h,) d]
        self.values = None if value_table is None else value_table[..., row, :]

    @staticmethod
    def broadcast(x: Tensor | None, heads: slice) -> Tensor | None:
        """A row ``[(h,) d]`` of these heads, broadcastable to ``[b, g, n, d]``."""
        if x is None:
            return None
        return (x if x.ndim == 1 else x[heads]).unsqueeze(-2)  # [(g,) 1, d]

    def term(self, q: Tensor, heads: slice, scale: float) -> Tensor:
        """``scale * q_i . a^K``: ``[b, g, n_q]`` for ``q [b, g, n_q, d]`` of these heads."""
        row = self.broadcast(self.keys, heads)  # [(g,) 1, d]
        return (q @ row.transpose(-2, -1)).squeeze(-1).mul_(scale)

    def _seq(self, x: Tensor) -> Tensor:
        return x.flip(2) if self.flip else x

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, heads: slice, scale: float
    ) -> tuple[Tensor, Tensor]:
        """``(out, lse)``: ``[b, g, n_q, d]``, ``[b, g, n_q]`` over the part's keys for the
        heads ``heads`` (``q``, ``k``, ``v`` theirs), ``lse`` with the term added, ``-inf``
        (and ``out`` 0) for rows with no key here."""
        n_q, n_k = q.shape[2], k.shape[2]
        term = self.term(q, heads, scale)  # [b, g, n_q]
        q, k, v = self._seq(q), self._seq(k), self._seq(v)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        lse = q.new_full(q.shape[:-1], float("-inf"))
        for rows, keys, causal in _lead_pieces(n_q, n_k, self.delta):
            o, l = common._flash_cpu(
                q[:, :, rows], k[:, :, keys], v[:, :, keys], 0.0, causal, scale=scale
            )
            merged = torch.logaddexp(lse[:, :, rows], l)
            out[:, :, rows] = out[:, :, rows] * (lse[:, :, rows] - merged).exp().unsqueeze(
                -1
            ) + o * (l - merged).exp().unsqueeze(-1)
            lse[:, :, rows] = merged
        return self._seq(out), self._seq(lse) + term

    def backward(
        self, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """The kernel's gradients ``(dq, dk, dv)`` over the part's keys given the merged
        ``out`` (less the part's value row) and ``lse`` (less the part's term)."""
        n_q, n_k = q.shape[2], k.shape[2]
        g, q, k, v, out, lse = (self._seq(x) for x in (grad_out, q, k, v, out, lse))
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows, keys, causal in _lead_pieces(n_q, n_k, self.delta):
            gq, gk, gv = common._flash_cpu_backward(
                g[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                lse[:, :, rows], 0.0, causal, scale=scale,
            )  # fmt: skip
            grad_q[:, :, rows] += gq
            grad_k[:, :, keys] += gk
            grad_v[:, :, keys] += gv
        return self._seq(grad_q), self._seq(grad_k), self._seq(grad_v)


def _far_parts(
    table: Tensor, value_table: Tensor | None, index: Tensor | None, n_q: int, n_k: int,
    causal: bool,
) -> tuple[list[_FarPart], int | None, int | None]:  # fmt: skip
    """The far parts of a clipped index and the band left between them: ``(parts, low,
    high)``, query ``i`` meeting keys ``i + low .. i + high`` in the strip (None: unbounded).

    Offset column ``m = j - i + n_q - 1``: columns below ``lead`` hold the first row, from
    ``W - tail`` the last. Under a causal mask (aligned at the end) keys after
    ``i + n_k - n_q`` are hidden: the lead stops there, and there is no tail part (the strip
    takes its visible keys up to the causal bound). No far parts below
    :data:`tuning.FAR_PAIRS` pairs: the strip then covers every key, as for any term.
    """
    runs = None if index is None or n_q * n_k < tuning.FAR_PAIRS else _clipped_runs(index)
    high = n_k - n_q if causal else None
    if runs is None:
        return [], None, high
    lead, tail = runs
    low = lead - n_q + 1  # lead keys: j <= i + low - 1
    if causal:
        low = min(low, n_k - n_q + 1)
    parts = [_FarPart(table, value_table, int(index[0]), low, flip=False)]
    if not causal and tail:
        high = n_k - tail - 1  # tail keys: j >= i + high + 1
        # reversed: i* = n_q - 1 - i, j* = n_k - 1 - j: j* <= i* + (tail - n_q + 1) - 1
        parts.append(_FarPart(table, value_table, int(index[-1]), tail - n_q + 1, flip=True))
    return parts, low, high


def _strip(
    blk: slice, n_q: int, n_k: int, low: int | None, high: int | None
) -> tuple[slice, slice, int, int | None]:
    """A block's strip: ``(keys, offset columns, first hidden logit column from the left
    (0: none), first hidden logit column on the right (None: none))``; keys ``a .. c - 1``,
    logits column ``col`` of the block is offset ``col - (rows - 1) + a - start``."""
    rows = blk.stop - blk.start
    a = 0 if low is None else min(max(blk.start + low, 0), n_k)
    c = n_k if high is None else min(max(blk.stop + high, a), n_k)
    cols = slice(a - blk.stop + n_q, c - blk.start + n_q - 1)
    left = 0 if low is None else max(low + rows - 1 - a + blk.start, 0)
    right = None if high is None else high + rows - a + blk.start
    return slice(a, c), cols, left, right


class _OffsetTermAttention(torch.autograd.Function):
    """The lean engine for a query term ``q_i . r_(j-i)`` (relative embedding, Huang et al.;
    Shaw's keys), with Shaw's value term ``sum_j P_ij a^V_(j-i)`` when given its rows.

    For consecutive positions with no mask and no bias, each block's term is the skew of
    ``q_blk @ r^T`` over the offsets it meets, handed to the fused kernel as a strided view
    (no ``[rows, n_k]`` copy). The value term is ``unskew(P) @ a^V`` with ``P`` recomputed
    from the kernel's ``logsumexp`` over the block's keys. Backward: ``dS`` (and ``P``) go
    back through the skew into zero-padded buffers (one per tag, :func:`_reused`); small products
    give the gradients of ``q`` and of the rows. Rows given as a clipped table (see :class:`_Rows`) make every product
    with them ``R`` rows wide instead of ``W``.

    A clipped table (Shaw) is also constant far from the diagonal: keys ``k`` or more before
    a query meet only its first row, ``k`` or more after only its last. Those pairs take the
    fused kernels over the whole sequence without a mask (:class:`_FarPart`: a causal call
    shifted by ``k``, and one on the sequences reversed): their term is one number per
    query, added to the part's logsumexp, their value term the part's weight times one row.
    Only the band of ``2k - 1`` offsets around the diagonal is handled as above, block by
    block (keys outside it ``-inf`` in the block's logits; its value term normalised within
    the band, as its output). The parts are merged by their logsumexps (split-key flash
    attention), which scales the band's output and value term by its share; the backward
    runs the fused kernel on each far part with the merged ``logsumexp`` and output, the
    output less the part's value row so that the kernel's ``D = dO . O`` misses exactly
    that row's share of ``dP``. Only from :data:`tuning.FAR_PAIRS` query-key pairs per head: below
    it the band covers every key.

    Under a causal mask each block stops at the last key it sees, and the offsets its
    queries may not see are ``-inf`` in its logits.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        table: Tensor,
        value_table: Tensor | None,
        index: Tensor | None,
        scale: float,
        rows: int,
        causal: bool,
    ) -> Tensor:
        b, h, n_q, _ = q.shape
        n_k = k.shape[2]
        table = table.detach()
        value_table = None if value_table is None else value_table.detach()
        parts, low, high = _far_parts(table, value_table, index, n_q, n_k, causal)
        groups = _strip_groups(b, h, parts)
        rows = _strip_rows(rows, low, high)
        # the strip's share so far: rows with no strip key keep -inf
        out = torch.zeros_like(q)  # [b, h, n_q, d]
        lse = q.new_full(q.shape[:-1], float("-inf"))  # [b, h, n_q]
        padded: _Buffers = {}
        tables: dict[tuple[Any, ...], _Rows] = {}
        for blk, keys_of, cols, lo, hi in _strips(n_q, n_k, rows, low, high):
            if keys_of.stop <= keys_of.start or hi <= lo:  # no strip key for any query
                continue
            keys = _rows_cached(tables, table, index, cols)
            values = None if value_table is None else _rows_cached(tables, value_table, index, cols)
            has_key = _band_rows(blk, keys_of, low, high)  # [rows] rows with a strip key
            for hs in groups:
                qh, kh = q[:, hs, blk], k[:, hs, keys_of]  # [b, g, rows | c - a, d]
                attn_mask = _term_mask(qh, keys, hs, scale, kh.shape[2], lo, padded)
                o, l = common._flash_cpu(
                    qh, kh, v[:, hs, keys_of], attn_mask=attn_mask, scale=scale
                )
                if values is not None:  # normalized within the strip, as o: the merge
                    # below scales both by the strip's share (rows with no strip key: 0)
                    l_seen = l if has_key is None else l.masked_fill(~has_key, float("inf"))
                    o = o + _strip_values(qh, kh, attn_mask, l_seen, values, hs, scale, lo, padded)
                if has_key is not None:
                    o = torch.where(has_key[:, None], o, 0.0)  # (whatever the kernel gave)
                    l = l.masked_fill(~has_key, float("-inf"))
                out[:, hs, blk], lse[:, hs, blk] = o, l
        weights = mixed = None
        if parts:  # merged into the strip's share, a head group at a time (their copies)
            weights = q.new_empty(len(parts), b, h, n_q)  # each part's share of each row
            mixed = q.new_empty(len(parts), b, h, n_q, v.shape[-1])  # share * its output
            for hs in common._head_groups(b, h):
                qh, kh, vh = q[:, hs], k[:, hs], v[:, hs]  # [b, g, n, d]
                far = [part.forward(qh, kh, vh, hs, scale) for part in parts]
                total = torch.logsumexp(torch.stack([lse[:, hs], *(l for _, l in far)]), dim=0)
                out_h = out[:, hs] * (lse[:, hs] - total).exp_().unsqueeze(-1)  # [b, g, n, d]
                for i, (part, (o, l)) in enumerate(zip(parts, far, strict=True)):
                    w = (l - total).exp_()  # [b, g, n_q]
                    weights[i, :, hs] = w
                    mixed[i, :, hs] = o.mul_(w.unsqueeze(-1))
                    out_h += o
                    value_row = _FarPart.broadcast(part.values, hs)
                    if value_row is not None:
                        out_h += w.unsqueeze(-1) * value_row
                out[:, hs], lse[:, hs] = out_h, total
        ctx.save_for_backward(q, k, v, out, lse, table, value_table, index, weights, mixed)
        ctx.scale, ctx.rows, ctx.causal = scale, rows, causal
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, table, value_table, index, weights, mixed = ctx.saved_tensors
        scale, rows, causal = ctx.scale, ctx.rows, ctx.causal
        b, h, n_q, _ = q.shape
        n_k = k.shape[2]
        grad_q = torch.zeros_like(q)
        grad_table = torch.zeros_like(table)  # [(h,) R | n_q + n_k - 1, d]
        grad_values = None if value_table is None else torch.zeros_like(value_table)
        grad_out = grad_out.contiguous()
        parts, low, high = _far_parts(table, value_table, index, n_q, n_k, causal)
        groups = _strip_groups(b, h, parts)  # (rows: the forward's, already for the strip)
        key_grads = _KeyGrads(k, v, groups)
        padded: _Buffers = {}  # through the skew, zero outside
        tables: dict[tuple[Any, ...], _Rows] = {}
        for blk, keys_of, cols, lo, hi in _strips(n_q, n_k, rows, low, high):
            if keys_of.stop <= keys_of.start or hi <= lo:  # no strip key for any query
                continue
            keys = _rows_cached(tables, table, index, cols)
            values = None if value_table is None else _rows_cached(tables, value_table, index, cols)
            has_key = _band_rows(blk, keys_of, low, high)  # [rows] rows with a strip key
            width = keys_of.stop - keys_of.start
            for hs in groups:
                qh = q[:, hs, blk]  # [b, g, rows, d]
                gh, oh, lh = grad_out[:, hs, blk], out[:, hs, blk], lse[:, hs, blk]
                if has_key is not None:  # rows with no strip key: no share here
                    gh = gh * has_key[:, None]
                grad_k, grad_v = key_grads.of(hs)
                attn_mask = _term_mask(qh, keys, hs, scale, width, lo, padded)
                # dP through a^V too; D = dO . O with O the whole output (a^V included); 0
                # off the finite columns, where P is 0
                extra_dp = None
                if values is not None:
                    extra_dp = _skewed(values.logits(gh, hs), values, width, lo, 0.0, padded)
                gq, probs, grad_s = _block_grads(
                    qh, k[:, hs, keys_of], v[:, hs, keys_of], gh, oh, lh, attn_mask, scale,
                    (grad_k[:, :, keys_of], grad_v[:, :, keys_of]), need_ds=True,
                    extra_dp=extra_dp, floor=bool(parts),
                )  # fmt: skip
                if values is not None and grad_values is not None:
                    by_offset = _unskew(probs, padded, "p")  # [b, g, rows, rows + c - a - 1]
                    values.add_grad(grad_values, hs, by_offset[..., lo:hi], gh, 1.0)
                grad_logits = _unskew(grad_s, padded, "s")[..., lo:hi]  # 0 elsewhere (P is)
                grad_q[:, hs, blk] += gq.add_(keys.combine(grad_logits, hs).mul_(scale))
                keys.add_grad(grad_table, hs, grad_logits, qh, scale)
        grad_k, grad_v = key_grads.result()
        for hs in (
            common._head_groups(b, h) if parts else []
        ):  # the far parts, a head group at a time
            qh, kh, vh = q[:, hs], k[:, hs], v[:, hs]  # [b, g, n, d]
            gh, oh, lh = grad_out[:, hs], out[:, hs], lse[:, hs]
            for i, part in enumerate(parts):
                key_row = _FarPart.broadcast(part.keys, hs)  # [(g,) 1, d]
                value_row = _FarPart.broadcast(part.values, hs)
                # the kernel's D = dO . O' must miss the value row's share of dP
                o_seen = oh if value_row is None else oh - value_row
                part_lse = lh - part.term(qh, hs, scale)
                share = weights[i, :, hs]  # [b, g, n_q]
                if q.dtype == torch.float32:  # a part whose share underflows: exactly 0, no
                    # denormal exp over its keys (several times slower kernel backward)
                    part_lse = part_lse.masked_fill(share < _SHARE_FLOOR, float("inf"))
                gq, gk, gv = part.backward(gh, qh, kh, vh, o_seen, part_lse, scale)
                grad_k[:, hs] += gk
                grad_v[:, hs] += gv
                # the part's dS summed over its keys, one per query: sum_j P (dP - D)
                d_term = (gh * mixed[i, :, hs]).sum(dim=-1) - share * (gh * o_seen).sum(dim=-1)
                grad_q[:, hs] += gq.add_(d_term.unsqueeze(-1) * key_row * scale)
                _add_row(grad_table, part.row, hs, torch.einsum("bgn,bgnd->gd", d_term * scale, qh))
                if grad_values is not None:
                    _add_row(grad_values, part.row, hs, torch.einsum("bgn,bgnd->gd", share, gh))
        return grad_q, grad_k, grad_v, grad_table, grad_values, None, None, None, None


def _strip_values(
    qh: Tensor,
    kh: Tensor,
    attn_mask: Tensor,
    lse: Tensor,
    values: _Rows,
    heads: slice,
    scale: float,
    lo: int,
    padded: _Buffers,
) -> Tensor:
    """A strip block's value term ``sum_j P_ij a^V_(j-i)``: ``[b, g, rows, d]``, ``P``
    recomputed from the strip's own ``lse [b, g, rows]`` (+inf: a row without a key);
    ``values`` the rows of the finite logits columns, from ``lo``."""
    probs = torch.matmul(qh * scale, kh.transpose(-2, -1)).add_(attn_mask).sub_(lse[..., None])
    probs = probs.exp_()
    by_offset = _unskew(probs, padded, "p")  # [b, g, rows, rows + c - a - 1]
    return values.combine(by_offset[..., lo : lo + values.width], heads)


def _strip_rows(rows: int, low: int | None, high: int | None) -> int:
    """Query rows per strip block: a block's strip is ``rows + band - 1`` keys wide, so with
    far parts (a band of ``high - low + 1`` offsets) its work grows as ``rows^2``: at most
    ``max(64, band)`` rows."""
    if low is None or high is None:
        return rows
    return min(rows, max(64, high - low + 1))


def _strip_groups(b: int, h: int, parts: list[_FarPart]) -> list[slice]:
    """Heads per block on the term path: with far parts the strip is narrow (``rows + 2k -
    2`` keys), and all heads at once save the per-call overhead that dominates it; else
    :func:`common._head_groups`."""
    return [slice(0, h)] if parts else common._head_groups(b, h)


def _add_row(grad: Tensor, row: int, heads: slice, rows: Tensor) -> None:
    """Add ``rows [g, d]`` of the heads ``heads`` to row ``row`` of a table's gradient
    ``[(h,) R, d]`` (summed over the heads for a shared table)."""
    if grad.ndim == 2:
        grad[row] += rows.sum(dim=0)
    else:
        grad[heads, row] += rows


def _band_rows(blk: slice, keys_of: slice, low: int | None, high: int | None) -> Tensor | None:
    """``[rows]`` bool: the rows of a block that meet a key of its strip (query ``i`` meets
    keys ``i + low .. i + high``); None when all do. A row that meets none must not take the
    kernel's output and logsumexp (0, not -inf) for it."""
    i = torch.arange(blk.start, blk.stop)
    first = torch.full_like(i, keys_of.start) if low is None else (i + low).clamp(min=keys_of.start)
    last = (
        torch.full_like(i, keys_of.stop - 1)
        if high is None
        else (i + high).clamp(max=keys_of.stop - 1)
    )
    seen = first <= last
    return None if bool(seen.all()) else seen


def _unskew(x: Tensor, padded: _Buffers, tag: str) -> Tensor:
    """``x [b, g, rows, n_k]`` back through the skew: ``[b, g, rows, rows + n_k - 1]``, row
    ``i`` shifted right by ``rows - 1 - i``, zero elsewhere (a buffer reused per shape)."""
    shape = (*x.shape[:-1], x.shape[-2] + x.shape[-1] - 1)
    # (a tag per head-group size: groups of two sizes would otherwise remake it each time)
    out = _reused(padded, f"{tag} {x.shape[:2]}", shape, lambda: x.new_zeros(shape))
    skew_rows(out, x.shape[-1]).copy_(x)
    return out


def _strips(
    n_q: int, n_k: int, rows: int, low: int | None, high: int | None
) -> Iterator[tuple[slice, slice, slice, int, int]]:
    """``(query rows, keys, offset columns, lo, hi)`` per block of ``rows`` queries: the
    block's strip (:func:`_strip`) with only its finite logits columns, ``lo .. hi - 1`` of
    the ``rows + n_keys - 1`` (the others ``-inf``: keys met elsewhere or hidden), and
    their offset columns. With far parts they are the band's ``2k - 1`` of ``rows + 2k - 2``
    columns: the term is computed, and its gradient reduced, over them alone."""
    for start in range(0, n_q, rows):
        blk = slice(start, min(start + rows, n_q))
        keys, cols, left, right = _strip(blk, n_q, n_k, low, high)
        width = cols.stop - cols.start
        hi = width if right is None else min(max(right, 0), width)
        lo = min(left, hi)
        yield blk, keys, slice(cols.start + lo, cols.start + hi), lo, hi


def _rows_cached(
    cache: dict[tuple[Any, ...], _Rows], table: Tensor, index: Tensor | None, cols: slice
) -> _Rows:
    """``_Rows(table, index, cols)``, made once per table and columns (the strips of a
    sequence's inner blocks meet the same offsets)."""
    key = (id(table), cols.start, cols.stop)
    if key not in cache:
        cache[key] = _Rows(table, index, cols)
    return cache[key]


def _term_mask(
    q_blk: Tensor,
    keys: _Rows,
    heads: slice,
    scale: float,
    n_k: int,
    lo: int,
    buffers: _Buffers,
) -> Tensor:
    """A block's query term as the fused kernel's mask: ``[b, g, rows, n_k]``, a strided view
    of ``scale * q_blk @ r^T`` through the skew, with ``keys`` the rows of its finite logits
    columns, from ``lo`` (see :func:`_strips`); the other columns (offsets) are ``-inf``:
    keys the block's queries meet elsewhere (far parts) or may not see (a causal mask).
    Never clamped (unlike a content-free bias, see :data:`tuning.BIAS_SPAN`): the term is content,
    as ``q . k`` is, and a clamp could change a weight that ``q . k`` makes count."""
    logits = keys.logits(q_blk * scale, heads)  # [b, g, rows, >= hi - lo]
    return _skewed(logits, keys, n_k, lo, float("-inf"), buffers)  # [b, g, rows, n_k]


def _skewed(
    logits: Tensor, rows: _Rows, n_k: int, lo: int, fill: float, buffers: _Buffers
) -> Tensor:
    """The skew of a block's product with ``rows`` (``[b, g, n_rows, >= rows.width]``, see
    :meth:`_Rows.logits`) over all ``n_rows + n_k - 1`` offsets of the block, ``fill`` in
    the columns it does not cover (from ``lo``): ``[b, g, n_rows, n_k]``, a view of the
    product itself where it covers them all."""
    width = logits.shape[-2] + n_k - 1
    if rows.width < width:
        logits = _widen(logits[..., : rows.width], width, lo, fill, buffers)
    return skew_rows(logits, n_k)  # [b, g, n_rows, n_k], a view


def _offset_rows(
    rows: Tensor | tuple[Tensor, Tensor] | None,
) -> tuple[Tensor, Tensor | None] | None:
    """An ``offset_term`` / ``offset_value`` result as ``(table, index or None)``."""
    if rows is None or isinstance(rows, tuple):
        return rows
    return rows, None


def _same_index(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and torch.equal(a, b)


def _expand_rows(table: Tensor, index: Tensor | None) -> Tensor:
    """The rows ``[(h,) W, d]`` themselves: ``table[..., index, :]``."""
    return table if index is None else table[..., index, :]  # a scheme's own index
