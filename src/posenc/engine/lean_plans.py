"""The lean engine's paths' plans: the per-offset term and bias, the 2-D term and bias over a
whole map, and the general lean engine (fused or not); :mod:`.dispatch` walks them after
the materialised path (:mod:`.plans`).

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim;
positions ``[B', n]`` with ``B'`` 1 or ``b``.
"""

from __future__ import annotations

import math

import torch

from . import common, tuning
from .common import _bias_span, _dense_last
from .grid import _grid_kernel_values, _GridFusedAttention, _GridTermAttention
from .lean import _LeanAttention, _LeanFusedAttention
from .offset_bias import _offset_kernel_values, _OffsetFusedAttention
from .offset_term import _expand_rows, _offset_rows, _OffsetTermAttention, _same_index
from .plans import _CONTEXTUAL, Call, Plan, _refusal


def _plan_offset_term(call: Call) -> Plan:
    hooks = call.hooks
    why = _refusal(
        call, "offset_term", "a query term per offset j - i", "score_bias", causal_ok=True,
        value_ok=True,
    )  # fmt: skip
    if why is not None:
        return why
    if hooks.value_term is not None and hooks.offset_value is None:
        return "a value term with no offset_value"
    term = _offset_rows(hooks.offset_term(call.q_pos, call.k_pos))
    value = None
    if hooks.value_term is not None:
        value = _offset_rows(hooks.offset_value(call.q_pos, call.k_pos))
    if term is None or (hooks.value_term is not None and value is None):
        return "positions that are not one consecutive run"
    q, k, v = _dense_last(call.q, call.k, call.v)
    (table, index), value_table = term, None
    if value is not None:
        value_table, value_index = value
        if not _same_index(index, value_index):  # use the rows themselves
            table, value_table = _expand_rows(table, index), _expand_rows(*value)
            index = None
    table = table.to(q.dtype)  # [(h,) R | n_q + n_k - 1, d]
    value_table = None if value_table is None else value_table.to(q.dtype)
    rows = _block_rows(call)
    return lambda: _OffsetTermAttention.apply(
        q, k, v, table, value_table, index, call.scale, rows, call.mask.causal
    )


def _plan_grid_term(call: Call) -> Plan:
    hooks = call.hooks
    why = _refusal(call, "grid_term", "a 2-D query term", "score_bias", causal_ok=False)
    if why is not None:
        return why
    tables = hooks.grid_term(call.q_pos, call.k_pos)
    if tables is None:
        return "queries and keys that are not one whole map in order"
    q, k, v = _dense_last(call.q, call.k, call.v)
    height, width = (t.to(q.dtype) for t in tables)
    return lambda: _GridTermAttention.apply(q, k, v, height, width, call.scale)


def _plan_grid_bias(call: Call) -> Plan:
    hooks = call.hooks
    why = _refusal(call, "grid_bias", "a 2-D bias per offset", "score_term", causal_ok=False)
    if why is not None:
        return why
    if call.q.shape[2] * call.k.shape[2] < tuning.GRID_BIAS_PAIRS:
        return f"fewer than GRID_BIAS_PAIRS = {tuning.GRID_BIAS_PAIRS} query-key pairs"
    grid = hooks.grid_bias(call.q_pos, call.k_pos)
    if grid is None:
        return "queries and keys that are not one whole map in order"
    grid = grid.to(call.q.dtype)  # [h, 2H-1, 2W-1]
    kernel_grid = _grid_kernel_values(grid, lambda: _bias_span(call.q, call.k, call.scale))
    if kernel_grid is None:
        return "a bias spanning more than its span whose best is not at offset (0, 0)"
    q, k, v = _dense_last(call.q, call.k, call.v)
    return lambda: _GridFusedAttention.apply(q, k, v, grid, kernel_grid, call.scale)


def _plan_offset_bias(call: Call) -> Plan:
    hooks = call.hooks
    why = _refusal(call, "offset_bias", "a bias per offset j - i", "score_term", causal_ok=True)
    if why is not None:
        return why
    values = hooks.offset_bias(call.q_pos, call.k_pos)
    if values is None:
        return "positions that are not one consecutive run"
    values = values.to(call.q.dtype)  # [h|1, n_q + n_k - 1]
    n_q, n_k = call.q.shape[2], call.k.shape[2]
    kernel_values = _offset_kernel_values(
        values, n_q, n_k, lambda: _bias_span(call.q, call.k, call.scale), causal=call.mask.causal
    )
    if kernel_values is None:
        return "a bias spanning more than its span where some query misses its best offset"
    q, k, v = _dense_last(call.q, call.k, call.v)
    keep = not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, values)))
    return lambda: _OffsetFusedAttention.apply(
        q, k, v, values, kernel_values, call.scale, call.mask.causal, keep
    )


def _block_rows(call: Call) -> int:
    """Query rows per block: the hooks' term ``[B', h, rows, n_k]`` has ``B' = 1`` for a bias
    shared by the batch."""
    b, h, n_q, _ = call.q.shape
    per_batch = call.hooks.score_term is not None or call.hooks.value_term is not None
    return common.lean_block_rows(b if per_batch else call.q_pos.shape[0], h, n_q, call.k.shape[2])


def _plan_lean_fused(call: Call) -> Plan:
    hooks = call.hooks
    if hooks.contextual_term is not None:
        return _CONTEXTUAL
    if not common._fused_cpu_available(call.q, call.v, hooks):
        return (
            "the fused CPU kernels do not run here (device, dtype, values of another head "
            "dim, value term)"
        )
    q, k, v = _dense_last(call.q, call.k, call.v)
    span = math.inf if hooks.score_term is not None else _bias_span(q, k, call.scale)
    rows = _block_rows(call)
    return lambda: _LeanFusedAttention.apply(
        q, k, v, hooks, call.q_pos, call.k_pos, call.mask, call.scale, rows, span, *call.params
    )


def _plan_lean(call: Call) -> Plan:
    if call.hooks.contextual_term is not None:
        return _CONTEXTUAL
    rows = _block_rows(call)
    return lambda: _LeanAttention.apply(
        call.q, call.k, call.v, call.hooks, call.q_pos, call.k_pos, call.mask, call.scale,
        rows, math.inf, *call.params,
    )  # fmt: skip
