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


def test_plot_sinusoidal_writes_pngs(tmp_path, capsys):
    assert (
        main(["plot", "sinusoidal", "--dim", "16", "--length", "20", "--out", str(tmp_path)]) == 0
    )
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "sinusoidal_columns.png",
        "sinusoidal_heatmap.png",
        "sinusoidal_similarity.png",
    ]
    for path in tmp_path.iterdir():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    assert str(tmp_path / "sinusoidal_heatmap.png") in capsys.readouterr().out


def test_plot_svg(tmp_path):
    assert main(["plot", "sinusoidal", "--out", str(tmp_path), "--format", "svg"]) == 0
    assert (tmp_path / "sinusoidal_columns.svg").read_text().lstrip().startswith("<?xml")


def test_plot_bad_input_is_a_clean_error(tmp_path, capsys):
    assert main(["plot", "sinusoidal", "--dim", "8", "--out", str(tmp_path)]) == 2
    assert "--dim must be at least 10" in capsys.readouterr().err
    assert main(["plot", "sinusoidal", "--dim", "11", "--out", str(tmp_path)]) == 2
    assert "dim must be even" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plot", "sinusoidal", "--format", "jpg"])
