"""The dispatcher (engine/dispatch.py): which path auto takes, and inputs in any layout."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    TableBias,
    ValueTable,
    block_rows,
    lean_and_math,
    offset_rows,
    spy_on,
)
from torch import nn

from posenc.engine import Mask, attend, explain_call, grid, offset_bias, offset_term, tuning


@pytest.mark.parametrize("name", ["t5", "relative", "shaw", "swin-2d", "relative-2d"])
def test_fast_paths_take_inputs_in_projection_layout(monkeypatch, name):
    """q, k, v as a projection gives them, ``[b, n, h, d]`` viewed as ``[b, h, n, d]`` (not
    contiguous): every fast path with a written-out backward, outputs and gradients."""
    from posenc import (
        RelativePositionBias,
        RelativeQueryEmbedding,
        RelativeQueryEmbedding2D,
        ShawRelativePosition,
        T5RelativeBias,
    )

    b, h, d, n = 2, 3, 8, 24
    engine, scheme = {
        "t5": (
            offset_bias._OffsetFusedAttention,
            lambda: T5RelativeBias(h, num_buckets=8, max_distance=16),
        ),
        "relative": (offset_term._OffsetTermAttention, lambda: RelativeQueryEmbedding(n, d)),
        "shaw": (offset_term._OffsetTermAttention, lambda: ShawRelativePosition(d, 3)),
        "swin-2d": (grid._GridFusedAttention, lambda: RelativePositionBias((4, 6), h)),
        "relative-2d": (grid._GridTermAttention, lambda: RelativeQueryEmbedding2D((4, 6), d)),
    }[name]
    calls = spy_on(monkeypatch, engine)
    monkeypatch.setattr(tuning, "FAR_PAIRS", 0)  # Shaw's far parts too
    monkeypatch.setattr(tuning, "GRID_BIAS_PAIRS", 0)  # the 2-D bias's gate
    block_rows(monkeypatch, 5)
    offset_rows(monkeypatch, 5, b, n, n)
    torch.manual_seed(1)
    scheme = scheme().double()
    for p in scheme.parameters():
        nn.init.normal_(p, std=1.0)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float64).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    pos = torch.arange(n)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(n, n))
    assert calls
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a)


def test_auto_choice():
    """auto: SDPA with nothing positional (or with dropout), the lean engine for a bias or a
    value term, the math reference for a value term with dropout."""
    pos = torch.arange(4)[None]
    q = torch.zeros(1, 1, 4, 2)

    def path(scheme, dropout_p=0.0):
        args = dict(scheme=scheme, q_pos=pos, k_pos=pos, mask=Mask(4, 4), dropout_p=dropout_p)
        return explain_call(q, q, q, **args).path

    assert path(None) == "sdpa"
    assert path(TableBias(1)) == "lean-fused"
    assert path(ValueTable(2)) == "lean"
    assert path(TableBias(1), dropout_p=0.1) == "sdpa"
    assert path(ValueTable(2), dropout_p=0.1) == "math"
    with pytest.raises(ValueError, match="backend='lean' has no attention dropout"):
        attend(
            q,
            q,
            q,
            scheme=None,
            q_pos=pos,
            k_pos=pos,
            mask=Mask(4, 4),
            backend="lean",
            dropout_p=0.5,
        )
