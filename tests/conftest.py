"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch.nn.functional as F


@pytest.fixture
def sdpa_masks(monkeypatch):
    """``(masks, sdpa)``: every call of ``F.scaled_dot_product_attention`` (posenc's and the
    bench's floor, which both reach it through ``torch.nn.functional``) appends its
    ``attn_mask`` to ``masks``; ``sdpa`` is the function itself, for references."""
    masks = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F,
        "scaled_dot_product_attention",
        lambda *a, **kw: masks.append(kw.get("attn_mask")) or sdpa(*a, **kw),
    )
    return masks, sdpa
