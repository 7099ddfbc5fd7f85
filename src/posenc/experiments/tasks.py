"""Synthetic tasks on which positional information is necessary and the answer is known.

Each task draws seeded batches of any length, so that a model trained at one length can be
tested at longer ones. Targets are token ids, :data:`IGNORE` where a position has no
answer (it is left out of the loss and of the accuracy).

- ``shift``: ``y_i = x_{i - delta}`` over random tokens, bidirectional. Needs the relative
  offset ``-delta``; without positions the model cannot tell which token is ``delta``
  back, and is at chance (``1 / vocab``).
- ``copy``: a causal language model on ``a_1 .. a_m SEP a_1 .. a_m``, scored on the second
  half. Needs to find, for each token after ``SEP``, the token ``m`` places back:
  content (``SEP``) plus relative position (an induction head), or absolute positions
  that only cover the trained length.
- ``grid``: random tokens on an ``H x W`` grid (row-major), output the token of the cell
  above. On the flattened sequence the cell above is ``W`` places back: a 1-D relative
  scheme learns the offset ``-W`` of the training grid and fails on a wider grid; a 2-D
  scheme learns the offset ``(-1, 0)``, which holds on any grid.

Shape legend: ``b`` batch, ``n`` tokens, ``H x W`` a grid (``n = H * W``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import _validate as check

__all__ = ["IGNORE", "TASKS", "Batch", "CopyTask", "GridTask", "ShiftTask", "Task", "get_task"]

#: target id of a position with no answer (``torch.nn.functional.cross_entropy``'s default)
IGNORE = -100


@dataclass(frozen=True)
class Batch:
    """A batch of a task.

    Attributes:
        tokens: ``[b, n]`` input token ids.
        targets: ``[b, n]`` target ids, :data:`IGNORE` where there is no answer.
        size: ``(H, W)`` when the tokens are a grid, else None.
    """

    tokens: Tensor
    targets: Tensor
    size: tuple[int, int] | None = None


@dataclass(frozen=True)
class Task:
    """A task: its vocabulary, attention direction, and lengths to train and test at.

    Lengths are token counts, or ``(H, W)`` grids for 2-D tasks.
    """

    name: str = ""
    vocab: int = 16
    causal: bool = False
    two_d: bool = False
    train_length: int | tuple[int, int] = 32
    test_lengths: tuple[int | tuple[int, int], ...] = (32, 64, 128)
    summary: str = field(default="", compare=False)

    def sample(
        self, batch: int, length: int | tuple[int, int], generator: torch.Generator
    ) -> Batch:
        """Draw ``batch`` examples of ``length`` (seeded by ``generator``)."""
        raise NotImplementedError

    @property
    def chance(self) -> float:
        """The accuracy of a uniform guess among the possible answers."""
        return 1 / self.vocab

    def tokens_of(self, length: int | tuple[int, int]) -> int:
        """The number of tokens of an example of ``length``."""
        return length[0] * length[1] if isinstance(length, tuple) else int(length)

    def label(self, length: int | tuple[int, int]) -> str:
        """``"32"`` or ``"6x6"``: how a length is written in tables."""
        return f"{length[0]}x{length[1]}" if isinstance(length, tuple) else str(length)


@dataclass(frozen=True)
class ShiftTask(Task):
    """``y_i = x_{i - delta}`` (bidirectional); the first ``delta`` positions have no answer."""

    name: str = "shift"
    delta: int = 3
    summary: str = field(default="output the token `delta` places back (bidirectional)")

    def sample(
        self, batch: int, length: int | tuple[int, int], generator: torch.Generator
    ) -> Batch:
        n = check.positive_int("length", length)
        if n <= self.delta:
            raise ValueError(
                f"shift needs a length > delta = {self.delta} (else nothing is scored), got {n}"
            )
        tokens = torch.randint(0, self.vocab, (batch, n), generator=generator)  # [b, n]
        targets = torch.full_like(tokens, IGNORE)
        targets[:, self.delta :] = tokens[:, : n - self.delta]
        return Batch(tokens, targets)


@dataclass(frozen=True)
class CopyTask(Task):
    """Causal LM on ``a_1 .. a_m SEP a_1 .. a_m`` (``n = 2m`` inputs), scored after ``SEP``.

    Symbols ``a`` are drawn from ``1 .. vocab-1``; ``SEP`` is 0. The inputs are the sequence
    without its last token and the targets the sequence shifted by one, so the model
    predicts ``a_1`` at ``SEP`` and every later symbol of the copy from its prefix.
    """

    name: str = "copy"
    causal: bool = True
    summary: str = field(default="causal LM on `a b c d SEP a b c d`: predict the copy")

    @property
    def chance(self) -> float:
        """The answers are the symbols ``1 .. vocab-1``."""
        return 1 / (self.vocab - 1)

    def sample(
        self, batch: int, length: int | tuple[int, int], generator: torch.Generator
    ) -> Batch:
        n = check.positive_int("length", length)
        if n % 2 or n < 4:
            raise ValueError(f"copy needs an even length >= 4 (2m tokens), got {n}")
        m = n // 2
        symbols = torch.randint(1, self.vocab, (batch, m), generator=generator)  # [b, m]
        sep = torch.zeros(batch, 1, dtype=symbols.dtype)
        full = torch.cat((symbols, sep, symbols), dim=1)  # [b, 2m + 1]
        tokens, targets = full[:, :-1], full[:, 1:].clone()  # [b, n] each
        targets[:, :m] = IGNORE  # only the copy is scored
        return Batch(tokens, targets)


@dataclass(frozen=True)
class GridTask(Task):
    """Random tokens on an ``H x W`` grid; output the token of the cell above (row 0: none)."""

    name: str = "grid"
    two_d: bool = True
    train_length: int | tuple[int, int] = (6, 6)
    test_lengths: tuple[int | tuple[int, int], ...] = ((6, 6), (9, 9), (12, 12))
    summary: str = field(default="tokens on an H x W grid: output the token of the cell above")

    def sample(
        self, batch: int, length: int | tuple[int, int], generator: torch.Generator
    ) -> Batch:
        if not isinstance(length, tuple):
            raise ValueError(f"grid lengths are (H, W) pairs, got {length!r}")
        h, w = length
        if h < 2 or w < 1:
            raise ValueError(
                f"grid needs at least 2 rows (row 0 has no cell above) and 1 column, got {h}x{w}"
            )
        tokens = torch.randint(0, self.vocab, (batch, h, w), generator=generator)  # [b, H, W]
        targets = torch.full_like(tokens, IGNORE)
        targets[:, 1:] = tokens[:, :-1]  # the cell above
        return Batch(tokens.flatten(1), targets.flatten(1), size=(h, w))  # [b, H*W]


TASKS: dict[str, Task] = {task.name: task for task in (ShiftTask(), CopyTask(), GridTask())}


def get_task(name: str) -> Task:
    """The task called ``name``.

    Raises:
        ValueError: an unknown name, with the known ones.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name]
