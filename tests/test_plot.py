"""``posenc plot``: every kind draws files, bad options are clean errors, the data drawn is right.

The data functions are checked against the slow obvious computation (loops over cells),
so that a picture cannot show the right shapes with the wrong numbers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from posenc import LearnedEncoding, LinearScaling, Rotary, YaRNScaling, alibi_slopes, t5_bucket
from posenc.cli import main
from posenc.cli._plot_options import parse_window
from posenc.cli.plot import KINDS
from posenc.cli.plot_encodings import (
    cosine_similarity_matrix,
    rotary_decay,
    rotary_wavelengths,
    similarity_figure,
)
from posenc.cli.plot_scores import (
    alibi_data,
    skew_data,
    swin_bias_data,
    swin_index_data,
    t5_bucket_map,
)

PNG = b"\x89PNG\r\n\x1a\n"

# each kind at tiny sizes, and the files it writes
TINY = {
    "sinusoidal": (
        ["--dim", "16", "--length", "20"],
        ["sinusoidal_columns", "sinusoidal_heatmap", "sinusoidal_similarity"],
    ),
    "similarity": (["--dim", "8", "--length", "12"], ["similarity_sinusoidal"]),
    "skew": (["--length", "3"], ["skew"]),
    "swin-index": (["--window", "2,2"], ["swin_index"]),
    "bias": (
        ["--heads", "2", "--length", "8", "--window", "2,2"],
        ["bias_alibi", "bias_swin", "bias_t5"],
    ),
    "distance": (["--heads", "2", "--length", "16"], ["distance"]),
    "cope": ([], ["cope"]),
    "cpb": (["--window", "2,3"], ["cpb"]),
    "rotary": (
        ["--dim", "8", "--length", "64", "--factor", "2"],
        ["rotary_decay", "rotary_scaling"],
    ),
}


def test_every_kind_is_covered():
    # the kinds of trained models are tested in test_plot_trained.py
    assert set(TINY) | {"attention"} == set(KINDS)


@pytest.mark.parametrize("kind", sorted(TINY))
def test_kind_writes_pngs_and_prints_them(kind, tmp_path, capsys):
    options, names = TINY[kind]
    assert main(["plot", kind, *options, "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.png" for n in names)
    printed = capsys.readouterr().out.split()
    for name in names:
        path = tmp_path / f"{name}.png"
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000
        assert str(path) in printed


@pytest.mark.parametrize("kind", sorted(TINY))
def test_kind_writes_svg(kind, tmp_path):
    options, names = TINY[kind]
    assert main(["plot", kind, *options, "--out", str(tmp_path), "--format", "svg"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.svg" for n in names)
    for name in names:
        text = (tmp_path / f"{name}.svg").read_text()
        assert text.lstrip().startswith("<?xml") and "<svg" in text


def test_png_and_svg_together(tmp_path):
    assert (
        main(["plot", "skew", "--length", "2", "--out", str(tmp_path), "--format", "png,svg"]) == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["skew.png", "skew.svg"]


def test_sinusoidal_default_length_is_kept(tmp_path):
    assert main(["plot", "sinusoidal", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "sinusoidal_heatmap.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize(
    ("kind", "options", "message"),
    [
        ("sinusoidal", ["--dim", "8"], "--dim must be at least 10"),
        ("sinusoidal", ["--dim", "11"], "dim must be even"),
        ("similarity", ["--dim", "9"], "--dim must be even"),
        ("similarity", ["--length", "1"], "--length"),
        ("skew", ["--length", "1"], "--length"),
        ("skew", ["--length", "13"], "--length"),
        ("swin-index", ["--window", "6,6"], "--window"),
        ("bias", ["--heads", "17"], "--heads"),
        ("bias", ["--length", "1"], "--length"),
        ("rotary", ["--dim", "7"], "--dim"),
        ("rotary", ["--length", "4"], "--length"),
        ("rotary", ["--length", "10", "--factor", "20"], "--factor"),
    ],
)
def test_bad_option_is_a_clean_error(kind, options, message, tmp_path, capsys):
    """Out of the range of this kind: refused by the kind before it draws anything."""
    assert main(["plot", kind, *options, "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.startswith("posenc plot: error:")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kind", "options", "message"),
    [
        ("sinusoidal", ["--length", "0"], "argument --length: must be >= 1, got 0"),
        ("sinusoidal", ["--dim", "-4"], "argument --dim: must be >= 1, got -4"),
        ("sinusoidal", ["--dim", "8.5"], "argument --dim: must be an integer >= 1, got '8.5'"),
        ("similarity", ["--base", "-3"], "argument --base: must be > 1, got -3"),
        ("rotary", ["--base", "1"], "argument --base: must be > 1, got 1"),
        ("rotary", ["--base", "inf"], "argument --base: must be a finite number > 1, got 'inf'"),
        ("swin-index", ["--window", "0,3"], "argument --window: must be two integers >= 1 as"),
        ("swin-index", ["--window", "3"], "argument --window: must be two integers >= 1 as"),
        ("swin-index", ["--window", "a,b"], "got 'a,b'"),
        ("swin-index", ["--window", "3,3,3"], "got '3,3,3'"),
        ("bias", ["--heads", "0"], "argument --heads: must be >= 1, got 0"),
        ("bias", ["--window", "2,-1"], "got '2,-1'"),
        (
            "rotary",
            ["--factor", "0.5"],
            "argument --factor: must be >= 1 (the context extension), got 0.5",
        ),
        ("skew", ["--format", "jpg"], "argument --format: must be png, svg or png,svg, got 'jpg'"),
        ("skew", ["--checkpoints", "nowhere"], "argument --checkpoints: no folder 'nowhere'; run"),
    ],
)
def test_a_value_no_kind_takes_is_refused_by_argparse(kind, options, message, tmp_path, capsys):
    """Refused before any kind runs: status 2, one error line naming the option."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", kind, *options, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == err.splitlines()[-1]
    assert errors[0].startswith("posenc plot: error: ") and message in errors[0]
    assert not any(tmp_path.iterdir())


