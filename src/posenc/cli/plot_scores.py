"""``posenc plot`` kinds of the index arithmetic and the score biases: ``skew``,
``swin-index``, ``bias``.

The relative -> absolute skew on a matrix of offsets, Swin's relative position index and
the offset each table row serves, and the per-head biases of ALiBi, T5 (its buckets) and
Swin (an illustrative smooth table). The pure ``*_data``-style functions arrange posenc's
output for drawing and are what the tests check; ``plot_<kind>(args) -> list[Path]``
draws a kind.

Shape legend: ``L`` length, ``N = Wh * Ww`` tokens of a window, ``R`` table rows.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..bias import ALiBi, RelativePositionBias, T5RelativeBias
from ..indices import relative_position_index, relative_to_absolute, t5_bucket
from ._figures import annotate, cell_grid, fade, outline_rows, pyplot, save
from ._plot_options import int_option, window_option

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
    length = int_option(args, "length", 5, low=2, high=12)
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
    wh, ww = window_option(args, (3, 3), max_tokens=25)
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
    heads = int_option(args, "heads", 4, high=16)
    length = int_option(args, "length", 64, low=2, high=1024)
    window = window_option(args, (4, 4), max_tokens=256)
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
