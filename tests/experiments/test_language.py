"""Scoring the ``lm`` task: perplexity against exp(mean NLL) written out per byte, and the
RoPE scalings applied to a trained rotary model at evaluation."""

from __future__ import annotations

import math
import random

import pytest
import torch

import posenc.experiments.language as language
from posenc import (
    ALiBi,
    DynamicNTKScaling,
    LinearScaling,
    NTKScaling,
    Rotary,
    YaRNScaling,
)
from posenc.experiments.language import (
    ROPE_SCALINGS,
    evaluate_lm,
    perplexity,
    rope_scaling,
    rope_scaling_perplexity,
)
from posenc.experiments.models import TinyTransformer
from posenc.experiments.tasks import LanguageModelTask
from posenc.experiments.training import Config, run_one

HEAD_DIM = 8


@pytest.fixture
def task(tmp_path):
    """One file: 1800 training bytes, the last 200 held out; trained at 4, tested to 16."""
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(random.Random(1).choices(range(32, 127), k=2000)))
    return LanguageModelTask(train_length=4, test_lengths=(4, 8, 16), corpus=str(path))


def tiny(position=None, seed=0):
    torch.manual_seed(seed)
    return TinyTransformer(256, dim=16, heads=2, layers=1, position=position).eval()


def reference(model, task, n, chunks):
    """exp(mean NLL), accuracy: every held-out window of ``n`` bytes, every byte, one by one.

    The held-out text is ``chunks`` chunks of 16 bytes (+ the next byte) at
    ``start_c = c * (200 - 1 - 16) // (chunks - 1)``; each is cut into windows of ``n``.
    """
    held = task.text.held_out.tolist()
    stride = (len(held) - 1 - 16) // max(1, chunks - 1)
    nll, hits, count = 0.0, 0, 0
    for c in range(chunks):
        for k in range(16 // n):
            start = c * stride + k * n
            tokens = torch.tensor([held[start : start + n]])
            with torch.no_grad():
                logits = model(tokens, causal=True)[0].double()  # [n, 256]
            for i in range(n):
                target = held[start + i + 1]
                log_z = math.log(sum(math.exp(v) for v in logits[i].tolist()))
                nll += log_z - float(logits[i, target])  # -log softmax(logits)[target]
                hits += int(int(logits[i].argmax()) == target)
                count += 1
    return math.exp(nll / count), hits / count


@pytest.mark.parametrize("n", [4, 8, 16])
def test_perplexity_is_exp_of_the_mean_nll_of_every_held_out_byte(task, n, monkeypatch):
    model = tiny(ALiBi(2)).double()
    monkeypatch.setattr(language, "EVAL_TOKENS", 24)  # several forward passes per length
    ppl, accuracy = perplexity(model, task, n, examples=3)
    want_ppl, want_accuracy = reference(model, task, n, chunks=3)
    torch.testing.assert_close(ppl, want_ppl, rtol=1e-10, atol=0)
    assert accuracy == want_accuracy
    assert 1 < ppl < 10 * 256  # an untrained model: near a uniform guess (256)


def test_evaluate_lm_leaves_out_the_lengths_a_scheme_cannot_serve(task):
    model = tiny(ALiBi(2))
    accuracy, ppl = evaluate_lm(model, task, examples=2, serves=lambda n: n <= 8)
    assert ppl["16"] is None and accuracy["16"] is None
    assert ppl["8"] == perplexity(model, task, 8, examples=2)[0]
    assert accuracy["4"] == perplexity(model, task, 4, examples=2)[1]


SCALINGS = {
    "linear": lambda f, trained: LinearScaling(f),
    "ntk": lambda f, trained: NTKScaling(f),
    "dynamic-ntk": lambda f, trained: DynamicNTKScaling(f, original_max_len=trained),
    "yarn": lambda f, trained: YaRNScaling(f, original_max_len=trained),
}


def test_rope_scalings_are_those_of_a_model_built_with_them(task):
    """Each scaling at length n is the trained model's weights in a model whose Rotary was
    built with that scaling and the factor n / 4 (4: the training length)."""
    assert list(ROPE_SCALINGS) == list(SCALINGS)
    model = tiny(Rotary(HEAD_DIM))
    results = rope_scaling_perplexity(model, task, examples=2)
    assert set(results) == set(SCALINGS)
    for name, make in SCALINGS.items():
        assert set(results[name]) == {"8", "16"}  # the lengths past training only
        for n in (8, 16):
            built = tiny(Rotary(HEAD_DIM, scaling=make(n / 4, 4)), seed=1)
            built.load_state_dict(model.state_dict())
            want = perplexity(built, task, n, examples=2)[0]
            torch.testing.assert_close(results[name][str(n)], want, rtol=1e-12, atol=0)
    assert model.blocks[0].attn.position.scaling is None  # given back
    plain = perplexity(model, task, 16, examples=2)[0]
    assert all(results[name]["16"] != plain for name in SCALINGS)  # each one changes it


def test_rope_scaling_gives_the_scaling_back_after_an_error():
    model = TinyTransformer(256, dim=16, heads=2, layers=2, position=lambda: Rotary(HEAD_DIM))
    assert model.blocks[0].attn.position is not model.blocks[1].attn.position  # one per block
    scaling = LinearScaling(2.0)
    with pytest.raises(RuntimeError, match="inside"), rope_scaling(model, scaling):
        assert all(b.attn.position.scaling is scaling for b in model.blocks)
        raise RuntimeError("inside")
    assert all(b.attn.position.scaling is None for b in model.blocks)


def test_rope_scaling_needs_rotary_attention(task):
    alibi = tiny(ALiBi(2))
    with pytest.raises(ValueError, match="rope_scaling needs a model with rotary attention"):
        rope_scaling(alibi, LinearScaling(2.0)).__enter__()
    assert rope_scaling_perplexity(tiny(ALiBi(2)), task, examples=1) is None
    scaled = tiny(Rotary(HEAD_DIM, scaling=DynamicNTKScaling(1.0, original_max_len=4)))
    assert rope_scaling_perplexity(scaled, task, examples=1) is None  # scaled already


@pytest.mark.parametrize(("scheme", "scaled"), [("rotary", True), ("rotary-ntk", False)])
def test_an_lm_run_carries_perplexity_and_rope_scaling(task, scheme, scaled):
    config = Config(steps=2, batch=2, dim=16, heads=2, layers=1, eval_examples=2)
    run = run_one(task, scheme, 0, config)
    assert set(run.perplexity) == set(run.accuracy) == {"4", "8", "16"}
    assert all(v > 1 for v in run.perplexity.values())
    assert (run.rope_scaling is not None) == scaled
    if scaled:
        assert set(run.rope_scaling) == set(SCALINGS)
