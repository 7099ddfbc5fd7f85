"""The ``posenc`` command through ``main([...])``, no ``sys.argv``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from posenc import __version__
from posenc.cli import build_parser, main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"posenc {__version__}"


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "plot" in capsys.readouterr().out


def test_help_lists_commands():
    text = build_parser().format_help()
    assert "plot" in text and "--version" in text


# ----- every argument is checked before the command starts --------------------------------


def _subparsers():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices


def test_every_value_option_has_a_checking_type():
    """A number or a path taken as plain ``int``/``float``/``Path`` reaches the command
    unchecked (``--batch 0``, ``--out`` a file): each needs a type of ``_options`` (or
    ``choices``), which refuses a bad value before anything runs."""
    for command, parser in _subparsers().items():
        for action in parser._actions:
            if action.nargs == 0 or action.choices is not None:  # flags, --help, choices
                continue
            assert action.type not in (None, int, float, str, Path), (command, action.dest)


@pytest.fixture
def no_work(monkeypatch):
    """Every command's work fails the test if it starts."""
    from posenc.cli import bench, compare, demo, plot

    def started(*args, **kwargs):
        raise AssertionError("the command started its work before checking its arguments")

    monkeypatch.setattr(bench, "run_bench", started)
    monkeypatch.setattr(compare, "compare", started)
    monkeypatch.setattr(demo, "run_demo", started)
    monkeypatch.setattr(plot, "KINDS", dict.fromkeys(plot.KINDS, started))


def refused(argv, capsys) -> str:
    """Run ``posenc argv``, which argparse must refuse: exit status 2, no traceback, one
    error line (after the usage); return that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(errors) == 1, err
    assert err.splitlines()[-1] == errors[0]
    return errors[0]


#: each command that writes into a folder, with the options that make it run
OUT_COMMANDS = {
    "plot": ["plot", "skew"],
    "compare": ["compare", "--quiet"],
    "demo": ["demo", "--quiet"],
}
#: each command that writes a file, and the file name its message suggests
JSON_COMMANDS = {"bench": "bench.json", "compare": "compare.json"}


def _only(folder: Path, *names: str) -> None:
    """Nothing was written in ``folder`` besides ``names`` (what the test made)."""
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)


@pytest.mark.parametrize("command", sorted(OUT_COMMANDS))
def test_out_that_is_a_file_is_refused(command, tmp_path, capsys, no_work):
    path = tmp_path / "results.txt"
    path.write_text("keep me")
    line = refused([*OUT_COMMANDS[command], "--out", str(path)], capsys)
    assert line == (
        f"posenc {command}: error: argument --out: '{path}' is a file; pass a folder "
        "(it is created if missing)"
    )
    assert path.read_text() == "keep me"
    _only(tmp_path, "results.txt")


@pytest.mark.parametrize("command", sorted(OUT_COMMANDS))
def test_out_below_a_file_is_refused(command, tmp_path, capsys, no_work):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "sub"
    line = refused([*OUT_COMMANDS[command], "--out", str(path)], capsys)
    assert line == (
        f"posenc {command}: error: argument --out: cannot create '{path}': "
        f"'{tmp_path / 'file'}' is a file, not a folder; choose another path"
    )
    _only(tmp_path, "file")


@pytest.mark.parametrize("command", ["plot", "demo"])
def test_default_out_that_is_a_file_is_refused(command, tmp_path, capsys, no_work, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "posenc-out").write_text("")
    line = refused(OUT_COMMANDS[command], capsys)
    assert "argument --out: 'posenc-out' is a file" in line
    _only(tmp_path, "posenc-out")


@pytest.mark.parametrize("command", sorted(JSON_COMMANDS))
def test_json_that_is_a_folder_is_refused(command, tmp_path, capsys, no_work):
    line = refused([command, "--json", str(tmp_path)], capsys)
    example = tmp_path / JSON_COMMANDS[command]
    assert line == (
        f"posenc {command}: error: argument --json: '{tmp_path}' is a folder; pass a file "
        f"name, e.g. '{example}'"
    )
    _only(tmp_path)


@pytest.mark.parametrize("command", sorted(JSON_COMMANDS))
def test_json_below_a_file_is_refused(command, tmp_path, capsys, no_work):
    (tmp_path / "file").write_text("")
    line = refused([command, "--json", str(tmp_path / "file" / "r.json")], capsys)
    assert "argument --json: cannot create" in line and "is a file, not a folder" in line
    _only(tmp_path, "file")


def test_a_folder_without_write_permission_is_refused(tmp_path, capsys, no_work, monkeypatch):
    from posenc.cli import _options

    # as root every folder is writable: pretend that none is
    monkeypatch.setattr(_options.os, "access", lambda path, mode: False)
    line = refused(["plot", "skew", "--out", str(tmp_path)], capsys)
    assert line.endswith(
        f"argument --out: no permission to write in '{tmp_path}'; choose another folder"
    )
    line = refused(["bench", "--json", str(tmp_path / "new" / "r.json")], capsys)
    assert f"no permission to write in '{tmp_path}'" in line


def test_a_write_the_checks_cannot_foresee_is_one_line(tmp_path, capsys):
    """What the system refuses during the run is one line and status 1, not a traceback."""
    (tmp_path / "skew.png").mkdir()  # the file plot skew writes
    assert main(["plot", "skew", "--length", "2", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("posenc plot: error: ") and err.count("\n") == 1
    assert "skew.png" in err