def test_argparse_rejects_bad_format_and_kind():
    with pytest.raises(SystemExit):
        main(["plot", "sinusoidal", "--format", "jpg"])
    with pytest.raises(SystemExit):
        main(["plot", "attention-of-nothing"])


def test_options_a_kind_does_not_read_are_ignored(tmp_path):
    # skew reads --length only: a window, heads or factor out of the range of the kinds that
    # read them (swin-index: 25 tokens, bias: 16 heads) pass
    argv = ["plot", "skew", "--length", "2", "--window", "6,6", "--heads", "17", "--dim", "3"]
    assert main([*argv, "--out", str(tmp_path)]) == 0


def test_parse_window():
    assert parse_window(None, (3, 3)) == (3, 3)
    assert parse_window("2,5", (3, 3)) == (2, 5)
    assert parse_window(" 4x1 ", (3, 3)) == (4, 1)
    for bad in ("0,3", "3", "", "1,2,3", "-1,2", "a,b", "2.5,2"):
        with pytest.raises(ValueError, match="--window"):
            parse_window(bad, (3, 3))


# ----- the data drawn --------------------------------------------------------------------------


def test_cosine_similarity_matrix_by_hand():
    table = np.random.default_rng(0).normal(size=(5, 3))
    sim = cosine_similarity_matrix(table)
    for i in range(5):
        for j in range(5):
            a, b = table[i], table[j]
            assert sim[i, j] == pytest.approx(a @ b / math.sqrt((a @ a) * (b @ b)))


def test_similarity_figure_takes_any_table(tmp_path):
    weight = LearnedEncoding(4, 6).weight  # a parameter: requires grad
    paths = similarity_figure(weight, "learned table", tmp_path, "sim", ["png", "svg"])
    assert paths == [tmp_path / "sim.png", tmp_path / "sim.svg"]
    assert paths[0].read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="table must have shape"):
        similarity_figure(np.zeros(5), "bad", tmp_path, "bad", ["png"])


@pytest.mark.parametrize("length", [1, 2, 3, 5, 8])
def test_skew_data_is_the_offset_j_minus_i(length):
    relative, absolute, kept = skew_data(length)
    assert relative.shape == (length, 2 * length - 1) and absolute.shape == (length, length)
    for i in range(length):
        for c in range(2 * length - 1):
            assert relative[i, c] == c - (length - 1)
            assert kept[i, c] == (length - 1 - i <= c <= 2 * length - 2 - i)
        for j in range(length):
            assert absolute[i, j] == j - i
            assert absolute[i, j] == relative[i, j - i + length - 1]


