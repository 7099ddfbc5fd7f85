"""tools/code_ab.py: the working tree against a commit, timed in one process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import code_ab  # noqa: E402

import posenc  # noqa: E402
from posenc.engine import learned  # noqa: E402


def _in_a_repository() -> bool:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    return done.returncode == 0


needs_git = pytest.mark.skipif(not _in_a_repository(), reason="needs the git repository")


@needs_git
def test_the_base_is_a_package_of_its_own_whose_schemes_count_as_posenc(tmp_path):
    base = code_ab.load_base("HEAD", tmp_path)
    assert base.__name__ == "posenc_base" and base is not posenc
    assert base.ALiBi is not posenc.ALiBi
    # the engine of each version counts its own classes as posenc's (a kept route with
    # gradients, no probe of the hooks), and the other's as a user's
    base_learned = sys.modules["posenc_base.engine.learned"]
    assert base_learned._reads_own_only(base.ALiBi(4))
    assert learned._reads_own_only(posenc.ALiBi(4))
    assert not learned._reads_own_only(base.ALiBi(4))
    # both compute the attention (float64: to rounding, whatever the working tree changed)
    q, k, v = (torch.randn(1, 4, 8, 16, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(
        base.attention(q, k, v, position=base.ALiBi(4)),
        posenc.attention(q, k, v, position=posenc.ALiBi(4)),
    )


@needs_git
@pytest.mark.parametrize(
    ("backward", "layout", "causal"),
    [(False, "bhnd", False), (True, "bhnd", False), (True, "bnhd", False), (False, "bhnd", True)],
)
def test_measure_times_each_version_against_the_floor(
    tmp_path, monkeypatch, backward, layout, causal
):
    """Each variant runs on the inputs of ``layout`` (leaves, or views of one ``[b, n, 3,
    h, d]`` projection) and ``causal`` or not: the floor is SDPA's with ``is_causal``."""
    code_ab.load_base("HEAD", tmp_path)
    seen, floor, core = [], code_ab._floor, code_ab._core

    def spied_floor(q, k, v, causal=False):
        seen.append(("floor", q.stride(), causal))
        return floor(q, k, v, causal=causal)

    def spied_core(*args):
        seen.append(("core", args[-1]))  # causal, the last argument
        return core(*args)

    monkeypatch.setattr(code_ab, "_floor", spied_floor)
    monkeypatch.setattr(code_ab, "_core", spied_core)
    row = code_ab.measure("alibi", (1, 2, 8, 8), 3, backward, layout=layout, causal=causal)
    assert row["mode"] == ("fwd+bwd" if backward else "fwd")
    assert row["floor_us"] > 0
    assert all(row[name] > 0 for name in ("base/floor", "new/floor", "new/base"))
    strides = (128, 64, 8, 1) if layout == "bhnd" else (384, 8, 48, 1)  # [b, n, 3, h, d] views
    assert ("floor", strides, causal) in seen and ("core", causal) in seen
    assert all(entry[-1] == causal for entry in seen)


@needs_git
def test_main_prints_a_table(capsys):
    argv = ["--base", "HEAD", "--schemes", "none", "--shapes", "1x2x8x8", "--repeats", "1"]
    assert code_ab.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| scheme | b h n d | mode |") and len(lines) == 3
    assert lines[2].startswith("| none | 1 2 8 8 | fwd |")


@pytest.mark.parametrize("text", ["2x8x64", "2x8x0x64", "2x8xnx64"])
def test_a_shape_that_is_not_four_positive_sizes_is_refused(text, capsys):
    with pytest.raises(SystemExit):
        code_ab.build_parser().parse_args(["--shapes", text])
    assert "a shape is four positive sizes b x h x n x d" in capsys.readouterr().err
