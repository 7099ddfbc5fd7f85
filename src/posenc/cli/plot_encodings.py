"""``posenc plot`` kinds of the encodings themselves: ``sinusoidal``, ``similarity``, ``rotary``.

The sinusoidal table (its columns, heat map and cosine similarity), the position-by-position
similarity of any table of position vectors (:func:`similarity_figure`, also for the learned
tables that ``posenc compare`` trained), and RoPE's long-term decay with what each scaling
does to it. The pure ``*_data``-style functions arrange posenc's output for drawing and are
what the tests check; ``plot_<kind>(args) -> list[Path]`` draws a kind.

Shape legend: ``n`` positions, ``d`` head dim, ``r`` rotated channels.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..absolute import sinusoidal
from ..rotary import LinearScaling, NTKScaling, Rotary, RotaryScaling, YaRNScaling
from ._figures import pyplot, save
from ._plot_options import base_option, even_dim, int_option
from .plot_trained import learned_tables

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
    dim = int_option(args, "dim", 32)
    if dim < 10:
        raise ValueError(f"--dim must be at least 10 to show columns 6-9, got {dim}")
    dim = even_dim(args, 32)
    length = int_option(args, "length", 60, low=2)
    base = base_option(args)
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
    dim = even_dim(args, 64)
    length = int_option(args, "length", 100, low=2)
    base = base_option(args)
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
    dim = even_dim(args, 128, low=4)
    length = int_option(args, "length", 4096, low=8, high=65536)
    base = base_option(args)
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
