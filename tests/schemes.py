"""Every in-attention scheme, built for a given shape: the registry the cross-scheme tests use.

Each entry: name -> Entry(factory(heads, head_dim, max_len, grid), properties).
``grid`` is an ``(H, W)`` whose cells cover ``max_len`` for the 2-D schemes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import posenc


@dataclass(frozen=True)
class Entry:
    build: Callable[[int, int, int, tuple[int, int]], Any]
    relative: bool = True  # output unchanged when every position moves by the same amount
    two_d: bool = False  # positions are flat indices of a 2-D grid
    learned: bool = True  # has parameters that must receive gradients
    flex: bool = False  # test the compiled flex path (few: each compiles for ~15 s)


SCHEMES: dict[str, Entry] = {
    "rotary": Entry(lambda h, d, n, g: posenc.Rotary(d), learned=False, flex=True),
    "rotary-interleaved": Entry(
        lambda h, d, n, g: posenc.Rotary(d, interleaved=True), learned=False
    ),
    "rotary-partial": Entry(lambda h, d, n, g: posenc.Rotary(d, rotary_dim=d // 2), learned=False),
    "alibi": Entry(lambda h, d, n, g: posenc.ALiBi(h), learned=False, flex=True),
    "t5": Entry(lambda h, d, n, g: posenc.T5RelativeBias(h, num_buckets=8, max_distance=16)),
    "t5-decoder": Entry(
        lambda h, d, n, g: posenc.T5RelativeBias(
            h, num_buckets=8, max_distance=16, bidirectional=False
        )
    ),
    "swin-1d": Entry(lambda h, d, n, g: posenc.RelativePositionBias(n, h)),
    "swin-2d": Entry(
        lambda h, d, n, g: posenc.RelativePositionBias(g, h), relative=False, two_d=True, flex=True
    ),
    "relative": Entry(lambda h, d, n, g: posenc.RelativeQueryEmbedding(n, d)),
    "relative-per-head": Entry(lambda h, d, n, g: posenc.RelativeQueryEmbedding(n, d, heads=h)),
    "relative-2d": Entry(
        lambda h, d, n, g: posenc.RelativeQueryEmbedding2D(g, d), relative=False, two_d=True
    ),
    "absolute-query": Entry(lambda h, d, n, g: posenc.AbsoluteQueryEmbedding(n, d), relative=False),
    "shaw": Entry(lambda h, d, n, g: posenc.ShawRelativePosition(d, 3)),
    "shaw-keys-only": Entry(lambda h, d, n, g: posenc.ShawRelativePosition(d, 3, values=False)),
    "rotary-2d": Entry(
        lambda h, d, n, g: posenc.Rotary2D(d, size=g), relative=False, two_d=True, learned=False
    ),
}
