"""The options of ``posenc plot``'s kinds: each kind reads the few it needs, with its defaults.

A value out of a kind's range raises ``ValueError`` naming the option and the kind, before
anything is drawn (``posenc`` turns it into exit status 2).
"""

from __future__ import annotations

import argparse
import math
import re

__all__ = ["base_option", "even_dim", "int_option", "parse_window", "window_option", "window_type"]


def int_option(
    args: argparse.Namespace, name: str, default: int, *, low: int = 1, high: int | None = None
) -> int:
    """``--name`` (or the kind's default), checked to lie in ``[low, high]``."""
    value = getattr(args, name.replace("-", "_"), None)
    value = default if value is None else value
    if value < low or (high is not None and value > high):
        allowed = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"--{name} must be {allowed} for `posenc plot {args.kind}`, got {value}")
    return value


def even_dim(args: argparse.Namespace, default: int, *, low: int = 2) -> int:
    """``--dim`` (or the kind's default), at least ``low`` and even."""
    dim = int_option(args, "dim", default, low=low)
    if dim % 2:
        raise ValueError(
            f"--dim must be even (every frequency needs a pair of channels), got {dim}; "
            f"use {dim + 1} or {dim - 1}"
        )
    return dim


def base_option(args: argparse.Namespace) -> float:
    """``--base`` (default 10000), a finite number > 1."""
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


def window_type(text: str) -> tuple[int, int]:
    """``--window`` for argparse: :func:`parse_window`, its message without the option name
    (argparse puts ``argument --window:`` before it)."""
    try:
        return parse_window(text, (1, 1))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--window ")) from None


def window_option(
    args: argparse.Namespace, default: tuple[int, int], max_tokens: int
) -> tuple[int, int]:
    """``--window`` (or the kind's default), with at most ``max_tokens`` tokens."""
    window = getattr(args, "window", None)  # parsed by argparse, or text when built by hand
    window = parse_window(window, default) if window is None or isinstance(window, str) else window
    if window[0] * window[1] > max_tokens:
        raise ValueError(
            f"--window {window[0]},{window[1]} has {window[0] * window[1]} tokens; "
            f"`posenc plot {args.kind}` draws at most {max_tokens} (the cells would be unreadable)"
        )
    return window
