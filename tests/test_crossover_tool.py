"""tools/crossover.py with fewer queries than keys (``--queries``): the three variants
compute one attention, the floor's causal band aligned at the end."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import crossover  # noqa: E402

import posenc  # noqa: E402


@pytest.mark.parametrize("causal", [False, True])
def test_few_queries_at_the_end_of_the_keys_give_one_attention(causal):
    n_q, n = 3, 10
    scheme = crossover._scheme("t5-decoder", 2, 8, n, causal).double()
    torch.manual_seed(0)
    q = torch.randn(1, 2, n_q, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for _ in range(2))
    at = {"positions": torch.arange(n - n_q, n), "key_positions": torch.arange(n)}
    want = posenc.attention(q, k, v, position=scheme, causal=causal, backend="math", **at)
    for variant in ("materialised", "lean"):
        got = crossover._call(variant, scheme, causal, n_q, n)(q, k, v)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    floor = crossover._call("floor", None, causal, n_q, n)(q, k, v)
    plain = posenc.attention(q, k, v, causal=causal, backend="math", **at)  # no scheme
    torch.testing.assert_close(floor, plain, rtol=0, atol=1e-12)


def test_measure_names_the_queries_and_times_the_modes_asked():
    args = types.SimpleNamespace(repeats=1, least=0.0, modes=["fwd"])
    row = crossover.measure("alibi", (1, 2, 16, 8), True, args, n_q=4)
    assert row["queries"] == 4 and row["lean_path"] == "offset-bias"
    assert "fwd" in row and "fwd+bwd" not in row
    assert row["fwd"]["materialised"] > 0 and row["fwd"]["lean"] > 0
    assert "| 4 | yes |" in crossover._row(row)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--modes", "both"], "--modes takes comma-separated fwd+bwd, fwd; got ['both']"),
        (["--masks", "both"], "--masks takes comma-separated none, causal; got ['both']"),
    ],
)
def test_a_mode_or_mask_it_does_not_know_is_refused(argv, says, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["crossover.py", *argv])
    with pytest.raises(SystemExit):
        crossover.main()
    assert says in capsys.readouterr().err


def test_more_queries_than_keys_are_skipped_and_said(monkeypatch, capsys):
    argv = ["--schemes", "alibi", "--shapes", "1x2x8x8", "--queries", "16", "--modes", "fwd"]
    monkeypatch.setattr(sys, "argv", ["crossover.py", *argv, "--masks", "none"])
    crossover.main()
    assert "(skipped: 16 queries over 8 keys" in capsys.readouterr().out
