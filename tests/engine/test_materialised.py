"""The materialised path of ``auto`` (engine/plans.py ``_plan_materialised``): the bias,
term or value term written out where the scores are few (with gradients, the formula op by
op; without, SDPA with a float mask), the lean paths above."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import posenc
from posenc.engine import lean_plans, plans, tuning


def _spy_kernels(monkeypatch):
    """A list that grows by ``"sdpa"`` or ``"ops"`` each time the materialised path runs
    SDPA or the formula op by op (which must use the scheme's fast hooks; in one buffer
    without grad mode, :func:`~posenc.engine.reference._forward_in_place`); the path sees
    two threads, as on the machines the op-by-op rule was measured on, whatever this one
    has (on one thread no call runs op by op that SDPA's kernel could run)."""
    monkeypatch.setattr(plans, "_threads", lambda: 2)
    calls = []
    sdpa, ops, in_place = plans._sdpa, plans._math, plans._forward_in_place

    def spied_ops(*args, **kwargs):
        assert kwargs["reference"] is False, kwargs  # the fast hooks, not the literal ones
        assert kwargs.keys() <= {"reference", "bias"}, kwargs
        calls.append("ops")
        return ops(*args, **kwargs)

    def spied_in_place(*args, **kwargs):
        calls.append("ops")
        return in_place(*args, **kwargs)

    monkeypatch.setattr(plans, "_sdpa", lambda *a, **kw: calls.append("sdpa") or sdpa(*a, **kw))
    monkeypatch.setattr(plans, "_math", spied_ops)
    monkeypatch.setattr(plans, "_forward_in_place", spied_in_place)
    return calls


def _refused(told, path: str, *reason: str) -> None:
    """The call took ``path``, and the materialised path said why not: ``reason``."""
    assert told.path == path, told
    assert told.reasons["materialised"] == "".join(reason)


def _past(monkeypatch, name, value, q, scheme, what, *, causal=False):
    """The crossover ``name`` set to ``value``, below the call's scores: the call takes the
    offset-term path, and the materialised path names the constant and ``what`` it runs."""
    monkeypatch.setattr(tuning, name, value)
    b, h, n, _ = q.shape
    _refused(
        posenc.explain(q, q, q, position=scheme, causal=causal),
        "offset-term",
        f"{b * h * n * n} scores [b, h, n_q, n_k], above the crossover {value} ({name}) from "
        f"which the lean paths run {what} faster",
    )


def _spied_path(monkeypatch):
    """A list that gets an entry each time the dispatcher asks ``plans._offset_term_path``."""
    asked = []
    path = plans._offset_term_path
    monkeypatch.setattr(plans, "_offset_term_path", lambda call: asked.append(1) or path(call))
    return asked


def _randomised(scheme):
    torch.manual_seed(1)
    scheme = scheme.double()
    for p in scheme.parameters():
        nn.init.normal_(p, std=1.0)  # learned tables far from zero
    return scheme


def test_explain_picks_materialised_when_small_and_a_lean_path_when_large(monkeypatch):
    """Few scores: the materialised path; above the memory budget, the pairs per head or the
    crossover, the lean path, with the size and the constant in the reason; ``backend="lean"``
    never takes it."""
    t5, relative = posenc.T5RelativeBias(8), posenc.RelativeQueryEmbedding(2048, 64)
    small = torch.randn(2, 8, 64, 64)
    for scheme in (t5, relative):
        told = posenc.explain(small, small, small, position=scheme, causal=True)
        assert told.path == "materialised", told
        assert "materialised" in told.reasons["sdpa"]
        lean = posenc.explain(small, small, small, position=scheme, backend="lean")
        assert lean.path in ("offset-bias", "offset-term") and "materialised" not in lean.reasons
    large = torch.randn(2, 8, 2048, 64)  # 2^26 scores, 256 MiB in float32
    _refused(
        posenc.explain(large, large, large, position=t5),
        "offset-bias",
        "the [b, h, n_q, n_k] scores would be 256.0 MiB, above the budget 32.0 MiB "
        "(MATERIALISED_SCORES)",
    )
    one = torch.randn(1, 1, 512, 64)  # 2^18 scores, all in one head
    _refused(
        posenc.explain(one, one, one, position=posenc.T5RelativeBias(1)),
        "offset-bias",
        "512 x 512 query-key pairs per head, above MATERIALISED_PAIRS = 65536, from which "
        "the lean paths are faster at any batch",
    )
    # within the budget, above a measured crossover: a term's is its own
    monkeypatch.setattr(tuning, "MATERIALISED_TERM_SCORES", 2**15)
    _refused(
        posenc.explain(small, small, small, position=relative),
        "offset-term",
        "65536 scores [b, h, n_q, n_k], above the crossover 32768 (MATERIALISED_TERM_SCORES) "
        "from which the lean paths run a score term faster",
    )
    # under a causal mask, whose hidden pairs the lean paths skip, a term has its own
    assert posenc.explain(small, small, small, position=relative, causal=True).path == (
        "materialised"
    )
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_TERM_SCORES", 2**15)
    frozen = copy.deepcopy(relative).requires_grad_(False)  # (with gradients: the next test)
    _refused(
        posenc.explain(small, small, small, position=frozen, causal=True),
        "offset-term",
        "65536 scores [b, h, n_q, n_k], above the crossover 32768 "
        "(MATERIALISED_CAUSAL_TERM_SCORES) from which the lean paths run a causal score term "
        "faster",
    )
    assert posenc.explain(small, small, small, position=t5).path == "materialised"


def test_a_causal_term_with_gradients_in_self_attention_has_its_own_crossover(monkeypatch):
    """A score term under a causal mask takes the materialised path up to
    MATERIALISED_CAUSAL_GRAD_TERM_SCORES in a call with gradients in self-attention whose
    lean path is the offset-term path (what was measured), and up to
    MATERIALISED_CAUSAL_TERM_SCORES otherwise: without gradients, a decoding step, a mask
    beside the causal one (another lean path). Under the lowest of the term limits the
    offset-term path is not asked about."""
    relative = posenc.RelativeQueryEmbedding(64, 8)  # its table learns
    q = torch.randn(2, 2, 64, 8)  # 2^14 scores
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_TERM_SCORES", 2**12)
    assert posenc.explain(q, q, q, position=relative, causal=True).path == "materialised"
    what = "a causal score term"
    with torch.no_grad():
        _past(monkeypatch, "MATERIALISED_CAUSAL_TERM_SCORES", 2**12, q, relative, what, causal=True)
    frozen = copy.deepcopy(relative).requires_grad_(False)
    _past(monkeypatch, "MATERIALISED_CAUSAL_TERM_SCORES", 2**12, q, frozen, what, causal=True)
    told = posenc.explain(q.requires_grad_(), q, q, position=frozen, causal=True)
    assert told.path == "materialised", told  # gradients for q alone
    q = q.detach()
    _past(
        monkeypatch, "MATERIALISED_CAUSAL_GRAD_TERM_SCORES", 2**13, q, relative, what, causal=True
    )
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_GRAD_TERM_SCORES", 2**14)  # at the limit
    assert posenc.explain(q, q, q, position=relative, causal=True).path == "materialised"
    # a decoding step: one query against 64 keys (128 scores), which sees every key: no
    # causal mask, the unmasked crossover
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_TERM_SCORES", 2**6)
    one = q[:, :, -1:]
    told = posenc.explain(one, q, q, position=relative, causal=True)  # (aligned at the end)
    assert told.path == "materialised", told
    with monkeypatch.context() as patched:
        patched.setattr(tuning, "MATERIALISED_TERM_SCORES", 2**6)
        told = posenc.explain(one, q, q, position=relative, causal=True)
        assert "(MATERIALISED_TERM_SCORES)" in told.reasons["materialised"], told
    # a key padding mask beside the causal one: the fused lean path, not the offset-term's
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_TERM_SCORES", 2**12)
    padding = torch.zeros(2, 64, dtype=torch.bool)
    padding[0, -3:] = True
    told = posenc.explain(q, q, q, position=relative, causal=True, key_padding_mask=padding)
    assert told.path != "materialised"
    assert "(MATERIALISED_CAUSAL_TERM_SCORES)" in told.reasons["materialised"], told
    # values of another head dim: the fused CPU kernels do not run (nor the offset-term path)
    told = posenc.explain(q, q, torch.randn(2, 2, 64, 4), position=relative, causal=True)
    assert "(MATERIALISED_CAUSAL_TERM_SCORES)" in told.reasons["materialised"], told
    # under every term limit the path is not asked about
    asked = _spied_path(monkeypatch)
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_TERM_SCORES", 2**14)
    assert posenc.explain(q, q, q, position=relative, causal=True).path == "materialised"
    assert asked == []
    monkeypatch.setattr(tuning, "MATERIALISED_TERM_SCORES", 2**14 - 1)  # the lowest
    assert posenc.explain(q, q, q, position=relative, causal=True).path == "materialised"
    assert asked == [1]


def test_a_bias_without_gradients_is_written_out_up_to_the_budget(monkeypatch):
    """A bias's crossover holds where the call asks for gradients (a learned table, or
    ``q, k, v`` that require grad); without, the budget alone (its forward is cheap), and
    under a causal mask MATERIALISED_CAUSAL_PAIRS pairs per head. (ALiBi's bias, which it
    keeps between calls, has a rule of its own: the next test.)"""
    monkeypatch.setattr(tuning, "MATERIALISED_BIAS_SCORES", 2**12)
    q = torch.randn(2, 2, 32, 8)  # 2^12 scores: at the crossover, then past it
    frozen, t5 = posenc.T5RelativeBias(2).requires_grad_(False), posenc.T5RelativeBias(2)
    assert posenc.explain(q, q, q, position=frozen).path == "materialised"
    monkeypatch.setattr(tuning, "MATERIALISED_BIAS_SCORES", 2**11)
    assert posenc.explain(q, q, q, position=frozen).path == "materialised"
    trained = posenc.explain(q.requires_grad_(), q, q, position=frozen)
    assert trained.path == "offset-bias"
    assert trained.reasons["materialised"] == (
        "4096 scores [b, h, n_q, n_k], above the crossover 2048 (MATERIALISED_BIAS_SCORES) "
        "from which the lean paths run a bias with gradients faster"
    )
    q = q.detach()
    assert posenc.explain(q, q, q, position=t5).path == "offset-bias"  # its table learns
    with torch.no_grad():
        assert posenc.explain(q, q, q, position=t5).path == "materialised"
        # causal: the lean forward skips the hidden pairs; a decoding step stays below
        long = torch.randn(1, 2, 128, 8)
        _refused(
            posenc.explain(long, long, long, position=t5, causal=True),
            "offset-bias",
            "a causal bias without gradients over 128 x 128 pairs per head, above "
            "MATERIALISED_CAUSAL_PAIRS = 4096: the lean paths skip the hidden pairs, which "
            "SDPA with a float mask computes",
        )
        step = posenc.explain(long[:, :, -1:], long, long, position=t5, causal=True)
        assert step.path == "materialised"


def test_alibis_kept_bias_runs_sdpas_fused_kernel_past_the_scores_budget(monkeypatch):
    """ALiBi's bias, which it keeps between calls, goes to SDPA's fused kernel as its float
    mask past MATERIALISED_SCORES, MATERIALISED_PAIRS and MATERIALISED_BIAS_SCORES (the
    kernel writes no scores; the kept bias costs the call nothing), with or without
    gradients, equal to the definition in float64 to float32's rounding; up to
    KEPT_BIAS_PAIRS pairs per head, for no mask, a bias kept in the queries' dtype (paper
    slopes, consecutive positions) and inputs SDPA's fused kernel takes. Otherwise the
    budgets hold, with their reasons."""
    from posenc.engine import sdpa

    calls = _spy_kernels(monkeypatch)
    monkeypatch.setattr(tuning, "MATERIALISED_SCORES", 2**10)  # 2 x 2 x 24 x 24 is above
    monkeypatch.setattr(tuning, "MATERIALISED_PAIRS", 2**8)
    monkeypatch.setattr(tuning, "MATERIALISED_BIAS_SCORES", 2**8)
    torch.manual_seed(0)
    n, d = 24, 8
    q, k, v = (torch.randn(2, 2, n, d) for _ in range(3))
    alibi = posenc.ALiBi(2)
    assert posenc.explain(q, k, v, position=alibi).path == "materialised"
    weights = torch.linspace(-1, 1, d)
    results = {}
    for backend in ("math", "auto", "auto"):  # the second auto call replays the route
        dtype = torch.float64 if backend == "math" else torch.float32
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = posenc.attention(*leaves, position=alibi, backend=backend)
        (out * weights.to(dtype)).sum().backward()
        results[backend] = [out, *(t.grad for t in leaves)]
        with torch.no_grad():
            results[backend].append(posenc.attention(*leaves, position=alibi, backend=backend))
    assert calls == ["sdpa", "sdpa"]  # the first auto call with gradients, then without
    # float32 rounding of logits of at most scale * d * max|q| max|k| + max|bias| (the
    # bias's largest is the flattest slope, 1/16 for two heads, times n - 1), carried to
    # outputs of at most max|v| and to gradients summed over n keys
    eps = torch.finfo(torch.float32).eps
    logits = d**-0.5 * d * q.abs().max() * k.abs().max() + (n - 1) / 16
    tol = float(8 * eps * logits * v.abs().max())
    for a, c, scale in zip(results["math"], results["auto"], (1, n, n, n, 1), strict=True):
        torch.testing.assert_close(c.double(), a, rtol=0, atol=tol * scale)
    # past KEPT_BIAS_PAIRS, the scores' budget
    monkeypatch.setattr(tuning, "KEPT_BIAS_PAIRS", n * n - 1)
    _refused(
        posenc.explain(q, k, v, position=alibi),
        "offset-bias",
        "the [b, h, n_q, n_k] scores would be 0.0 MiB, above the budget 0.0 MiB "
        "(MATERIALISED_SCORES)",
    )
    monkeypatch.setattr(tuning, "KEPT_BIAS_PAIRS", n * n)
    # no kept bias (learned slopes, positions not one run), a mask, other value channels,
    # float64 (the bias is kept in float32: a copy per call), inputs SDPA's fused kernel
    # does not take (its math kernel would write the scores)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        math_only = posenc.explain(q, k, v, position=alibi)
    others = {
        "learned": posenc.explain(q, k, v, position=posenc.ALiBi(2, learned=True)),
        "positions": posenc.explain(q, k, v, position=alibi, positions=torch.arange(n).flip(0)),
        "causal": posenc.explain(q, k, v, position=alibi, causal=True),
        "d_v": posenc.explain(q, k, torch.randn(2, 2, n, 4), position=alibi),
        "float64": posenc.explain(q.double(), k.double(), v.double(), position=alibi),
        "flash off": math_only,
        "strided": posenc.explain(torch.randn(2, 2, n, 2 * d)[..., ::2], k, v, position=alibi),
    }
    for why, told in others.items():
        assert told.path != "materialised", why
        assert "MATERIALISED_SCORES" in told.reasons["materialised"], (why, told)
    # a route kept for the run goes back to the dispatcher where the scheme keeps no bias,
    # or SDPA's fused kernel would not run
    masks = []
    kernel = sdpa._kernel
    monkeypatch.setattr(sdpa, "_kernel", lambda *a: masks.append(a[3] is not None) or kernel(*a))
    with torch.no_grad():
        posenc.attention(q, k, v, position=alibi)  # kept (grad mode off: a signature of its own)
        assert masks == [True] and calls[-1] == "sdpa"
        masks.clear()
        posenc.attention(q, k, v, position=alibi)  # replayed
        assert masks == [True] and calls[-1] == "sdpa" and len(calls) == 3
        masks.clear()
        far = posenc.attention(q, k, v, position=alibi, positions=2 * torch.arange(n))
        with sdpa_kernel(SDPBackend.MATH):
            posenc.attention(q, k, v, position=alibi)
        assert masks == [] and len(calls) == 3  # the lean paths both times
    spread = 2 * torch.arange(n)
    bias = (
        -(spread[None, :] - spread[:, None]).abs().double()
        / torch.tensor([16.0, 256.0])[:, None, None]
    )  # [h, n, n], the paper's slopes for two heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=bias
    )
    torch.testing.assert_close(far.double(), expected, rtol=0, atol=tol)


