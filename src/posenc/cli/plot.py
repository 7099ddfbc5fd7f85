"""``posenc plot KIND --out DIR``: the pictures people draw to understand positional encodings.

Kinds, and the options each reads (the others are ignored; defaults in brackets):

- ``sinusoidal`` (``--dim`` [32], ``--length`` [60], ``--base``): columns 6-9 of the
  sinusoidal table against position, the whole table, and its cosine similarity.
- ``similarity`` (``--dim`` [64], ``--length`` [100], ``--base``): position-by-position
  cosine similarity of the sinusoidal table (Wang and Chen 2020, "What Do Position
  Embeddings Learn?"). :func:`similarity_figure` draws it for any ``[n, dim]`` table.
- ``skew`` (``--length`` [5]): :func:`~posenc.relative_to_absolute` on a matrix of relative
  offsets, every cell annotated.
- ``swin-index`` (``--window`` [3,3]): Swin's :func:`~posenc.relative_position_index` and
  the offset ``(dy, dx)`` each table row serves.
- ``bias`` (``--heads`` [4], ``--length`` [64], ``--window`` [4,4]): per-head score biases
  of :class:`~posenc.ALiBi`, :class:`~posenc.T5RelativeBias` (its buckets) and
  :class:`~posenc.RelativePositionBias` (Swin, with an illustrative smooth table).
- ``rotary`` (``--dim`` [128], ``--length`` [4096], ``--base``, ``--factor`` [4]): RoPE's
  long-term decay (RoFormer, section 3.4.3) and what :class:`~posenc.LinearScaling`,
  :class:`~posenc.NTKScaling` and :class:`~posenc.YaRNScaling` do to it.
- ``attention`` (``--checkpoints DIR``): the attention maps of the models that
  ``posenc compare --out`` saved in ``DIR`` (see :mod:`posenc.cli.plot_trained`); with
  ``--checkpoints``, ``similarity`` also draws each learned absolute table they hold.

Each kind is a function ``plot_<kind>(args) -> list[Path]`` registered in ``KINDS``; to add
one, write the function and add it there. The maths comes from posenc's public functions
and modules; the pure ``*_data``-style functions below only arrange their output for
drawing, and are what the tests check. A value no kind accepts (``--dim 0``, ``--out`` a
file) is refused by argparse before anything runs; a value out of a kind's range raises
``ValueError`` naming the option before anything is drawn (``posenc`` turns both into exit
status 2).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..absolute import sinusoidal
from ..bias import ALiBi, RelativePositionBias, T5RelativeBias
from ..indices import relative_position_index, relative_to_absolute, t5_bucket
from ..rotary import LinearScaling, NTKScaling, Rotary, RotaryScaling, YaRNScaling
from ._figures import annotate, cell_grid, fade, outline_rows, pyplot, save
from ._options import float_above, formats, input_dir, output_dir, positive_int
from .plot_trained import learned_tables, plot_attention

# ----- options ---------------------------------------------------------------------------------


def _int_option(
    args: argparse.Namespace, name: str, default: int, *, low: int = 1, high: int | None = None
) -> int:
    """``--name`` (or the kind's default), checked to lie in ``[low, high]``."""
    value = getattr(args, name.replace("-", "_"), None)
    value = default if value is None else value
    if value < low or (high is not None and value > high):
        allowed = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"--{name} must be {allowed} for `posenc plot {args.kind}`, got {value}")
    return value


def _even_dim(args: argparse.Namespace, default: int, *, low: int = 2) -> int:
    dim = _int_option(args, "dim", default, low=low)
    if dim % 2:
        raise ValueError(
            f"--dim must be even (every frequency needs a pair of channels), got {dim}; "
            f"use {dim + 1} or {dim - 1}"
        )
    return dim


def _base(args: argparse.Namespace) -> float:
    base = getattr(args, "base", None)
    base = 10000.0 if base is None else base
    if not math.isfinite(base) or base <= 1:
        raise ValueError(f"--base must be a finite number > 1, got {base}")
    return base


def parse_window(text: str | None, default: tuple[int, int]) -> tuple[int, int]:
    """``"Wh,Ww"`` (or ``"WhxWw"``) to ``(Wh, Ww)``; ``None`` gives ``default``.

    Raises:
        ValueError: not two integers >= 1, naming ``--window``.
    """
    if text is None:
        return default
    match = re.fullmatch(r"\s*(\d+)\s*[,x]\s*(\d+)\s*", text)
    window = (int(match[1]), int(match[2])) if match else (0, 0)
    if min(window) < 1:
        raise ValueError(
            f"--window must be two integers >= 1 as Wh,Ww (e.g. 3,3; 1,W for a 1-D window), "
            f"got {text!r}"
        )
    return window


