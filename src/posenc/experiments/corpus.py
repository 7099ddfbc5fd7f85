"""Real text for the ``lm`` task of ``posenc compare``: bytes, split into training and
held-out text.

By default the corpus is the Python standard library's own source, which every machine
with Python has and no one here wrote: the top-level ``*.py`` files of
``sysconfig.get_paths()["stdlib"]`` whose name does not start with ``_`` (private and
machine-generated modules such as ``_sysconfigdata_*`` are left out), in sorted order.
Any UTF-8 text file or folder of them can replace it (``posenc compare --corpus PATH``).

The split is by file and depends on a file's name only, so that one file more or less
(another Python version) moves no other file between the two sides: a file is held out
when ``zlib.crc32(name) % 5 == 0`` (its path relative to the folder; about one file in
five). The training text is the training files concatenated in sorted order and cut at
:data:`TRAIN_BYTES`, the held-out text the held-out files cut at :data:`HELD_OUT_BYTES`.
A single file, or a folder whose files all fall on one side, is split by position
instead: its last tenth (at most :data:`HELD_OUT_BYTES`) is held out.

Shape legend: ``t`` bytes of text.
"""

from __future__ import annotations

import functools
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import _validate as check

__all__ = [
    "HELD_OUT_BYTES",
    "HELD_OUT_EVERY",
    "STDLIB",
    "TRAIN_BYTES",
    "Corpus",
    "is_held_out",
    "load_corpus",
    "stdlib_files",
]

#: the name of the default corpus (the standard library's source)
STDLIB = "stdlib"
#: training text kept, in bytes
TRAIN_BYTES = 2 * 2**20
#: held-out text kept, in bytes
HELD_OUT_BYTES = 256 * 2**10
#: one file in this many is held out (by the CRC-32 of its name)
HELD_OUT_EVERY = 5
#: the share of the text held out when the split is by position
TAIL_SHARE = 0.1


@dataclass(frozen=True, eq=False)
class Corpus:
    """A corpus as bytes, split into training and held-out text.

    Attributes:
        source: ``"stdlib"`` or the path given.
        root: the folder the file names are relative to (the file itself for one file).
        train: ``[t]`` uint8, the training text.
        held_out: ``[t]`` uint8, the held-out text.
        train_files: the files the training text comes from, in order.
        held_out_files: the files the held-out text comes from, in order.
        split: ``"files"`` (held-out files) or ``"tail"`` (the end of the text).
    """

    source: str
    root: str
    train: Tensor
    held_out: Tensor
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]
    split: str

    def describe(self) -> dict[str, Any]:
        """What the JSON record says of the corpus: where, which files, how many bytes."""
        return {
            "source": self.source,
            "root": self.root,
            "split": self.split,
            "train_bytes": int(self.train.numel()),
            "held_out_bytes": int(self.held_out.numel()),
            "train_files": list(self.train_files),
            "held_out_files": list(self.held_out_files),
        }


def is_held_out(name: str) -> bool:
    """Whether the file called ``name`` (relative to its folder) is held out."""
    return zlib.crc32(name.encode("utf-8")) % HELD_OUT_EVERY == 0


def stdlib_files() -> tuple[Path, list[Path]]:
    """``(folder, files)``: the standard library's folder and its corpus files, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_") and p.is_file())
    return root, files


def _folder_files(root: Path) -> list[Path]:
    """Every file under ``root``, sorted by relative path; hidden files and folders left out."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def _read(path: Path) -> bytes:
    """The bytes of ``path``, checked to be UTF-8 text.

    Raises:
        ValueError: the file is not UTF-8, naming it, the offending byte and the fix.
    """
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"corpus file {path} is not UTF-8 text ({err.reason} at byte {err.start}); "
            f"convert it to UTF-8, or give --corpus a folder without it"
        ) from None
    return data


def _gather(root: Path, files: list[Path], budget: int) -> tuple[bytes, list[tuple[str, int]]]:
    """Concatenate ``files`` in order up to ``budget`` bytes: ``(text, [(name, bytes
    used)])``, the last file cut where the budget ends."""
    parts: list[bytes] = []
    used: list[tuple[str, int]] = []
    size = 0
    for path in files:
        if size >= budget:
            break
        data = _read(path)[: budget - size]
        if data:
            parts.append(data)
            used.append((path.relative_to(root).as_posix(), len(data)))
            size += len(data)
    return b"".join(parts), used


def _names(used: list[tuple[str, int]], start: int, stop: int) -> tuple[str, ...]:
    """The names of ``used`` (from :func:`_gather`) whose bytes meet ``[start, stop)``."""
    names, offset = [], 0
    for name, size in used:
        if offset < stop and offset + size > start:
            names.append(name)
        offset += size
    return tuple(names)


def _bytes(data: bytes) -> Tensor:
    """``data`` as a ``[t]`` uint8 tensor."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@functools.lru_cache(maxsize=4)
def load_corpus(
    path: str | None = None,
    *,
    train_bytes: int = TRAIN_BYTES,
    held_out_bytes: int = HELD_OUT_BYTES,
) -> Corpus:
    """Load a corpus (see the module docstring for the files and the split).

    Loaded once per process and argument set (cached).

    Args:
        path: a UTF-8 text file or a folder of them; None (or ``"stdlib"``): the Python
            standard library's source.
        train_bytes: training text kept, in bytes.
        held_out_bytes: held-out text kept, in bytes.

    Returns:
        The :class:`Corpus`.

    Raises:
        ValueError: no such file or folder, a file that is not UTF-8, no text at all, or
            text on one side of the split only.
    """
    check.positive_int("train_bytes", train_bytes)
    check.positive_int("held_out_bytes", held_out_bytes)
    if path is None or path == STDLIB:
        source = STDLIB
        root, files = stdlib_files()
    else:
        source = str(path)
        given = Path(path).expanduser()
        if given.is_file():
            root, files = given.parent, [given]
        elif given.is_dir():
            root, files = given, _folder_files(given)
        else:
            raise ValueError(
                f"corpus {path!r} is not a file or a folder; give a UTF-8 text file or a "
                f"folder of them"
            )
    names = [p.relative_to(root).as_posix() for p in files]
    held = [p for p, name in zip(files, names, strict=True) if is_held_out(name)]
    kept = [p for p, name in zip(files, names, strict=True) if not is_held_out(name)]
    train_text, train_used = _gather(root, kept, train_bytes)
    held_text, held_used = _gather(root, held, held_out_bytes)
    train_names = _names(train_used, 0, len(train_text))
    held_names = _names(held_used, 0, len(held_text))
    split = "files"
    if not train_text or not held_text:  # one side empty: hold out the tail of the text
        split = "tail"
        text, used = _gather(root, files, train_bytes + held_out_bytes)
        cut = len(text) - min(held_out_bytes, int(len(text) * TAIL_SHARE))
        train_text, held_text = text[:cut], text[cut:]
        train_names, held_names = _names(used, 0, cut), _names(used, cut, len(text))
    total = len(train_text) + len(held_text)
    if total == 0:
        raise ValueError(
            f"corpus {source!r} holds no text ({len(files)} file(s), all empty); give a "
            f"UTF-8 text file or a folder of them"
        )
    if not train_text or not held_text:
        raise ValueError(
            f"corpus {source!r} holds too little text ({total} bytes in {len(files)} "
            f"file(s)) to split into training and held-out text; "
            f"give a file or folder with more UTF-8 text"
        )
    return Corpus(
        source=source,
        root=str(root),
        train=_bytes(train_text),
        held_out=_bytes(held_text),
        train_files=train_names,
        held_out_files=held_names,
        split=split,
    )