def test_a_value_term_has_its_own_crossover(monkeypatch):
    """Shaw's a^V takes the path op by op, with or without gradients, up to
    MATERIALISED_VALUE_SCORES; under a causal mask up to MATERIALISED_CAUSAL_SELF_VALUE_SCORES
    in self-attention where the offset-term path may take the call (what was measured; with
    gradients over at most MATERIALISED_CAUSAL_GRAD_VALUE_PAIRS pairs per head),
    MATERIALISED_CAUSAL_VALUE_SCORES otherwise (a decoding step, a mask beside the causal
    one, longer rows with gradients). Under both causal limits the offset-term path is not
    asked about."""
    q = torch.randn(2, 2, 16, 8)  # 2^10 scores
    shaw = posenc.ShawRelativePosition(8, 3)
    assert posenc.explain(q, q, q, position=shaw).path == "materialised"
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            _past(monkeypatch, "MATERIALISED_VALUE_SCORES", 2**9, q, shaw, "a value term")
    assert posenc.explain(q, q, q, position=shaw, causal=True).path == "materialised"
    what, name = "a causal value term", "MATERIALISED_CAUSAL_SELF_VALUE_SCORES"
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_VALUE_SCORES", 2**4)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            assert posenc.explain(q, q, q, position=shaw, causal=True).path == "materialised"
            _past(monkeypatch, name, 2**9, q, shaw, what, causal=True)
            monkeypatch.setattr(tuning, name, 2**10)  # at the limit
            assert posenc.explain(q, q, q, position=shaw, causal=True).path == "materialised"
    one = q[:, :, -1:]  # a decoding step: one query against 16 keys (64 scores)
    told = posenc.explain(one, q, q, position=shaw, causal=True)  # (aligned at the end)
    assert told.path == "materialised", told  # no causal mask: it sees every key
    with monkeypatch.context() as patched:
        patched.setattr(tuning, "MATERIALISED_VALUE_SCORES", 2**5)
        told = posenc.explain(one, q, q, position=shaw, causal=True)
        assert "(MATERIALISED_VALUE_SCORES)" in told.reasons["materialised"], told
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[0, -3:] = True
    told = posenc.explain(q, q, q, position=shaw, causal=True, key_padding_mask=padding)
    assert told.path != "materialised"
    assert "(MATERIALISED_CAUSAL_VALUE_SCORES)" in told.reasons["materialised"], told
    # with gradients over more pairs per head: MATERIALISED_CAUSAL_VALUE_SCORES
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_GRAD_VALUE_PAIRS", 16 * 16 - 1)
    _past(monkeypatch, "MATERIALISED_CAUSAL_VALUE_SCORES", 2**4, q, shaw, what, causal=True)
    with torch.no_grad():
        assert posenc.explain(q, q, q, position=shaw, causal=True).path == "materialised"
    frozen = copy.deepcopy(shaw).requires_grad_(False)  # grad mode, no gradient asked
    assert posenc.explain(q, q, q, position=frozen, causal=True).path == "materialised"
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_GRAD_VALUE_PAIRS", 16 * 16)
    assert posenc.explain(q, q, q, position=shaw, causal=True).path == "materialised"
    # without a causal mask, MATERIALISED_VALUE_SCORES alone, whatever the causal limits
    monkeypatch.setattr(tuning, name, 2**9)
    monkeypatch.setattr(tuning, "MATERIALISED_VALUE_SCORES", 2**10)
    assert posenc.explain(q, q, q, position=shaw).path == "materialised"
    monkeypatch.setattr(tuning, name, 2**10)
    _past(monkeypatch, "MATERIALISED_VALUE_SCORES", 2**9, q, shaw, "a value term")
    asked = _spied_path(monkeypatch)
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_VALUE_SCORES", 2**10)
    assert posenc.explain(q, q, q, position=shaw, causal=True).path == "materialised"
    assert asked == []
    monkeypatch.setattr(tuning, name, 2**10 - 1)  # the lower limit: asked, and refused
    _refused(
        posenc.explain(q, q, q, position=shaw, causal=True),
        "offset-term",
        f"1024 scores [b, h, n_q, n_k], above the crossover 1023 ({name}) from which the lean "
        f"paths run {what} faster",
    )
    assert asked == [1]


