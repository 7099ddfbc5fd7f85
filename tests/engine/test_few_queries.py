"""posenc.engine.few_queries: a bias asked of few queries over more keys stays on the
materialised path past the pairs' limits (and past the scores' budget where SDPA's fused
kernel writes the bias alone, within the budget or the call's keys and values); a window
keeps the mask blocks, one query under a causal window hides no pair."""

from __future__ import annotations

import torch
from test_materialised import _randomised, _refused

import posenc
from posenc.engine import kept, tuning
from tolerances import assert_close, logit_size


def test_few_queries_over_more_keys_stay_materialised_past_the_pairs(monkeypatch):
    """A bias without gradients asked of fewer queries than keys, and fewer than
    MATERIALISED_QUERIES_PER_SEQUENCE per sequence of the batch (at most
    MATERIALISED_QUERIES), stays on the materialised path past MATERIALISED_PAIRS and
    MATERIALISED_CAUSAL_PAIRS, and equals the math path; from those queries on, with
    gradients, or past the budget (where SDPA's fused kernel does not write the bias
    alone, or that bias is larger than the budget and than the call's keys and values),
    the lean path, for the reasons it had."""
    monkeypatch.setattr(tuning, "MATERIALISED_QUERIES_PER_SEQUENCE", 5)
    monkeypatch.setattr(tuning, "MATERIALISED_QUERIES", 12)
    monkeypatch.setattr(tuning, "MATERIALISED_PAIRS", 2**6)
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_PAIRS", 2**5)
    torch.manual_seed(0)
    t5 = _randomised(posenc.T5RelativeBias(2))  # float64
    k, v = (
        torch.randn(3, 2, 64, 8, dtype=torch.float64),
        torch.randn(3, 2, 64, 8, dtype=torch.float64),
    )

    def call(b, n_q, causal, run=posenc.explain, **kwargs):
        """``q`` and ``run``'s answer for ``n_q`` queries at the end of the 64 keys."""
        q = torch.randn(b, 2, n_q, 8, dtype=torch.float64)
        positions, key_positions = torch.arange(64 - n_q, 64), torch.arange(64)
        answer = run(
            q, k[:b], v[:b], position=t5, positions=positions, key_positions=key_positions,
            causal=causal, **kwargs,
        )  # fmt: skip
        return q, answer

    q = torch.randn(3, 2, 4, 8, dtype=torch.float64)  # its table learns: gradients
    trained = posenc.explain(
        q, k, v, position=t5, positions=torch.arange(60, 64), key_positions=torch.arange(64)
    )
    assert (
        trained.path == "offset-bias"
        and "MATERIALISED_PAIRS = 64" in trained.reasons["materialised"]
    )
    with torch.no_grad():
        for b, fewest in ((3, 12), (2, 10), (1, 5)):  # 5 per sequence, at most 12
            for causal in (False, True):
                with monkeypatch.context() as patched:
                    if causal:  # the causal limit alone
                        patched.setattr(tuning, "MATERIALISED_PAIRS", 2**20)
                    _, below = call(b, fewest - 1, causal)
                    assert below.path == "materialised", (b, causal, below)
                    _, at = call(b, fewest, causal)
                assert at.path == "offset-bias", (b, causal, at)
                pairs = "MATERIALISED_CAUSAL_PAIRS = 32" if causal else "MATERIALISED_PAIRS = 64"
                assert pairs in at.reasons["materialised"], at
        torch.manual_seed(1)
        q, out = call(3, 11, False, posenc.attention)  # the materialised path, in float64
        want = posenc.attention(
            q, k, v, position=t5, positions=torch.arange(53, 64), key_positions=torch.arange(64),
            backend="math",
        )  # fmt: skip
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
        # past the scores' budget, the bias alone through SDPA's fused kernel, within it:
        # float32 queries (no cast of the bias), grad mode off, no mask but the causal one
        monkeypatch.setattr(tuning, "MATERIALISED_SCORES", 2**10)  # 3 x 2 x 4 x 64 is above
        budget = (
            "the [b, h, n_q, n_k] scores would be 0.0 MiB, above the budget 0.0 MiB "
            "(MATERIALISED_SCORES)"
        )
        alone = (  # where SDPA's fused kernel would take the bias alone, but it is too large
            "; the bias alone as SDPA's float mask would write 0.0 MiB (with its causal-masked "
            "copy), above the budget and the call's keys and values (0.0 MiB)"
        )
        t5 = t5.float()
        # one channel: the keys and values (3 x 2 x 64 x (1 + 1) = 768) below the biases
        # weighed here, which they would let past the budget (below)
        q, k, v = torch.randn(3, 2, 4, 1), torch.randn(3, 2, 64, 1), torch.randn(3, 2, 64, 1)
        at = {"positions": torch.arange(60, 64), "key_positions": torch.arange(64)}
        before = set(kept._routes(t5) or ())  # (the float64 calls above kept theirs)
        for causal in (False, True):  # 2 x 4 x 64, twice under the causal mask: at most 2^10
            told = posenc.explain(q, k, v, position=t5, causal=causal, **at)
            assert told.path == "materialised", told
            out = posenc.attention(q, k, v, position=t5, causal=causal, **at)
            want = posenc.attention(q, k, v, position=t5, causal=causal, backend="math", **at)
            assert_close(out, want, terms=64, logit=logit_size(q, k))
            assert set(kept._routes(t5) or ()) == before, "none kept: not in the key"
            _refused(posenc.explain(q.double(), k.double(), v.double(), position=t5.double(),
                                    causal=causal, **at), "offset-bias", budget)  # fmt: skip
            t5.float()
            with torch.enable_grad():  # grad mode on: a bias that asks for none, all the same
                _refused(posenc.explain(q, k, v, position=t5.requires_grad_(False),
                                        causal=causal, **at), "offset-bias", budget)  # fmt: skip
            t5.requires_grad_(True)
        with monkeypatch.context() as patched:  # the causal mask's copy counts
            patched.setattr(tuning, "MATERIALISED_SCORES", 2**10 - 1)
            assert posenc.explain(q, k, v, position=t5, **at).path == "materialised"
            _refused(posenc.explain(q, k, v, position=t5, causal=True, **at), "offset-bias",
                     budget, alone)  # fmt: skip
        per_sequence = torch.arange(60, 64).expand(3, 4)  # a bias per sequence: 3 x 2 x 4 x 64
        told = posenc.explain(
            q, k, v, position=t5, positions=per_sequence, key_positions=torch.arange(64)
        )
        _refused(told, "lean-fused", budget, alone)  # (not one run of positions: no offset path)
        padding = torch.zeros(3, 64, dtype=torch.bool)
        padding[0, :3] = True  # its own paths: the mask blocks
        told = posenc.explain(q, k, v, position=t5, key_padding_mask=padding, **at)
        assert told.path != "materialised" and told.reasons["materialised"] == budget, told
        # past the budget, a bias alone within the call's keys and values: as much as the
        # per-offset path writes (the keys and values reversed)
        monkeypatch.setattr(tuning, "MATERIALISED_SCORES", 2**9 - 1)  # the bias alone is above
        assert posenc.explain(q, k, v, position=t5, **at).path == "materialised"  # 512 <= 768
        out = posenc.attention(q, k, v, position=t5, **at)
        want = posenc.attention(q, k, v, position=t5, backend="math", **at)
        assert_close(out, want, terms=64, logit=logit_size(q, k))
        one = (q[:1], k[:1], v[:1])  # keys and values 1 x 2 x 64 x 2 = 256 < 512
        _refused(posenc.explain(*one, position=t5, **at), "offset-bias", budget, alone)
        assert posenc.explain(*one, position=t5, causal=True, **at).path != "materialised"


