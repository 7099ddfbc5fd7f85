"""Pictures of trained ``compare`` models: attention maps and learned-table similarity."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from posenc.cli import main
from posenc.cli.compare import compare
from posenc.cli.plot_trained import (
    attention_of,
    attention_to_offset,
    checkpoints_in,
    learned_tables,
)
from posenc.experiments.tasks import TASKS
from posenc.experiments.training import Config, load_checkpoint
from tolerances import assert_close

PNG = b"\x89PNG\r\n\x1a\n"
CONFIG = Config(steps=2, batch=4, dim=16, heads=2, layers=2, eval_examples=2)
SHIFT = replace(TASKS["shift"], train_length=8, test_lengths=(8, 12))
GRID = replace(TASKS["grid"], train_length=(2, 3), test_lengths=((2, 3), (3, 3)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints")
    compare(
        [SHIFT, GRID], ["none", "learned", "swin-2d"], 1, CONFIG, quiet=True, checkpoints=folder
    )
    return folder


def test_checkpoints_per_task_in_scheme_order(checkpoints):
    found = checkpoints_in(checkpoints)
    assert [p.name for p in found["shift"]] == ["shift-none.pt", "shift-learned.pt"]
    assert [p.name for p in found["grid"]] == ["grid-none.pt", "grid-learned.pt", "grid-swin-2d.pt"]


def test_attention_maps_are_head_averaged_distributions(checkpoints):
    task, scheme, maps = attention_of(checkpoints / "grid-swin-2d.pt")
    assert scheme == "swin-2d" and maps.shape == (2, 6, 6)  # layers, 2x3 grid
    assert task.train_length == (2, 3)  # the checkpoint's lengths, not the defaults
    assert_close(torch.from_numpy(maps.sum(-1)), torch.ones(2, 6), terms=6)  # 6 weights each


def test_plot_attention_and_learned_similarity(checkpoints, tmp_path, capsys):
    assert (
        main(["plot", "attention", "--checkpoints", str(checkpoints), "--out", str(tmp_path)]) == 0
    )
    for name in ("attention_shift.png", "attention_grid.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    argv = ["plot", "similarity", "--dim", "8", "--length", "10", "--checkpoints"]
    assert main([*argv, str(checkpoints), "--out", str(tmp_path)]) == 0
    for name in ("similarity_sinusoidal", "similarity_learned_shift", "similarity_learned_grid"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG
    tables = dict(learned_tables(checkpoints))
    assert tables["shift"].shape == (8, 16) and tables["grid"].shape == (6, 16)


def test_missing_checkpoints_are_a_clean_error(tmp_path, capsys):
    assert main(["plot", "attention", "--out", str(tmp_path)]) == 2
    assert "--checkpoints is needed for this kind" in capsys.readouterr().err
    assert main(["plot", "attention", "--checkpoints", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_attention_to_offset_against_the_maps(checkpoints):
    path = checkpoints / "shift-none.pt"
    got = attention_to_offset(path, -3, 10, examples=4)
    model, task, _, _ = load_checkpoint(path)
    batch = task.sample(4, 10, torch.Generator().manual_seed(0))
    best = 0.0
    for weights in model.attention_maps(batch.tokens):  # [4, h, 10, 10]
        for h in range(weights.shape[1]):
            values = [float(weights[e, h, i, i - 3]) for e in range(4) for i in range(3, 10)]
            best = max(best, sum(values) / len(values))
    assert abs(got - best) < 1e-6


def test_checkpoints_that_are_a_file_are_refused_by_argparse(tmp_path, capsys):
    path = tmp_path / "shift-none.pt"
    path.write_bytes(b"")
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "attention", "--checkpoints", str(path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"posenc plot: error: argument --checkpoints: '{path}' is a file, not a folder; run "
        "`posenc compare --out DIR` first and pass --checkpoints DIR/checkpoints"
    )
    assert not (tmp_path / "out").exists()


def test_checkpoints_are_read_before_anything_is_drawn(checkpoints, tmp_path, capsys):
    """similarity drew the sinusoidal table before finding no checkpoint, and attention drew
    a task's figure before finding a bad checkpoint of the next task."""
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = ["plot", "similarity", "--dim", "8", "--length", "10", "--out", str(out)]
    assert main([*argv, "--checkpoints", str(empty)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert not out.exists()
    mixed = tmp_path / "mixed"
    shutil.copytree(checkpoints, mixed)
    torch.save({"something": "else"}, mixed / "zzz-none.pt")  # read last: task names sorted
    argv = ["plot", "attention", "--checkpoints", str(mixed), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("posenc plot: error: ") and err.count("\n") == 1
    assert "zzz-none.pt is not a checkpoint of this posenc" in err
    assert not out.exists()