def test_a_clipped_term_in_self_attention_has_its_own_crossover(monkeypatch):
    """Shaw's keys beyond their reach (a table of 2k + 1 rows that most offsets share) in
    self-attention take the materialised path up to MATERIALISED_CLIPPED_TERM_SCORES (under
    a causal mask at most MATERIALISED_CAUSAL_CLIPPED_TERM_PAIRS pairs per head, and
    MATERIALISED_CAUSAL_CLIPPED_TERM_SCORES with gradients,
    MATERIALISED_CAUSAL_CLIPPED_TERM_FORWARD_SCORES without), past the crossover of other
    score terms; within its reach, where the rows met are more than half the offsets (the
    bound itself is clipped), without gradients on one thread or in a decoding step, the
    term's own crossover holds."""
    monkeypatch.setattr(plans, "_threads", lambda: 2)  # the forward in one buffer, on any CPU
    q = torch.randn(2, 2, 64, 8)  # 2^14 scores, 127 offsets
    clipped = posenc.ShawRelativePosition(8, 16, values=False)  # 33 rows
    posenc.attention(q, q, q, position=clipped)  # below the term's crossover: a kept route
    told = posenc.explain(q, q, q, position=clipped)
    assert told.path == "materialised" and told.replayed, told
    for name in ("TERM", "CAUSAL_TERM", "CAUSAL_GRAD_TERM"):  # every other term's crossover
        monkeypatch.setattr(tuning, f"MATERIALISED_{name}_SCORES", 2**12)
    assert posenc.explain(q, q, q, position=clipped).path == "materialised"  # its keys learn
    assert posenc.explain(q, q, q, position=clipped, causal=True).path == "materialised"
    with torch.no_grad():  # no gradient (the forward in one buffer): causal, its own too
        assert posenc.explain(q, q, q, position=clipped).path == "materialised"
        assert posenc.explain(q, q, q, position=clipped, causal=True).path == "materialised"
        name = "MATERIALISED_CAUSAL_CLIPPED_TERM_FORWARD_SCORES"
        what = "a causal clipped score term"
        _past(monkeypatch, name, 2**13, q, clipped, what, causal=True)
    frozen = copy.deepcopy(clipped).requires_grad_(False)
    _past(monkeypatch, name, 2**13, q, frozen, what, causal=True)  # no gradient asked
    monkeypatch.setattr(tuning, name, 2**14)
    assert posenc.explain(q, q, q, position=frozen, causal=True).path == "materialised"
    monkeypatch.setattr(tuning, name, 2**13)
    told = posenc.explain(q.requires_grad_(), q, q, position=frozen, causal=True)
    assert told.path == "materialised", told  # with gradients, for q
    q = q.detach()
    # every offset its own row; 81 rows met of 127, more than half; 63 rows, at most half
    for reach, path in ((63, "offset-term"), (40, "offset-term"), (31, "materialised")):
        keys = posenc.ShawRelativePosition(8, reach, values=False)
        assert posenc.explain(q, q, q, position=keys).path == path, reach
    what = "a clipped score term"
    _past(monkeypatch, "MATERIALISED_CLIPPED_TERM_SCORES", 2**13, q, clipped, what)
    with torch.no_grad():
        _past(monkeypatch, "MATERIALISED_CLIPPED_TERM_SCORES", 2**13, q, clipped, what)
    assert posenc.explain(q, q, q, position=clipped, causal=True).path == "materialised"
    name, what = "MATERIALISED_CAUSAL_CLIPPED_TERM_SCORES", f"a causal {what[2:]}"
    _past(monkeypatch, name, 2**13, q, clipped, what, causal=True)
    monkeypatch.setattr(tuning, "MATERIALISED_CLIPPED_TERM_SCORES", 2**14)
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_CLIPPED_TERM_SCORES", 2**14)
    assert posenc.explain(q, q, q, position=clipped, causal=True).path == "materialised"
    # causal, at most this many pairs per head; over more, the crossover of a causal term
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_CLIPPED_TERM_PAIRS", 64 * 64)
    assert posenc.explain(q, q, q, position=clipped, causal=True).path == "materialised"
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_CLIPPED_TERM_PAIRS", 64 * 64 - 1)
    assert posenc.explain(q, q, q, position=clipped).path == "materialised"
    what = "a causal score term"
    name = "MATERIALISED_CAUSAL_GRAD_TERM_SCORES"  # (with gradients, in self-attention)
    _past(monkeypatch, name, 2**12, q, clipped, what, causal=True)
    with torch.no_grad():
        _past(monkeypatch, "MATERIALISED_CAUSAL_TERM_SCORES", 2**12, q, clipped, what, causal=True)
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_CLIPPED_TERM_PAIRS", 64 * 64)
    # the rows met against the offsets at the bound: 33 of 65, more than half; 33 of 67
    for n, path in ((33, "offset-term"), (34, "materialised")):
        q = torch.randn(2, 2, n, 8)
        assert posenc.explain(q, q, q, position=clipped).path == path, n
    # without gradients only where the forward runs in one buffer (on one thread it would
    # be SDPA with the term as its mask, unmeasured): the crossover of a score term
    monkeypatch.setattr(plans, "_threads", lambda: 1)
    with torch.no_grad():
        q = torch.randn(2, 2, 64, 8)
        _past(monkeypatch, "MATERIALISED_TERM_SCORES", 2**12, q, clipped, "a score term")
        what = "a causal score term"
        _past(monkeypatch, "MATERIALISED_CAUSAL_TERM_SCORES", 2**12, q, clipped, what, causal=True)
    monkeypatch.setattr(plans, "_threads", lambda: 2)
    assert posenc.explain(q, q, q, position=clipped).path == "materialised"
    # self-attention alone (a decoding step with gradients lost): one query, 34 keys
    one, keys = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 34, 8)
    monkeypatch.setattr(tuning, "MATERIALISED_TERM_SCORES", 2**6)
    kwargs = {"positions": torch.tensor([33]), "key_positions": torch.arange(34)}
    _refused(
        posenc.explain(one, keys, keys, position=clipped, **kwargs),
        "offset-term",
        "136 scores [b, h, n_q, n_k], above the crossover 64 (MATERIALISED_TERM_SCORES) from "
        "which the lean paths run a score term faster",
    )


