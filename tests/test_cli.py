"""The ``posenc`` command through ``main([...])``, no ``sys.argv``."""

from __future__ import annotations

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
