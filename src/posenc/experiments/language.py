"""Scoring a language model of the ``lm`` task: perplexity per test length, and RoPE
scaling applied at evaluation time.

The perplexity per byte at a length ``n`` is ``exp(mean NLL)`` over every byte of the
held-out text, read in non-overlapping windows of ``n`` bytes
(:meth:`~posenc.experiments.tasks.LanguageModelTask.held_out`); every length scores the
same bytes. A byte early in a window sees little context, so a model that uses a longer
context well scores lower at longer lengths (Press et al. 2022, "Train Short, Test Long:
Attention with Linear Biases Enables Input Length Extrapolation", arXiv 2108.12409,
Section 2 and Figure 1, "nonoverlapping inference").

:func:`rope_scaling_perplexity` answers the question users ask of a rotary model trained at
``L``: what each context-extension rule of :mod:`posenc.rotary_scaling` gives at a longer
length ``n`` when applied to the trained model without fine-tuning, with the factor
``n / L``.

Shape legend: ``b`` windows, ``n`` bytes per window, ``V`` the vocabulary (256).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..rotary import Rotary
from ..rotary_scaling import (
    DynamicNTKScaling,
    LinearScaling,
    NTKScaling,
    RotaryScaling,
    YaRNScaling,
)
from .tasks import LanguageModelTask

__all__ = [
    "EVAL_TOKENS",
    "ROPE_SCALINGS",
    "evaluate_lm",
    "perplexity",
    "rope_scaling",
    "rope_scaling_perplexity",
]

#: tokens per forward pass in the evaluation (bounds the memory of long windows)
EVAL_TOKENS = 16384

#: the RoPE scalings tried at evaluation: name -> ``make(factor, trained_length)``
ROPE_SCALINGS: dict[str, Callable[[float, int], RotaryScaling]] = {
    "linear": lambda factor, trained: LinearScaling(factor),
    "ntk": lambda factor, trained: NTKScaling(factor),
    "dynamic-ntk": lambda factor, trained: DynamicNTKScaling(factor, original_max_len=trained),
    "yarn": lambda factor, trained: YaRNScaling(factor, original_max_len=trained),
}


@torch.no_grad()
def perplexity(
    model: nn.Module,
    task: LanguageModelTask,
    length: int,
    *,
    examples: int,
    device: str | torch.device = "cpu",
) -> tuple[float, float]:
    """``(perplexity per byte, next-byte accuracy)`` of ``model`` at ``length``.

    Args:
        model: a causal language model, ``tokens [b, n] -> logits [b, n, V]``
            (``model(tokens, causal=True)``).
        task: the task whose held-out text is scored.
        length: the window length, one of the task's test lengths.
        examples: windows of the longest test length scored (the same bytes at every
            length; see :meth:`~posenc.experiments.tasks.LanguageModelTask.test_text`).
        device: where the model is.

    Returns:
        ``exp`` of the mean negative log-likelihood (natural log) of every held-out byte,
        and the fraction of bytes whose most likely value is the next byte.
    """
    batch = task.held_out(length, examples)
    rows = max(1, EVAL_TOKENS // length)
    nll, hits, count = 0.0, 0, 0
    for start in range(0, batch.tokens.shape[0], rows):
        tokens = batch.tokens[start : start + rows].to(device)  # [b, n]
        targets = batch.targets[start : start + rows].to(device)  # [b, n]
        logits = model(tokens, causal=True)  # [b, n, V]
        nll += float(
            F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(), reduction="sum")
        )
        hits += int((logits.argmax(-1) == targets).sum())
        count += targets.numel()
    return math.exp(nll / count), hits / count


def evaluate_lm(
    model: nn.Module,
    task: LanguageModelTask,
    *,
    examples: int,
    device: str | torch.device = "cpu",
    serves: Callable[[int], bool] = lambda n: True,
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """``(accuracy, perplexity)`` per test length label (None where not ``serves(n)``)."""
    accuracy: dict[str, float | None] = {}
    ppl: dict[str, float | None] = {}
    for length in task.test_lengths:
        label, n = task.label(length), task.tokens_of(length)
        if not serves(n):
            accuracy[label] = ppl[label] = None
            continue
        ppl[label], accuracy[label] = perplexity(model, task, n, examples=examples, device=device)
    return accuracy, ppl


def _rotaries(model: nn.Module) -> list[Rotary]:
    """The distinct :class:`~posenc.Rotary` modules of ``model``."""
    return list({id(m): m for m in model.modules() if isinstance(m, Rotary)}.values())


@contextlib.contextmanager
def rope_scaling(model: nn.Module, scaling: RotaryScaling | None) -> Iterator[nn.Module]:
    """Within the block, every :class:`~posenc.Rotary` of ``model`` uses ``scaling``.

    The previous scalings come back on exit (an exception too). The weights are not
    touched: this is a scaling applied at evaluation, without fine-tuning.

    Raises:
        ValueError: ``model`` has no :class:`~posenc.Rotary`.
    """
    rotaries = _rotaries(model)
    if not rotaries:
        raise ValueError(
            f"rope_scaling needs a model with rotary attention (posenc.Rotary), got "
            f"{type(model).__name__} without one"
        )
    before = [m.scaling for m in rotaries]
    try:
        for m in rotaries:
            m.scaling = scaling
        yield model
    finally:
        for m, old in zip(rotaries, before, strict=True):
            m.scaling = old


def rope_scaling_perplexity(
    model: nn.Module,
    task: LanguageModelTask,
    *,
    examples: int,
    device: str | torch.device = "cpu",
) -> dict[str, dict[str, float]] | None:
    """Perplexity at each test length past the training one, per RoPE scaling.

    Each scaling of :data:`ROPE_SCALINGS` is applied to every :class:`~posenc.Rotary` of
    the trained ``model`` (:func:`rope_scaling`) with the factor ``n / L`` at the test
    length ``n`` (``L`` the training length; dynamic NTK and YaRN with
    ``original_max_len = L``), without fine-tuning.

    Returns:
        ``{scaling: {length label: perplexity}}``, or None when ``model`` has no rotary
        attention or its rotary is already scaled (nothing to compare with).
    """
    rotaries = _rotaries(model)
    if not rotaries or any(m.scaling is not None for m in rotaries):
        return None
    trained = task.tokens_of(task.train_length)
    longer = [t for t in task.test_lengths if task.tokens_of(t) > trained]
    results: dict[str, dict[str, float]] = {}
    for name, make in ROPE_SCALINGS.items():
        results[name] = {}
        for length in longer:
            n = task.tokens_of(length)
            with rope_scaling(model, make(n / trained, trained)):
                results[name][task.label(length)] = perplexity(
                    model, task, n, examples=examples, device=device
                )[0]
    return results