def test_a_call_the_clipped_crossover_chose_keeps_no_route(monkeypatch):
    """Whether a term is clipped reads the positions' values (the offsets met), which a
    kept route's key does not hold: a call that crossover put on the materialised path is
    not replayed, and a later call of the same shapes at positions that meet most rows
    takes the offset-term path again. Where the offset-term path would not take the call
    (a key padding mask), the crossover is not asked, nor the scheme's ``offset_term``."""
    monkeypatch.setattr(tuning, "MATERIALISED_TERM_SCORES", 2**12)
    monkeypatch.setattr(tuning, "MATERIALISED_CAUSAL_TERM_SCORES", 2**12)
    asked = []
    rows = plans._run_rows
    monkeypatch.setattr(plans, "_run_rows", lambda *a: asked.append(1) or rows(*a))
    shaw = posenc.ShawRelativePosition(8, 40, values=False)  # 81 rows for 127 offsets
    q = torch.randn(2, 2, 64, 8, requires_grad=True)
    far = torch.arange(1000, 1064)  # every offset clipped to -40: one row
    assert posenc.explain(q, q, q, position=shaw).path == "offset-term"
    told = posenc.explain(q, q, q, position=shaw, positions=far, key_positions=torch.arange(64))
    assert told.path == "materialised" and not told.replayed, told
    ran = []
    lean = lean_plans._OffsetTermAttention.apply
    monkeypatch.setattr(
        lean_plans._OffsetTermAttention, "apply", lambda *a: ran.append(1) or lean(*a)
    )
    monkeypatch.setattr(plans, "_threads", lambda: 2)  # the forward in one buffer
    # the formula's route, or the forward in one buffer's (causal too, without gradients)
    for grad, causal in ((True, False), (False, False), (False, True)):
        with torch.set_grad_enabled(grad):
            kwargs = {"position": shaw, "causal": causal}
            posenc.attention(q, q, q, positions=far, key_positions=torch.arange(64), **kwargs)
            ran.clear()
            posenc.attention(q, q, q, **kwargs)
            assert ran == [1], (grad, causal)
    asked.clear()
    padding = torch.zeros(2, 64, dtype=torch.bool)
    padding[0, -3:] = True
    told = posenc.explain(
        q, q, q, position=shaw, positions=far, key_positions=torch.arange(64),
        key_padding_mask=padding,
    )  # fmt: skip
    assert told.path == "lean-fused" and asked == [], told


