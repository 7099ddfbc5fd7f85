"""posenc.engine.reference: the attention formula op by op, which writes into its own scores
where that gives the same values."""

from __future__ import annotations

import torch

from posenc.engine import Mask, attend
from posenc.engine.reference import _plus


def test_plus_writes_into_the_scores_only_where_the_sum_is_the_same_tensor():
    scores = torch.zeros(2, 3, 4, 5)
    assert _plus(scores, torch.ones(3, 1, 5), own=True) is scores
    assert bool((scores == 1).all())
    wider = _plus(scores, torch.ones(3, 1, 5, dtype=torch.float64), own=True)
    assert wider.dtype == torch.float64 and bool((scores == 1).all())  # promoted, untouched
    larger = _plus(torch.zeros(1, 3, 4, 5), torch.ones(2, 3, 4, 5), own=True)
    assert larger.shape == (2, 3, 4, 5)
    assert _plus(scores, torch.ones(5), own=False) is not scores
    assert bool((scores == 1).all())


class HeldBias:
    """A bias per clipped offset from a table it is handed ``[h, 9]``."""

    def __init__(self, table):
        self.table = table

    def score_bias(self, q_pos, k_pos):
        offsets = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-4, 4) + 4  # [B', n_q, n_k]
        return self.table[:, offsets].transpose(0, 1)  # [B', h, n_q, n_k]


def test_the_formula_under_vmap_over_a_table_equals_a_loop():
    """vmap over the bias's table with q, k, v shared: the scores are not batched, the bias
    is, so the formula must not write the bias into them (vmap cannot)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    tables = torch.randn(3, 2, 9, dtype=torch.float64)
    pos = torch.arange(6)[None]

    def run(table):
        mask = Mask(6, 6, causal=True)
        return attend(q, k, v, scheme=HeldBias(table), q_pos=pos, k_pos=pos, mask=mask,
                      backend="math")[0]  # fmt: skip

    batched = torch.func.vmap(run)(tables)
    looped = torch.stack([run(t) for t in tables])
    torch.testing.assert_close(batched, looped, rtol=1e-12, atol=1e-12)
