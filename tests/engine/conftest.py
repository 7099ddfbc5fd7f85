"""Fixtures of the engine tests: head groups, small blocks, mask blocks at any size."""

from __future__ import annotations

import pytest

from posenc.engine import common, tuning


@pytest.fixture(params=["threads", "single", "pairs"])
def head_groups(request, monkeypatch):
    """The fused paths' head groups: as the machine's threads give, or forced to one head
    (the accumulators' one-tensor layout) or to pairs of heads, so that both group layouts
    are tested on any machine."""
    if request.param != "threads":
        size = 1 if request.param == "single" else 2
        groups = lambda b, h: [slice(s, min(s + size, h)) for s in range(0, h, size)]  # noqa: E731
        monkeypatch.setattr(common, "_head_groups", groups)
    return request.param


@pytest.fixture
def small_blocks(monkeypatch):
    """Force several blocks of rows on small inputs."""
    monkeypatch.setattr(tuning, "LEAN_BLOCK_ELEMENTS", 64)


@pytest.fixture
def blocks_at_any_size(monkeypatch):
    """Masks split into blocks whatever the size of their calls (MASK_BLOCK_PAIRS)."""
    monkeypatch.setattr(tuning, "MASK_BLOCK_PAIRS", 1)
