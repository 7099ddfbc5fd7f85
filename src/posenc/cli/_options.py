"""Argument types shared by the commands: each rejects a bad value with a clear message.

They are argparse ``type=`` functions, so a bad value stops the command before it starts:
argparse prints the argument's name before the message and exits with status 2, e.g.
``posenc bench: error: argument --batch: must be >= 1, got 0``. Every command takes its
numbers, lists and paths through these, so the same mistake reads the same everywhere.

Paths are checked without writing anything: an output folder must be a folder or
creatable (no file on its way, permission to write), an output file must not be a folder
and must be creatable, an input folder must exist.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .. import registry

# ----- numbers -------------------------------------------------------------------------------


def int_at_least(low: int) -> Callable[[str], int]:
    """The type of a whole number >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


#: a whole number >= 1 (sizes, counts, repeats)
positive_int = int_at_least(1)
#: a whole number >= 0 (warm-up runs)
non_negative_int = int_at_least(0)


def float_above(low: float, *, inclusive: bool = False, hint: str = "") -> Callable[[str], float]:
    """The type of a finite number > ``low`` (>= with ``inclusive``); ``hint`` follows the
    bound in the message, e.g. ``" (the context extension)"``."""
    bound = f"{'>=' if inclusive else '>'} {low:g}{hint}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text.strip()}")
        return value

    parse.__name__ = f"number {bound}"
    return parse


#: a finite number > 0 (learning rates)
positive_float = float_above(0.0)


def positive_int_list(text: str) -> list[int]:
    """Comma-separated whole numbers >= 1, e.g. ``512,1024``; each once, in the order first
    given."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated integers >= 1 (e.g. 512,1024), got {text!r}"
        )
    return list(dict.fromkeys(values))


def scheme_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """The type of comma-separated scheme names of :mod:`posenc.registry`, among ``allowed``.

    An old name (:data:`posenc.registry.ALIASES`, e.g. ``swin``) still works: it gives
    today's name (``swin-1d``), with a note on stderr that the old one will go. Each scheme
    comes once, in the order first named (an old name and today's are one scheme).
    """

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if registry.ALIASES.get(n, n) not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown scheme(s) {', '.join(unknown) or text!r}; "
                f"choose from {', '.join(allowed)}"
            )
        for old in dict.fromkeys(n for n in names if n in registry.ALIASES):
            print(
                f"posenc: note: scheme {old!r} is now called {registry.ALIASES[old]!r}; "
                "the old name still works but will be removed",
                file=sys.stderr,
            )
        return list(dict.fromkeys(registry.ALIASES.get(n, n) for n in names))

    parse.__name__ = "scheme list"
    return parse


def aliases_note(allowed: Sequence[str]) -> str:
    """``--help`` text on the old names of ``allowed``: ``" (old names: swin = swin-1d)"``."""
    old = [f"{a} = {n}" for a, n in registry.ALIASES.items() if n in allowed]
    return f" (deprecated old names: {', '.join(old)})" if old else ""


def formats(text: str) -> list[str]:
    """Image formats: ``png``, ``svg`` or ``png,svg``."""
    names = [f.strip().lower() for f in text.split(",") if f.strip()]
    if not names or any(f not in ("png", "svg") for f in names):
        raise argparse.ArgumentTypeError(f"must be png, svg or png,svg, got {text!r}")
    return names


# ----- paths ---------------------------------------------------------------------------------


def _check_creatable(path: Path) -> None:
    """Raise when ``path`` (absent) cannot be created: an existing ancestor of it is a file,
    or the nearest existing one is a folder this process cannot write in."""
    for parent in path.parents:
        if not os.path.exists(parent):
            continue
        if not os.path.isdir(parent):
            raise argparse.ArgumentTypeError(
                f"cannot create {str(path)!r}: {str(parent)!r} is a file, not a folder; "
                "choose another path"
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(
                f"cannot create {str(path)!r}: no permission to write in {str(parent)!r}; "
                "choose another path"
            )
        return


def output_dir(*, files: Sequence[str] = (), folders: Sequence[str] = ()) -> Callable[[str], Path]:
    """The type of a folder a command writes into (created when missing).

    Args:
        files: names of the files the command writes in it (each must not be a folder).
        folders: names of the folders it makes in it (each must not be a file).
    """

    def parse(text: str) -> Path:
        path = Path(text)
        if not os.path.exists(path):
            _check_creatable(path)
            return path
        if not os.path.isdir(path):
            raise argparse.ArgumentTypeError(
                f"{text!r} is a file; pass a folder (it is created if missing)"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(
                f"no permission to write in {text!r}; choose another folder"
            )
        for name in files:
            if os.path.isdir(path / name):
                raise argparse.ArgumentTypeError(
                    f"{str(path / name)!r} is a folder, but the command writes a file there; "
                    "remove it or choose another folder"
                )
        for name in folders:
            if os.path.exists(path / name) and not os.path.isdir(path / name):
                raise argparse.ArgumentTypeError(
                    f"{str(path / name)!r} is a file, but the command makes a folder there; "
                    "remove it or choose another folder"
                )
        return path

    parse.__name__ = "output folder"
    return parse


def output_file(example: str) -> Callable[[str], Path]:
    """The type of a file a command writes (its folders are created when missing);
    ``example`` is the file name the message suggests when given a folder."""

    def parse(text: str) -> Path:
        path = Path(text)
        if os.path.isdir(path):
            raise argparse.ArgumentTypeError(
                f"{text!r} is a folder; pass a file name, e.g. {str(path / example)!r}"
            )
        if not os.path.exists(path):
            _check_creatable(path)
        elif not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(
                f"no permission to write {text!r}; choose another file"
            )
        return path

    parse.__name__ = "output file"
    return parse


def input_dir(hint: str = "") -> Callable[[str], Path]:
    """The type of a folder a command reads; ``hint`` ends the message (how to make one)."""

    def parse(text: str) -> Path:
        path = Path(text)
        if not os.path.exists(path):
            raise argparse.ArgumentTypeError(f"no folder {text!r}{hint}")
        if not os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder{hint}")
        return path

    parse.__name__ = "input folder"
    return parse


# ----- devices -------------------------------------------------------------------------------


def device(text: str) -> str:
    """A torch device that this machine has (``cpu``, ``cuda``, ``cuda:1``, ``mps``)."""
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"unknown device {text!r}; use cpu, cuda or cuda:N"
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"device {text!r} asked for, but this torch build sees no CUDA GPU; use cpu"
        )
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"device {text!r} asked for, but there are {torch.cuda.device_count()} CUDA GPU(s)"
        )
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"device {text!r} is not available here; use cpu")
    return text
