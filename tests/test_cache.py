"""KVCache, left padding and packed sequences, scheme-independent.

Every scheme's decoding parity with the full pass is in tests/test_schemes.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posenc import (
    ALiBi,
    KVCache,
    MultiHeadAttention,
    positions_from_documents,
    positions_from_padding,
)
from posenc.indices import _known_run, run_positions
from tolerances import assert_close, forward


class DecayBias(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.rate = nn.Parameter(torch.linspace(0.1, 0.5, heads))

    def score_bias(self, q_pos, k_pos):
        distance = (k_pos[:, None, :] - q_pos[:, :, None]).abs()
        return -self.rate[:, None, None] * distance[:, None]


def model(position=None, backend="auto"):
    torch.manual_seed(0)
    return MultiHeadAttention(16, 4, position=position, backend=backend).eval()


def test_positions_from_padding():
    mask = torch.tensor(
        [[True, True, False, False], [False, False, False, False], [False, False, True, True]]
    )
    expected = torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3], [0, 1, 2, 2]])
    assert torch.equal(positions_from_padding(mask), expected)
    with pytest.raises(TypeError, match=r"key_padding_mask must be a bool tensor.*\.bool\(\)"):
        positions_from_padding(mask.long())


def test_positions_from_documents():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert torch.equal(
        positions_from_documents(ids), torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    )
    assert torch.equal(positions_from_documents(torch.tensor([3, 3, 4])), torch.tensor([0, 1, 0]))
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        positions_from_documents(torch.zeros(3))


@pytest.mark.parametrize("backend", ["math", "sdpa", "lean", "auto"])
@pytest.mark.parametrize("with_scheme", [False, True])
def test_prefill_then_tokens_equals_full_pass(backend, with_scheme):
    m = model(DecayBias(4) if with_scheme else None, backend)
    x = torch.randn(2, 10, 16)
    full, logit = forward(m, x, causal=True)
    cache = KVCache()
    outs = [m(x[:, :3], causal=True, cache=cache)]
    outs.append(m(x[:, 3:5], causal=True, cache=cache))  # a chunk of two
    outs += [m(x[:, t : t + 1], causal=True, cache=cache) for t in range(5, 10)]
    assert len(cache) == 10 and cache.positions.tolist() == [list(range(10))]
    # other kernel shapes, other float32 roundings: 10 keys (tests/tolerances.py)
    assert_close(torch.cat(outs, 1), full, terms=10, logit=logit)


def test_left_padded_batch_equals_each_sequence_alone():
    m = model(DecayBias(4))
    a, b = torch.randn(1, 3, 16), torch.randn(1, 5, 16)
    pad = torch.zeros(1, 2, 16)
    batch = torch.cat((torch.cat((pad, a), 1), b))  # [2, 5, 16], row 0 left-padded
    padding = torch.tensor([[True, True, False, False, False], [False] * 5])
    positions = positions_from_padding(padding)
    out, logit = forward(m, batch, key_padding_mask=padding, positions=positions, causal=True)
    assert_close(out[0, 2:], m(a, causal=True)[0], terms=5, logit=logit)
    assert_close(out[1], m(b, causal=True)[0], terms=5, logit=logit)


def test_left_padded_decoding_with_cache():
    m = model(DecayBias(4))
    a = torch.randn(1, 6, 16)
    alone, logit = forward(m, a, causal=True)
    padded = torch.cat((torch.zeros(1, 2, 16), a[:, :3]), 1)  # prompt of 3 behind 2 pads
    padding = torch.tensor([[True, True, False, False, False]])
    cache = KVCache()
    first = m(
        padded,
        causal=True,
        key_padding_mask=padding,
        positions=positions_from_padding(padding),
        cache=cache,
    )
    rest = [m(a[:, t : t + 1], causal=True, cache=cache) for t in range(3, 6)]
    assert_close(first[:, 2:], alone[:, :3], terms=8, logit=logit)
    assert_close(torch.cat(rest, 1), alone[:, 3:], terms=8, logit=logit)
    assert cache.key_padding.tolist() == [[True, True] + [False] * 6]


@pytest.mark.parametrize("backend", ["math", "sdpa", "lean"])
def test_packed_documents_equal_separate_runs(backend):
    m = model(DecayBias(4), backend)
    docs = [torch.randn(1, n, 16) for n in (3, 4, 2)]
    packed = torch.cat(docs, 1)  # [1, 9, 16]
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]])
    for causal in (False, True):
        out, logit = forward(m, packed, document_ids=ids, causal=causal)
        separate = torch.cat([m(d, causal=causal) for d in docs], 1)
        assert_close(out, separate, terms=9, logit=logit)


def test_cache_and_packing_errors():
    m = model(DecayBias(4))
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="cache is for self-attention decoding"):
        m(x, torch.randn(2, 4, 16), cache=KVCache())
    with pytest.raises(TypeError, match="cache must be a posenc.KVCache, got dict"):
        m(x, cache={})
    with pytest.raises(ValueError, match="document_ids .* cannot be combined with a cache"):
        m(x, cache=KVCache(), document_ids=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"document_ids must have shape \[batch, n\] = \[2, 3\]"):
        m(x, document_ids=torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        m(x, document_ids=torch.zeros(2, 3))
    cache = KVCache()
    m(x, cache=cache)
    with pytest.raises(ValueError, match=r"the cache holds keys of shape .*cache.reset\(\)"):
        m(torch.randn(3, 1, 16), cache=cache)
    cache.reset()
    assert len(cache) == 0 and cache.next_position == 0

    class NoCache(DecayBias):
        supports_cache = False

    with pytest.raises(ValueError, match="NoCache cannot decode incrementally"):
        model(NoCache(4))(x, cache=KVCache())


def test_a_failed_step_leaves_the_cache_untouched():
    """A step that raises (a 1-D RelativePositionBias outgrown by the positions) had already
    appended its keys: after the suggested .resize, the retry decoded with the token cached
    twice. Updates are all or nothing."""
    from posenc import RelativePositionBias

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, position=RelativePositionBias(4, 4)).eval()
    x = torch.randn(1, 6, 16)
    cache = KVCache()
    attn(x[:, :4], cache=cache, causal=True)
    keys = cache.keys.clone()
    with pytest.raises(ValueError, match=r"\.resize\(5\)"):
        attn(x[:, 4:5], cache=cache, causal=True)
    assert len(cache) == 4 and torch.equal(cache.keys, keys)
    attn.position.resize(8)
    step = attn(x[:, 4:5], cache=cache, causal=True)
    assert len(cache) == 5
    full = attn(x[:, :5], causal=True)
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(
        step, full[:, 4:], rtol=0, atol=64 * eps * float(full.detach().abs().max())
    )


def test_extended_leaves_the_cache_as_it_is_and_store_takes_it():
    cache = KVCache()
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    cache.append(k, v, torch.arange(3)[None], None)
    entries = cache.extended(k[:, :, :1], v[:, :, :1], torch.tensor([[3]]), None)
    assert entries[0].shape[2] == 4 and len(cache) == 3
    cache.store(*entries)
    assert len(cache) == 4 and torch.equal(cache.positions, torch.arange(4)[None])


def test_default_positions_keep_the_cache_one_marked_run():
    """Prefill and steps at their default positions leave the cache's positions one run
    marked as such (the schemes then know them without reading them), equal to arange;
    positions written into in place, or given by the caller, are read: the next step
    follows their last value as before."""
    attn = model(ALiBi(4))
    x = torch.randn(1, 10, 16)
    cache = KVCache()
    attn(x[:, :5], causal=True, cache=cache)
    for t in range(5, 8):
        attn(x[:, t : t + 1], causal=True, cache=cache)
    assert _known_run(cache.positions) == (0, 7)
    assert torch.equal(cache.positions, torch.arange(8)[None])
    cache.positions.add_(10)  # written into: no longer known without reading it
    assert _known_run(cache.positions) is None
    attn(x[:, 8:9], causal=True, cache=cache)
    assert cache.positions[0, -2:].tolist() == [17, 18]
    given = KVCache()
    attn(x[:, :3], positions=torch.arange(3) + 4, causal=True, cache=given)
    attn(x[:, 3:4], causal=True, cache=given)
    assert given.positions.tolist() == [[4, 5, 6, 7]]
    gap = KVCache()  # two marked runs that do not follow each other: one cat, unmarked
    attn(x[:, :3], positions=run_positions(0, 3), causal=True, cache=gap)
    attn(x[:, 3:4], positions=run_positions(5, 1), causal=True, cache=gap)
    assert gap.positions.tolist() == [[0, 1, 2, 5]] and _known_run(gap.positions) is None


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("b", [1, 3])
def test_decoding_at_marked_positions_equals_the_full_pass(mode, b):
    """Steps at the cache's marked positions (built outside inference mode, so that they
    carry a version counter) give the full causal pass's rows, for every sequence of the
    batch, a few tokens at a time too."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, position=ALiBi(4)).double().eval()
    x = torch.randn(b, 12, 16, dtype=torch.float64)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        full = attn(x, causal=True)
        cache = KVCache()
        steps = [attn(x[:, :5], causal=True, cache=cache)]
        steps += [attn(x[:, t : t + 1], causal=True, cache=cache) for t in range(5, 9)]
        steps.append(attn(x[:, 9:], causal=True, cache=cache))  # three at once
        assert _known_run(cache.positions) == (0, 11)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)
