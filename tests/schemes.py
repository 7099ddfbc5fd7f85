"""Every scheme inside attention, built at the tests' sizes: what the cross-scheme tests run.

The schemes and their properties come from :mod:`posenc.registry`, the table that the
commands read too: a scheme added there is tested here. Each entry: name ->
``Entry(build(heads, head_dim, max_len, grid), properties)``; ``grid`` is an ``(H, W)``
whose cells cover ``max_len`` for the 2-D schemes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posenc import registry

#: Shaw's clipping distance at the tests' sizes: small, so that clipping shows at n = 12
CLIP = 3
#: T5's (num_buckets, max_distance) at the tests' sizes: the log buckets start at n = 12
BUCKETS = (8, 16)
#: the schemes whose compiled flex path is tested (few: each compiles for ~15 s)
FLEX = ("rotary", "alibi", "swin-2d")
#: schemes of the registry left out, and why: each is a known defect to fix, not a choice
LEFT_OUT: dict[str, str] = {}  # registry entries the cross-scheme tests leave out, and why


@dataclass(frozen=True)
class Entry:
    build: Callable[[int, int, int, tuple[int, int]], Any]
    relative: bool = True  # output unchanged when every position moves by the same amount
    two_d: bool = False  # positions are flat indices of a 2-D grid
    learned: bool = True  # has parameters that must receive gradients
    flex: bool = False  # test the compiled flex path (few: each compiles for ~15 s)
    cache: bool = True  # decodes with a KVCache


def _entry(name: str, entry: registry.Entry) -> Entry:
    def build(heads: int, head_dim: int, max_len: int, grid: tuple[int, int]) -> Any:
        shape = registry.Shape(heads, head_dim, max_len, grid, clip=CLIP, buckets=BUCKETS)
        return entry.build(shape)

    return Entry(
        build,
        relative=entry.relative,
        two_d=entry.two_d,
        learned=entry.learned,
        flex=name in FLEX,
        cache=entry.cache,
    )


SCHEMES: dict[str, Entry] = {
    name: _entry(name, entry)
    for name, entry in registry.SCHEMES.items()
    if entry.inside and name not in LEFT_OUT
}