def test_what_the_materialised_path_refuses_and_why():
    """A contextual term (CoPE) never takes it; half precision does not (SDPA would round
    the bias); neither does a call with nothing positional."""
    q = torch.randn(2, 2, 16, 8)
    cope = posenc.CoPE(2, 8, 17)
    for kwargs in ({}, {"causal": True}):
        assert posenc.explain(q, q, q, position=cope, **kwargs).path == "math"
    half = posenc.explain(q.bfloat16(), q.bfloat16(), q.bfloat16(), position=posenc.ALiBi(2))
    assert half.path != "materialised"
    assert half.reasons["materialised"].startswith("torch.bfloat16: SDPA would add the bias")
    assert posenc.explain(
        q, q, q, position=posenc.ShawRelativePosition(8, 3, values=False)
    ).path == ("materialised")
    assert posenc.explain(q, q, q).path == "sdpa"


def _masked_batch(n):
    padding = torch.zeros(2, n, dtype=torch.bool)
    padding[1, n - 5 :] = True
    return {"causal": True, "key_padding_mask": padding}


CASES = {  # scheme, n, the call's keyword arguments
    "bias": (lambda: posenc.T5RelativeBias(2, num_buckets=8, max_distance=16), 12, {}),
    "term": (lambda: posenc.RelativeQueryEmbedding(12, 8), 12, {}),
    "2-D bias": (lambda: posenc.RelativePositionBias((3, 4), 2), 12, {}),
    "causal and padding": (lambda: posenc.RelativePositionBias(12, 2), 12, _masked_batch(12)),
    "per-row positions": (
        lambda: posenc.T5RelativeBias(2, num_buckets=8, max_distance=16),
        12,
        {"positions": torch.stack([torch.arange(12), torch.arange(12) * 3 + 5])},
    ),
    "keys-only term, causal": (
        lambda: posenc.ShawRelativePosition(8, 3, values=False),
        12,
        {"causal": True},
    ),
    "value term, padding": (lambda: posenc.ShawRelativePosition(8, 3), 12, _masked_batch(12)),
    "value term, scattered positions": (
        lambda: posenc.ShawRelativePosition(8, 3),
        12,
        {"positions": torch.tensor([[0, 3, 4, 9, 10, 11, 20, 21, 22, 23, 30, 31]])},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_materialised_equals_math_outputs_and_gradients(monkeypatch, case):
    """float64: the output and the gradients of q, k, v and the scheme's tables equal the
    math reference's, op by op with a plain autograd graph (no wrapper); without gradients
    the output too, by SDPA (op by op for a value term)."""
    build, n, kwargs = CASES[case]
    scheme = _randomised(build())
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for _ in range(3))
    assert posenc.explain(q, k, v, position=scheme, **kwargs).path == "materialised"
    calls = _spy_kernels(monkeypatch)
    weights = torch.linspace(-1, 1, 8, dtype=torch.float64)
    results = {}
    for backend in ("math", "auto"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        scheme.zero_grad(set_to_none=True)
        out = posenc.attention(*leaves, position=scheme, backend=backend, **kwargs)
        assert "TwiceDifferentiable" not in type(out.grad_fn).__name__
        (out * weights).sum().backward()
        results[backend] = [out, *(t.grad for t in leaves), *(p.grad for p in scheme.parameters())]
    assert calls == ["ops"]
    for a, c in zip(results["math"], results["auto"], strict=True):
        torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-10)
    value = case.startswith("value term")
    plain = "padding" not in case  # no mask but, perhaps, the causal one
    for limit, kernel in ((1 << 62, "ops" if plain else "sdpa"), (0, "sdpa")):
        monkeypatch.setattr(tuning, "OPS_IN_PLACE_SCORES", limit)
        monkeypatch.setattr(tuning, "OPS_IN_PLACE_BIAS_SCORES", limit)
        calls.clear()
        with torch.no_grad():
            out = posenc.attention(q, k, v, position=scheme, **kwargs)
        assert calls == ["ops" if value else kernel]
        torch.testing.assert_close(out, results["math"][0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("build", "limit_name"),
    [
        (lambda: posenc.RelativeQueryEmbedding(16, 8, heads=2), "OPS_IN_PLACE_SCORES"),
        (
            lambda: posenc.T5RelativeBias(2, num_buckets=8, max_distance=16),
            "OPS_IN_PLACE_BIAS_SCORES",
        ),
    ],
    ids=["term", "bias alone"],
)
def test_a_call_without_gradients_runs_op_by_op_up_to_its_in_place_limit(
    monkeypatch, build, limit_name
):
    """In no-grad mode, a term runs op by op (not SDPA with a float mask) up to
    OPS_IN_PLACE_SCORES scores, a bias alone up to OPS_IN_PLACE_BIAS_SCORES, on CPU, with
    two threads or more and no mask but a causal one; the same values. OPS_FORWARD_SCORES,
    the limit of a call that records a graph, does not bound it, nor the other limit."""
    calls = _spy_kernels(monkeypatch)
    scheme = build()
    q = torch.randn(2, 2, 16, 8)  # 2^10 scores
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[0, -3:] = True
    other = ({"OPS_IN_PLACE_SCORES", "OPS_IN_PLACE_BIAS_SCORES"} - {limit_name}).pop()
    with torch.no_grad():
        expected = posenc.attention(q, q, q, position=scheme, causal=True, backend="math")
        for limit, masks, threads, kernel in (
            (2**10, ({}, {"causal": True}), 2, "ops"),
            (2**10, ({}, {"causal": True}), 1, "sdpa"),  # one thread: the fused kernel
            (2**10 - 1, ({}, {"causal": True}), 2, "sdpa"),
            (2**10, ({"key_padding_mask": padding},), 2, "sdpa"),
        ):
            monkeypatch.setattr(tuning, limit_name, limit)
            monkeypatch.setattr(tuning, other, 0)
            monkeypatch.setattr(tuning, "OPS_FORWARD_SCORES", 0)
            monkeypatch.setattr(plans, "_threads", lambda threads=threads: threads)
            for kwargs in masks:
                calls.clear()
                out = posenc.attention(q, q, q, position=scheme, **kwargs)
                assert calls == [kernel], (limit, kwargs, threads)
                if kwargs.get("causal"):
                    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_by_default_a_bias_alone_without_gradients_runs_sdpa_and_a_term_op_by_op(monkeypatch):
    """The defaults: SDPA with a bias alone as its float mask (the route of the code posenc
    replaces), a score term in one buffer op by op; with gradients a constant bias takes
    SDPA's fused route at every size (OPS_GRAD_BIAS_SCORES = 0), a learned one runs op by
    op."""
    calls = _spy_kernels(monkeypatch)
    q = torch.randn(2, 2, 16, 8)
    for scheme, kernel in (
        (posenc.ALiBi(2), "sdpa"),
        (posenc.T5RelativeBias(2, num_buckets=8, max_distance=16), "sdpa"),
        (posenc.RelativeQueryEmbedding(16, 8, heads=2), "ops"),
    ):
        calls.clear()
        with torch.no_grad():
            posenc.attention(q, q, q, position=scheme)
        assert calls == [kernel], type(scheme).__name__
    for n in (4, 8, 9, 16):  # 8 channels per value: fewer weights than outputs up to 8
        for scheme, kernel in ((posenc.ALiBi(2), "sdpa"), (posenc.T5RelativeBias(2), "ops")):
            calls.clear()
            x = torch.randn(2, 2, n, 8, requires_grad=True)
            posenc.attention(x, x, x, position=scheme).sum().backward()
            assert calls == [kernel], (n, type(scheme).__name__)
            assert x.grad is not None


def test_the_math_path_zeroes_a_query_that_sees_no_key_under_a_causal_mask():
    """More queries than keys under a causal mask (aligned at the end): the first queries
    see no key and get 0; with at most as many queries every row keeps its weights."""
    q, k = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (6, 4))
    out = posenc.attention(q, k, k, position=posenc.ALiBi(2), causal=True, backend="math")
    assert out[:, :, :2].abs().max() == 0
    slopes = posenc.alibi_slopes(2).double()
    for i in range(2, 6):  # query i sees keys j <= i - 2, the slow obvious way
        for h in range(2):
            logits = [
                float(q[0, h, i] @ k[0, h, j]) / 2 - float(slopes[h]) * abs(j - i)
                for j in range(i - 1)
            ]
            weights = torch.tensor(logits, dtype=torch.float64).softmax(0)
            expected = weights @ k[0, h, : i - 1]
            torch.testing.assert_close(out[0, h, i], expected, rtol=1e-12, atol=1e-12)


def test_second_order_gradients_through_the_materialised_path(monkeypatch):
    """A gradient penalty (``create_graph=True``) through the materialised path equals the
    math reference's: the second derivative is the definition's."""
    scheme = _randomised(posenc.T5RelativeBias(2, num_buckets=8, max_distance=16))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 4, dtype=torch.float64) for _ in range(3))
    calls = _spy_kernels(monkeypatch)
    results = {}
    for backend in ("math", "auto"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        scheme.zero_grad(set_to_none=True)
        out = posenc.attention(*leaves, position=scheme, causal=True, backend=backend)
        (dq,) = torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)
        dq.square().sum().backward()
        results[backend] = [dq, *(t.grad for t in leaves), scheme.embedding.weight.grad]
    assert calls == ["ops"]
    for a, c in zip(results["math"], results["auto"], strict=True):
        torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-10)


