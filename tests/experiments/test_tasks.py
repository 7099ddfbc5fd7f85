"""The synthetic tasks: targets against the definitions, written as plain loops; seeding."""

from __future__ import annotations

import pytest
import torch

from posenc.experiments.tasks import IGNORE, TASKS, CopyTask, GridTask, ShiftTask, get_task


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_shift_targets_are_the_token_delta_back():
    task = ShiftTask(delta=3)
    batch = task.sample(4, 20, gen())
    assert batch.tokens.shape == batch.targets.shape == (4, 20) and batch.size is None
    for b in range(4):
        for i in range(20):
            expected = batch.tokens[b, i - 3] if i >= 3 else IGNORE
            assert batch.targets[b, i] == expected
    assert batch.tokens.min() >= 0 and batch.tokens.max() < task.vocab


def test_copy_is_a_language_model_on_a_repeated_sequence():
    task = CopyTask()
    n = 12
    batch = task.sample(3, n, gen())
    m = n // 2
    for b in range(3):
        tokens, targets = batch.tokens[b].tolist(), batch.targets[b].tolist()
        symbols = tokens[:m]
        assert 0 not in symbols  # 0 is the separator
        full = [*symbols, 0, *symbols]  # a_1..a_m SEP a_1..a_m
        assert tokens == full[:-1]
        for i in range(n):
            assert targets[i] == (IGNORE if i < m else full[i + 1])
    assert task.causal


@pytest.mark.parametrize("n", [5, 2])
def test_copy_rejects_odd_or_tiny_lengths(n):
    with pytest.raises(ValueError, match="copy needs an even length >= 4"):
        CopyTask().sample(1, n, gen())


def test_grid_target_is_the_cell_above():
    task = GridTask()
    h, w = 3, 5
    batch = task.sample(2, (h, w), gen())
    assert batch.size == (h, w) and batch.tokens.shape == (2, h * w)
    for b in range(2):
        for r in range(h):
            for c in range(w):
                expected = batch.tokens[b, (r - 1) * w + c] if r > 0 else IGNORE
                assert batch.targets[b, r * w + c] == expected


def test_grid_needs_a_pair():
    with pytest.raises(ValueError, match=r"grid lengths are \(H, W\) pairs, got 36"):
        GridTask().sample(1, 36, gen())


@pytest.mark.parametrize("name", list(TASKS))
def test_seeded_batches_are_reproducible(name):
    task = TASKS[name]
    length = task.train_length
    first, again = task.sample(4, length, gen(7)), task.sample(4, length, gen(7))
    other = task.sample(4, length, gen(8))
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.targets, again.targets)
    assert not torch.equal(first.tokens, other.tokens)


def test_lengths_and_labels():
    assert GridTask().tokens_of((6, 7)) == 42 and GridTask().label((6, 7)) == "6x7"
    assert ShiftTask().tokens_of(32) == 32 and ShiftTask().label(32) == "32"


def test_unknown_task():
    assert get_task("shift") is TASKS["shift"]
    with pytest.raises(ValueError, match="unknown task 'sort'; choose from shift, copy, grid"):
        get_task("sort")


def test_bad_length():
    with pytest.raises(ValueError, match="length"):
        ShiftTask().sample(1, 0, gen())


@pytest.mark.parametrize(
    ("task", "length", "message"),
    [
        (ShiftTask(delta=3), 3, "shift needs a length > delta = 3"),
        (GridTask(), (1, 4), "grid needs at least 2 rows"),
        (GridTask(), (3, 0), "size\\[1\\]|1 column"),
    ],
)
def test_lengths_that_score_nothing_are_rejected(task, length, message):
    with pytest.raises(ValueError, match=message):
        task.sample(1, length, gen())


def test_chance():
    assert ShiftTask().chance == 1 / 16 and GridTask().chance == 1 / 16
    assert CopyTask().chance == 1 / 15  # the answers are the symbols 1..15
