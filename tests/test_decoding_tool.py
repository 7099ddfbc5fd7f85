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


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize(("fresh", "chunk"), [(False, 1), (True, 3)], ids=["crop", "fresh"])
def test_a_left_padded_batch_by_hand_equals_posencs_steps(name, fresh, chunk):
    """With ``padding`` the prompt's rows are left-padded (row r of 3 by r * 40 // 6
    tokens), which posenc's prefill takes as its key padding mask and each step by hand
    hides: the same outputs (float64), every row's finite, and the padding moves them
    (the padded keys are hidden, not read)."""
    assert decoding._padding(3, 40).sum(dim=1).tolist() == [0, 6, 13]
    torch.set_default_dtype(torch.float64)
    try:
        with_posenc, by_cat, in_buffer = decoding._steps(
            name, 3, 2, 8, 40, tokens=6, fresh=fresh, chunk=chunk, padding=True
        )
        plain = decoding._steps(name, 3, 2, 8, 40, tokens=6, fresh=fresh, chunk=chunk)[0]
        with torch.no_grad():
            got, want, buffer, unpadded = with_posenc(), by_cat(), in_buffer(), plain()
    finally:
        torch.set_default_dtype(torch.float32)
    atol = 46 * torch.finfo(torch.float32).eps if name == "rotary" else 1e-12
    torch.testing.assert_close(got, want, rtol=0, atol=atol * float(want.abs().max()))
    torch.testing.assert_close(buffer, want, rtol=0, atol=1e-12 * float(want.abs().max()))
    assert got.isfinite().all() and not torch.allclose(got[1:], unpadded[1:])
    torch.testing.assert_close(got[0], unpadded[0], rtol=0, atol=atol * float(want.abs().max()))


@pytest.mark.parametrize("chunk", [1, 2])
@pytest.mark.parametrize("walked", [False, True])
def test_measure_gives_the_times_and_the_ratios(chunk, walked, monkeypatch):
    """Each variant's time and the ratios; ``walked``: posenc once more with no route kept,
    set only while its steps run."""
    limits = []
    real = decoding._walked

    def spy(run):
        walked_run = real(run)
        return lambda: limits.append(0) or walked_run()

    monkeypatch.setattr(decoding, "_walked", spy)
    args = types.SimpleNamespace(
        heads=2, head_dim=8, tokens=2, repeats=3, least=0.001, fresh=True, chunk=chunk,
        walked=walked,
    )  # fmt: skip
    row = decoding.measure("alibi", 1, 16, args)
    assert all(row[variant] > 0 for variant in decoding._VARIANTS)
    assert row["ratio cat"] > 0 and row["ratio buffer"] > 0
    assert ("ratio walked" in row) == walked == (decoding._WALKED in row) == bool(limits)
    assert decoding.tuning.KEPT_ROUTES == 16
    assert (row["scheme"], row["b"], row["n"]) == ("alibi", 1, 16)


def test_a_scheme_without_a_step_by_hand_is_refused(monkeypatch, capsys):
    with pytest.raises(ValueError, match="no decoding step by hand for 'shaw'; choose from"):
        decoding._bias_by_hand("shaw", None, 4)
    monkeypatch.setattr(sys, "argv", ["decoding.py", "--schemes", "alibi,t5"])
    with pytest.raises(SystemExit):
        decoding.main()
    assert "no decoding step by hand for ['t5']" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("chunk", "error"),
    [
        ("3", "--tokens 8 is not a multiple of --chunk 3"),
        ("0", "--chunk must be at least 1, got 0"),
    ],
)
def test_a_chunk_that_does_not_divide_the_tokens_is_refused(monkeypatch, capsys, chunk, error):
    monkeypatch.setattr(sys, "argv", ["decoding.py", "--tokens", "8", "--chunk", chunk])
    with pytest.raises(SystemExit):
        decoding.main()
    assert error in capsys.readouterr().err


def test_the_header_says_what_was_timed(monkeypatch, capsys):
    argv = ["decoding.py", "--schemes", "alibi", "--batches", "1", "--lengths", "8"]
    argv += ["--tokens", "4", "--chunk", "2", "--repeats", "1", "--least", "0.001", "--fresh"]
    monkeypatch.setattr(sys, "argv", [*argv, "--padding"])
    decoding.main()
    out = capsys.readouterr().out
    assert "--tokens 4 --chunk 2 --repeats 1 --fresh --padding, h=8 d=64; times per token" in out
    assert "| alibi | 1 | 8 |" in out


def test_walked_runs_with_no_route_kept():
    seen = []
    run = decoding._walked(lambda: seen.append(decoding.tuning.KEPT_ROUTES) or torch.zeros(1))
    run()
    assert seen == [0] and decoding.tuning.KEPT_ROUTES == 16
