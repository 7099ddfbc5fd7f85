"""The grid paths (engine/grid.py): the 2-D Swin table and 2-D relative embedding over whole maps."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    assert_lean_matches_math,
    assert_results_close,
    grid_rows,
    lean_and_math,
    run,
    spy_on,
)
from torch import nn

from posenc.engine import Mask, common, grid, tuning
from tolerances import logit_size


@pytest.mark.parametrize(
    ("window", "table", "grid_path"),
    [
        ((4, 6), "learned", True),
        ((5, 3), "learned", True),
        ((4, 6), "peaked", True),  # spans > BIAS_SPAN, best at offset (0, 0): raised
        ((4, 6), "off-centre", False),  # spans > BIAS_SPAN, best elsewhere: general path
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("map_rows", [1, 2, None])
def test_grid_bias_path_equals_math(
    head_groups, monkeypatch, window, table, grid_path, dtype, map_rows
):
    """A 2-D table over a whole map, no mask: the map-row engine, outputs and gradients;
    one map row a block, two (a short last block on the 5-row map), all."""
    from posenc import RelativePositionBias

    calls = spy_on(monkeypatch, grid._GridFusedAttention)
    monkeypatch.setattr(tuning, "LEAN_BLOCK_ELEMENTS", 64)
    monkeypatch.setattr(tuning, "GRID_BIAS_PAIRS", 0)
    grid_rows(monkeypatch, map_rows, *window)
    b, h, d = 2, 3, 8
    n = window[0] * window[1]
    torch.manual_seed(1)
    scheme = RelativePositionBias(window, h).to(dtype)
    with torch.no_grad():
        nn.init.normal_(scheme.table, std=2.0)
        if table != "learned":
            # -10 per unit of distance from the best offset: far keys 70 and more below it
            rows, cols = torch.meshgrid(
                torch.arange(2 * window[0] - 1), torch.arange(2 * window[1] - 1), indexing="ij"
            )
            best = (window[0] - 1, window[1] - 1) if table == "peaked" else (0, 0)
            far = (rows - best[0]).abs() + (cols - best[1]).abs()
            scheme.table.sub_(10.0 * far.flatten()[:, None].to(dtype))
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for _ in range(3))
    pos = torch.arange(n)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(n, n))
    assert bool(calls) == grid_path
    assert_results_close(grads, dtype, logit_size(q, k, scheme, pos, pos), n)


@pytest.mark.parametrize("columns", [1, 8])
def test_grid_term_path_with_the_rows_padded_or_not_equals_math(monkeypatch, columns):
    """The column term's product with the width rows padded to GEMM_COLUMNS (1: none; 8:
    the 65 offsets of a 33-wide map to 72, whose skew reads the first columns alone)."""
    from posenc import RelativeQueryEmbedding2D

    monkeypatch.setattr(tuning, "GEMM_COLUMNS", columns)
    calls = spy_on(monkeypatch, grid._GridTermAttention)
    monkeypatch.setattr(tuning, "LEAN_BLOCK_ELEMENTS", 64)
    grid_rows(monkeypatch, 1, 2, 33)
    b, h, d, n = 2, 3, 8, 66
    torch.manual_seed(1)
    scheme = RelativeQueryEmbedding2D((2, 33), d, heads=h).double()
    for table in (scheme.height, scheme.width):
        nn.init.normal_(table, std=0.5)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(n, n))
    assert calls
    assert_results_close(grads, torch.float64, logit_size(q, k, scheme, pos, pos), n)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize(("size", "std"), [((4, 6), 0.5), ((5, 3), 0.5), ((4, 6), 40.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("map_rows", [1, 2, None])
def test_grid_term_path_equals_math(head_groups, monkeypatch, per_head, size, std, dtype, map_rows):
    """2-D relative embedding over a whole map, no mask: outputs and every gradient; one map
    row a block, two (a short last block on the 5-row map), all."""
    from posenc import RelativeQueryEmbedding2D

    calls = spy_on(monkeypatch, grid._GridTermAttention)
    monkeypatch.setattr(tuning, "LEAN_BLOCK_ELEMENTS", 64)
    grid_rows(monkeypatch, map_rows, *size)
    b, h, d = 2, 3, 8
    n = size[0] * size[1]
    torch.manual_seed(1)
    scheme = RelativeQueryEmbedding2D(size, d, heads=h if per_head else None).to(dtype)
    for table in (scheme.height, scheme.width):
        nn.init.normal_(table, std=std)  # 40: the term spans > BIAS_SPAN (never clamped)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for _ in range(3))
    pos = torch.arange(n)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(n, n))
    assert calls
    # std 40: logits' terms in the hundreds, and float32 rounding of the scores with them
    assert_results_close(grads, dtype, logit_size(q, k, scheme, pos, pos), n)
    assert scheme.grid_term(pos[:, 1:], pos) is None  # not the whole map: general path


@pytest.mark.parametrize("map_rows", [1, 2, None])
def test_grid_bias_path_with_a_frozen_table(monkeypatch, map_rows):
    """A frozen 2-D table: the fused kernel's backward over blocks of whole map rows (no
    ``dS`` written out), outputs and input gradients as math's."""
    from posenc import RelativePositionBias

    calls = spy_on(monkeypatch, grid._GridFusedAttention)
    fused_backward = []
    backward = common._flash_cpu_backward
    monkeypatch.setattr(
        common,
        "_flash_cpu_backward",
        lambda *a, **kw: fused_backward.append(a[1].shape[2]) or backward(*a, **kw),
    )
    monkeypatch.setattr(tuning, "LEAN_BLOCK_ELEMENTS", 64)
    monkeypatch.setattr(tuning, "GRID_BIAS_PAIRS", 0)
    monkeypatch.setattr(common, "_head_groups", lambda b, h: [slice(i, i + 1) for i in range(h)])
    b, h, d, window = 2, 3, 8, (5, 3)
    grid_rows(monkeypatch, map_rows, *window)
    torch.manual_seed(1)
    scheme = RelativePositionBias(window, h).double().requires_grad_(False)
    with torch.no_grad():
        nn.init.normal_(scheme.table, std=2.0)
    assert_lean_matches_math(scheme, b, h, 15, d)
    assert calls
    # queries per kernel backward call: whole map rows, the last block short
    expected = {1: {3}, 2: {6, 3}, None: {15}}[map_rows]
    assert set(fused_backward) == expected


