"""tools/decoding.py: a cached decoding step, posenc's against the same step by hand."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import decoding  # noqa: E402

SCHEMES = ["alibi", "swin-1d"]
SCHEMES += ["t5-decoder"] if importlib.util.find_spec("transformers") else []
SCHEMES += ["rotary"] if importlib.util.find_spec("rotary_embedding_torch") else []


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize(("b", "n"), [(1, 5), (2, 40), (1, 300)])
@pytest.mark.parametrize(
    ("fresh", "chunk"), [(False, 1), (True, 1), (False, 3)], ids=["crop", "fresh", "chunks"]
)
def test_the_steps_by_hand_equal_posencs_steps(name, b, n, fresh, chunk):
    """Each scheme's steps written by hand, six tokens one at a time (or three at a time,
    under the causal mask), give posenc's outputs (the tool times the two only after
    checking this), and a second run of the cache put back gives the same; in float64 so
    that a wrong offset, mask or channel order shows (rotary-embedding-torch computes its
    angles in float32: an angle at position ``p`` is off by up to ``p`` ulps of float32
    in radians, which moves a logit and so the output by at most about that, relative to
    its size)."""
    torch.set_default_dtype(torch.float64)
    try:
        with_posenc, by_cat, in_buffer = decoding._steps(
            name, b, 2, 8, n, tokens=6, fresh=fresh, chunk=chunk
        )
        with torch.no_grad():
            got, want, buffer = with_posenc(), by_cat(), in_buffer()
            again, buffer_again = with_posenc(), in_buffer()  # from the prefill again: the same
    finally:
        torch.set_default_dtype(torch.float32)
    assert got.shape == (b, 6, 16)
    atol = (n + 6) * torch.finfo(torch.float32).eps if name == "rotary" else 1e-12
    torch.testing.assert_close(got, want, rtol=0, atol=atol * float(want.abs().max()))
    assert (
        torch.equal(buffer, want) and torch.equal(got, again) and torch.equal(buffer, buffer_again)
    )


@pytest.mark.parametrize("chunk", [1, 2])
def test_measure_gives_the_times_and_the_ratios(chunk):
    args = types.SimpleNamespace(
        heads=2, head_dim=8, tokens=2, repeats=3, least=0.001, fresh=True, chunk=chunk
    )
    row = decoding.measure("alibi", 1, 16, args)
    assert all(row[variant] > 0 for variant in decoding._VARIANTS)
    assert row["ratio cat"] > 0 and row["ratio buffer"] > 0
    assert (row["scheme"], row["b"], row["n"]) == ("alibi", 1, 16)


def test_a_scheme_without_a_step_by_hand_is_refused(monkeypatch, capsys):
    with pytest.raises(ValueError, match="no decoding step by hand for 'shaw'; choose from"):
        decoding._bias_by_hand("shaw", None, 4)
    monkeypatch.setattr(sys, "argv", ["decoding.py", "--schemes", "alibi,t5"])
    with pytest.raises(SystemExit):
        decoding.main()
    assert "no decoding step by hand for ['t5']" in capsys.readouterr().err


def test_tokens_that_are_not_a_multiple_of_the_chunk_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["decoding.py", "--tokens", "8", "--chunk", "3"])
    with pytest.raises(SystemExit):
        decoding.main()
    assert "--tokens 8 is not a multiple of --chunk 3" in capsys.readouterr().err
