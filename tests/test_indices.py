"""indices.py helpers not covered by the scheme tests: gather_rows."""

from __future__ import annotations

import pytest
import torch

from posenc.indices import gather_rows


@pytest.mark.parametrize("batch", [1, 3])
def test_gather_rows_equals_indexing_with_gradients(batch):
    torch.manual_seed(0)
    table = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)  # [rows, h]
    index = torch.randint(0, 7, (batch, 5, 6))
    out = gather_rows(table, index)
    assert out.shape == (batch, 4, 5, 6)
    for b in range(batch):
        for h in range(4):
            for i in range(5):
                for j in range(6):
                    assert out[b, h, i, j] == table[index[b, i, j], h]
    weight = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * weight).sum(), table)
    expected = torch.zeros(7, 4, dtype=torch.float64)
    for b in range(batch):
        for i in range(5):
            for j in range(6):
                expected[index[b, i, j]] += weight[b, :, i, j]
    torch.testing.assert_close(grad, expected)
    torch.autograd.gradcheck(lambda t: gather_rows(t, index), (table,))