def test_few_queries_under_a_window_keep_the_rules_of_a_window(monkeypatch):
    """A causal window over few queries is not the few-queries case: its mask runs in
    blocks that read only the window's keys (a decoding step too: one query keeps its
    causal flag under a window), past the pairs' limits as before."""
    monkeypatch.setattr(tuning, "MATERIALISED_PAIRS", 2**5)
    t5 = posenc.T5RelativeBias(2, bidirectional=False)
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    for n_q in (1, 4):
        q = torch.randn(1, 2, n_q, 8)
        at = {"positions": torch.arange(64 - n_q, 64), "key_positions": torch.arange(64)}
        with torch.no_grad():
            plain = posenc.explain(q, k, v, position=t5, causal=True, **at)
            windowed = posenc.explain(q, k, v, position=t5, causal=True, window=5, **at)
        assert plain.path == "materialised", plain
        assert windowed.path != "materialised", windowed
        assert "MATERIALISED_PAIRS" in windowed.reasons["materialised"], windowed


def test_one_query_under_a_causal_window_is_cut_in_blocks_and_hides_no_pair(monkeypatch):
    """One query under a causal window keeps its causal flag, so that its mask runs in
    blocks (of the window's keys) where they pay; the causal limit, which weighs the pairs
    a causal mask hides, does not apply to it (it hides none)."""
    t5 = posenc.T5RelativeBias(2, bidirectional=False)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    at = {"positions": torch.tensor([63]), "key_positions": torch.arange(64), "causal": True}
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_PAIRS", 2**5)  # 1 x 64 is above
    with torch.no_grad():
        told = posenc.explain(q, k, v, position=t5, window=8, **at)
        assert told.path == "materialised", told  # (a window: no blocks below 2^15 pairs)
        monkeypatch.setattr(tuning, "MASK_BLOCK_PAIRS", 2**5)
        monkeypatch.setattr(tuning, "MATERIALISED_PAIRS", 2**5)
        told = posenc.explain(q, k, v, position=t5, window=8, **at)
        assert told.path == "mask-blocks", told
        out = posenc.attention(q, k, v, position=t5, window=8, **at)
    want = posenc.attention(q, k, v, position=t5, window=8, backend="math", **at)
    assert_close(out, want, terms=64, logit=logit_size(q, k))
