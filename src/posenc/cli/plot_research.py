"""``posenc plot`` kinds for the length-generalisation research schemes.

- ``distance``: the score bias against the distance to the key for a query late in a
  sequence, per head: ALiBi and T5 beside KERPLE, Sandwich and FIRE.

Shape legend: ``h`` heads, ``L`` the longest distance drawn.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from .. import registry
from ._figures import pyplot, save
from ._plot_options import int_option

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
