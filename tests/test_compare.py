"""``posenc compare``: the command end to end on tiny sizes, the report, and DDP.

The pieces of one model (build, positions, checkpoints) are tested in
tests/experiments/test_training.py.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from posenc.cli import main
from posenc.cli.compare import compare, format_markdown
from posenc.experiments.tasks import TASKS
from posenc.experiments.training import Config, load_checkpoint, train
from tolerances import assert_close

TINY = ["--steps", "3", "--batch", "4", "--dim", "16", "--heads", "2", "--layers", "1"]
TINY_CONFIG = Config(steps=3, batch=4, dim=16, heads=2, layers=1, eval_examples=4)


def test_compare_writes_table_plot_json_and_checkpoints(tmp_path, capsys):
    out, record = tmp_path / "out", tmp_path / "r.json"
    argv = ["compare", "--tasks", "shift,grid", "--schemes", "none,learned,rotary-2d"]
    argv += ["--lengths", "8,16", "--grid-lengths", "2x3,3x4", "--seeds", "2", "--quiet"]
    argv += ["--jobs", "1", "--eval-examples", "4", "--out", str(out), "--json", str(record)]
    code = main([*argv, *TINY])
    assert code == 0
    text = capsys.readouterr().out
    assert "| `learned` |" in text and "n/a" in text  # a learned table cannot go past 8
    assert "rotary-2d" in text.split("### grid")[1]  # 2-D schemes only on the grid
    assert "rotary-2d" not in text.split("### grid")[0]
    assert (out / "compare.md").read_text() in text
    for name in ("compare_shift.png", "compare_grid.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(record.read_text())
    runs = data["runs"]
    # shift: none + learned, grid: none + learned + rotary-2d; 2 seeds each
    assert len(runs) == 2 * 2 + 3 * 2
    assert {(r["task"], r["scheme"], r["seed"]) for r in runs} >= {("grid", "rotary-2d", 1)}
    learned = next(r for r in runs if r["task"] == "shift" and r["scheme"] == "learned")
    assert learned["accuracy"]["16"] is None and 0 <= learned["accuracy"]["8"] <= 1
    assert data["config"]["steps"] == 3 and data["config"]["seeds"] == 2
    assert data["config"]["tasks"]["grid"]["test_lengths"] == ["2x3", "3x4"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "grid-learned.pt",
        "grid-none.pt",
        "grid-rotary-2d.pt",
        "shift-learned.pt",
        "shift-none.pt",
    ]


def test_checkpoint_round_trip(tmp_path):
    task = TASKS["shift"]
    runs = compare([task], ["t5"], 1, TINY_CONFIG, quiet=True, checkpoints=tmp_path)
    model, task_again, scheme, config = load_checkpoint(tmp_path / "shift-t5.pt")
    assert task_again == task and scheme == "t5" and config == TINY_CONFIG
    tokens = torch.randint(0, task.vocab, (2, 32))
    trained, _ = train(task, "t5", 0, TINY_CONFIG)
    torch.testing.assert_close(model(tokens), trained(tokens))
    assert runs[0].parameters == sum(p.numel() for p in model.parameters())


def test_workers_give_the_same_results_as_one_process():
    task = TASKS["shift"]
    kwargs = dict(quiet=True)
    alone = compare([task], ["none", "alibi"], 1, TINY_CONFIG, jobs=1, **kwargs)
    workers = compare([task], ["none", "alibi"], 1, TINY_CONFIG, jobs=2, **kwargs)
    # the same models; only the float summation order may differ (1 thread vs 2)
    assert [(r.scheme, r.seed, r.accuracy) for r in alone] == [
        (r.scheme, r.seed, r.accuracy) for r in workers
    ]
    for a, w in zip(alone, workers, strict=True):
        assert abs(a.final_loss - w.final_loss) <= 1e-5 * abs(a.final_loss)


def test_the_old_name_swin_still_works_with_a_note(capsys):
    """``swin`` was compare's name of the 1-D Swin table; it is ``swin-1d`` everywhere now."""
    argv = ["compare", "--tasks", "shift", "--schemes", "swin", "--lengths", "8", "--seeds", "1"]
    argv += ["--eval-examples", "2", "--jobs", "1", "--quiet"]
    assert main([*argv, *TINY]) == 0
    captured = capsys.readouterr()
    assert "| `swin-1d` |" in captured.out and "`swin`" not in captured.out
    assert "posenc: note: scheme 'swin' is now called 'swin-1d'" in captured.err
    from posenc.cli import build_parser

    parser = build_parser()
    for command in ("compare", "bench"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        # (argparse wraps the help at spaces and hyphens)
        assert "deprecatedoldnames:swin=swin-1d" in "".join(capsys.readouterr().out.split())


def test_markdown_shows_mean_and_spread():
    task = TASKS["shift"]
    runs = compare([task], ["none"], 2, TINY_CONFIG, quiet=True)
    text = format_markdown(runs, [task], 2)
    values = [r.accuracy["32"] for r in runs]
    mean = sum(values) / 2
    assert f"{mean:.2f} ± " in text
    assert "chance is 0.06" in text


def test_markdown_says_how_many_seeds_and_shows_no_spread_for_one():
    """One seed has no spread to show: its cells read the accuracy alone, not "± 0.00"."""
    from posenc.experiments.training import Run

    task = TASKS["shift"]
    labels = [task.label(t) for t in task.test_lengths]

    def run(scheme, seed, accuracy):
        return Run("shift", scheme, seed, dict.fromkeys(labels, accuracy), 10, 1.0, 0.5)

    one = format_markdown([run("rotary", 0, 0.75), run("none", 0, 0.25)], [task], 1)
    assert "accuracy on held-out examples, one seed (no spread); chance" in one
    assert "±" not in one
    assert f"| `rotary` | {' | '.join(['0.75'] * len(labels))} | 10 | 1.0 |" in one
    three = format_markdown(
        [run("rotary", s, a) for s, a in enumerate((0.5, 0.75, 1.0))], [task], 3
    )
    assert "accuracy on held-out examples, mean ± std over 3 seeds; chance" in three
    # mean 0.75, sample standard deviation sqrt(((-0.25)^2 + 0 + 0.25^2) / 2) = 0.25
    assert f"| `rotary` | {' | '.join(['0.75 ± 0.25'] * len(labels))} | 10 |" in three


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schemes", "rope"], "unknown scheme(s) 'rope'; choose from none,"),
        (["--tasks", "sort"], "unknown task(s) 'sort'; choose from shift, copy, grid"),
        (["--lengths", "8,x"], "lengths are positive integers or HxW grids"),
        (["--seeds", "0"], "argument --seeds: must be >= 1, got 0"),
        (["--device", "gpu0"], "unknown device 'gpu0'; use cpu, cuda or cuda:N"),
        (["--lr", "-1"], "argument --lr: must be > 0, got -1"),
        (["--lr", "0"], "argument --lr: must be > 0, got 0"),
        (["--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
        (["--lr", "fast"], "argument --lr: must be a finite number > 0, got 'fast'"),
        (["--table-lr-scale", "-1"], "argument --table-lr-scale: must be >= 0, got -1"),
        (["--jobs", "0"], "argument --jobs: must be >= 1, got 0"),
        (["--format", "jpg"], "argument --format: must be png, svg or png,svg, got 'jpg'"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys, monkeypatch, tmp_path):
    import posenc.cli.compare as command

    def started(*args, **kwargs):
        raise AssertionError("training started before the arguments were checked")

    monkeypatch.setattr(command, "compare", started)
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--out", str(tmp_path / "out"), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("posenc compare: error: ") and message in err
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("where", ["compare.md", "checkpoints"])
def test_out_that_compare_cannot_fill_is_refused_before_training(
    where, tmp_path, capsys, monkeypatch
):
    """``--out`` used to be written only after all the training: a folder where compare.md
    goes, or a file where the checkpoints go, failed after it (the checkpoints: during it)."""
    import posenc.cli.compare as command

    def started(*args, **kwargs):
        raise AssertionError("training started before the arguments were checked")

    monkeypatch.setattr(command, "compare", started)
    if where == "compare.md":
        (tmp_path / where).mkdir()
    else:
        (tmp_path / where).write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    kind, made = (
        ("a folder", "writes a file") if where == "compare.md" else ("a file", "makes a folder")
    )
    assert line == (
        f"posenc compare: error: argument --out: '{tmp_path / where}' is {kind}, but the "
        f"command {made} there; remove it or choose another folder"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "grid", "--grid-lengths", "36"], "--grid-lengths for task 'grid' must be HxW"),
        (["--tasks", "shift", "--lengths", "4x4"], "--lengths for task 'shift' must be token"),
        (["--tasks", "copy", "--lengths", "8,9"], "copy needs an even length"),
        (["--dim", "12", "--heads", "2"], "must give a head dim that is a multiple of 4"),
        (["--tasks", "shift", "--lengths", "3,8"], "shift needs a length > delta = 3"),
        (["--tasks", "shift", "--schemes", "rotary-2d"], "the 2-D schemes need --tasks grid"),
        (["--dim", "10", "--heads", "4"], "--dim 10 must be divisible by --heads 4"),
    ],
)
def test_inconsistent_arguments_are_clean_errors(argv, message, capsys):
    assert main(["compare", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


DDP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from posenc.cli.compare import _init_distributed, _leave_distributed
    from posenc.experiments.tasks import TASKS
    from posenc.experiments.training import Config, train

    assert _init_distributed("cpu")
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    config = Config(steps=4, batch=8, dim=16, heads=2, layers=1)
    model, losses = train(TASKS["shift"], "t5", 0, config)
    torch.save({"state": model.state_dict(), "losses": losses}, f"{sys.argv[1]}/rank{rank}.pt")
    _leave_distributed()
    """
)


@pytest.mark.slow
def test_ddp_two_gloo_processes_match_one_process(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    # gloo on a loaded machine very rarely aborts a worker in C++ ("terminate called
    # without an active exception"; seen twice in full suite runs, one of them in CI, and
    # never in 60 launches on their own, loaded or not):
    # a launch killed by a signal is tried again, at most twice; any other failure, and
    # every comparison below, counts at once
    for _ in range(3):
        result = subprocess.run(
            [*torchrun, "--nproc_per_node", "2", str(script), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=240,
        )
        if result.returncode == 0 or "Signal 6 (SIGABRT)" not in result.stderr:
            break
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for key, value in ranks[0]["state"].items():
        torch.testing.assert_close(ranks[1]["state"][key], value, rtol=0, atol=0)
    # one process on the whole global batch: the same parameters, and its loss is the
    # mean of the ranks' losses (each rank scores the same number of tokens)
    model, losses = train(
        TASKS["shift"], "t5", 0, Config(steps=4, batch=8, dim=16, heads=2, layers=1)
    )
    # (AdamW moves a parameter by ~lr whatever the size of its gradient, so a gradient
    # that is ~0 up to the order of a float sum can move it either way: atol 0.05 * lr)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=0, atol=1.5e-4)
    rank_mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    # a mean over steps * batch * seq = 4 * 8 * 32 scored tokens (the shift task's length 32)
    assert_close(torch.tensor(rank_mean), torch.tensor(losses), terms=4 * 8 * 32)


def test_head_dim_multiple_of_4_only_matters_for_2d_schemes(capsys):
    argv = ["compare", "--tasks", "shift", "--schemes", "none", "--dim", "24", "--heads", "4"]
    argv += ["--steps", "1", "--batch", "2", "--layers", "1", "--seeds", "1", "--quiet"]
    assert main([*argv, "--eval-examples", "1", "--jobs", "1"]) == 0  # head dim 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only build")
def test_cuda_on_a_cpu_build_is_a_clean_error(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--device", "cuda"])
    assert "sees no CUDA GPU; use cpu" in capsys.readouterr().err


# ----- lm: a byte-level language model on real text ----------------------------------------


@pytest.fixture
def corpus(tmp_path):
    """A one-file corpus: 3600 training bytes, the last 400 held out."""
    import random

    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(random.Random(0).choices(range(32, 127), k=4000)))
    return path


def test_compare_lm_writes_perplexity_rope_scaling_and_the_corpus(tmp_path, corpus, capsys):
    out, record = tmp_path / "out", tmp_path / "r.json"
    argv = ["compare", "--tasks", "lm", "--corpus", str(corpus), "--lengths", "4,8,16"]
    argv += ["--schemes", "learned,rotary,kerple-log", "--seeds", "2", "--jobs", "1"]
    argv += ["--quiet", "--eval-examples", "3", "--out", str(out), "--json", str(record)]
    assert main([*argv, *TINY]) == 0
    text = capsys.readouterr().out
    assert "### lm: causal byte-level language model on real text" in text
    assert "| scheme | ppl @ 4 (train) | ppl @ 8 | ppl @ 16 | params | train s |" in text
    assert "| `learned` |" in text and "n/a" in text
    assert "#### lm: `rotary` with RoPE scaling at evaluation (no fine-tuning)" in text
    for scaling in ("none", "linear", "ntk", "dynamic-ntk", "yarn"):
        assert f"| {scaling} | " in text
    assert (out / "compare_lm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "lm-kerple-log.pt",
        "lm-learned.pt",
        "lm-rotary.pt",
    ]
    data = json.loads(record.read_text())
    lm = data["config"]["tasks"]["lm"]
    assert lm["steps"] == 3 and lm["vocab"] == 256 and lm["test_lengths"] == ["4", "8", "16"]
    assert lm["corpus"]["source"] == str(corpus) and lm["corpus"]["split"] == "tail"
    assert lm["corpus"]["train_files"] == ["corpus.txt"] and lm["corpus"]["held_out_bytes"] == 400
    assert lm["scored_bytes"] == 3 * 16  # 3 windows of the longest length, at every length
    runs = {(r["scheme"], r["seed"]): r for r in data["runs"]}
    assert len(runs) == 3 * 2
    for run in runs.values():
        assert set(run["perplexity"]) == set(run["accuracy"]) == {"4", "8", "16"}
        assert ("rope_scaling" in run) == (run["scheme"] == "rotary")
    assert runs["learned", 0]["perplexity"]["8"] is None
    assert runs["learned", 0]["perplexity"]["4"] > 1
    assert set(runs["rotary", 1]["rope_scaling"]["yarn"]) == {"8", "16"}
    # a checkpoint of the lm task rebuilds on its corpus
    _, task, scheme, _ = load_checkpoint(out / "checkpoints" / "lm-rotary.pt")
    assert (task.name, task.corpus, task.test_lengths, scheme) == (
        "lm",
        str(corpus),
        (4, 8, 16),
        "rotary",
    )


def test_lm_trains_its_own_steps_and_lengths_unless_given():
    from posenc.cli import build_parser
    from posenc.cli.compare import LM_STEPS, _task_configs, _tasks

    parser = build_parser()
    for extra, steps, lengths in (
        ([], LM_STEPS["full"], (64, 128, 256, 512)),
        (["--quick"], LM_STEPS["quick"], (32, 64, 128, 256)),
    ):
        args = parser.parse_args(["compare", "--tasks", "shift,lm", *extra])
        tasks = _tasks(args)
        configs = _task_configs(args, TINY_CONFIG, tasks)
        assert list(configs) == ["lm"] and configs["lm"].steps == steps
        assert tasks[1].test_lengths == lengths and tasks[1].train_length == lengths[0]
        assert tasks[0] == TASKS["shift"]  # the synthetic tasks keep theirs
    args = parser.parse_args(["compare", "--tasks", "lm", "--steps", "7", "--lengths", "8,16"])
    assert _task_configs(args, TINY_CONFIG, _tasks(args)) == {}
    assert _tasks(args)[0].test_lengths == (8, 16)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "shift", "--corpus", "."], "--corpus . is the text of the lm task"),
        (["--tasks", "lm", "--corpus", "/dev/null"], "corpus '/dev/null' is not a file or a"),
        # (the held-out text is 256 KiB: a window of 2^18 bytes does not fit, and no training
        # starts; the training text, 2 MiB, has room for it)
        (["--tasks", "lm", "--lengths", "64,262144"], "fewer than the 262145 that one window"),
    ],
)
def test_lm_arguments_are_clean_errors(argv, message, capsys, monkeypatch):
    import posenc.cli.compare as command

    def started(*args, **kwargs):
        raise AssertionError("training started before the arguments were checked")

    monkeypatch.setattr(command, "compare", started)
    assert main(["compare", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_corpus_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--tasks", "lm", "--corpus", "nowhere.txt"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "posenc compare: error: argument --corpus: no file or folder 'nowhere.txt'; give a "
        "UTF-8 text file or a folder of them"
    )


def test_lm_demo_gives_markdown_and_the_plot(tmp_path, corpus):
    from posenc.cli.compare import lm_demo
    from posenc.experiments.tasks import LanguageModelTask

    task = LanguageModelTask(train_length=4, test_lengths=(4, 8), corpus=str(corpus))
    text, plots = lm_demo(tmp_path, task=task, config=TINY_CONFIG, quiet=True)
    assert "| `kerple-log` |" in text and "| yarn |" in text  # every lm scheme, 1 seed
    assert "| `rotary-2d` |" not in text  # causal 1-D schemes only
    assert plots == [tmp_path / "compare_lm.png"] and plots[0].exists()


def test_plot_lines_differ_in_colour_or_line_style():
    from posenc.cli._compare_lm import line_styles

    styles = line_styles(22)
    pairs = {(s["color"], s["linestyle"]) for s in styles}
    assert len(pairs) == 22  # no two of 22 lines look alike
    assert len({s["color"] for s in styles[:11]}) == 11  # the lm plot: 11 colours
    for a, b in itertools.pairwise(styles):  # neighbours differ in every respect
        assert a["color"] != b["color"] and a["linestyle"] != b["linestyle"]
        assert a["marker"] != b["marker"]
    # the line of the same colour (11 later) has another line style and marker
    assert styles[0]["linestyle"] != styles[11]["linestyle"]
    assert styles[0]["marker"] != styles[11]["marker"]


def test_ctrl_c_in_workers_cancels_the_models_not_started(monkeypatch):
    """An interrupt while workers train cancels the queue (it does not wait for every model
    queued), and the interrupt goes on up."""
    import concurrent.futures

    from posenc.cli import compare as compare_module
    from posenc.cli._progress import Progress

    shutdowns = []

    class Pool:
        def __init__(self, jobs, mp_context=None):
            self.futures = []

        def submit(self, fn, *args, **kwargs):
            self.futures.append(concurrent.futures.Future())
            return self.futures[-1]

        def shutdown(self, wait=True, *, cancel_futures=False):
            shutdowns.append((wait, cancel_futures))

    def interrupted(futures):
        raise KeyboardInterrupt
        yield  # a generator, as as_completed is

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(concurrent.futures, "as_completed", interrupted)
    plan = [(TASKS["shift"], "rotary", seed) for seed in range(6)]
    with pytest.raises(KeyboardInterrupt):
        compare_module._compare_in_workers(plan, TINY_CONFIG, Progress(6, quiet=True), None, 2)
    assert shutdowns == [(False, True)]
