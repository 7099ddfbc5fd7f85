"""``posenc demo``: the report exists, links only files that exist, and renders offline."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from posenc.cli import main
from posenc.cli.demo import (
    PHASES,
    DemoPlan,
    Phase,
    markdown_to_html,
    plan_for,
    run_demo,
)
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
    report = run_demo(tmp_path, TINY, log=lambda line: None, quiet=True)
    assert [r.status for r in report.phases] == ["done"] * len(PHASES)
    assert report.exit_status == 0
    report_md, report_html = report.markdown, report.html
    text = report_md.read_text()
    assert "Incomplete" not in text and "| bench | done |" in text
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


# ----- phases: what a failing or interrupted one leaves -----------------------------------


def _section(name: str, log: list[str] | None = None) -> Phase:
    """A phase that returns one line of text (and notes that it ran in ``log``)."""

    def run(context):
        if log is not None:
            log.append(name)
        return ["", f"{name} finished."]

    return Phase(name, f"The {name} phase", run)


def _raising(name: str, error: BaseException) -> Phase:
    def run(context):
        raise error

    return Phase(name, f"The {name} phase", run)


def test_a_failing_phase_is_reported_and_the_others_still_run(tmp_path):
    ran: list[str] = []
    needs_it = Phase("trained", "Trained", lambda c: ran.append("trained") or [], ("compare",))
    phases = [
        _section("plots", ran),
        _raising("compare", RuntimeError("no space left\non device")),
        needs_it,
        _section("bench", ran),
    ]
    lines: list[str] = []
    report = run_demo(tmp_path, TINY, log=lines.append, quiet=True, phases=phases)
    assert ran == ["plots", "bench"]  # not the phase that needs the failed one
    assert [r.status for r in report.phases] == ["done", "failed", "not run", "done"]
    assert report.exit_status == 1
    text = report.markdown.read_text()
    assert "## 1. The plots phase\n\nplots finished." in text
    assert "## 4. The bench phase\n\nbench finished." in text
    failed = "failed after 0 s (RuntimeError: no space left on device)"
    assert f"## 2. The compare phase\n\n_Not here: this phase {failed}._" in text
    not_run = "was not run: it needs compare, which did not finish"
    assert f"## 3. Trained\n\n_Not here: this phase {not_run}._" in text
    assert text.split("\n\n")[2] == f"**Incomplete**: compare {failed}; trained {not_run}."
    assert "| compare | failed | 0 |\n| trained | not run | - |\n| bench | done | 0 |" in text
    assert any("Traceback" in line and "no space left" in line for line in lines)
    assert "<h2>2. The compare phase</h2>" in report.html.read_text()


def test_ctrl_c_stops_the_demo_and_the_report_says_what_finished(tmp_path):
    ran: list[str] = []
    phases = [
        _section("plots", ran),
        _raising("compare", KeyboardInterrupt()),
        _section("bench", ran),
    ]
    report = run_demo(tmp_path, TINY, log=lambda line: None, quiet=True, phases=phases)
    assert ran == ["plots"]
    assert [r.status for r in report.phases] == ["done", "interrupted", "not run"]
    assert report.exit_status == 130
    text = report.markdown.read_text()
    assert "plots finished." in text and "bench finished." not in text
    assert (
        "**Incomplete**: compare was interrupted after 0 s; bench was not run: the demo was "
        "interrupted before it."
    ) in text
    assert "| compare | interrupted | 0 |\n| bench | not run | - |" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "report.md"]


def test_the_report_is_written_after_each_phase(tmp_path):
    """A demo killed outright (no Ctrl-C to catch) leaves the report of the phases before."""
    seen = []

    def second(context):
        seen.append((tmp_path / "report.md").read_text())
        return []

    phases = [_section("plots"), Phase("compare", "Compare", second)]
    run_demo(tmp_path, TINY, log=lambda line: None, quiet=True, phases=phases)
    assert "plots finished." in seen[0]
    assert "compare has not run yet (the demo stopped before it, or is still running)" in seen[0]


@pytest.mark.parametrize(("error", "status"), [(KeyboardInterrupt(), 130), (OSError("x"), 1)])
def test_the_exit_status_says_the_demo_did_not_finish(error, status, tmp_path, capsys, monkeypatch):
    import posenc.cli.demo as demo

    monkeypatch.setattr(demo, "PHASES", (_section("plots"), _raising("compare", error)))
    assert main(["demo", "--quick", "--quiet", "--out", str(tmp_path)]) == status
    captured = capsys.readouterr()
    assert f"report: {tmp_path / 'report.md'}" in captured.out
    assert "posenc demo: not done: compare (the report says why)" in captured.err


def test_a_phase_that_needs_a_later_one_is_refused(tmp_path):
    phases = [Phase("trained", "Trained", lambda c: [], ("compare",)), _section("compare")]
    with pytest.raises(ValueError, match="phase 'trained' needs 'compare', which is not a phase"):
        run_demo(tmp_path, TINY, log=lambda line: None, phases=phases)


def test_phases():
    names = [phase.name for phase in PHASES]
    assert names == ["plots", "compare", "lm", "trained", "bench"]
    assert dict(zip(names, (p.needs for p in PHASES), strict=True))["trained"] == ("compare",)


def test_plans():
    from posenc import registry

    quick, full = plan_for(True), plan_for(False)
    assert quick.seeds <= full.seeds and quick.config.steps < full.config.steps
    assert max(full.bench_lengths) == 1024 and max(quick.bench_lengths) < 1024
    assert full.schemes is None and len(full.tasks) > len(quick.tasks)
    assert all(registry.resolve(name) == name for name in quick.schemes)
    # the text of the trained-model plots speaks of a learned table and of a scheme that
    # solved shift
    assert {"learned", "rotary"} <= set(quick.schemes)


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
