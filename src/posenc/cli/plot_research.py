"""``posenc plot`` kinds for the length-generalisation research schemes.

- ``distance``: the score bias against the distance to the key for a query late in a
  sequence, per head: ALiBi and T5 beside KERPLE and FIRE.
- ``cope``: CoPE's contextual positions on a sentence whose gates open on full stops:
  the position of a key counts the sentences back, not the tokens.
- ``cpb``: Swin V2's continuous position bias for the window it was built for and a
  window twice as wide, from the same network, and the log-spaced coordinates it reads.

Shape legend: ``h`` heads, ``L`` the longest distance drawn, ``n`` tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from .. import registry
from ..bias_continuous import ContinuousPositionBias, log_spaced_coordinates
from ..embedding_research import contextual_positions
from ._figures import pyplot, save
from ._plot_options import int_option, window_option

#: the 1-D score biases ``distance`` draws, those of the registry, in this order
DISTANCE_SCHEMES = ("alibi", "t5", "kerple-log", "kerple-power", "sandwich", "fire")


@torch.no_grad()
def distance_data(name: str, heads: int, length: int) -> np.ndarray:
    """The bias a query at position ``L`` gives the key ``t`` places back, per head.

    Built from the registry at its initialisation (seed 0), read through the scheme's
    ``score_bias`` hook: ``score_bias(q_pos = [[L]], k_pos = [[L, L-1, ..., 0]])``.

    Args:
        name: a 1-D score bias of the registry.
        heads: heads.
        length: ``L``.

    Returns:
        ``[heads, L + 1]`` float64, entry ``[h, t]`` the bias at distance ``t``.
    """
    torch.manual_seed(0)
    shape = registry.Shape(heads=heads, head_dim=64, max_len=length + 1, causal=True)
    scheme = registry.build(name, shape)
    q_pos = torch.tensor([[length]])  # [1, 1]
    k_pos = torch.arange(length, -1, -1)[None]  # [1, L + 1], distance 0 first
    bias = scheme.score_bias(q_pos, k_pos)  # [1, h or 1, 1, L + 1]
    return bias[0, :, 0].double().expand(heads, -1).numpy()


def plot_distance(args: argparse.Namespace) -> list[Path]:
    """One panel per scheme: the bias against the distance back to the key, a line per head."""
    plt = pyplot()
    heads = int_option(args, "heads", 8, high=16)
    length = int_option(args, "length", 512, low=2, high=16384)
    names = [name for name in DISTANCE_SCHEMES if name in registry.SCHEMES]
    fig, axes = plt.subplots(
        2, (len(names) + 1) // 2, figsize=(4.2 * ((len(names) + 1) // 2), 7.4), squeeze=False
    )
    distance = np.arange(length + 1)
    cmap = plt.get_cmap("viridis")
    for ax, name in zip(axes.ravel(), names, strict=False):
        bias = distance_data(name, heads, length)
        for h in range(heads):
            ax.plot(distance, bias[h], color=cmap(0.9 * h / max(heads - 1, 1)), linewidth=1.2)
        entry = registry.get(name)
        state = "at initialisation (learned)" if entry.learned else "fixed"
        ax.set_title(f"{name}: {state}", fontsize=10)
        ax.set_xlabel("distance back to the key, i - j")
        ax.set_ylabel("bias added to the score")
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(names) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"Score bias against distance for a query at position {length}, {heads} heads "
        f"(dark: head 0)"
    )
    fig.tight_layout()
    return save(fig, args.out, "distance", args.format)


#: the example ``cope`` counts on: the gates open on its full stops
COPE_TEXT = "The cat sat. It purred. Then it slept. A dog came by. The cat woke."


@torch.no_grad()
def cope_data(text: str = COPE_TEXT, *, sharpness: float = 12.0) -> tuple[np.ndarray, ...]:
    """CoPE's positions for a query at the last character of ``text``, gates on full stops.

    The logits are those of a query that matches the full stops: ``z_j = +s`` for a key
    that is ``"."`` and ``-s`` for any other (``s = sharpness``), so the gate
    ``sigmoid(z_j)`` is about 1 on the full stops and about 0 elsewhere, and
    :func:`~posenc.embedding_research.contextual_positions` counts the sentence ends
    between each key and the query (causal: the query sees every character).

    Returns:
        ``(gates [n], contextual positions [n], token distances [n])``, float64, per key.
    """
    stops = torch.tensor([c == "." for c in text])  # [n]
    logits = torch.where(stops, sharpness, -sharpness).double()[None]  # [1, n]: one query
    positions = contextual_positions(logits, max_position=len(text))[0]  # [n]
    distance = torch.arange(len(text) - 1, -1, -1, dtype=torch.float64)  # [n]: i - j
    return torch.sigmoid(logits[0]).numpy(), positions.numpy(), distance.numpy()


def plot_cope(args: argparse.Namespace) -> list[Path]:
    """CoPE's position of every key for the last query, against its token distance."""
    plt = pyplot()
    gates, positions, distance = cope_data()
    n = len(COPE_TEXT)
    fig, (ax_gates, ax_pos) = plt.subplots(
        2, 1, figsize=(13, 5.6), sharex=True, gridspec_kw={"height_ratios": [1, 2.2]}
    )
    keys = np.arange(n)
    ax_gates.bar(keys, gates, color="tab:orange")
    ax_gates.set_ylabel("gate sigmoid(z)")
    ax_gates.set_title("gates of the last query: open on the full stops", fontsize=10)
    ax_pos.step(keys, positions, where="mid", color="tab:blue", linewidth=2)
    ax_pos.set_ylabel("CoPE position (gates summed from j to i)", color="tab:blue")
    ax_dist = ax_pos.twinx()
    ax_dist.plot(keys, distance, color="0.5", linestyle="--")
    ax_dist.set_ylabel("token distance i - j (dashed)", color="0.4")
    ax_pos.set_xticks(keys, list(COPE_TEXT.replace(" ", "\u2423")), fontsize=8)
    ax_pos.set_xlabel("key j (characters; the query is the last one)")
    fig.suptitle("CoPE counts what its gates select: here sentences, not characters")
    fig.tight_layout()
    return save(fig, args.out, "cope", args.format)


