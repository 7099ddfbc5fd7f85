"""The general memory-lean engine: blocks of query rows, only the log-sum-exp kept for the
backward (as FlashAttention), on the fused CPU kernels where they run.

Each block's scores are built with the scheme's hooks, soft-maxed and multiplied by ``v``
(and the value term). The backward recomputes each block from ``q, k, v`` and the
log-sum-exp and takes the gradients of the hooks' tables with one local autograd call per
block. Peak memory is ``O(block * n_k)``, not ``O(n_q * n_k)``.

Shape legend: ``b`` batch, ``h`` heads, ``g`` a head group, ``rows`` a block's queries,
``n_q`` queries, ``n_k`` keys, ``d`` head dim; positions ``[B', n]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..hooks import Hooks
from . import common
from .common import (
    _block_grads,
    _exp_no_denormals,
    _group_masks,
    _heads_of,
    _KeyGrads,
    _sum_into,
    _sum_to,
    _visible,
)
from .mask import Mask
from .reference import _fold_scores, _wide


def _block_scores(
    q_blk: Tensor,
    k: Tensor,
    extra: Tensor | None,
    keep: Tensor | None,
    scale: float,
) -> Tensor:
    """``(q k^T) * scale + extra`` for one block, masked keys at the most negative value.

    ``extra`` is the block's ``score_term * scale + score_bias`` (float32 or wider).
    """
    scores = ((q_blk * scale) @ k.transpose(-2, -1)).to(_wide(q_blk.dtype))  # [b, h, rows, n_k]
    if extra is not None:
        scores = scores.add_(extra)
    if keep is not None:
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    return scores


def _add_grads(total: list[Tensor | None], grads: tuple[Tensor | None, ...]) -> None:
    """Add one block's gradients of the hooks' tensors into ``total`` (None where none has
    reached a tensor yet, as autograd leaves a tensor no gradient reaches)."""
    for i, g in enumerate(grads):
        if g is not None:
            total[i] = g.clone() if total[i] is None else total[i].add_(g)  # g may be a buffer


class _LeanAttention(torch.autograd.Function):
    """Blocked attention that keeps only the log-sum-exp for the backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        hooks: Hooks,
        q_pos: Tensor,
        k_pos: Tensor,
        mask: Mask,
        scale: float,
        rows: int,
        span: float,
        *params: Tensor,
    ) -> Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))  # [b, h, n_q, d_v]
        lse = torch.empty(q.shape[:-1], dtype=_wide(q.dtype), device=q.device)  # [b, h, n_q]
        for start in range(0, q.shape[2], rows):
            blk = slice(start, min(start + rows, q.shape[2]))
            q_blk, qp = q[:, :, blk], q_pos[:, blk]
            extra = _fold_scores(
                hooks, q_blk, qp, k_pos, scale, reference=False, mask=mask, rows=blk
            )
            keep = mask.shared_keep(blk, device=q.device)
            scores = _block_scores(q_blk, k, extra, keep, scale)
            block_lse = scores.logsumexp(dim=-1, keepdim=True)  # [b, h, rows, 1]
            probs = _exp_no_denormals(scores.sub_(block_lse))
            if keep is not None:
                probs = probs.mul_(keep.any(dim=-1, keepdim=True))
            probs = probs.to(v.dtype)
            out_blk = probs @ v
            if hooks.value_term is not None:
                out_blk = out_blk + hooks.value_term(probs, qp, k_pos)
            out[:, :, blk] = out_blk
            lse[:, :, blk] = block_lse.squeeze(-1)
        ctx.save_for_backward(q, k, v, out, q_pos, k_pos, lse, *params)
        ctx.hooks, ctx.mask, ctx.scale, ctx.rows = hooks, mask, scale, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, q_pos, k_pos, lse, *params = ctx.saved_tensors
        hooks, mask, scale, rows = ctx.hooks, ctx.mask, ctx.scale, ctx.rows
        grad_q = torch.zeros_like(q)
        grad_k = torch.zeros(k.shape, dtype=_wide(k.dtype), device=k.device)
        grad_v = torch.zeros(v.shape, dtype=_wide(v.dtype), device=v.device)
        grad_params: list[Tensor | None] = [None] * len(params)  # None: no gradient reached it
        has_hooks = hooks.score_term is not None or hooks.score_bias is not None
        for start in range(0, q.shape[2], rows):
            blk = slice(start, min(start + rows, q.shape[2]))
            qp, g_out = q_pos[:, blk], grad_out[:, :, blk]
            q_blk = q[:, :, blk].detach().requires_grad_(hooks.score_term is not None)
            with torch.enable_grad():
                extra = _fold_scores(
                    hooks, q_blk, qp, k_pos, scale, reference=False, mask=mask, rows=blk
                )
            keep = mask.shared_keep(blk, device=q.device)
            scores = _block_scores(
                q_blk.detach(), k, None if extra is None else extra.detach(), keep, scale
            )
            probs = _exp_no_denormals(scores.sub_(lse[:, :, blk, None]))
            if keep is not None:
                probs = probs.mul_(keep.any(dim=-1, keepdim=True))
            wide = _wide(q.dtype)
            grad_probs = (g_out @ v.transpose(-2, -1)).to(wide)  # [b, h, rows, n_k]
            value_out = None
            if hooks.value_term is not None:
                probs_leaf = probs.to(v.dtype).requires_grad_()
                with torch.enable_grad():
                    value_out = hooks.value_term(probs_leaf, qp, k_pos)
                outputs, wrt = [value_out], [probs_leaf, *params]
                grads = torch.autograd.grad(outputs, wrt, [g_out], allow_unused=True)
                grad_probs = grad_probs + grads[0].to(wide)
                _add_grads(grad_params, grads[1:])
            grad_v += probs.transpose(-2, -1) @ g_out.to(wide)
            # sum_j P_ij dP_ij = dO_i . O_i (FlashAttention's D), O(rows * d) not O(rows * n_k)
            row_dot = (g_out.to(wide) * out[:, :, blk].to(wide)).sum(dim=-1, keepdim=True)
            grad_scores = probs.mul_(grad_probs.sub_(row_dot))  # dL/d(scaled scores)
            gs = grad_scores.to(q.dtype)
            grad_q[:, :, blk] = (gs @ k) * scale
            grad_k += (gs.transpose(-2, -1) @ q_blk.detach()).to(wide) * scale
            if has_hooks and extra is not None and extra.requires_grad:
                wrt = ([q_blk] if hooks.score_term is not None else []) + list(params)
                grad_extra = _sum_to(grad_scores, extra.shape)  # undo the broadcast of [B', h|1]
                grads = torch.autograd.grad([extra], wrt, [grad_extra], allow_unused=True)
                if hooks.score_term is not None:
                    if grads[0] is not None:  # a term that reads q only as an index: none
                        grad_q[:, :, blk] += grads[0]
                    grads = grads[1:]
                _add_grads(grad_params, grads)
        return (
            grad_q,
            grad_k.to(k.dtype),
            grad_v.to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            *grad_params,
        )


