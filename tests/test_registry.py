"""The registry of scheme names: one vocabulary, every entry builds what its place says."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import posenc
from posenc import registry
from posenc.registry import SCHEMES, Shape

SHAPE = Shape(heads=2, head_dim=8, max_len=12, grid=(3, 4))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_entry_builds_what_its_place_says(name):
    entry = SCHEMES[name]
    built = entry.build(SHAPE)
    assert entry.place in registry.PLACES and set(entry.default_in) <= set(registry.COMMANDS)
    if entry.place == 0:
        assert built is None
    elif entry.place == 1:  # an input encoding: x + P
        x = torch.zeros(1, *((3, 4) if entry.two_d else (12,)), 16)
        assert built(x).shape == x.shape
    else:  # a scheme of MultiHeadAttention
        model = posenc.MultiHeadAttention(16, 2, position=built)
        assert model(torch.randn(1, 12, 16)).shape == (1, 12, 16)
    parameters = list(built.parameters()) if isinstance(built, nn.Module) else []
    assert entry.learned == bool(parameters), "learned: it has parameters"


def test_names_filter_and_keep_the_order():
    inside = registry.names(inside=True)
    assert inside == [n for n in SCHEMES if SCHEMES[n].place >= 2]
    assert registry.names(inside=False) == ["none", "sinusoidal", "learned", "sinusoidal-2d"]
    assert registry.names(inside=True, default_in="compare") == [
        n for n in inside if "compare" in SCHEMES[n].default_in
    ]
    assert "rotary-interleaved" not in registry.names(default_in="bench")  # a variant


def test_old_names_resolve_and_unknown_ones_are_clean_errors():
    assert registry.resolve("swin") == "swin-1d" and registry.get("swin") is SCHEMES["swin-1d"]
    assert set(registry.ALIASES.values()) <= set(SCHEMES)
    assert not set(registry.ALIASES) & set(SCHEMES)
    with pytest.raises(ValueError, match="unknown scheme 'rope'; choose from none, sinusoidal"):
        registry.resolve("rope")


def test_sizes_come_from_the_shape():
    shape = Shape(heads=3, head_dim=8, max_len=20, grid=(4, 5), train_len=6, clip=2)
    assert registry.build("learned", shape).weight.shape == (6, 24)
    assert registry.build("swin-1d", shape).table.shape == (39, 3)
    assert registry.build("shaw", shape).keys.shape == (5, 8)
    t5 = registry.build("t5", Shape(2, 8, 16, buckets=(8, 16), causal=True))
    assert (t5.num_buckets, t5.max_distance, t5.bidirectional) == (8, 16, False)
    assert registry.build("t5-decoder", SHAPE).bidirectional is False


def test_a_2d_scheme_without_a_grid_is_a_clean_error():
    with pytest.raises(ValueError, match="swin-2d is a 2-D scheme: it needs a grid"):
        registry.build("swin-2d", Shape(2, 8, 12))


def test_serves_up_to_the_longest_sequence():
    assert SCHEMES["learned"].serves(Shape(2, 8, 20, train_len=8), 8)
    assert not SCHEMES["learned"].serves(Shape(2, 8, 20, train_len=8), 9)
    assert SCHEMES["rotary"].serves(SHAPE, 10**6)


@pytest.mark.parametrize(("n", "grid"), [(12, (3, 4)), (16, (4, 4)), (7, (1, 7)), (1, (1, 1))])
def test_squarest_grid(n, grid):
    assert registry.squarest_grid(n) == grid