def test_under_torch_compile_auto_keeps_sdpa(monkeypatch):
    """Inside ``torch.compile`` the SDPA path takes a bias before the materialised path is
    asked (the lean paths do not trace): what a compiled model runs is unchanged."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q = torch.randn(1, 2, 16, 8)
    assert posenc.explain(q, q, q, position=posenc.T5RelativeBias(2)).path == "sdpa"


class _OnceDifferentiableTerm(torch.autograd.Function):
    """``q @ table^T`` whose backward is not differentiable again."""

    @staticmethod
    def forward(ctx, q, table):
        ctx.save_for_backward(q, table)
        return q @ table.t()  # [b, h, n, n]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, table = ctx.saved_tensors
        return grad @ table, (grad.transpose(-2, -1) @ q).sum((0, 1))


class _UserTerm(nn.Module):
    """A user's scheme: a fast ``score_term`` differentiable once, beside a literal
    ``reference_score_term`` (the hook protocol's pair)."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(n, d, dtype=torch.float64))

    def score_term(self, q, q_pos, k_pos):
        return _OnceDifferentiableTerm.apply(q, self.table[k_pos[0]])

    def reference_score_term(self, q, q_pos, k_pos):
        return q @ self.table[k_pos[0]].t()


def test_second_order_gradients_of_a_users_once_differentiable_hook_go_through_its_reference():
    """The materialised path differentiates its own graph twice only for hooks known to be
    plain ops (posenc's, or a scheme without literal reference hooks); a user's fast hook
    beside a reference hook takes the math reference for create_graph=True, as before."""
    torch.manual_seed(0)
    scheme = _UserTerm(10, 4)
    q, k, v = (torch.randn(1, 2, 10, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert posenc.explain(q, k, v, position=scheme).path == "materialised"
    second = {}
    for backend in ("math", "auto"):
        out = posenc.attention(q, k, v, position=scheme, backend=backend)
        (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        (second[backend],) = torch.autograd.grad(dq.square().sum(), scheme.table)
    torch.testing.assert_close(second["auto"], second["math"], rtol=1e-10, atol=1e-10)


def test_second_order_gradients_through_shaws_value_term_op_by_op():
    """Shaw's fast value term (scatter_add into the clipped offsets) on the op-by-op kernel,
    with no wrapper: its second derivatives equal the math reference's (literal a^V)."""
    scheme = _randomised(posenc.ShawRelativePosition(4, 2))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    results = {}
    for backend in ("math", "auto"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        scheme.zero_grad(set_to_none=True)
        out = posenc.attention(*leaves, position=scheme, causal=True, backend=backend)
        if backend == "auto":
            assert "TwiceDifferentiable" not in type(out.grad_fn).__name__
        (dv,) = torch.autograd.grad(out.square().sum(), leaves[2], create_graph=True)
        dv.square().sum().backward()
        results[backend] = [dv, *(t.grad for t in leaves), scheme.keys.grad, scheme.values.grad]
    for a, c in zip(results["math"], results["auto"], strict=True):
        torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-10)


class _Cube(torch.autograd.Function):
    """``x ** 3`` whose backward is not differentiable again."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


class _UserKeyShift(nn.Module):
    """``q_i . R_j^3``: the term in plain ops, its key-shift form (which the fast paths fold
    into the keys) differentiable once only, and a fixed bias."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(n, d, dtype=torch.float64) * 0.7)

    def score_term(self, q, q_pos, k_pos):
        rows = self.table[k_pos] ** 3  # [B', n_k, d]
        return q @ rows.to(q.dtype).unsqueeze(1).transpose(-2, -1)  # [b, h, n_q, n_k]

    def key_shift(self, q, q_pos, k_pos):
        return _Cube.apply(self.table[k_pos]).to(q.dtype).unsqueeze(1)  # [B', 1, n_k, d]

    def score_bias(self, q_pos, k_pos):
        return -(k_pos[:, None, None, :] - q_pos[:, None, :, None]).abs().double() * 0.1


def _second_order(scheme, q, k, v, backend):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = posenc.attention(*leaves, position=scheme, backend=backend)
    params = list(scheme.parameters())
    first = torch.autograd.grad(
        out.square().sum(), leaves + params, create_graph=True, allow_unused=True
    )
    penalty = sum(g.square().sum() for g in first if g is not None)
    second = torch.autograd.grad(penalty, leaves + params, allow_unused=True)
    inputs = leaves + params
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, second, strict=True)]


def test_second_order_through_a_users_key_shift_or_a_hook_set_on_an_instance():
    """Two more fast forms the materialised path runs where the math path runs another: a
    user's key shift (beside its term) and a fast/reference pair set on a posenc instance;
    once-differentiable, each takes the math reference for create_graph=True."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 4, dtype=torch.float64) for _ in range(3))
    shifted = _UserKeyShift(10, 4)
    shaw = _randomised(posenc.ShawRelativePosition(4, 2))
    user = _UserTerm(10, 4)
    shaw.score_term = user.score_term  # once-differentiable, on the instance
    shaw.reference_score_term = user.reference_score_term
    shaw.table = user.table
    for scheme in (shifted, shaw):
        assert posenc.explain(q.requires_grad_(), k, v, position=scheme).path == "materialised"
        q = q.detach()
        found = _second_order(scheme, q, k, v, "auto")
        for a, c in zip(found, _second_order(scheme, q, k, v, "math"), strict=True):
            torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("build", "kwargs"),
    [
        (lambda: posenc.ALiBi(2), {}),
        (lambda: posenc.ALiBi(2), _masked_batch(12)),
        (
            lambda: posenc.T5RelativeBias(2, num_buckets=8, max_distance=16).requires_grad_(False),
            {},
        ),
    ],
    ids=["alibi", "alibi causal and padding", "frozen t5"],
)
def test_a_constant_bias_with_gradients_takes_sdpas_fused_kernel(monkeypatch, build, kwargs):
    """A bias that asks for no gradient itself, in a call with gradients for q, k, v: SDPA
    with the bias as a float mask (its fused kernel and backward keep no [b, h, n, n]
    weights) above OPS_GRAD_BIAS_SCORES (0 by default), equal to math in float64 for the
    output and the gradients; a gradient with create_graph=True goes through the math
    reference (SDPA's backward is not differentiable twice); a learned table, or a term,
    keeps the formula op by op; at most OPS_GRAD_BIAS_SCORES scores on CPU the constant bias
    runs op by op too where its weights do not outweigh SDPA's output."""
    scheme = build().double()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    assert posenc.explain(q, k, v, position=scheme, **kwargs).path == "materialised"
    calls = _spy_kernels(monkeypatch)
    monkeypatch.setattr(tuning, "OPS_GRAD_BIAS_SCORES", 0)  # the default: SDPA's route
    weights = torch.linspace(-1, 1, 8, dtype=torch.float64)
    results = {}
    for backend in ("math", "auto"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = posenc.attention(*leaves, position=scheme, backend=backend, **kwargs)
        (dq,) = torch.autograd.grad((out * weights).sum(), leaves[0], create_graph=True)
        dq.square().sum().backward()
        results[backend] = [out, dq, *(t.grad for t in leaves)]
    assert calls == ["sdpa"]
    for a, c in zip(results["math"], results["auto"], strict=True):
        torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-10)
    for learned in (posenc.T5RelativeBias(2), posenc.RelativeQueryEmbedding(12, 8)):
        calls.clear()
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        posenc.attention(*leaves, position=learned.requires_grad_(True), **kwargs)
        assert calls == ["ops"], learned
    if not kwargs:  # small enough on CPU: the constant bias op by op too, the same values
        monkeypatch.setattr(tuning, "OPS_GRAD_BIAS_SCORES", 2 * 2 * 12 * 12)
        monkeypatch.setattr(tuning, "OPS_GRAD_WEIGHTS_RATIO", 2)  # 12 keys, 8 channels
        firsts = {}
        for backend in ("math", "auto"):
            calls.clear()
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = posenc.attention(*leaves, position=scheme, backend=backend)
            (out * weights).sum().backward()
            firsts[backend] = [out, *(t.grad for t in leaves)]
        assert calls == ["ops"] and "TwiceDifferentiable" not in type(out.grad_fn).__name__
        for a, c in zip(firsts["math"], firsts["auto"], strict=True):
            torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-10)


def test_a_users_bias_that_reads_a_learned_tensor_keeps_its_gradient(monkeypatch):
    """A scheme that is any object (not an nn.Module), or a posenc bias whose primitive,
    slopes or grid table a subclass overrides, may read a tensor that requires grad: it
    stays op by op (SDPA's route would not differentiate it), and the tensor's gradient
    equals math's."""
    import posenc

    class UserBias:
        def __init__(self, table):
            self.table = table  # [h, 15], learned

        def score_bias(self, q_pos, k_pos):
            offsets = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-7, 7) + 7
            return self.table[:, offsets].transpose(0, 1)  # [B', h, n_q, n_k]

    class Scaled(posenc.ALiBi):
        def __init__(self, heads, factor):
            super().__init__(heads)
            self.factor = factor  # a tensor that requires grad, not a parameter

        def bias(self, offsets):
            return super().bias(offsets) * self.factor

    monkeypatch.setattr(tuning, "OPS_GRAD_BIAS_SCORES", 0)  # where SDPA would take a constant
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[0, -3:] = True
    calls = _spy_kernels(monkeypatch)

    class Slopes(posenc.ALiBi):  # ALiBi's documented override, here with learned slopes
        def __init__(self, heads, slopes):
            super().__init__(heads)
            self.given = slopes

        def slopes(self, device=None):
            return self.given

    grid = posenc.RelativePositionBias((3, 4), 2).double().requires_grad_(False)

    class ScaledGrid(type(grid)):
        def grid_table(self, *args, **kwargs):
            return super().grid_table(*args, **kwargs) * self.factor

    def scaled_grid(factor):
        scheme = copy.deepcopy(grid)
        scheme.__class__ = ScaledGrid
        scheme.factor = factor
        return scheme

    for build, start in (
        (UserBias, torch.randn(2, 15, dtype=torch.float64)),
        (lambda t: Scaled(2, t).double(), torch.tensor(0.7, dtype=torch.float64)),
        (lambda t: Slopes(2, t), torch.tensor([0.5, 0.25], dtype=torch.float64)),
        (scaled_grid, torch.tensor(1.5, dtype=torch.float64)),
    ):
        grads = {}
        for backend in ("math", "auto"):
            learned = start.clone().requires_grad_()
            scheme = build(learned)
            for kwargs in ({}, {"key_padding_mask": padding}):
                calls.clear()
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = posenc.attention(*leaves, position=scheme, backend=backend, **kwargs)
                out.square().sum().backward()
                assert calls == ([] if backend == "math" else ["ops"])
            grads[backend] = learned.grad
        torch.testing.assert_close(grads["auto"], grads["math"], rtol=1e-10, atol=1e-10)


def test_torch_func_grad_through_a_constant_bias_on_the_materialised_path(monkeypatch):
    """torch.func.grad of a call whose constant bias SDPA's route would take: op by op
    under the transform, the gradient of the math path."""
    import posenc

    monkeypatch.setattr(tuning, "OPS_FORWARD_SCORES", 0)
    monkeypatch.setattr(tuning, "OPS_GRAD_BIAS_SCORES", 0)
    scheme = posenc.ALiBi(2).double()
    q = torch.randn(2, 2, 12, 8, dtype=torch.float64)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[0, -3:] = True
    for kwargs in ({}, {"key_padding_mask": padding}):
        got, want = (
            torch.func.grad(
                lambda x, b=backend, kw=kwargs: (
                    posenc.attention(x, x, x, position=scheme, backend=b, **kw).square().sum()
                )
            )(q)
            for backend in ("auto", "math")
        )
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_the_thread_count_is_read_once_per_call(monkeypatch):
    """The path's choice and the dispatcher's check of its graph see one thread count: a
    count that changes within a call (another Python thread's set_num_threads) cannot make
    the plan take SDPA's kernel while the check skips the wrapper that a gradient with
    create_graph=True needs (SDPA's CPU backward is not differentiable)."""
    scheme = posenc.ALiBi(2).double()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    reads = []

    def threads():  # one thread at the first read of a call, two after
        reads.append(None)
        return 1 if len(reads) == 1 else 2

    monkeypatch.setattr(plans, "_threads", threads)
    grads = {}
    for backend in ("math", "auto"):
        reads.clear()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = posenc.attention(*leaves, position=scheme, backend=backend)
        (dq,) = torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)
        dq.square().sum().backward()
        grads[backend] = [out, dq, *(t.grad for t in leaves)]
    for a, c in zip(grads["math"], grads["auto"], strict=True):
        torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-10)