def test_grid_paths_by_size(monkeypatch):
    """A 2-D bias takes its grid path from GRID_BIAS_PAIRS query-key pairs per head (below,
    the general engine's one block is faster); a 2-D term at any size."""
    from posenc import RelativePositionBias, RelativeQueryEmbedding2D

    monkeypatch.setattr(tuning, "MATERIALISED_SCORES", 0)  # the lean paths at any size
    bias_calls = spy_on(monkeypatch, grid._GridFusedAttention)
    term_calls = spy_on(monkeypatch, grid._GridTermAttention)
    q, k, v = (torch.randn(2, 3, 24, 8) for _ in range(3))
    pos = torch.arange(24)[None]
    bias, term = RelativePositionBias((4, 6), 3), RelativeQueryEmbedding2D((4, 6), 8)
    for pairs, taken in ((24 * 24 + 1, 0), (24 * 24, 1)):
        monkeypatch.setattr(tuning, "GRID_BIAS_PAIRS", pairs)
        bias_calls.clear()
        with torch.no_grad():
            run("auto", bias, q, k, v, pos, pos, Mask(24, 24))
        assert len(bias_calls) == taken
    with torch.no_grad():
        run("auto", term, q, k, v, pos, pos, Mask(24, 24))
    assert term_calls


@pytest.mark.parametrize("learn", [True, False])
def test_grid_bias_buffers_stay_within_their_budget(monkeypatch, learn):
    """Every :class:`_GridBias` buffer, forward and backward (learned or frozen table, with
    head groups of two), holds at most ``GRID_BUFFER_ELEMENTS`` values."""
    from posenc import RelativePositionBias

    sizes = []
    init = grid._GridBias.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sizes.append(self.buffer.numel())

    monkeypatch.setattr(grid._GridBias, "__init__", spy)
    monkeypatch.setattr(tuning, "LEAN_BLOCK_ELEMENTS", 64)
    monkeypatch.setattr(tuning, "GRID_BIAS_PAIRS", 0)
    monkeypatch.setattr(common, "_head_groups", lambda b, h: [slice(0, 2), slice(2, 3)])
    budget = 3 * grid._GridBias.copy_size(5, 3)  # three map rows of one head
    monkeypatch.setattr(tuning, "GRID_BUFFER_ELEMENTS", budget)
    torch.manual_seed(0)
    scheme = RelativePositionBias((5, 3), 3).double().requires_grad_(learn)
    assert_lean_matches_math(scheme, 2, 3, 15, 8)
    assert sizes and max(sizes) <= budget


def test_grid_bias_is_the_score_bias_by_offsets():
    from posenc import RelativePositionBias

    scheme = RelativePositionBias((3, 4), 2)
    pos = torch.arange(12)[None]
    grid = scheme.grid_bias(pos, pos)  # [h, 5, 7]
    bias = scheme.score_bias(pos, pos)[0]  # [h, 12, 12]
    for i in range(12):
        for j in range(12):
            dr, dc = j // 4 - i // 4, j % 4 - i % 4
            torch.testing.assert_close(grid[:, dr + 2, dc + 3], bias[:, i, j], rtol=0, atol=0)
    assert scheme.grid_bias(pos[:, :6], pos) is None  # not the whole map
    assert scheme.grid_bias(pos.flip(-1), pos) is None  # not in order
    assert RelativePositionBias(12, 2).grid_bias(pos, pos) is None  # 1-D


def test_grid_kernel_values_ask_for_the_span_only_when_a_head_spreads():
    """The span reads every query and key: asked for only when some head's biases spread
    over more than ``BIAS_SPAN``, and then the far ones are raised to it below the best."""
    from posenc.engine.grid import _grid_kernel_values

    asked = []

    def span() -> float:
        asked.append(1)
        return tuning.BIAS_SPAN + 10.0

    grid = torch.zeros(2, 3, 3)  # [h, 2H-1, 2W-1]: best at the centre, offset (0, 0)
    grid[0, 0, 0] = -tuning.BIAS_SPAN
    torch.testing.assert_close(_grid_kernel_values(grid, span), grid, rtol=0, atol=0)
    assert not asked
    grid[0, 0, 0] = -tuning.BIAS_SPAN - 20.0
    raised = _grid_kernel_values(grid, span)
    assert asked
    assert raised is not None and float(raised[0, 0, 0]) == -tuning.BIAS_SPAN - 10.0
    torch.testing.assert_close(raised[1], grid[1], rtol=0, atol=0)
