"""``posenc plot KIND --out DIR``: the pictures people draw to understand positional encodings.

Kinds, and the options each reads (the others are ignored; defaults in brackets):

- ``sinusoidal`` (``--dim`` [32], ``--length`` [60], ``--base``): columns 6-9 of the
  sinusoidal table against position, the whole table, and its cosine similarity.
- ``similarity`` (``--dim`` [64], ``--length`` [100], ``--base``): position-by-position
  cosine similarity of the sinusoidal table (Wang and Chen 2020, "What Do Position
  Embeddings Learn?"). :func:`~posenc.cli.plot_encodings.similarity_figure` draws it for
  any ``[n, dim]`` table.
- ``skew`` (``--length`` [5]): :func:`~posenc.relative_to_absolute` on a matrix of relative
  offsets, every cell annotated.
- ``swin-index`` (``--window`` [3,3]): Swin's :func:`~posenc.relative_position_index` and
  the offset ``(dy, dx)`` each table row serves.
- ``bias`` (``--heads`` [4], ``--length`` [64], ``--window`` [4,4]): per-head score biases
  of :class:`~posenc.ALiBi`, :class:`~posenc.T5RelativeBias` (its buckets) and
  :class:`~posenc.RelativePositionBias` (Swin, with an illustrative smooth table).
- ``distance`` (``--heads`` [8], ``--length`` [512]): the score bias against the distance
  back to the key, per head, of ALiBi, T5, KERPLE and FIRE
  (:mod:`~posenc.cli.plot_research`).
- ``cope``: CoPE's contextual positions on a sentence whose gates open on full stops.
- ``cpb`` (``--window`` [8,8]): Swin V2's continuous position bias on the window it was
  built for and on one twice as large, from the same network.
- ``rotary`` (``--dim`` [128], ``--length`` [4096], ``--base``, ``--factor`` [4]): RoPE's
  long-term decay (RoFormer, section 3.4.3) and what :class:`~posenc.LinearScaling`,
  :class:`~posenc.NTKScaling` and :class:`~posenc.YaRNScaling` do to it.
- ``attention`` (``--checkpoints DIR``): the attention maps of the models that
  ``posenc compare --out`` saved in ``DIR`` (see :mod:`posenc.cli.plot_trained`); with
  ``--checkpoints``, ``similarity`` also draws each learned absolute table they hold.

Each kind is a function ``plot_<kind>(args) -> list[Path]`` registered in ``KINDS``; to add
one, write the function and add it there. The kinds live by what they draw:
:mod:`~posenc.cli.plot_encodings` (``sinusoidal``, ``similarity``, ``rotary``),
:mod:`~posenc.cli.plot_scores` (``skew``, ``swin-index``, ``bias``) and
:mod:`~posenc.cli.plot_trained` (``attention``); the options they read are in
:mod:`~posenc.cli._plot_options`. The maths comes from posenc's public functions and
modules; the pure ``*_data``-style functions only arrange their output for drawing, and
are what the tests check. A value no kind accepts (``--dim 0``, ``--out`` a file) is
refused by argparse before anything runs; a value out of a kind's range raises
``ValueError`` naming the option before anything is drawn (``posenc`` turns both into exit
status 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from ._options import float_above, formats, input_dir, output_dir, positive_int
from ._plot_options import window_type
from .plot_encodings import plot_rotary, plot_similarity, plot_sinusoidal
from .plot_research import plot_cope, plot_cpb, plot_distance
from .plot_scores import plot_bias, plot_skew, plot_swin_index
from .plot_trained import plot_attention

# ----- the command ---------------------------------------------------------------------------

#: kind -> function drawing it; add a kind by registering ``plot_<kind>(args) -> list[Path]``
KINDS: dict[str, Callable[[argparse.Namespace], list[Path]]] = {
    "sinusoidal": plot_sinusoidal,
    "similarity": plot_similarity,
    "skew": plot_skew,
    "swin-index": plot_swin_index,
    "bias": plot_bias,
    "distance": plot_distance,
    "cope": plot_cope,
    "cpb": plot_cpb,
    "rotary": plot_rotary,
    "attention": plot_attention,
}


def run(args: argparse.Namespace) -> int:
    """Run ``posenc plot``: draw the requested kind and print the files written."""
    for path in KINDS[args.kind](args):
        print(path)
    return 0


_EPILOG = """\
kinds and the options they read (others are ignored; defaults in brackets):
  sinusoidal  --dim [32] --length [60] --base: table columns, heat map, similarity
  similarity  --dim [64] --length [100] --base: cosine similarity of position vectors;
              with --checkpoints, also of each learned table that `compare` trained
  skew        --length [5, at most 12]: relative_to_absolute, every cell annotated
  swin-index  --window [3,3]: Swin's relative position index and each table row's offset
  bias        --heads [4] --length [64] --window [4,4]: ALiBi, T5 buckets, Swin, per head
  distance    --heads [8] --length [512]: bias against distance, ALiBi, T5, KERPLE,
              FIRE (learned ones at initialisation), a line per head
  cope        CoPE's contextual positions on a sentence, gates on the full stops
  cpb         --window [8,8]: Swin V2's continuous bias on its window and one twice as large
  rotary      --dim [128] --length [4096] --base --factor [4]: RoPE decay and scaling
  attention   --checkpoints DIR: attention maps of the models `posenc compare --out` saved
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``posenc plot``."""
    parser = commands.add_parser(
        "plot",
        help="draw the pictures that explain a positional scheme",
        description="Draw the pictures that explain a positional scheme, as PNG (or SVG).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kind", choices=sorted(KINDS), help="what to draw")
    # a string default goes through the type too: a file named posenc-out is caught
    parser.add_argument(
        "--out", type=output_dir(), default="posenc-out", help="output folder (posenc-out)"
    )
    parser.add_argument(
        "--dim", type=positive_int, help="encoding width or head dim (default per kind)"
    )
    parser.add_argument(
        "--length", type=positive_int, help="positions or distance (default per kind)"
    )
    parser.add_argument(
        "--base", type=float_above(1.0), default=10000.0, help="wavelength base (10000)"
    )
    parser.add_argument(
        "--window",
        type=window_type,
        help="Swin window Wh,Ww (swin-index: 3,3; bias: 4,4; cpb: 8,8)",
    )
    parser.add_argument("--heads", type=positive_int, help="attention heads (bias: 4, distance: 8)")
    parser.add_argument(
        "--factor",
        type=float_above(1.0, inclusive=True, hint=" (the context extension)"),
        help="RoPE context extension (rotary: 4)",
    )
    parser.add_argument(
        "--checkpoints",
        type=input_dir(
            "; run `posenc compare --out DIR` first and pass --checkpoints DIR/checkpoints"
        ),
        default=None,
        help="the checkpoints folder of `posenc compare --out DIR` (DIR/checkpoints)",
    )
    parser.add_argument(
        "--format", type=formats, default=["png"], help="png, svg or png,svg (default png)"
    )
    parser.set_defaults(run=run)
