"""Print the Markdown table of docs/schemes.md: every scheme of the registry, measured.

Run: ``.venv/bin/python tools/schemes_table.py``, and paste its output over the table in
docs/schemes.md. tests/test_schemes_table.py checks that the table there is what this
prints today, so the doc cannot drift from the code: the class, the place, the parameters
and the fast path are read from the schemes themselves, and "past the built length" is
tried, not claimed. Only the papers are written here by hand (:data:`PAPERS`), one per
class; a class of the registry with no paper fails the test.

Shape legend: ``h`` heads, ``d`` head dim, ``n`` tokens, ``H x W`` a grid.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import math

import torch

import posenc
from posenc import registry

#: the sizes every scheme is built for in the table: 8 heads of 64, 256 tokens, a 16 x 16 map
SHAPE = registry.Shape(heads=8, head_dim=64, max_len=256, grid=(16, 16))
#: the 1-D sequence and the 2-D map on which the fast path is read
PATH_TOKENS, PATH_GRID = 2048, (32, 32)
#: what the schemes are built for where the path is read
PATH_SHAPE = registry.Shape(heads=8, head_dim=64, max_len=PATH_TOKENS, grid=PATH_GRID)

#: class -> the paper it implements (authors, year, title)
PAPERS = {
    "SinusoidalEncoding": "Vaswani et al. 2017, Attention Is All You Need",
    "LearnedEncoding": "Gehring et al. 2017 (ConvS2S); BERT, GPT",
    "SinusoidalEncoding2D": "Dosovitskiy et al. 2021 (ViT); He et al. 2022 (MAE)",
    "Rotary": "Su et al. 2021, RoFormer (RoPE)",
    "Rotary2D": "Heo et al. 2024, Rotary Position Embedding for Vision Transformer (axial)",
    "ALiBi": "Press et al. 2022, Train Short, Test Long (ALiBi)",
    "KerpleBias": "Chi et al. 2022, KERPLE",
    "T5RelativeBias": "Raffel et al. 2020, T5",
    "RelativePositionBias1D": "Liu et al. 2021, Swin Transformer (its table, on one axis)",
    "RelativePositionBias2D": "Liu et al. 2021, Swin Transformer",
    "RelativeQueryEmbedding": "Huang et al. 2018, Music Transformer (the skew); Dai et al. 2019",
    "RelativeQueryEmbedding2D": "Ramachandran et al. 2019 (SASA); Srinivas et al. 2021 (BoTNet)",
    "AbsoluteQueryEmbedding": "Huang et al. 2020, Improve Transformer Models with Better "
    "Relative Position Embeddings (method 2's absolute form)",
    "ShawRelativePosition": "Shaw et al. 2018, Self-Attention with Relative Position "
    "Representations",
    "XPos": "Sun et al. 2022, A Length-Extrapolatable Transformer (xPos)",
    "SandwichBias": "Chi et al. 2023, Dissecting Transformer Length Extrapolation (Sandwich)",
    "FIREBias": "Li et al. 2023, Functional Interpolation for Relative Positions (FIRE)",
    "CoPE": "Golovneva et al. 2024, Contextual Position Encoding (CoPE)",
    "ContinuousPositionBias": "Liu et al. 2022, Swin Transformer V2 (log-spaced CPB)",
    "RotaryMixed": "Heo et al. 2024, Rotary Position Embedding for Vision Transformer (Mixed)",
    "RotaryND": "axial N-D RoPE; Wang et al. 2024, Qwen2-VL (M-RoPE)",
}

_HEADER = (
    "| name | class | place | parameters (h=8, d=64, 256 tokens, 16x16) | relative "
    "| past the built length | `auto` path (n=2048 causal; 32x32 map) | paper |\n"
    "|---|---|---|---|---|---|---|---|"
)


def _parameters(scheme: object) -> str:
    """``name [shape]`` of each learned tensor, or "none"."""
    if not isinstance(scheme, torch.nn.Module):
        return "none"
    found = [f"`{n}` {list(p.shape)}" for n, p in scheme.named_parameters()]
    return ", ".join(found) if found else "none"


def _tokens(entry: registry.Entry, grid: tuple[int, int]) -> int:
    return math.prod(grid) if entry.two_d else PATH_TOKENS


def _inputs(n: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(1, SHAPE.heads, n, SHAPE.head_dim, generator=generator) for _ in range(3)
    )  # [b, h, n, d] each


def _resize(scheme: object, grid: tuple[int, int]) -> None:
    """Point a 2-D scheme that takes a size per call (in ``forward``, or a settable
    ``size``) at ``grid``: its attention hook reads ``.size``. A scheme sized by its
    tables keeps its size."""
    forward = getattr(type(scheme), "forward", None)
    per_call = forward is not None and {"size", "window"} & set(
        inspect.signature(forward).parameters
    )
    size = getattr(type(scheme), "size", None)
    if per_call or (isinstance(size, property) and size.fset is not None):
        scheme.size = grid


def _path(entry: registry.Entry, scheme: object) -> str:
    """The path ``auto`` takes: causal over 2048 tokens, or non-causal on a 32 x 32 map."""
    if not entry.inside:
        return "sdpa (no scheme inside)"
    q, k, v = _inputs(_tokens(entry, PATH_GRID))
    explained = posenc.explain(q, k, v, position=scheme, causal=not entry.two_d)
    return f"`{explained.path}`"


@torch.no_grad()
def _past_built_length(entry: registry.Entry, scheme: object) -> str:
    """Whether the scheme built for 256 tokens (a 16 x 16 map) runs at 512 (a 32 x 16 map)."""
    grid = (2 * SHAPE.grid[0], SHAPE.grid[1])
    n = math.prod(grid) if entry.two_d else 2 * SHAPE.max_len
    if scheme is None:
        return "any length"
    try:
        if entry.inside:
            _resize(scheme, grid)
            q, k, v = _inputs(n)
            posenc.attention(q, k, v, position=scheme, causal=not entry.two_d)
        else:
            shape = (1, *grid) if entry.two_d else (1, n)  # [b, H, W] or [b, n]
            scheme(torch.zeros(*shape, SHAPE.width))
    except (ValueError, IndexError):
        return "raises: its table ends"
    return "any map" if entry.two_d else "any length"


def rows() -> list[str]:
    """One Markdown row per registry entry, in the registry's order."""
    out = []
    for name, entry in registry.SCHEMES.items():
        torch.manual_seed(0)
        scheme = entry.build(SHAPE)
        cls = "none" if scheme is None else type(scheme).__name__
        paper = "" if scheme is None else PAPERS[cls]
        place = f"{entry.place}: {registry.PLACES[entry.place]}"
        relative = "yes" if entry.relative else "no"
        past = _past_built_length(entry, entry.build(SHAPE))
        cells = [f"`{name}`", f"`{cls}`" if scheme is not None else "-", place]
        torch.manual_seed(0)
        path = _path(entry, entry.build(PATH_SHAPE))
        cells += [_parameters(scheme), relative, past, path, paper]
        out.append("| " + " | ".join(cells) + " |")
    return out


def table() -> str:
    """The whole Markdown table."""
    with contextlib.redirect_stderr(io.StringIO()):
        return "\n".join([_HEADER, *rows()])


if __name__ == "__main__":
    print(table())