def test_a_constant_bias_with_gradients_is_computed_once_per_call(monkeypatch):
    """SDPA's route with gradients asks the scheme for its bias once: the check that it is
    constant and the float mask read the same tensor."""
    kept = posenc.ALiBi.kept_score_bias
    asked = []

    def counted(self, q_pos, k_pos):
        asked.append(1)
        return kept(self, q_pos, k_pos)

    monkeypatch.setattr(posenc.ALiBi, "kept_score_bias", counted)
    calls = _spy_kernels(monkeypatch)
    x = torch.randn(2, 2, 16, 8, requires_grad=True)  # 16 queries > 8 channels: SDPA's route
    out = posenc.attention(x, x, x, position=posenc.ALiBi(2))
    assert calls == ["sdpa"] and len(asked) == 1
    out.sum().backward()
    reference = posenc.attention(x.detach(), x.detach(), x.detach(), position=posenc.ALiBi(2))
    torch.testing.assert_close(out.detach(), reference, rtol=0, atol=1e-6)


def test_with_gradients_a_constant_bias_takes_the_route_that_keeps_less(monkeypatch):
    """Op by op keeps the [b, h, n_q, n_k] weights for the backward; SDPA's route keeps its
    output [b, h, n_q, d_v] and the float mask where the call builds one. With gradients a
    constant bias takes SDPA's route only where the weights outweigh those: ALiBi's kept
    bias with no mask and more keys than value channels; never for a bias it builds
    (a cast, a mask folded in, a bias not kept), nor for few keys (cross-attention). The
    rule under OPS_GRAD_BIAS_SCORES lifted (by default 0: SDPA's route at every size)."""
    monkeypatch.setattr(tuning, "OPS_GRAD_BIAS_SCORES", 3 << 19)
    calls = _spy_kernels(monkeypatch)
    frozen_t5 = posenc.T5RelativeBias(2, num_buckets=8, max_distance=16).requires_grad_(False)
    cases = [
        ("kept, n_k > d_v", posenc.ALiBi(2), (2, 2, 16, 8), 16, {}, "sdpa"),
        ("kept, n_k = d_v", posenc.ALiBi(2), (2, 2, 8, 8), 8, {}, "ops"),
        ("causal: the mask is built", posenc.ALiBi(2), (2, 2, 16, 8), 16, {"causal": True}, "ops"),
        ("cast to float64", posenc.ALiBi(2), (2, 2, 16, 8), 16, {"dtype": torch.float64}, "ops"),
        ("not kept", frozen_t5, (2, 2, 16, 8), 16, {}, "ops"),
        ("few keys", posenc.ALiBi(2), (2, 2, 16, 8), 4, {}, "ops"),
        ("many keys for few queries", posenc.ALiBi(2), (2, 2, 4, 8), 24, {}, "sdpa"),
    ]
    for name, scheme, shape, n_k, kwargs, kernel in cases:
        dtype = kwargs.pop("dtype", torch.float32)
        torch.manual_seed(0)
        q = torch.randn(shape, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(shape[0], shape[1], n_k, shape[3], dtype=dtype) for _ in range(2))
        calls.clear()
        out = posenc.attention(q, k, v, position=scheme, **kwargs)
        assert calls == [kernel], name
        (grad,) = torch.autograd.grad(out.square().sum(), q)
        leaf = q.detach().double().requires_grad_()
        kd, vd = k.double(), v.double()
        expected = posenc.attention(
            leaf, kd, vd, position=scheme.double(), backend="math", **kwargs
        )
        (expected_grad,) = torch.autograd.grad(expected.square().sum(), leaf)
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
        torch.testing.assert_close(grad.double(), expected_grad, rtol=tol, atol=tol)
        scheme.float()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("padded", [False, True])
