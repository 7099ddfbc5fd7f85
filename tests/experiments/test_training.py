"""The experiment of ``posenc compare``: schemes per task, models, positions, checkpoints."""

from __future__ import annotations

import pytest
import torch

from posenc import RelativePositionBias, registry
from posenc.experiments.tasks import TASKS, GridTask
from posenc.experiments.training import (
    Config,
    build_model,
    default_schemes,
    load_checkpoint,
    logits_of,
    positions_for,
    scheme_order,
    schemes_for,
    shape_for,
)

TINY_CONFIG = Config(steps=3, batch=4, dim=16, heads=2, layers=1, eval_examples=4)


def test_schemes_for_each_task():
    assert "rotary-2d" in schemes_for(TASKS["grid"]) and "rotary-2d" not in schemes_for(
        TASKS["shift"]
    )
    assert schemes_for(TASKS["grid"]) == default_schemes()


def test_2d_schemes_number_cells_in_the_largest_grid():
    task = GridTask(train_length=(2, 3), test_lengths=((2, 3), (4, 5)))
    batch = task.sample(1, (2, 3), torch.Generator().manual_seed(0))
    config = Config()
    # cell (r, c) of a 2x3 grid is r * 5 + c in the largest (4x5) grid
    assert positions_for(task, "swin-2d", config, batch).tolist() == [0, 1, 2, 5, 6, 7]
    assert positions_for(task, "swin-1d", config, batch) is None  # 1-D: the flat sequence


@pytest.mark.parametrize("scheme", registry.names())
def test_every_scheme_builds_and_runs(scheme):
    task = TASKS["grid"]
    torch.manual_seed(0)
    model = build_model(task, scheme, TINY_CONFIG)
    for length in task.test_lengths:
        if not registry.get(scheme).serves(shape_for(task, TINY_CONFIG), task.tokens_of(length)):
            continue
        batch = task.sample(2, length, torch.Generator().manual_seed(0))
        logits = logits_of(model, task, scheme, TINY_CONFIG, batch)
        assert logits.shape == (2, task.tokens_of(length), task.vocab)
        assert torch.isfinite(logits).all()


def test_a_foreign_checkpoint_is_a_clean_error(tmp_path):
    path = tmp_path / "shift-none.pt"
    torch.save({"something": "else"}, path)
    with pytest.raises(ValueError, match=r"shift-none.pt is not a checkpoint of this posenc"):
        load_checkpoint(path)


def test_default_schemes_are_those_compare_always_ran():
    """The registry's ``default_in`` and compare's order (1-D first) give the list that
    compare ran before the registry, in the same order: docs/compare.md's rows."""
    assert default_schemes() == [
        "none",
        "sinusoidal",
        "learned",
        "rotary",
        "rotary-ntk",
        "alibi",
        "t5",
        "swin-1d",
        "relative",
        "shaw",
        "sinusoidal-2d",
        "rotary-2d",
        "swin-2d",
        "relative-2d",
    ]
    assert scheme_order(["swin-2d", "t5", "swin"]) == ["t5", "swin-1d", "swin-2d"]


@pytest.mark.parametrize("scheme", ["rotary", "alibi", "t5", "rotary-2d"])
def test_shared_schemes_serve_every_layer(scheme):
    model = build_model(TASKS["grid"], scheme, Config(layers=2))
    first, second = (block.attn.position for block in model.blocks)
    assert registry.get(scheme).shared and first is second


@pytest.mark.parametrize("scheme", ["swin-1d", "relative", "shaw", "swin-2d", "relative-2d"])
def test_learned_tables_are_built_per_layer(scheme):
    model = build_model(TASKS["grid"], scheme, Config(layers=2))
    first, second = (block.attn.position for block in model.blocks)
    assert not registry.get(scheme).shared and first is not second


def test_compare_sizes_its_schemes_for_the_task():
    shape = shape_for(TASKS["shift"], Config())
    assert (shape.heads, shape.head_dim, shape.dim) == (4, 16, 64)
    assert (shape.train_len, shape.max_len, shape.grid) == (32, 128, None)
    shaw = registry.build("shaw", shape)
    t5 = registry.build("t5", shape)
    assert shaw.max_distance == 8 and (t5.num_buckets, t5.max_distance) == (16, 64)
    assert (
        t5.bidirectional
        and not registry.build("t5", shape_for(TASKS["copy"], Config())).bidirectional
    )
    assert shape_for(TASKS["grid"], Config()).grid == (12, 12)


def test_a_2d_scheme_on_a_1d_task_is_a_clean_error():
    with pytest.raises(ValueError, match="a 2-D scheme needs a 2-D task, got task 'shift'"):
        build_model(TASKS["shift"], "swin-2d", TINY_CONFIG)


def test_the_old_name_swin_is_swin_1d(tmp_path):
    from posenc.experiments.training import save_checkpoint

    task = TASKS["shift"]
    assert schemes_for(task, ["swin"]) == ["swin-1d"]
    torch.manual_seed(0)
    model = build_model(task, "swin", TINY_CONFIG)
    assert isinstance(model.blocks[0].attn.position, RelativePositionBias)
    # a checkpoint saved under the old name loads, under the new one
    path = save_checkpoint(tmp_path, model, task, "swin", TINY_CONFIG)
    loaded, _, scheme, _ = load_checkpoint(path)
    assert scheme == "swin-1d"
    tokens = torch.randint(0, task.vocab, (2, 16))
    torch.testing.assert_close(loaded(tokens), model.eval()(tokens))


def test_lm_runs_the_1d_default_schemes_and_kerple_log():
    """The lm task: every default scheme but the 2-D ones, with KERPLE (log) beside ALiBi
    and T5, the schemes of the length-extrapolation papers."""
    from posenc.experiments.tasks import get_task

    lm = get_task("lm")
    assert schemes_for(lm) == [
        "none",
        "sinusoidal",
        "learned",
        "rotary",
        "rotary-ntk",
        "alibi",
        "kerple-log",
        "t5",
        "swin-1d",
        "relative",
        "shaw",
    ]
    assert schemes_for(lm, ["t5", "rotary"]) == ["t5", "rotary"]  # named: as given
    shape = shape_for(lm, Config())
    assert (shape.train_len, shape.max_len, shape.causal) == (64, 512, True)
    assert not registry.build("t5", shape).bidirectional  # T5's decoder buckets
