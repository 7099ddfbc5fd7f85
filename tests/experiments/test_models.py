"""TinyTransformer: shapes, shared and per-block schemes, equivariance, training, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posenc import ALiBi, LearnedEncoding, Rotary, SinusoidalEncoding2D, T5RelativeBias
from posenc.experiments.models import TinyTransformer
from posenc.experiments.tasks import IGNORE, ShiftTask
from tolerances import assert_close, forward


def test_logits_shape_and_parameters():
    model = TinyTransformer(10, dim=16, layers=3, heads=2, num_outputs=7)
    logits = model(torch.randint(0, 10, (2, 9)))
    assert logits.shape == (2, 9, 7)
    assert len(model.blocks) == 3


def test_one_shared_scheme_or_one_per_block():
    shared = T5RelativeBias(2)
    model = TinyTransformer(10, dim=16, layers=2, heads=2, position=shared)
    assert all(block.attn.position is shared for block in model.blocks)
    # shared tables are counted once
    assert (
        sum(p.numel() for p in model.parameters())
        == sum(p.numel() for p in TinyTransformer(10, dim=16, layers=2, heads=2).parameters())
        + shared.embedding.weight.numel()
    )

    per_block = TinyTransformer(10, dim=16, layers=2, heads=2, position=lambda: T5RelativeBias(2))
    first, second = (block.attn.position for block in per_block.blocks)
    assert first is not second and isinstance(first, T5RelativeBias)


def test_without_positions_the_model_is_permutation_equivariant():
    torch.manual_seed(0)
    model = TinyTransformer(10, dim=16, heads=2).eval()
    tokens = torch.randint(0, 10, (2, 8))
    perm = torch.randperm(8)
    expected, logit = forward(model, tokens)  # 8 keys in each block (tests/tolerances.py)
    assert_close(
        model(tokens[:, perm]), expected[:, perm], terms=8 * len(model.blocks), logit=logit
    )


def test_with_positions_it_is_not():
    torch.manual_seed(0)
    model = TinyTransformer(10, dim=16, heads=2, encoding=LearnedEncoding(16, 8)).eval()
    tokens = torch.randint(0, 10, (2, 8))
    perm = torch.roll(torch.arange(8), 1)
    assert not torch.allclose(model(tokens[:, perm]), model(tokens)[:, perm], atol=1e-4)


def test_2d_encoding_needs_the_grid_size():
    model = TinyTransformer(10, dim=16, heads=2, encoding=SinusoidalEncoding2D(16))
    tokens = torch.randint(0, 10, (2, 12))
    assert model(tokens, size=(3, 4)).shape == (2, 12, 10)
    with pytest.raises(
        ValueError, match=r"needs size=\(H, W\) with H \* W = n = 12, got size=None"
    ):
        model(tokens)
    with pytest.raises(ValueError, match=r"got size=\(2, 4\)"):
        model(tokens, size=(2, 4))


def test_errors():
    with pytest.raises(TypeError, match="encoding must be an input encoding module"):
        TinyTransformer(10, encoding="sinusoidal")
    with pytest.raises(ValueError, match="vocab"):
        TinyTransformer(0)
    with pytest.raises(ValueError, match="dim must be divisible by heads"):
        TinyTransformer(10, dim=10, heads=4)


def test_attention_maps_are_distributions():
    torch.manual_seed(0)
    model = TinyTransformer(10, dim=16, layers=2, heads=2, position=ALiBi(2)).eval()
    tokens = torch.randint(0, 10, (1, 6))
    maps = model.attention_maps(tokens, causal=True)
    assert len(maps) == 2 and maps[0].shape == (1, 2, 6, 6)
    for weights in maps:
        assert_close(weights.sum(-1), torch.ones(1, 2, 6), terms=6)  # 6 weights in [0, 1]
        assert weights.triu(1).eq(0).all()  # causal


def test_the_model_learns_the_shift_task():
    torch.manual_seed(0)
    task = ShiftTask(vocab=8, delta=1)
    # (not ALiBi: its symmetric distance penalty cannot single out "one place back")
    model = TinyTransformer(8, dim=32, heads=2, position=Rotary(16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        batch = task.sample(16, 12, gen)
        loss = F.cross_entropy(
            model(batch.tokens).flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
