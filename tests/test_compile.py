"""``torch.compile(fullgraph=True)`` of every scheme inside attention, and ``torch.export``.

Every scheme of tests/schemes.py, inside :class:`~posenc.MultiHeadAttention` in eval mode,
compiles to one graph with no graph break (``fullgraph=True`` raises on a break) and gives
the eager output; a second input of the same shape reuses the graph (the guards do not
depend on the values). Under compilation ``backend="auto"`` takes ``sdpa`` (``math`` for
Shaw's value term), so this also checks those paths against the eager lean engine.

All 15 schemes are compiled, not one per place: on this 2-core CPU with a cold inductor
cache the whole file takes about 40 s (the first graph ~10 s, then 1-5 s each), well under
the 90 s budget. Compile tests of the standalone modules are in tests/test_rotary.py,
tests/test_absolute.py, tests/test_embedding.py, tests/test_shaw.py and
tests/test_attention.py (a custom scheme); they are not repeated here.

``torch.export.export`` of attention with RoPE and with ALiBi (non-strict, batch and
sequence length dynamic) gives the eager output at the traced shape and at another one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posenc import ALiBi, MultiHeadAttention, Rotary
from schemes import SCHEMES
from tolerances import assert_close, recorded_logits

pytestmark = pytest.mark.compile

HEADS, HEAD_DIM = 2, 8
DIM = HEADS * HEAD_DIM
GRID = (3, 4)
N = GRID[0] * GRID[1]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # each test compiles MultiHeadAttention.forward for another scheme: without a reset the
    # cache of that code object fills up (recompile limit) and later schemes fall back
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, N, DIM, generator=gen)
    padding = torch.zeros(2, N, dtype=torch.bool)
    padding[1, -3:] = True
    return x, padding


@pytest.mark.parametrize("name", list(SCHEMES))
def test_compile_fullgraph_every_scheme_in_attention(name):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = MultiHeadAttention(DIM, HEADS, position=SCHEMES[name].build(HEADS, HEAD_DIM, N, GRID))
    model.eval()
    compiled = torch.compile(model, fullgraph=True)
    counters.clear()
    with torch.no_grad():
        for seed in (1, 2):
            x, padding = _inputs(seed)
            got = compiled(x, key_padding_mask=padding, causal=True)
            with recorded_logits() as logits:
                expected = model(x, key_padding_mask=padding, causal=True)
            # inductor fuses and reorders the float32 sums: N keys, these logits
            assert_close(got, expected, terms=N, logit=max(logits), msg=f"seed {seed}")
    assert counters["stats"]["unique_graphs"] == 1, "one graph, reused for the second input"


class Wrapped(nn.Module):
    """Attention with explicit positions as an input (what a decoder step exports)."""

    def __init__(self, scheme: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = MultiHeadAttention(DIM, HEADS, position=scheme)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.attn(x, positions=positions, causal=True)


@pytest.mark.parametrize("scheme", [Rotary(HEAD_DIM), ALiBi(HEADS)], ids=["rotary", "alibi"])
def test_export_matches_eager(scheme):
    model = Wrapped(scheme).eval()
    x = torch.randn(2, N, DIM)
    positions = torch.arange(N) + 5
    batch = torch.export.Dim("batch", min=1, max=16)
    seq = torch.export.Dim("seq", min=2, max=256)
    program = torch.export.export(
        model,
        (x, positions),
        dynamic_shapes={"x": {0: batch, 1: seq}, "positions": {0: seq}},
    )
    exported = program.module()
    with torch.no_grad():
        with recorded_logits() as logits:
            expected = model(x, positions)
        assert_close(exported(x, positions), expected, terms=N, logit=max(logits))
        other, other_positions = torch.randn(3, 7, DIM), torch.arange(7) + 1000
        with recorded_logits() as logits:
            expected = model(other, other_positions)
        assert_close(exported(other, other_positions), expected, terms=7, logit=max(logits))
