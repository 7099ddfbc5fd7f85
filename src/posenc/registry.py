"""One table of every positional scheme: its name, how to build it, and what it is.

``posenc bench``, ``posenc compare``, ``posenc plot`` and the cross-scheme tests all read
:data:`SCHEMES`: a new scheme is one :class:`Entry` here, and appears in every one of
them (in the default runs of ``bench`` and ``compare`` too, unless its ``default_in``
says otherwise). The names are the one vocabulary of the command line; :data:`ALIASES`
keeps old names working.

Each entry builds its scheme for a :class:`Shape` (heads, head dim, longest sequence,
grid, and the few sizes that are not the sequence's), so that every user builds the
same scheme, each at its own sizes::

    from posenc.registry import SCHEMES, Shape

    bias = SCHEMES["swin-2d"].build(Shape(heads=4, head_dim=16, max_len=36, grid=(6, 6)))

Not part of :mod:`posenc`'s public API (the classes are): names and fields may change.

Shape legend: ``h`` heads, ``d`` head dim, ``n`` tokens, ``H x W`` a grid (row-major).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .absolute import LearnedEncoding, SinusoidalEncoding, SinusoidalEncoding2D
from .bias import ALiBi, RelativePositionBias, T5RelativeBias
from .bias_continuous import ContinuousPositionBias
from .bias_research import FIREBias, KerpleBias, SandwichBias
from .embedding import AbsoluteQueryEmbedding, RelativeQueryEmbedding, RelativeQueryEmbedding2D
from .embedding_research import CoPE
from .rotary import DynamicNTKScaling, Rotary, Rotary2D
from .rotary_nd import RotaryMixed, RotaryND
from .rotary_research import XPos
from .shaw import ShawRelativePosition

__all__ = [
    "ALIASES",
    "COMMANDS",
    "PLACES",
    "SCHEMES",
    "Entry",
    "Shape",
    "build",
    "get",
    "names",
    "resolve",
    "squarest_grid",
]

#: where a scheme injects position (0: it does not)
PLACES = {
    0: "no positions",
    1: "the input",
    2: "queries and keys, rotated",
    3: "the scores, content-free",
    4: "the scores, content-dependent",
    5: "keys and values",
}

#: the commands with a default run, which takes the entries whose ``default_in`` names them
COMMANDS = ("bench", "compare")


@dataclass(frozen=True)
class Shape:
    """What a scheme is built for.

    Args:
        heads: attention heads ``h``.
        head_dim: head dim ``d``.
        max_len: the longest sequence it must serve: sizes the 1-D tables (Swin 1-D, the
            relative and absolute query embeddings).
        grid: ``(H, W)`` whose cells number the positions of the 2-D schemes (row-major);
            None where there is no grid (a 2-D scheme then refuses to build).
        dim: model width, for the input encodings (default ``heads * head_dim``).
        train_len: the training length: rows of a learned absolute table, the original
            context of dynamic NTK (default ``max_len``).
        causal: the scheme serves a causal model (T5's buckets then look back only).
        clip: Shaw's clipping distance ``k``.
        buckets: T5's ``(num_buckets, max_distance)``.
    """

    heads: int
    head_dim: int
    max_len: int
    grid: tuple[int, int] | None = None
    dim: int | None = None
    train_len: int | None = None
    causal: bool = False
    clip: int = 16
    buckets: tuple[int, int] = (32, 128)

    @property
    def width(self) -> int:
        """The model width: ``dim``, or ``heads * head_dim``."""
        return self.heads * self.head_dim if self.dim is None else self.dim

    @property
    def trained(self) -> int:
        """The training length: ``train_len``, or ``max_len``."""
        return self.max_len if self.train_len is None else self.train_len

    def cells(self, what: str) -> tuple[int, int]:
        """The grid, for ``what`` (a scheme's name).

        Raises:
            ValueError: no grid, naming the scheme.
        """
        if self.grid is None:
            raise ValueError(f"{what} is a 2-D scheme: it needs a grid (H, W), got grid=None")
        return self.grid


@dataclass(frozen=True)
class Entry:
    """One scheme: how to build it for a :class:`Shape`, and its properties.

    Args:
        build: ``build(shape)`` -> the input encoding (``place == 1``), the scheme for
            ``MultiHeadAttention(position=...)`` (``place >= 2``), or None (``place == 0``).
        summary: one line for ``--help``.
        place: where it injects position, a key of :data:`PLACES`.
        relative: its output is unchanged when every position moves by the same amount.
        two_d: it needs a grid (only on grid tasks); inside attention, its positions are
            flat row-major indices of ``shape.grid``.
        learned: it has parameters that training must reach.
        shared: one module serves every layer of a model (T5 shares its bias, as in the
            paper; parameter-free schemes); False: a fresh one per layer.
        cache: it decodes with a :class:`~posenc.KVCache` (dynamic NTK refuses to: its
            frequencies move with the length).
        longest: the longest sequence it serves when built for a shape (None: any).
        default_in: the commands of :data:`COMMANDS` whose default run takes it; every
            command takes, when named, each entry it can run.
    """

    build: Callable[[Shape], Any]
    summary: str
    place: int
    relative: bool = True
    two_d: bool = False
    learned: bool = True
    shared: bool = False
    cache: bool = True
    longest: Callable[[Shape], int] | None = None
    default_in: tuple[str, ...] = COMMANDS

    @property
    def inside(self) -> bool:
        """It works inside attention (places 2-5): a ``position=`` of the attention."""
        return self.place >= 2

    def serves(self, shape: Shape, tokens: int) -> bool:
        """Whether, built for ``shape``, it serves a sequence of ``tokens``."""
        return self.longest is None or tokens <= self.longest(shape)


def _t5(bidirectional: bool | None) -> Callable[[Shape], Any]:
    def build(s: Shape) -> T5RelativeBias:
        num_buckets, max_distance = s.buckets
        return T5RelativeBias(
            s.heads,
            num_buckets=num_buckets,
            max_distance=max_distance,
            bidirectional=not s.causal if bidirectional is None else bidirectional,
        )

    return build


def _max_len(s: Shape) -> int:
    return s.max_len


#: name -> entry, in the order the commands list them
SCHEMES: dict[str, Entry] = {
    "none": Entry(lambda s: None, "no positions at all", 0, learned=False, shared=True),
    "sinusoidal": Entry(
        lambda s: SinusoidalEncoding(s.width),
        "Vaswani sin/cos added to the input",
        1,
        relative=False,
        learned=False,
        default_in=("compare",),
    ),
    "learned": Entry(
        lambda s: LearnedEncoding(s.width, s.trained),
        "learned absolute table (BERT/GPT), rows for the training length",
        1,
        relative=False,
        longest=lambda s: s.trained,
        default_in=("compare",),
    ),
    "sinusoidal-2d": Entry(
        lambda s: SinusoidalEncoding2D(s.width),
        "2-D sin/cos added to the input (ViT/MAE)",
        1,
        relative=False,
        two_d=True,
        learned=False,
        default_in=("compare",),
    ),
    "rotary": Entry(
        lambda s: Rotary(s.head_dim), "RoPE (half-split)", 2, learned=False, shared=True
    ),
    "rotary-interleaved": Entry(
        lambda s: Rotary(s.head_dim, interleaved=True),
        "RoPE on interleaved channel pairs (GPT-J)",
        2,
        learned=False,
        shared=True,
        default_in=(),  # a variant: run when named
    ),
    "rotary-partial": Entry(
        lambda s: Rotary(s.head_dim, rotary_dim=s.head_dim // 2),
        "RoPE on half the channels (GPT-NeoX)",
        2,
        learned=False,
        shared=True,
        default_in=(),  # a variant: run when named
    ),
    "rotary-ntk": Entry(
        lambda s: Rotary(s.head_dim, scaling=DynamicNTKScaling(1.0, original_max_len=s.trained)),
        "RoPE with dynamic NTK scaling past the training length",
        2,
        relative=False,  # the frequencies move with the longest position
        learned=False,
        shared=True,
        cache=False,
        default_in=("compare",),  # bench: it costs what rotary costs
    ),
    "rotary-2d": Entry(
        lambda s: Rotary2D(s.head_dim, size=s.cells("rotary-2d")),
        "axial 2-D RoPE",
        2,
        relative=False,
        two_d=True,
        learned=False,
        shared=True,
        default_in=("compare",),  # bench: it costs what rotary costs
    ),
    "rotary-mixed": Entry(
        lambda s: RotaryMixed(s.head_dim, s.heads, size=s.cells("rotary-mixed")),
        "RoPE-Mixed: learned 2-D frequencies per head (Heo et al. 2024), per layer",
        2,
        relative=False,
        two_d=True,
        default_in=(),  # research: run when named
    ),
    "rotary-nd": Entry(
        lambda s: RotaryND(
            s.head_dim,
            (s.head_dim // 4, s.head_dim // 2 - s.head_dim // 4),
            size=s.cells("rotary-nd"),
            style="mrope",
        ),
        "M-RoPE (Qwen2-VL): one RoPE ladder shared out between the grid's rows and columns",
        2,
        relative=False,
        two_d=True,
        learned=False,
        shared=True,
        default_in=(),  # research: run when named
    ),
    "xpos": Entry(
        lambda s: XPos(s.head_dim),
        "xPos: RoPE with a per-pair exponential decay of the distance (scale base 512)",
        2,
        learned=False,
        shared=True,
        default_in=(),  # research: run when named
    ),
    "alibi": Entry(
        lambda s: ALiBi(s.heads), "ALiBi linear distance penalty", 3, learned=False, shared=True
    ),
    "alibi-learned": Entry(
        lambda s: ALiBi(s.heads, learned=True),
        "ALiBi with a learned slope per head (log-slope, from the paper's), per layer",
        3,
        default_in=(),  # a variant: run when named
    ),
    "kerple-log": Entry(
        lambda s: KerpleBias(s.heads, kind="log"),
        "KERPLE learned log kernel -r1 log(1 + r2 |j-i|), per layer",
        3,
        default_in=(),  # research: run when named (docs/compare.md predates it)
    ),
    "kerple-power": Entry(
        lambda s: KerpleBias(s.heads, kind="power"),
        "KERPLE learned power kernel -r1 |j-i|^r2, per layer",
        3,
        default_in=(),  # a variant: run when named
    ),
    "sandwich": Entry(
        lambda s: SandwichBias(s.heads, s.head_dim),
        "Sandwich: sinusoids' inner product minus dim/2, per head / (8h/H), no parameters",
        3,
        learned=False,
        shared=True,
        default_in=(),  # research: run when named
    ),
    "fire": Entry(
        lambda s: FIREBias(s.heads),
        "FIRE learned MLP of log|i-j| / log max(L, i), per layer",
        3,
        relative=False,  # past L the query's own position enters the bias
        default_in=(),  # research: run when named
    ),
    "t5": Entry(
        _t5(None),
        "T5 log-bucketed bias (one-directional in causal models), shared by the layers",
        3,
        shared=True,
    ),
    "t5-decoder": Entry(
        _t5(False),
        "T5 log-bucketed bias looking back only, shared by the layers",
        3,
        shared=True,
        default_in=(),  # a variant: run when named
    ),
    "swin-1d": Entry(
        lambda s: RelativePositionBias(s.max_len, s.heads),
        "1-D relative bias table (Swin-style), per layer",
        3,
        longest=_max_len,
    ),
    "swin-2d": Entry(
        lambda s: RelativePositionBias(s.cells("swin-2d"), s.heads),
        "Swin 2-D relative bias table, per layer",
        3,
        relative=False,
        two_d=True,
    ),
    "swin-v2-cpb": Entry(
        lambda s: ContinuousPositionBias(s.cells("swin-v2-cpb"), s.heads),
        "Swin V2 log-spaced continuous bias: an MLP of the 2-D offset, per layer",
        3,
        relative=False,
        two_d=True,
        default_in=(),  # research: run when named
    ),
    "relative": Entry(
        lambda s: RelativeQueryEmbedding(s.max_len, s.head_dim),
        "relative embedding q.R[j-i] with the skew, per layer",
        4,
        longest=_max_len,
    ),
    "relative-per-head": Entry(
        lambda s: RelativeQueryEmbedding(s.max_len, s.head_dim, heads=s.heads),
        "relative embedding q.R[j-i] with a table per head, per layer",
        4,
        longest=_max_len,
        default_in=(),  # a variant: run when named
    ),
    "relative-2d": Entry(
        lambda s: RelativeQueryEmbedding2D(s.cells("relative-2d"), s.head_dim),
        "factorised 2-D relative embedding (SASA/BoTNet), per layer",
        4,
        relative=False,
        two_d=True,
    ),
    "absolute-query": Entry(
        lambda s: AbsoluteQueryEmbedding(s.max_len, s.head_dim),
        "absolute embedding q.R[j], per layer",
        4,
        relative=False,
        longest=_max_len,
        default_in=("bench",),
    ),
    "cope": Entry(
        lambda s: CoPE(s.heads, s.head_dim, s.max_len + 1),
        "CoPE: q.e[p] at contextual positions, gated counts of the keys (Golovneva et al. "
        "2024), per layer",
        4,
        default_in=(),  # research: run when named
    ),
    "shaw": Entry(
        lambda s: ShawRelativePosition(s.head_dim, s.clip),
        "Shaw relative keys and values, clipped at distance k, per layer",
        5,
    ),
    "shaw-keys-only": Entry(
        lambda s: ShawRelativePosition(s.head_dim, s.clip, values=False),
        "Shaw relative keys only, clipped at distance k, per layer",
        5,
        default_in=(),  # a variant: run when named
    ),
}

#: old name -> its name in :data:`SCHEMES` (``posenc compare`` called Swin's 1-D table ``swin``)
ALIASES: dict[str, str] = {"swin": "swin-1d"}


def resolve(name: str) -> str:
    """The name in :data:`SCHEMES` of ``name`` or of its old name (:data:`ALIASES`).

    Raises:
        ValueError: an unknown name, with the known ones.
    """
    name = ALIASES.get(name, name)
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose from {', '.join(SCHEMES)}")
    return name


def get(name: str) -> Entry:
    """The entry of ``name`` (an old name of :data:`ALIASES` too)."""
    return SCHEMES[resolve(name)]


def names(*, inside: bool | None = None, default_in: str | None = None) -> list[str]:
    """Names of :data:`SCHEMES`, in order: those inside attention (``inside=True``), those
    not (False), or all (None); with ``default_in``, only the default run of that command."""
    return [
        name
        for name, entry in SCHEMES.items()
        if (inside is None or entry.inside == inside)
        and (default_in is None or default_in in entry.default_in)
    ]


def build(name: str, shape: Shape) -> Any:
    """``SCHEMES[name].build(shape)``, the name resolved through :data:`ALIASES`."""
    return get(name).build(shape)


def squarest_grid(n: int) -> tuple[int, int]:
    """``(H, W)`` with ``H * W == n`` and ``H <= W`` as close as possible (``(1, n)`` for a
    prime)."""
    height = int(n**0.5)
    while n % height:
        height -= 1
    return height, n // height