def test_forward_mode_ad_through_a_constant_bias(monkeypatch, threads, padded):
    """Inside a forward-mode AD level (torch.func.jvp, make_dual with and without grad) the
    materialised path runs op by op (SDPA's route goes through kernels and autograd
    Functions with no forward derivative): the tangent equals math's."""
    import torch.autograd.forward_ad as fwad

    monkeypatch.setattr(plans, "_threads", lambda: threads)
    torch.manual_seed(0)
    q, k, v, tangent = (torch.randn(1, 2, 12, 4, dtype=torch.float64) for _ in range(4))
    kwargs = {"key_padding_mask": torch.arange(12)[None] >= 9} if padded else {}

    def attend(backend):
        return lambda x: posenc.attention(
            x, k, v, position=posenc.ALiBi(2), backend=backend, **kwargs
        )

    expected = torch.func.jvp(attend("math"), (q,), (tangent,))[1]
    tangents = [torch.func.jvp(attend("auto"), (q,), (tangent,))[1]]
    for grad in (False, True):
        with fwad.dual_level():
            leaf = q.clone().requires_grad_(grad)
            tangents.append(fwad.unpack_dual(attend("auto")(fwad.make_dual(leaf, tangent))).tangent)
    for found in tangents:
        torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-10)


def test_with_other_value_channels_a_constant_bias_stays_op_by_op(monkeypatch):
    """With d_v other than d SDPA runs its math kernel, which keeps the weights too: such a
    call stays op by op up to OPS_FORWARD_SCORES (not OPS_GRAD_BIAS_SCORES, nor the memory
    rule, which are for SDPA's fused kernel)."""
    calls = _spy_kernels(monkeypatch)
    q, k = (torch.randn(2, 2, 32, 8, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 2, 32, 4, requires_grad=True)
    out = posenc.attention(q, k, v, position=posenc.ALiBi(2))
    assert calls == ["ops"]
    out.sum().backward()
