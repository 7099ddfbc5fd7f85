"""The ``peer`` variant of ``posenc bench`` (:mod:`posenc.cli._bench_peers`): each peer is
posenc's attention computed another way, and ``--baselines peer`` reports it."""

from __future__ import annotations

import json

import pytest
import torch

import posenc.cli.bench as bench
from posenc.cli import main
from posenc.cli._bench_peers import peer_layout, peer_of, skew
from tolerances import assert_close, logit_size


def _tiny(*extra: str) -> list[str]:
    argv = ["bench", "--lengths", "16", "--batch", "2", "--heads", "2", "--head-dim", "8"]
    return [*argv, "--repeats", "1", "--warmup", "0", "--no-memory", "--quiet", *extra]


PEER_SCHEMES = [
    "t5",
    "t5-decoder",
    "swin-1d",
    "swin-2d",
    "alibi",
    "alibi-learned",
    "shaw",
    "shaw-keys-only",
    "relative",
    "relative-per-head",
    "rotary",
    "rotary-interleaved",
]


@pytest.mark.parametrize("masks", [{}, {"causal": True, "padding": 0.25}, {"window": 3}])
@pytest.mark.parametrize("name", PEER_SCHEMES)
def test_peer_is_the_same_attention(name, masks):
    """Each peer computes posenc's attention (float64; masks folded in): what makes the
    ratio to it mean something. rotary-embedding-torch takes its channel pairs
    interleaved (``peer_layout``) and computes its angles in float32."""

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    scheme = bench.build_scheme(name, 2, 8, 16).double()
    expected = bench._core(scheme, "math", **masks)(q, k, v)
    got = bench._peer_of(scheme, **masks)(peer_layout(scheme, q), peer_layout(scheme, k), v)
    if name.startswith("rotary"):  # float32 angles up to n - 1 radians
        logit = logit_size(q, k) * 16
        assert_close(got, expected, terms=8, logit=logit, dtype=torch.float32)
    else:
        pos = torch.arange(16)[None]
        assert_close(got, expected, terms=16, logit=logit_size(q, k, scheme, pos, pos))


@pytest.mark.parametrize(
    "name", ["t5", "swin-1d", "swin-2d", "alibi-learned", "shaw", "relative-per-head"]
)
def test_peer_gradient_reaches_posencs_table(name):
    """The peers read posenc's own tables (HF's T5Attention shares the parameter): the
    gradient of the same attention, float64 against posenc's literal path."""
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    scheme = bench.build_scheme(name, 2, 8, 12).double()
    bench._core(scheme, "math", causal=True)(q, k, v).square().sum().backward()
    expected = [p.grad.clone() for p in scheme.parameters()]
    scheme.zero_grad()
    bench._peer_of(scheme, causal=True)(q, k, v).square().sum().backward()
    for grad, want in zip((p.grad for p in scheme.parameters()), expected, strict=True):
        torch.testing.assert_close(grad, want)


def test_skew_against_a_loop():
    """``skew``: ``S[i, j] = rel[i, j - i + n - 1]``, the slow obvious way."""
    for n in (1, 2, 5):
        rel = torch.randn(3, n, 2 * n - 1, dtype=torch.float64)
        expected = torch.empty(3, n, n, dtype=torch.float64)
        for i in range(n):
            for j in range(n):
                expected[:, i, j] = rel[:, i, j - i + n - 1]
        assert torch.equal(skew(rel), expected)


def test_peer_baseline_columns_json_and_skip_reasons(tmp_path, capsys, monkeypatch):
    """``--baselines peer``: a column pair; a scheme without a peer, or whose package is
    missing, is skipped with the reason; packed documents have none."""
    import posenc.cli._bench_peers as peers

    record = tmp_path / "bench.json"
    argv = _tiny("--schemes", "t5,kerple-log,rotary", "--baselines", "peer", "--json", str(record))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "to the scheme as other code computes it (peer)" in out
    header = next(line for line in out.splitlines() if line.startswith("| scheme"))
    assert header.endswith("| fwd+bwd time / peer | fwd-only time / peer | peak memory / peer |")
    assert "peer skipped for kerple-log (n = 16): no peer is written for KerpleBias" in out
    cases = {c["scheme"]: c for c in json.loads(record.read_text())["cases"]}
    for name in ("t5", "rotary"):
        assert set(cases[name]["fwd_bwd_s"]) == {"floor", "posenc", "reference", "peer"}
        assert cases[name]["ratios"]["time_vs_peer"] > 0
    assert cases["kerple-log"]["ratios"]["time_vs_peer"] is None

    installed = peers._installed
    monkeypatch.setattr(peers, "_installed", lambda name: False)
    assert main(_tiny("--schemes", "t5,rotary", "--baselines", "peer")) == 0
    out = capsys.readouterr().out
    assert "peer skipped for t5 (n = 16): transformers is not installed" in out
    assert "peer skipped for rotary (n = 16): rotary-embedding-torch is not installed" in out
    monkeypatch.setattr(peers, "_installed", installed)
    assert main(_tiny("--schemes", "t5", "--baselines", "peer", "--documents", "2")) == 0
    assert "peer skipped for t5 (n = 16): the peers take positions 0 .. n-1" in (
        capsys.readouterr().out
    )


def test_peer_of_a_scheme_without_one_is_refused():
    with pytest.raises(ValueError, match="scheme KerpleBias has no peer: no peer is written for"):
        peer_of(bench.build_scheme("kerple-log", 2, 8, 16), lambda q: None)
