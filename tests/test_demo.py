"""``posenc demo``: the report exists, links only files that exist, and renders offline."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from posenc.cli import main
from posenc.cli.demo import DemoPlan, markdown_to_html, plan_for, run_demo
from posenc.experiments.tasks import TASKS
from posenc.experiments.training import Config

TINY = DemoPlan(
    seeds=1,
    config=Config(steps=2, batch=4, dim=16, heads=2, layers=1, eval_examples=2),
    tasks=(
        replace(TASKS["shift"], test_lengths=(32, 40)),
        replace(TASKS["grid"], train_length=(2, 3), test_lengths=((2, 3), (3, 4))),
    ),
    bench_lengths=(16,),
    bench={"batch": 1, "heads": 2, "head_dim": 8, "repeats": 1, "warmup": 0},
)


@pytest.mark.slow
def test_demo_report_links_only_files_that_exist(tmp_path):
    report_md, report_html = run_demo(tmp_path, TINY, log=lambda line: None, quiet=True)
    text = report_md.read_text()
    for heading in ("What each scheme is", "Which scheme", "trained models learned", "costs"):
        assert heading in text
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(links) >= 10
    for link in links:
        path = tmp_path / link
        assert path.is_file() and path.stat().st_size > 0, link
    for kind in ("attention_shift", "attention_grid", "compare_grid", "similarity"):
        assert any(kind in link for link in links), kind
    page = report_html.read_text()
    assert page.count("<img ") == len(links) and "data:image/png;base64," in page
    assert 'src="plots/' not in page  # every image is inline: the page opens offline
    assert "<table>" in page


def test_markdown_to_html(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG\r\n\x1a\nrest")
    page = markdown_to_html(
        "# Title\n\nSome `code` and **bold** & _it_.\n\n| a | b |\n|---|---:|\n| x | 1 |\n\n"
        "![pic](a.png)\n",
        tmp_path,
    )
    assert "<h1>Title</h1>" in page
    assert "<p>Some <code>code</code> and <strong>bold</strong> &amp; <em>it</em>.</p>" in page
    assert '<td>x</td><td class="num">1</td>' in page
    assert '<img alt="pic" src="data:image/png;base64,iVBORw0KGgpyZXN0">' in page


def test_plans():
    quick, full = plan_for(True), plan_for(False)
    assert quick.seeds <= full.seeds and quick.config.steps < full.config.steps
    assert max(full.bench_lengths) == 1024 and max(quick.bench_lengths) < 1024


def test_demo_help(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "--quick" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "folder"),
    [("report.md", True), ("report.html", True), ("plots", False), ("checkpoints", False)],
)
def test_out_that_the_demo_cannot_fill_is_refused_before_it_starts(
    name, folder, tmp_path, capsys, monkeypatch
):
    """A folder where the demo writes a file (or a file where it makes a folder) used to
    fail part-way through the demo, after minutes of training."""
    import posenc.cli.demo as demo

    def started(*args, **kwargs):
        raise AssertionError("the demo started before its arguments were checked")

    monkeypatch.setattr(demo, "run_demo", started)
    if folder:
        (tmp_path / name).mkdir()
    else:
        (tmp_path / name).write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--quick", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    kind = (
        "a folder, but the command writes a file"
        if folder
        else "a file, but the command makes a folder"
    )
    assert err.splitlines()[-1] == (
        f"posenc demo: error: argument --out: '{tmp_path / name}' is {kind} there; remove "
        "it or choose another folder"
    )
    assert [p.name for p in tmp_path.iterdir()] == [name]
