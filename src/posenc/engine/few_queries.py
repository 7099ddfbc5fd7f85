"""The materialised path's rules for a bias asked of few queries over more keys
(cross-attention, a few tokens decoded at once, a prompt read in chunks): the lean paths
pass over every key and value once or more per call, which few queries do not pay for
(:data:`.tuning.MATERIALISED_QUERIES_PER_SEQUENCE`; docs/performance.md, "Thirtieth
pass"). :func:`~.plans._plan_materialised` reads them.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``B'`` the
positions' batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import tuning
from .sdpa import fused_cpu_runs

if TYPE_CHECKING:
    from .plans import Call


def few_queries(call: Call) -> bool:
    """Whether the call asks a bias without gradients (no term), with no mask but the
    causal one, of fewer queries than keys, and fewer than
    :data:`.tuning.MATERIALISED_QUERIES_PER_SEQUENCE` per sequence of the batch (fewer than
    :data:`.tuning.MATERIALISED_QUERIES` in all): too few to pay for the lean paths' passes
    over the keys, so that the materialised path keeps the call past the pairs'
    crossovers (a mask that runs in blocks, :func:`~.blocks._mask_blocks`, reads only the
    keys each block sees; other masks were not measured: not here). Shapes read in eager
    code only (False while compiling: no guard on them)."""
    hooks = call.hooks
    if (
        call.grad
        or hooks.score_term is not None
        or hooks.value_term is not None
        or not call.mask.causal_at_most  # (another mask: not measured; it may run in blocks)
        or torch.compiler.is_compiling()
    ):
        return False
    b, _, n_q, _ = call.q.shape
    if n_q >= call.k.shape[2]:
        return False
    return n_q < min(tuning.MATERIALISED_QUERIES_PER_SEQUENCE * b, tuning.MATERIALISED_QUERIES)


def bias_alone_fits(call: Call) -> bool:
    """For :func:`few_queries`'s call past the scores' budget: whether SDPA's fused CPU
    kernel takes it with the bias as its float mask (:func:`~.sdpa.fused_cpu_runs`; no
    mask but the causal one, no dropout, not op by op, grad mode off: no bias that asks
    for a gradient sends SDPA to its math kernel), so that the call writes the bias
    ``[B', h, n_q, n_k]`` (``B'`` the positions' batch; float32 queries: the bias's own
    dtype, no cast; twice under the causal mask, which is folded into a copy) and no
    scores, and that is within :data:`.tuning.MATERIALISED_SCORES` or within the call's
    keys and values (``k.numel() + v.numel()``: as much as the per-offset bias path
    writes, the keys and values reversed, where it runs the call past the budget). Such a
    call keeps no route (what it reads, the kernel SDPA takes, is not in the route's
    key)."""
    sizes = _bias_alone_sizes(call)
    return sizes is not None and sizes[0] <= sizes[1]


def bias_alone_refusal(call: Call) -> str:
    """Why :func:`bias_alone_fits` refused a call SDPA's fused kernel would take with the
    bias alone, for the materialised path's reason: the bias larger than the budget and
    the keys and values (``""`` where the kernel would not take it, or it fits)."""
    sizes = _bias_alone_sizes(call)
    if sizes is None or sizes[0] <= sizes[1]:
        return ""
    written = sizes[0]
    mib = 2**20 / call.q.dtype.itemsize
    return (
        f"; the bias alone as SDPA's float mask would write {written / mib:.1f} MiB (with its "
        f"causal-masked copy), above the budget and the call's keys and values "
        f"({(call.k.numel() + call.v.numel()) / mib:.1f} MiB)"
    )


def _bias_alone_sizes(call: Call) -> tuple[int, int] | None:
    """``(written, budget)`` in elements for :func:`bias_alone_fits`, or None where SDPA's
    fused kernel would not take the call with the bias alone."""
    if call.dropout_p or not call.mask.causal_at_most or torch.is_grad_enabled():
        return None
    if call.q.dtype != torch.float32 or not fused_cpu_runs(call.q, call.k, call.v):
        return None
    if call.op_by_op:
        return None
    _, h, n_q, _ = call.q.shape
    rows = max(call.q_pos.shape[0], call.k_pos.shape[0])
    written = rows * h * n_q * call.k.shape[2] * (2 if call.mask.causal else 1)
    return written, max(tuning.MATERIALISED_SCORES, call.k.numel() + call.v.numel())