def test_swin_index_data_for_a_2x2_window():
    index, offsets = swin_index_data((2, 2))
    assert index.tolist() == [[4, 3, 1, 0], [5, 4, 2, 1], [7, 6, 4, 3], [8, 7, 5, 4]]
    assert offsets.tolist() == [[dy, dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1)]


@pytest.mark.parametrize("window", [(1, 1), (1, 4), (2, 3), (3, 3), (4, 2)])
def test_swin_index_offsets_by_hand(window):
    wh, ww = window
    index, offsets = swin_index_data(window)
    n = wh * ww
    assert index.shape == (n, n) and offsets.shape == ((2 * wh - 1) * (2 * ww - 1), 2)
    for p in range(n):
        for q in range(n):
            (rp, cp), (rq, cq) = divmod(p, ww), divmod(q, ww)
            assert tuple(offsets[index[p, q]]) == (rp - rq, cp - cq)  # query minus key
    # every table row serves exactly one offset, and every offset has a row
    assert len({tuple(o) for o in offsets}) == len(offsets)


def test_alibi_data_by_hand():
    bias, slopes = alibi_data(3, 6)
    assert np.allclose(slopes, alibi_slopes(3).numpy())
    for h in range(3):
        for i in range(6):
            for j in range(6):
                assert bias[h, i, j] == pytest.approx(-slopes[h] * abs(j - i))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bucket_map_is_the_bucket_of_j_minus_i(bidirectional):
    length = 40
    buckets = t5_bucket_map(length, bidirectional=bidirectional)
    for i in range(length):
        for j in range(length):
            expected = t5_bucket(torch.tensor(j - i), bidirectional=bidirectional)
            assert buckets[i, j] == int(expected)
    if bidirectional:  # a key after the query is in the upper half
        assert buckets[0, 1] >= 16 and buckets[1, 0] < 16


def test_swin_bias_data_by_hand():
    window, heads = (2, 3), 10
    bias, peaks = swin_bias_data(window, heads)
    assert bias.shape == (heads, 6, 6)
    assert tuple(peaks[0]) == (0, 0) and tuple(peaks[9]) == (0, 0)
    for h in range(heads):
        spread = 1 + h // 9
        for p in range(6):
            for q in range(6):
                dy, dx = p // 3 - q // 3, p % 3 - q % 3
                py, px = peaks[h]
                expected = -((dy - py) ** 2 + (dx - px) ** 2) / (2 * spread)
                assert bias[h, p, q] == pytest.approx(expected)


def _slow_decay(theta: np.ndarray, m: int) -> tuple[float, float]:
    terms = np.exp(1j * m * theta)  # pair i, frequency order
    bound = np.mean([abs(terms[:j].sum()) for j in range(1, len(theta) + 1)])
    return bound, float(np.mean(np.cos(m * theta)))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_decay_matches_the_formula(interleaved):
    d, base = 8, 10000.0
    bound, cosine = rotary_decay(Rotary(d, base=base, interleaved=interleaved), 50)
    theta = base ** (-np.arange(0, d, 2) / d)
    assert bound[0] == pytest.approx((d / 2 + 1) / 2) and cosine[0] == pytest.approx(1.0)
    for m in (1, 2, 7, 50):
        slow_bound, slow_cosine = _slow_decay(theta, m)
        assert bound[m] == pytest.approx(slow_bound, rel=1e-9)
        assert cosine[m] == pytest.approx(slow_cosine, abs=1e-9)


def test_linear_scaling_stretches_the_decay():
    plain, _ = rotary_decay(Rotary(16), 40)
    stretched, _ = rotary_decay(Rotary(16, scaling=LinearScaling(4)), 160)
    assert np.allclose(stretched[::4], plain)


def test_yarn_attention_factor_cancels_in_the_decay():
    yarn = YaRNScaling(4, 32)
    bound, cosine = rotary_decay(Rotary(16, scaling=yarn), 100)
    assert yarn.attention_factor > 1
    assert bound[0] == pytest.approx(4.5) and cosine[0] == pytest.approx(1.0)
    assert np.isfinite(bound).all() and np.isfinite(cosine).all()


def test_rotary_wavelengths():
    d = 8
    plain = rotary_wavelengths(Rotary(d))
    assert np.allclose(plain, 2 * math.pi * 10000.0 ** (np.arange(0, d, 2) / d))
    assert np.allclose(rotary_wavelengths(Rotary(d, scaling=LinearScaling(3))), 3 * plain)