@torch.no_grad()
def cpb_data(window: tuple[int, int], heads: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Head 0 of Swin V2's bias on ``window`` and on a window twice as large, one network.

    The module is built for ``window`` (seed 0, Swin V2's initialisation), so both are
    normalised by it: the larger window reads offsets past the built ones on the same
    log-spaced curve.

    Returns:
        ``(built [2H-1, 2W-1], doubled [4H-1, 4W-1])``: the bias of each 2-D offset
        ``(dr, dc)``, key minus query, from ``grid_table``.
    """
    torch.manual_seed(0)
    cpb = ContinuousPositionBias(window, heads)
    built = cpb.grid_table()[..., 0].double().numpy()  # [2H-1, 2W-1]
    cpb.size = (2 * window[0], 2 * window[1])
    doubled = cpb.grid_table()[..., 0].double().numpy()  # [4H-1, 4W-1]
    return built, doubled


def plot_cpb(args: argparse.Namespace) -> list[Path]:
    """Swin V2's CPB: log-spaced coordinates, and one network's bias on two windows."""
    plt = pyplot()
    window = window_option(args, (8, 8), max_tokens=1024)
    built, doubled = cpb_data(window)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), layout="constrained")
    reach = 2 * window[1] - 1
    offsets = torch.arange(-reach, reach + 1)
    coords = log_spaced_coordinates(torch.zeros_like(offsets), offsets, window, dtype=torch.float64)
    axes[0].plot(offsets.numpy(), coords[:, 1].numpy(), label="log-spaced (Swin V2)")
    edge = float(coords[reach + window[1] - 1, 1])  # the log-spaced value at the built edge
    linear = -offsets.double() / max(window[1] - 1, 1) * abs(edge)  # meets it there
    axes[0].plot(offsets.numpy(), linear.numpy(), linestyle="--", label="linear, same edge")
    for edge in (-(window[1] - 1), window[1] - 1):
        axes[0].axvline(edge, color="grey", linewidth=0.8, linestyle=":")
    axes[0].set_xlabel("column offset c_j - c_i")
    axes[0].set_ylabel("coordinate the network reads")
    axes[0].set_title("dotted: the built window's largest offset", fontsize=9)
    axes[0].legend(fontsize="small")
    low, high = min(built.min(), doubled.min()), max(built.max(), doubled.max())
    for ax, table, label in ((axes[1], built, "built"), (axes[2], doubled, "twice as large")):
        rows, cols = (table.shape[0] + 1) // 2, (table.shape[1] + 1) // 2
        extent = (-(cols - 1) - 0.5, cols - 0.5, rows - 0.5, -(rows - 1) - 0.5)
        image = ax.imshow(table, cmap="viridis", vmin=low, vmax=high, extent=extent)
        ax.set_title(f"head 0, window {rows}x{cols} ({label})", fontsize=10)
        ax.set_xlabel("column offset")
        ax.set_ylabel("row offset")
    fig.colorbar(image, ax=list(axes[1:]), label="bias 16 sigmoid(MLP), at initialisation")
    fig.suptitle(f"Swin V2 continuous position bias: one network, any window (built {window})")
    return save(fig, args.out, "cpb", args.format)
