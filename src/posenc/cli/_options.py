"""Argument types shared by the commands: each rejects a bad value with a clear message."""

from __future__ import annotations

import argparse

import torch


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


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
