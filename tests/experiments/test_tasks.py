"""The tasks: targets against the definitions, written as plain loops; seeding; the
``lm`` task's training and held-out windows."""

from __future__ import annotations

import random

import pytest
import torch

from posenc.experiments.tasks import (
    ALL_TASKS,
    IGNORE,
    TASKS,
    CopyTask,
    GridTask,
    LanguageModelTask,
    ShiftTask,
    get_task,
)


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


# ----- lm ---------------------------------------------------------------------------------


@pytest.fixture
def lm(tmp_path):
    """An ``lm`` task on a one-file corpus: 900 training bytes, the last 100 held out."""
    letters = random.Random(0).choices(range(32, 127), k=1000)  # printable ASCII
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(letters))
    return LanguageModelTask(train_length=4, test_lengths=(4, 8, 16), corpus=str(path))


def test_lm_is_known_but_not_in_the_default_run():
    assert "lm" not in TASKS and get_task("lm") is ALL_TASKS["lm"]
    task = get_task("lm")
    assert task.causal and task.vocab == 256 and task.chance == 1 / 256
    assert (task.train_length, task.test_lengths) == (64, (64, 128, 256, 512))
    assert task.schemes == ("kerple-log",) and task.corpus is None


def test_lm_training_windows_are_slices_of_the_training_text(lm):
    train = lm.text.train.tolist()
    assert len(train) == 900
    batch = lm.sample(5, 8, gen(3))
    assert batch.tokens.shape == batch.targets.shape == (5, 8)
    assert batch.tokens.dtype == torch.long
    for b in range(5):
        tokens, targets = batch.tokens[b].tolist(), batch.targets[b].tolist()
        start = next(i for i in range(900 - 8) if train[i : i + 8] == tokens)
        assert targets == train[start + 1 : start + 9]  # every next byte, all scored
    again = lm.sample(5, 8, gen(3))
    assert torch.equal(batch.tokens, again.tokens)


def test_lm_held_out_windows_cover_the_same_bytes_at_every_length(lm):
    held = lm.text.held_out.tolist()
    assert len(held) == 100
    # span 16 (lcm of 4, 8, 16): (100 - 1) // 16 = 6 chunks fit; 2 windows of 16 asked
    chunks = lm.test_text(2)
    assert chunks.shape == (2, 17)
    stride = (100 - 1 - 16) // (2 - 1)
    for c, start in enumerate([0, stride]):
        assert chunks[c].tolist() == held[start : start + 17]
    for n in (4, 8, 16):
        batch = lm.held_out(n, 2)
        assert batch.tokens.shape == (2 * 16 // n, n)
        # window k of chunk c: tokens held[s + k n : s + (k + 1) n], targets one byte on
        for row in range(batch.tokens.shape[0]):
            c, k = divmod(row, 16 // n)
            s = [0, stride][c] + k * n
            assert batch.tokens[row].tolist() == held[s : s + n]
            assert batch.targets[row].tolist() == held[s + 1 : s + n + 1]
        scored = sorted(batch.targets.flatten().tolist())
        assert scored == sorted(chunks[:, 1:].flatten().tolist())  # the same bytes
    assert lm.test_text(1000).shape == (6, 17)  # as many as fit


def test_lm_errors(lm, tmp_path):
    with pytest.raises(ValueError, match=r"length 5 is not a test length of this task"):
        lm.held_out(5, 1)
    with pytest.raises(ValueError, match=r"fewer than a window of length 900 \+ 1"):
        lm.sample(1, 900, gen())
    long = LanguageModelTask(train_length=4, test_lengths=(4, 128), corpus=lm.corpus)
    with pytest.raises(ValueError, match=r"has 100 bytes, fewer than the 129 that one window"):
        long.test_text(1)