class _LeanFusedAttention(torch.autograd.Function):
    """The lean engine on PyTorch's fused CPU flash kernels, a block of rows and heads at a time.

    For each block of query rows the hooks' term is built once for all heads; the fused
    kernel then runs head group by head group with it as the additive mask. The backward of
    a scheme with nothing to differentiate (ALiBi) is the fused backward. When the term has
    a gradient (a learned table, or a score term that depends on ``q``), the block's
    backward is written out instead (the same five products as the kernel's), because it
    yields ``dS = P (dP - D)``, which one autograd call through the hooks turns into the
    table's and ``q``'s gradients.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        hooks: Hooks,
        q_pos: Tensor,
        k_pos: Tensor,
        mask: Mask,
        scale: float,
        rows: int,
        span: float,
        *params: Tensor,
    ) -> Tensor:
        out = torch.empty_like(q)  # [b, h, n_q, d]
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)  # [b, h, n_q]
        groups = common._head_groups(q.shape[0], q.shape[1])
        for start in range(0, q.shape[2], rows):
            blk = slice(start, min(start + rows, q.shape[2]))
            keep, has_key = _visible(mask, blk, q.device)
            extra = _fold_scores(
                hooks, q[:, :, blk], q_pos[:, blk], k_pos, scale, reference=False, mask=mask,
                rows=blk,
            )  # fmt: skip
            for hs, attn_mask in _group_masks(extra, keep, groups, q, span):
                out_blk, lse_blk = common._flash_cpu(
                    q[:, hs, blk], k[:, hs], v[:, hs], 0.0, False, attn_mask=attn_mask, scale=scale
                )  # [b, g, rows, d], [b, g, rows]
                out[:, hs, blk] = out_blk if has_key is None else out_blk * _heads_of(has_key, hs)
                lse[:, hs, blk] = lse_blk
        ctx.save_for_backward(q, k, v, out, q_pos, k_pos, lse, *params)
        ctx.hooks, ctx.mask, ctx.scale, ctx.rows, ctx.span = hooks, mask, scale, rows, span
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, q_pos, k_pos, lse, *params = ctx.saved_tensors
        hooks, mask, scale, rows, span = ctx.hooks, ctx.mask, ctx.scale, ctx.rows, ctx.span
        grad_q = torch.empty_like(q)
        grad_params: list[Tensor | None] = [None] * len(params)  # None: no gradient reached it
        grad_out = grad_out.contiguous()
        groups = common._head_groups(q.shape[0], q.shape[1])
        key_grads = _KeyGrads(k, v, groups)
        for start in range(0, q.shape[2], rows):
            blk = slice(start, min(start + rows, q.shape[2]))
            qp = q_pos[:, blk]
            q_blk = q[:, :, blk].detach().requires_grad_(hooks.score_term is not None)
            keep, has_key = _visible(mask, blk, q.device)
            with torch.enable_grad():
                extra = _fold_scores(
                    hooks, q_blk, qp, k_pos, scale, reference=False, mask=mask, rows=blk
                )
            g_out = grad_out[:, :, blk]
            if has_key is not None:
                g_out = g_out * has_key  # rows with no key contribute nothing
            learn = extra is not None and extra.requires_grad
            # every head group writes its heads of dS once (or, for a term shared by the
            # heads, adds to it): no zero fill needed
            grad_extra = torch.empty_like(extra) if learn else None
            term = None if extra is None else extra.detach()
            for hs, attn_mask in _group_masks(term, keep, groups, q, span):
                qh, kh, vh = q[:, hs, blk], k[:, hs], v[:, hs]  # [b, g, rows | n_k, d]
                gh, oh, lh = g_out[:, hs], out[:, hs, blk], lse[:, hs, blk]
                gq, _, grad_s = _block_grads(
                    qh, kh, vh, gh, oh, lh, attn_mask, scale, key_grads.of(hs),
                    need_ds=grad_extra is not None,
                )  # fmt: skip
                grad_q[:, hs, blk] = gq
                if grad_extra is None:  # the fused backward: nothing more to add
                    continue
                # dS summed over what the term broadcast: [B'|1, g|1, rows, n_k]
                if grad_extra.shape[1] == 1 and hs.start > 0:
                    grad_extra.add_(_sum_to(grad_s, grad_extra.shape))
                else:
                    _sum_into(_heads_of(grad_extra, hs), grad_s)
            if grad_extra is None:
                continue
            wrt = ([q_blk] if hooks.score_term is not None else []) + list(params)
            grads = torch.autograd.grad([extra], wrt, [grad_extra], allow_unused=True)
            if hooks.score_term is not None:
                if grads[0] is not None:  # a term that reads q only as an index: none
                    grad_q[:, :, blk] += grads[0]
                grads = grads[1:]
            _add_grads(grad_params, grads)
        grad_k, grad_v = key_grads.result()
        return (grad_q, grad_k, grad_v, None, None, None, None, None, None, None, *grad_params)
