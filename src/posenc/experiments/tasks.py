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

One task is not synthetic, and not in the default run (:data:`TASKS`):

- ``lm``: a causal byte-level language model on real text
  (:mod:`~posenc.experiments.corpus`; by default Python's standard library source),
  trained on windows of the training text and scored on the held-out text.

Shape legend: ``b`` batch, ``n`` tokens, ``H x W`` a grid (``n = H * W``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import _validate as check
from .corpus import Corpus, load_corpus

__all__ = [
    "ALL_TASKS",
    "IGNORE",
    "TASKS",
    "Batch",
    "CopyTask",
    "GridTask",
    "LanguageModelTask",
    "ShiftTask",
    "Task",
    "get_task",
]

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
    #: schemes run by default on this task besides ``compare``'s default ones
    schemes: tuple[str, ...] = field(default=(), compare=False)

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


@dataclass(frozen=True)
class LanguageModelTask(Task):
    """A causal byte-level language model on real text: predict every next byte.

    Training examples are windows of the training text at random offsets (inputs the
    window, targets the window moved by one byte, every byte scored). The test
    (:meth:`held_out`) scores the held-out text in non-overlapping windows of each test
    length, every byte of a window scored, as Press et al. 2022 ("Train Short, Test Long",
    arXiv 2108.12409) evaluate in their Figure 1; the windows of every length cover the
    same bytes, so that the lengths are compared on the same text.

    Attributes:
        corpus: a UTF-8 text file or folder, or None for Python's standard library source
            (see :func:`~posenc.experiments.corpus.load_corpus`).
    """

    name: str = "lm"
    vocab: int = 256
    causal: bool = True
    train_length: int | tuple[int, int] = 64
    test_lengths: tuple[int | tuple[int, int], ...] = (64, 128, 256, 512)
    corpus: str | None = None
    summary: str = field(default="causal byte-level language model on real text")
    schemes: tuple[str, ...] = field(default=("kerple-log",), compare=False)

    @property
    def text(self) -> Corpus:
        """The corpus (loaded once per process)."""
        return load_corpus(self.corpus)

    @property
    def chance(self) -> float:
        """A uniform guess among the 256 byte values."""
        return 1 / self.vocab

    def sample(
        self, batch: int, length: int | tuple[int, int], generator: torch.Generator
    ) -> Batch:
        n = check.positive_int("length", length)
        text = self.text.train
        if text.numel() < n + 1:
            raise ValueError(
                f"the training text of corpus {self.text.source!r} has {text.numel()} bytes, "
                f"fewer than a window of length {n} + 1; give a shorter length or more text"
            )
        starts = torch.randint(0, text.numel() - n, (batch,), generator=generator)  # [b]
        windows = text[starts[:, None] + torch.arange(n + 1)].long()  # [b, n + 1]
        return Batch(windows[:, :-1], windows[:, 1:])

    def test_text(self, examples: int) -> Tensor:
        """The held-out bytes that every test length scores: ``[c, span + 1]`` chunks.

        ``span`` is the least common multiple of the test lengths (the longest one when
        each divides it), so that every length cuts each chunk into whole windows;
        ``c = max(1, examples * longest // span)`` chunks (``examples`` windows of the
        longest length), spread evenly over the held-out text, as many as fit.

        Raises:
            ValueError: held-out text shorter than one chunk.
        """
        check.positive_int("examples", examples)
        lengths = [self.tokens_of(t) for t in self.test_lengths]
        span = math.lcm(*lengths)
        held = self.text.held_out
        fit = (held.numel() - 1) // span  # chunks of span + 1 bytes, sharing an end byte
        if fit < 1:
            raise ValueError(
                f"the held-out text of corpus {self.text.source!r} has {held.numel()} bytes, "
                f"fewer than the {span + 1} that one window of every test length needs "
                f"(lengths {', '.join(map(str, lengths))}); give shorter lengths or more text"
            )
        count = min(fit, max(1, examples * max(lengths) // span))
        stride = (held.numel() - 1 - span) // max(1, count - 1)  # >= span: no overlap
        starts = torch.arange(count) * stride  # [c]
        return held[starts[:, None] + torch.arange(span + 1)].long()  # [c, span + 1]

    def held_out(self, length: int | tuple[int, int], examples: int) -> Batch:
        """The held-out text of :meth:`test_text` in non-overlapping windows of ``length``.

        Returns:
            A :class:`Batch` of ``[c * span / length, length]`` tokens and targets (the
            next byte of each token; every one scored).

        Raises:
            ValueError: ``length`` is not one of the test lengths.
        """
        n = check.positive_int("length", length)
        if n not in [self.tokens_of(t) for t in self.test_lengths]:
            raise ValueError(
                f"length {n} is not a test length of this task ({self.test_lengths}); "
                f"the held-out windows are cut for those"
            )
        chunks = self.test_text(examples)  # [c, span + 1]
        tokens = chunks[:, :-1].reshape(-1, n)  # [c * span / n, n]
        targets = chunks[:, 1:].reshape(-1, n)  # [c * span / n, n]
        return Batch(tokens, targets)


#: the tasks of ``compare``'s default run (the synthetic ones)
TASKS: dict[str, Task] = {task.name: task for task in (ShiftTask(), CopyTask(), GridTask())}
#: every task that ``compare --tasks`` knows
ALL_TASKS: dict[str, Task] = {**TASKS, "lm": LanguageModelTask()}


def get_task(name: str) -> Task:
    """The task called ``name`` (one of :data:`ALL_TASKS`).

    Raises:
        ValueError: an unknown name, with the known ones.
    """
    if name not in ALL_TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(ALL_TASKS)}")
    return ALL_TASKS[name]