def _window_type(text: str) -> tuple[int, int]:
    """``--window`` for argparse: :func:`parse_window`, its message without the option name
    (argparse puts ``argument --window:`` before it)."""
    try:
        return parse_window(text, (1, 1))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--window ")) from None


def _window(args: argparse.Namespace, default: tuple[int, int], max_tokens: int) -> tuple[int, int]:
    window = getattr(args, "window", None)  # parsed by argparse, or text when built by hand
    window = parse_window(window, default) if window is None or isinstance(window, str) else window
    if window[0] * window[1] > max_tokens:
        raise ValueError(
            f"--window {window[0]},{window[1]} has {window[0] * window[1]} tokens; "
            f"`posenc plot {args.kind}` draws at most {max_tokens} (the cells would be unreadable)"
        )
    return window


# ----- sinusoidal and similarity ---------------------------------------------------------------


def cosine_similarity_matrix(table: np.ndarray) -> np.ndarray:
    """``[n, dim] -> [n, n]`` cosine similarity between the position vectors (rows)."""
    table = np.asarray(table, dtype=np.float64)
    unit = table / np.linalg.norm(table, axis=-1, keepdims=True).clip(min=1e-12)  # [n, dim]
    return unit @ unit.T  # [n, n]


def similarity_figure(
    table: np.ndarray | torch.Tensor, title: str, out: Path, name: str, formats: Sequence[str]
) -> list[Path]:
    """Draw the position-by-position cosine similarity of a table of position vectors.

    Left, the ``[n, n]`` heat map of ``cos(P[i], P[j])`` (Wang and Chen 2020, Figure 2);
    right, a few of its rows against the offset ``j - i``: they coincide when the
    similarity depends only on the offset (sinusoidal tables), and differ when it does
    not (learned tables usually). Works for any table, e.g. ``LearnedEncoding.weight``.

    Args:
        table: ``[n, dim]`` position vectors, one row per position: an array, or a tensor
            such as ``LearnedEncoding.weight`` (detached and moved to the CPU here).
        title: the figure's title; say which table it is.
        out: the folder to write to.
        name: the file name without extension.
        formats: ``["png"]``, ``["svg"]`` or both.

    Returns:
        The paths written.

    Raises:
        ValueError: ``table`` is not ``[n, dim]`` with ``n >= 2``.
    """
    if isinstance(table, torch.Tensor):
        table = table.detach().float().cpu().numpy()
    table = np.asarray(table, dtype=np.float64)
    if table.ndim != 2 or table.shape[0] < 2 or table.shape[1] < 1:
        raise ValueError(f"table must have shape [n >= 2, dim], got shape {table.shape}")
    plt = pyplot()
    sim = cosine_similarity_matrix(table)  # [n, n]
    n = len(table)
    fig, (ax_map, ax_rows) = plt.subplots(
        1, 2, figsize=(11, 4.4), layout="constrained", gridspec_kw={"width_ratios": [1, 1.2]}
    )
    image = ax_map.imshow(sim, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    ax_map.set_title("cos(P[i], P[j]) for every pair of positions")
    ax_map.set_xlabel("position j")
    ax_map.set_ylabel("position i")
    fig.colorbar(image, ax=ax_map, label="cosine similarity")

    offsets = np.arange(n)
    rows = sorted({0, n // 4, n // 2, n - 1})
    for k, i in enumerate(rows):  # wide to thin, so that coinciding lines stay visible
        width = 0.9 + 2.4 * (len(rows) - 1 - k) / max(len(rows) - 1, 1)
        ax_rows.plot(offsets - i, sim[i], label=f"i = {i}", linewidth=width, alpha=0.85)
    ax_rows.axhline(0.0, color="grey", linewidth=0.6)
    ax_rows.axvline(0.0, color="grey", linewidth=0.6, linestyle=":")
    ax_rows.set_ylim(-1.05, 1.05)
    ax_rows.set_title(
        "rows i of the matrix against the offset j - i\n(they coincide if only j - i matters)"
    )
    ax_rows.set_xlabel("offset j - i")
    ax_rows.set_ylabel("cos(P[i], P[j])")
    ax_rows.legend(loc="lower left", fontsize="small")
    fig.suptitle(title)
    return save(fig, out, name, formats)


def plot_sinusoidal(args: argparse.Namespace) -> list[Path]:
    """Three pictures of the sinusoidal table: curves, heat map, cosine similarity."""
    plt = pyplot()
    dim = _int_option(args, "dim", 32)
    if dim < 10:
        raise ValueError(f"--dim must be at least 10 to show columns 6-9, got {dim}")
    dim = _even_dim(args, 32)
    length = _int_option(args, "length", 60, low=2)
    base = _base(args)
    positions = torch.arange(length)
    table = sinusoidal(positions, dim, base=base).numpy()  # [length, dim]
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for col in range(6, 10):
        ax.plot(
            positions, table[:, col], label=f"column {col} ({'sin' if col % 2 == 0 else 'cos'})"
        )
    ax.set_title(f"Sinusoidal encoding: columns 6-9 against position (dim={dim})")
    ax.set_xlabel("position")
    ax.set_ylabel("value")
    ax.legend(loc="upper right", fontsize="small")
    paths += save(fig, args.out, "sinusoidal_columns", args.format)

    fig, ax = plt.subplots(figsize=(7, 4))
    image = ax.imshow(table.T, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, origin="lower")
    ax.set_title(f"Sinusoidal table P (dim={dim}, base={base:g})")
    ax.set_xlabel("position")
    ax.set_ylabel("dimension (even: sin, odd: cos)")
    fig.colorbar(image, ax=ax, label="P[position, dimension]")
    paths += save(fig, args.out, "sinusoidal_heatmap", args.format)

    title = f"Cosine similarity of sinusoidal position vectors (dim={dim}, base={base:g})"
    paths += similarity_figure(table, title, args.out, "sinusoidal_similarity", args.format)
    return paths


def plot_similarity(args: argparse.Namespace) -> list[Path]:
    """Cosine similarity of the sinusoidal table's position vectors (Wang and Chen 2020)."""
    dim = _even_dim(args, 64)
    length = _int_option(args, "length", 100, low=2)
    base = _base(args)
    # the checkpoints are read (and checked) before anything is drawn
    checkpoints = getattr(args, "checkpoints", None)
    learned = [] if checkpoints is None else learned_tables(checkpoints)
    table = sinusoidal(torch.arange(length), dim, base=base).numpy()  # [length, dim]
    title = f"Sinusoidal encoding (dim={dim}, base={base:g}): cosine similarity of position vectors"
    paths = similarity_figure(table, title, args.out, "similarity_sinusoidal", args.format)
    for task, weight in learned:
        title = (
            f"Learned absolute table after `posenc compare` on {task} "
            f"({weight.shape[0]} positions x {weight.shape[1]}): cosine similarity"
        )
        paths += similarity_figure(
            weight, title, args.out, f"similarity_learned_{task}", args.format
        )
    return paths


# ----- skew ------------------------------------------------------------------------------------


def skew_data(length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The skew of :func:`~posenc.relative_to_absolute` on a matrix of relative offsets.

    Args:
        length: ``L``.

    Returns:
        ``(relative, absolute, kept)``: ``relative [L, 2L-1]`` with ``relative[i, c] =
        c - (L-1)`` (the offset column ``c`` stands for); ``absolute [L, L]``, the skew of
        it (``absolute[i, j]`` is the offset ``j - i``); ``kept [L, 2L-1]`` bool, True on the
        cells of ``relative`` that the skew reads (found by skewing cell numbers).
    """
    width = 2 * length - 1
    relative = torch.arange(width).expand(length, width) - (length - 1)  # [L, 2L-1]
    absolute = relative_to_absolute(relative)  # [L, L]
    cells = torch.arange(length * width).reshape(length, width)  # [L, 2L-1] cell numbers
    kept = torch.zeros(length * width, dtype=torch.bool)
    kept[relative_to_absolute(cells).flatten()] = True
    return relative.numpy(), absolute.numpy(), kept.reshape(length, width).numpy()


def plot_skew(args: argparse.Namespace) -> list[Path]:
    """The relative -> absolute skew, side by side, every cell annotated with its offset."""
    plt = pyplot()
    length = _int_option(args, "length", 5, low=2, high=12)
    relative, absolute, kept = skew_data(length)
    width = 2 * length - 1
    reach = max(length - 1, 1)
    fig, (ax_rel, ax_abs) = plt.subplots(
        1,
        2,
        figsize=(max(0.62 * (width + length) + 3.2, 12.0), 0.62 * length + 2.6),
        layout="constrained",
        gridspec_kw={"width_ratios": [width, length]},
    )
    style = {"cmap": "RdBu_r", "vmin": -reach, "vmax": reach, "interpolation": "nearest"}
    image = ax_rel.imshow(relative, **style)
    # cells the skew drops are drawn faded; the kept band is the diagonal strip
    fade(ax_rel, ~kept)
    outline_rows(ax_rel, kept)
    annotate(ax_rel, image, relative, muted=~kept)
    ax_rel.set_title(
        f"x: relative logits [L, 2L-1] = [{length}, {width}]\n"
        "cell (i, c) holds offset c - (L-1); row i keeps the boxed L cells"
    )
    ax_rel.set_xticks(range(width), [f"{c}\n({c - (length - 1):+d})" for c in range(width)])
    ax_rel.set_yticks(range(length))
    ax_rel.set_xlabel("column c  (offset c - (L-1))")
    ax_rel.set_ylabel("query position i")
    cell_grid(ax_rel, length, width)

    image = ax_abs.imshow(absolute, **style)
    annotate(ax_abs, image, absolute)
    ax_abs.set_title(
        f"relative_to_absolute(x): [L, L] = [{length}, {length}]\n"
        "out[i, j] = x[i, j - i + L - 1] = offset j - i"
    )
    ax_abs.set_xticks(range(length))
    ax_abs.set_yticks(range(length))
    ax_abs.set_xlabel("key position j")
    ax_abs.set_ylabel("query position i")
    cell_grid(ax_abs, length, length)
    fig.colorbar(
        image,
        ax=[ax_rel, ax_abs],
        label="relative offset j - i",
        shrink=0.9,
        ticks=range(-reach, reach + 1, 1 if reach <= 6 else 2),
    )
    fig.suptitle(
        f"The skew (relative -> absolute), L = {length}: the boxed run of row i becomes row i "
        "on the right"
    )
    return save(fig, args.out, "skew", args.format)


# ----- Swin index ------------------------------------------------------------------------------


def swin_index_data(window: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Swin's relative position index and the offset each table row serves.

    Args:
        window: ``(Wh, Ww)``.

    Returns:
        ``(index, offsets)``: ``index [N, N]`` is :func:`~posenc.relative_position_index`;
        ``offsets [R, 2]`` (``R = (2Wh-1)(2Ww-1)`` rows of the table) holds the
        ``(dy, dx) = (row_q - row_k, col_q - col_k)`` of the token pairs that read row
        ``r``, with tokens numbered row-major (``p = row * Ww + col``).
    """
    wh, ww = window
    index = relative_position_index((wh, ww))  # [N, N]
    rows = RelativePositionBias((wh, ww), 1).table.shape[0]
    tokens = torch.arange(wh * ww)
    row, col = tokens // ww, tokens % ww  # [N]
    pairs = torch.stack(
        (row[:, None] - row[None, :], col[:, None] - col[None, :]), dim=-1
    )  # [N, N, 2]
    offsets = torch.zeros(rows, 2, dtype=torch.long)
    offsets[index.flatten()] = pairs.reshape(-1, 2)
    return index.numpy(), offsets.numpy()


def plot_swin_index(args: argparse.Namespace) -> list[Path]:
    """Swin's relative position index as an annotated heat map, with each row's meaning."""
    plt = pyplot()
    wh, ww = _window(args, (3, 3), max_tokens=25)
    index, offsets = swin_index_data((wh, ww))
    n, rows = index.shape[0], offsets.shape[0]
    # the table rows laid out on the grid of offsets, dy down and dx across
    grid = np.zeros((2 * wh - 1, 2 * ww - 1), dtype=np.int64)
    grid[offsets[:, 0] + wh - 1, offsets[:, 1] + ww - 1] = np.arange(rows)
    grid_labels = np.array(
        [
            [f"{grid[a, b]}\n({a - wh + 1},{b - ww + 1})" for b in range(2 * ww - 1)]
            for a in range(2 * wh - 1)
        ]
    )

    cell = max(0.5, min(0.9, 6 / n))  # inches per cell: small windows get larger cells
    fig, (ax_index, ax_table) = plt.subplots(
        1,
        2,
        figsize=(cell * (n + 2 * ww - 1) + 4.5, cell * max(n, 2 * wh - 1) + 2.8),
        layout="constrained",
        gridspec_kw={"width_ratios": [n, 2 * ww - 1]},
    )
    style = {"cmap": "viridis", "vmin": 0, "vmax": rows - 1, "interpolation": "nearest"}
    image = ax_index.imshow(index, **style)
    annotate(ax_index, image, index, fontsize=9 if n <= 16 else 8)
    ticks = [f"{p} ({p // ww},{p % ww})" for p in range(n)]
    ax_index.set_xticks(range(n), ticks, rotation=90)
    ax_index.set_yticks(range(n), ticks)
    ax_index.set_xlabel("key token j (row, col)")
    ax_index.set_ylabel("query token i (row, col)")
    ax_index.set_title(
        f"relative_position_index(({wh}, {ww})): [N, N], N = {n}\n"
        "cell (i, j) = row of the bias table that the pair reads"
    )
    cell_grid(ax_index, n, n, width=0.5)
    for edge in range(ww, n, ww):  # separate the rows of the window
        ax_index.axhline(edge - 0.5, color="white", linewidth=2)
        ax_index.axvline(edge - 0.5, color="white", linewidth=2)

    image = ax_table.imshow(grid, **style)
    annotate(ax_table, image, grid, grid_labels, fontsize=8)
    ax_table.set_xticks(range(2 * ww - 1), [f"{dx:+d}" for dx in range(1 - ww, ww)])
    ax_table.set_yticks(range(2 * wh - 1), [f"{dy:+d}" for dy in range(1 - wh, wh)])
    ax_table.set_xlabel("dx = col_i - col_j")
    ax_table.set_ylabel("dy = row_i - row_j")
    ax_table.set_title(f"the {rows} table rows:\nrow r over the (dy, dx) it serves")
    cell_grid(ax_table, 2 * wh - 1, 2 * ww - 1)
    fig.colorbar(image, ax=[ax_index, ax_table], label="table row", shrink=0.8)
    fig.suptitle(f"Swin relative position index, window ({wh}, {ww}), tokens row-major")
    return save(fig, args.out, "swin_index", args.format)


# ----- score biases ----------------------------------------------------------------------------


def alibi_data(heads: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """ALiBi's bias and slopes: ``([heads, L, L], [heads])`` from :class:`~posenc.ALiBi`."""
    alibi = ALiBi(heads)
    return alibi(length, length).numpy(), alibi.slopes().numpy()


def t5_bucket_map(
    length: int, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> np.ndarray:
    """The bucket of ``j - i`` for every (query i, key j), through :class:`~posenc.T5RelativeBias`.

    The module is given ``embedding.weight[b, h] = b``, so its bias is the bucket index.

    Returns:
        ``[L, L]`` float buckets.
    """
    t5 = T5RelativeBias(
        1, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional
    )
    with torch.no_grad():
        t5.embedding.weight.copy_(torch.arange(num_buckets, dtype=torch.float32)[:, None])
        return t5(length, length)[0].numpy()


#: per head, the offset (dy, dx) where the illustrative Swin table peaks
_SWIN_PEAKS = ((0, 0), (0, 1), (1, 0), (0, -1), (-1, 0), (1, 1), (-1, -1), (1, -1), (-1, 1))


def swin_bias_data(window: tuple[int, int], heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Swin's bias ``[heads, N, N]`` from :class:`~posenc.RelativePositionBias`, smooth table.

    The table is set to ``-|(dy, dx) - c_h|^2 / (2 s_h)`` with head ``h`` peaking at
    ``c_h = _SWIN_PEAKS[h % 9]`` (``s_h = 1 + h // 9``): an illustrative smooth table, not
    a trained one, that makes the block structure of the index visible.

    Returns:
        ``(bias [heads, N, N], peaks [heads, 2])``.
    """
    _, offsets = swin_index_data(window)  # [R, 2]
    peaks = np.array([_SWIN_PEAKS[h % len(_SWIN_PEAKS)] for h in range(heads)])  # [h, 2]
    spread = 1.0 + np.arange(heads) // len(_SWIN_PEAKS)  # [h]
    table = -((offsets[:, None, :] - peaks[None]) ** 2).sum(-1) / (2.0 * spread)  # [R, h]
    swin = RelativePositionBias(window, heads)
    with torch.no_grad():
        swin.table.copy_(torch.from_numpy(table))
        return swin().numpy(), peaks


def _head_axes(plt: Any, panels: int, size: float = 2.7) -> tuple[Any, list[Any]]:
    """A figure with ``panels`` square axes, one row of up to 5, else rows of 4."""
    cols = panels if panels <= 5 else 4
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(size * cols + 1.4, size * rows + 1.2),
        layout="constrained",
        squeeze=False,
    )
    axes = list(axes.ravel())
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, axes[:panels]


def _label_heads(axes: list[Any], xlabel: str, ylabel: str) -> None:
    """Label the left column's y axes and the bottom row's x axes."""
    cols = len(axes) if len(axes) <= 5 else 4
    for h, ax in enumerate(axes):
        if h % cols == 0:
            ax.set_ylabel(ylabel)
        if h >= len(axes) - cols:
            ax.set_xlabel(xlabel)


def _where_key(dy: int, dx: int) -> str:
    """Words for the key's place relative to the query, for ``(dy, dx)`` = query minus key."""
    parts = []
    if dy:
        parts.append(f"{abs(dy)} {'up' if dy > 0 else 'down'}")
    if dx:
        parts.append(f"{abs(dx)} {'left' if dx > 0 else 'right'}")
    return "key = query" if not parts else "key " + ", ".join(parts)


def plot_bias(args: argparse.Namespace) -> list[Path]:
    """Per-head heat maps of the content-free score biases: ALiBi, T5, Swin."""
    plt = pyplot()
    heads = _int_option(args, "heads", 4, high=16)
    length = _int_option(args, "length", 64, low=2, high=1024)
    window = _window(args, (4, 4), max_tokens=256)
    paths: list[Path] = []

    bias, slopes = alibi_data(heads, length)
    fig, axes = _head_axes(plt, heads + 1)
    maps, profile = axes[:heads], axes[heads]
    for h, ax in enumerate(maps):
        image = ax.imshow(bias[h], cmap="viridis", vmin=bias.min(), vmax=0, interpolation="nearest")
        ax.set_title(f"head {h}: slope 2^{math.log2(slopes[h]):.3g} = {slopes[h]:.3g}", fontsize=9)
        color = plt.get_cmap("plasma")(0.85 * h / max(heads - 1, 1))
        profile.plot(np.arange(length), bias[h, length // 2], color=color, label=f"head {h}")
    _label_heads(maps, "key position j", "query position i")
    fig.colorbar(image, ax=maps, label="bias = -slope · |j - i|", shrink=0.9)
    profile.set_title(f"row i = {length // 2} of each head (dark: head 0)", fontsize=9)
    profile.set_xlabel("key position j")
    profile.set_ylabel("bias")
    if heads <= 8:
        profile.legend(fontsize="x-small", loc="lower center", ncol=2 if heads > 4 else 1)
    profile.set_box_aspect(1)
    fig.suptitle(f"ALiBi score bias, {heads} heads, length {length} (one colour scale)")
    paths += save(fig, args.out, "bias_alibi", args.format)

    num_buckets, max_distance = 32, 128
    maps = {
        "bidirectional (encoder)": t5_bucket_map(length, bidirectional=True),
        "unidirectional (decoder)": t5_bucket_map(length, bidirectional=False),
    }
    fig, axes = plt.subplots(
        1, 3, figsize=(14, 4.8), layout="constrained", gridspec_kw={"width_ratios": [1, 1, 1.3]}
    )
    cmap = plt.get_cmap("viridis", num_buckets)
    for ax, (label, buckets) in zip(axes[:2], maps.items(), strict=True):
        image = ax.imshow(
            buckets, cmap=cmap, vmin=-0.5, vmax=num_buckets - 0.5, interpolation="nearest"
        )
        ax.set_title(label)
        ax.set_xlabel("key position j")
        ax.set_ylabel("query position i")
    fig.colorbar(image, ax=list(axes[:2]), label="bucket (= the bias shown)", shrink=0.9)
    reach = int(1.5 * max_distance)
    offsets = torch.arange(-reach, reach + 1)
    for bidirectional, label in ((True, "bidirectional"), (False, "unidirectional")):
        buckets = t5_bucket(
            offsets,
            bidirectional=bidirectional,
            num_buckets=num_buckets,
            max_distance=max_distance,
        )
        axes[2].step(offsets.numpy(), buckets.numpy(), where="mid", label=label)
    for edge in (-max_distance, max_distance):
        axes[2].axvline(edge, color="grey", linewidth=0.8, linestyle=":")
    axes[2].set_xlabel("relative position j - i")
    axes[2].set_ylabel("bucket")
    axes[2].set_title(f"t5_bucket(j - i); dotted: ±max_distance = {max_distance}")
    axes[2].legend(loc="center right", fontsize="small")
    fig.suptitle(
        f"T5RelativeBias with embedding.weight[b, h] = b, so the bias shown is the bucket of "
        f"j - i\n(num_buckets={num_buckets}, max_distance={max_distance}, length {length}; "
        "the same for every head: training gives each (bucket, head) its own value)"
    )
    paths += save(fig, args.out, "bias_t5", args.format)

    bias, peaks = swin_bias_data(window, heads)
    n = window[0] * window[1]
    fig, axes = _head_axes(plt, heads)
    for h, ax in enumerate(axes):
        image = ax.imshow(bias[h], cmap="viridis", vmin=bias.min(), vmax=0, interpolation="nearest")
        dy, dx = (int(v) for v in peaks[h])
        ax.set_title(f"head {h}: peak ({dy:+d}, {dx:+d}), {_where_key(dy, dx)}", fontsize=9)
        for edge in range(window[1], n, window[1]):  # separate the rows of the window
            ax.axhline(edge - 0.5, color="white", linewidth=0.6)
            ax.axvline(edge - 0.5, color="white", linewidth=0.6)
    _label_heads(axes, "key token j (row-major)", "query token i (row-major)")
    fig.colorbar(image, ax=axes, label="bias = table[index(i, j), h]", shrink=0.9)
    fig.suptitle(
        f"Swin RelativePositionBias, window {window}, illustrative table "
        "-|(dy, dx) - peak|²/2 (not trained)\n(dy, dx) = (row_i - row_j, col_i - col_j); "
        "white lines separate window rows"
    )
    paths += save(fig, args.out, "bias_swin", args.format)
    return paths


# ----- rotary ----------------------------------------------------------------------------------


def _pairs(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """The rotated channel pairs of ``x [..., d]`` as complex numbers ``[..., r/2]``, frequency order."""
    half = rotary.rotary_dim // 2
    x = x[..., : rotary.rotary_dim]
    if rotary.interleaved:
        return torch.complex(x[..., 0::2], x[..., 1::2])
    return torch.complex(x[..., :half], x[..., half:])


def rotary_decay(rotary: Rotary, max_distance: int) -> tuple[np.ndarray, np.ndarray]:
    """RoFormer's long-term decay, measured on tensors rotated by ``rotary``.

    ``q = k = 1`` (all ones); ``q`` is rotated at position 0 and ``k`` at ``m = 0 ..
    max_distance``. Pair ``i`` of channels contributes ``t_i(m) = q_i conj(k_i(m))`` (as
    complex numbers) to ``q.k = Re sum_i t_i(m)``; ``e_i(m) = t_i(m) / t_i(0)`` is then
    ``exp(-i m theta_i)``, read off the tensors, not from a formula.

    Args:
        rotary: the :class:`~posenc.Rotary` to measure (any scaling, either layout).
        max_distance: the largest relative distance ``m``.

    Returns:
        ``(bound, cosine)``, each ``[max_distance + 1]``: ``bound[m]`` is RoFormer's relative
        upper bound ``(2/r) sum_{j=1}^{r/2} |sum_{i<j} e_i(m)|`` (section 3.4.3, Figure 2);
        ``cosine[m]`` is the cosine of the rotated ``q`` and ``k``.
    """
    d = rotary.head_dim
    q = torch.ones(1, 1, 1, d, dtype=torch.float64)  # [b, h, 1, d]
    k = torch.ones(1, 1, max_distance + 1, d, dtype=torch.float64)  # [b, h, m, d]
    q, k = rotary(q, k, torch.zeros(1, dtype=torch.long), torch.arange(max_distance + 1))
    terms = _pairs(q, rotary) * _pairs(k, rotary).conj()  # [1, 1, m, r/2]
    terms = terms[0, 0] / terms[0, 0, :1]  # [m, r/2], e_i(m)
    bound = terms.cumsum(-1).abs().mean(-1)  # [m]
    cosine = (q * k).sum(-1) / (q.norm(dim=-1) * k.norm(dim=-1))  # [1, 1, m]
    return bound.numpy(), cosine[0, 0].numpy()


def rotary_wavelengths(rotary: Rotary) -> np.ndarray:
    """The wavelength ``2 pi / theta_i`` of each rotated pair, from ``rotary.cos_sin`` at position 1."""
    cos, sin = rotary.cos_sin(torch.ones(1, 1, dtype=torch.long))  # [1, 1, r/2]
    return (2 * math.pi / torch.atan2(sin, cos)[0, 0]).numpy()


#: RoFormer's relative upper bound (section 3.4.3), in matplotlib's mathtext
_BOUND = r"$\frac{2}{d}\sum_{j=1}^{d/2}\left|\sum_{i<j} e^{\mathrm{i}\,m\theta_i}\right|$"


def _scalings(factor: float, trained: int) -> dict[str, RotaryScaling | None]:
    """The scalings compared, by legend label."""
    yarn = YaRNScaling(factor, trained)
    return {
        "no scaling": None,
        f"LinearScaling({factor:g})": LinearScaling(factor),
        f"NTKScaling({factor:g})": NTKScaling(factor),
        f"YaRNScaling({factor:g}, {trained}), logits ×{yarn.attention_factor**2:.3g}": yarn,
    }


def plot_rotary(args: argparse.Namespace) -> list[Path]:
    """RoPE's long-term decay, and how scaling stretches it."""
    plt = pyplot()
    dim = _even_dim(args, 128, low=4)
    length = _int_option(args, "length", 4096, low=8, high=65536)
    base = _base(args)
    factor = 4.0 if getattr(args, "factor", None) is None else args.factor
    if not math.isfinite(factor) or factor < 1:
        raise ValueError(f"--factor must be a number >= 1 (the context extension), got {factor}")
    trained = int(length // factor)
    if trained < 1:
        raise ValueError(f"--length ({length}) must be at least --factor ({factor:g})")
    distance = np.arange(length + 1)
    short = min(length, 256)  # RoFormer's Figure 2 spans a few hundred positions
    paths: list[Path] = []

    bound, cosine = rotary_decay(Rotary(dim, base=base), length)
    fig, axes = plt.subplots(2, 2, figsize=(12, 6.6), layout="constrained")
    curves = (
        (bound, f"relative upper bound {_BOUND}", "C0"),
        (cosine, "cos(R(0) q, R(m) k), q = k = 1", "C1"),
    )
    for row, (values, ylabel, color) in enumerate(curves):
        linear, log = axes[row]
        linear.plot(distance[: short + 1], values[: short + 1], color=color, linewidth=1.0)
        linear.set_xlim(0, short)
        log.plot(distance[1:], values[1:], color=color, linewidth=0.7)
        log.set_xscale("log")
        log.set_xlim(1, length)
        linear.set_ylabel(ylabel)
        for ax in (linear, log):
            ax.axhline(0.0, color="grey", linewidth=0.6)
            ax.grid(alpha=0.3)
    axes[0, 0].set_title(f"m = 0 .. {short} (as RoFormer's Figure 2)")
    axes[0, 1].set_title(f"m = 1 .. {length}, log scale")
    for ax in axes[1]:
        ax.set_xlabel("relative distance m (q at position 0, k at position m)")
    fig.suptitle(
        f"RoPE long-term decay (RoFormer section 3.4.3): Rotary(head_dim={dim}, base={base:g}) "
        "applied to all-ones q and k\ntop: RoFormer's bound on |q·k|; bottom: the cosine of the "
        "rotated vectors"
    )
    paths += save(fig, args.out, "rotary_decay", args.format)

    fig, (ax_wave, ax_decay) = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    for label, scaling in _scalings(factor, trained).items():
        rotary = Rotary(dim, base=base, scaling=scaling)
        ax_wave.plot(rotary_wavelengths(rotary), label=label, linewidth=1.2)
        ax_decay.plot(distance[1:], rotary_decay(rotary, length)[0][1:], label=label, linewidth=0.8)
    ax_wave.axhline(trained, color="grey", linestyle="--", linewidth=0.8)
    ax_wave.axhline(length, color="black", linestyle=":", linewidth=0.8)
    ax_wave.text(0, trained, f" trained context {trained}", va="bottom", fontsize=8, color="grey")
    ax_wave.text(0, length, f" extended context {length}", va="bottom", fontsize=8)
    ax_wave.set_yscale("log")
    ax_wave.set_xlabel("frequency index i (pair of channels)")
    ax_wave.set_ylabel(r"wavelength $2\pi / \theta_i$ (positions)")
    ax_wave.set_title("per-frequency wavelengths")
    ax_wave.legend(loc="lower right", fontsize="small")
    ax_decay.axvline(trained, color="grey", linestyle="--", linewidth=0.8)
    ax_decay.text(trained, 0, " trained context", fontsize=8, color="grey", va="bottom")
    ax_decay.set_xscale("log")
    ax_decay.set_xlim(1, length)
    ax_decay.set_ylim(bottom=0)
    ax_decay.set_xlabel("relative distance m (log scale)")
    ax_decay.set_ylabel(f"relative upper bound {_BOUND}")
    ax_decay.set_title("RoFormer's decay bound with each scaling")
    ax_decay.legend(loc="lower left", fontsize="small")
    ax_decay.grid(alpha=0.3)
    fig.suptitle(
        f"RoPE scaling: trained on {trained} positions, extended ×{factor:g} to {length} "
        f"(head_dim={dim}, base={base:g})"
    )
    paths += save(fig, args.out, "rotary_scaling", args.format)
    return paths


# ----- the command ---------------------------------------------------------------------------

#: kind -> function drawing it; add a kind by registering ``plot_<kind>(args) -> list[Path]``
KINDS: dict[str, Callable[[argparse.Namespace], list[Path]]] = {
    "sinusoidal": plot_sinusoidal,
    "similarity": plot_similarity,
    "skew": plot_skew,
    "swin-index": plot_swin_index,
    "bias": plot_bias,
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
        "--window", type=_window_type, help="Swin window Wh,Ww (swin-index: 3,3; bias: 4,4)"
    )
    parser.add_argument("--heads", type=positive_int, help="attention heads (bias: 4)")
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
