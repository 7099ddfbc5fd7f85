"""posenc.engine.inputs: the check for non-finite values. (Grouped key/value heads and
non-finite tokens through the whole call are tested in tests/engine/test_dispatch.py.)"""

from __future__ import annotations

import pytest
import torch

from posenc.engine.inputs import finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finite_finds_one_non_finite_element_anywhere(dtype, bad):
    x, y = torch.randn(2, 3, 37, 8, dtype=dtype), torch.randn(5, dtype=dtype)
    assert finite(x, y) and finite(x, torch.empty(0, dtype=dtype)) and finite()
    for which, at in ((0, 0), (0, x.numel() // 2 + 3), (0, x.numel() - 1), (1, 4)):
        xs = [x.clone(), y.clone()]
        xs[which].view(-1)[at] = bad
        assert not finite(*xs)
        assert not finite(xs[0].transpose(-1, -2), xs[1])  # not contiguous
