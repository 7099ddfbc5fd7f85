"""KVCache, left padding and packed sequences, scheme-independent.

Every scheme's decoding parity with the full pass is in tests/test_schemes.py.
"""

from __future__ import annotations

import copy

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
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_prefill_then_tokens_equals_full_pass(backend, with_scheme, grad):
    m = model(DecayBias(4) if with_scheme else None, backend)
    x = torch.randn(2, 10, 16)
    full, logit = forward(m, x, causal=True)
    cache = KVCache()
    with torch.set_grad_enabled(grad):  # without gradients: keys and values in a buffer
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


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_a_failed_step_leaves_the_cache_untouched(grad):
    """A step that raises (a 1-D RelativePositionBias outgrown by the positions) had already
    appended its keys: after the suggested .resize, the retry decoded with the token cached
    twice. Updates are all or nothing; without gradients the failed step wrote into the
    buffer past the cache's length, which the retry writes over."""
    from posenc import RelativePositionBias

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, position=RelativePositionBias(4, 4)).eval()
    x = torch.randn(1, 6, 16)
    cache = KVCache()
    with torch.set_grad_enabled(grad):
        attn(x[:, :3], cache=cache, causal=True)
        attn(x[:, 3:4], cache=cache, causal=True)  # without gradients: a buffer
        keys = cache.keys.clone()
        with pytest.raises(ValueError, match=r"\.resize\(5\)"):
            attn(x[:, 4:5], cache=cache, causal=True)
        assert len(cache) == 4 and torch.equal(cache.keys, keys)
        assert (cache._buffer is None) == grad
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


# ----- the buffer: keys and values written in place ------------------------------------------


def _kv(b=1, h=2, m=1, d=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, m, d, generator=g, dtype=dtype) for _ in range(2))


def _tokens(cache):
    """The buffer's capacity in tokens, from the storage its keys are a view of."""
    keys = cache.keys
    return keys.untyped_storage().nbytes() // (keys.element_size() * keys[:, :, :1].numel())


def _prefill_and_step(attn, x, cache):
    """The outputs of a prefill of 4 tokens of ``x`` and of one step (the 5th): the step
    makes the cache's buffer."""
    return [attn(x[:, :4], causal=True, cache=cache), attn(x[:, 4:5], causal=True, cache=cache)]


def _append(cache, seed, m=1):
    k, v = _kv(m=m, seed=seed)
    cache.append(k, v, cache._following(m, torch.device("cpu")), None)
    return k, v


def test_steps_without_gradients_write_into_one_buffer_that_grows_by_a_quarter():
    cache = KVCache()
    with torch.no_grad():
        k0, v0 = _kv(m=3, seed=0)
        cache.append(k0, v0, run_positions(0, 3), None)  # the prefill: held as given
        assert cache.keys is k0
        written = [_append(cache, seed) for seed in range(1, 6)]
        storage = cache.keys.untyped_storage().data_ptr()
        assert _tokens(cache) == 4 + 64  # made for 4 tokens, plus at least 64
        for seed in range(6, 70):  # past 68 tokens: a new buffer, a quarter larger
            written.append(_append(cache, seed))
    keys = torch.cat([k0] + [k for k, _ in written], 2)
    values = torch.cat([v0] + [v for _, v in written], 2)
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)
    assert cache.keys.untyped_storage().data_ptr() != storage
    assert _tokens(cache) == 69 + 64 and len(cache) == 72
    assert _known_run(cache.positions) == (0, 71)


def test_capacity_sizes_the_first_buffer_and_is_checked():
    cache = KVCache(capacity=10)
    with torch.no_grad():
        cache.append(*_kv(m=3), torch.arange(3)[None], None)
        _append(cache, 1)
        assert _tokens(cache) == 10
        storage = cache.keys.untyped_storage().data_ptr()
        for seed in range(2, 8):
            _append(cache, seed)
        assert cache.keys.untyped_storage().data_ptr() == storage and len(cache) == 10
        _append(cache, 8)  # the 11th token: a buffer for 11 + 64
        assert _tokens(cache) == 75
    small = KVCache(capacity=2)  # less than the first write needs: sized by need
    with torch.no_grad():
        small.append(*_kv(m=3), torch.arange(3)[None], None)
        _append(small, 1)
    assert _tokens(small) == 68
    with pytest.raises(TypeError, match=r"capacity must be an int, got 2.5 \(float\); pass None"):
        KVCache(capacity=2.5)
    with pytest.raises(TypeError, match="capacity must be an int, got True"):
        KVCache(capacity=True)
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0; pass None to size"):
        KVCache(capacity=0)


def test_a_tensor_handed_out_never_changes():
    """The cache's keys and values read, what append returned, and a shallow copy's
    tensors: later steps, a crop below them and writes after it leave them as they were."""
    cache = KVCache()
    with torch.no_grad():
        cache.append(*_kv(m=3), torch.arange(3)[None], None)
        for seed in range(1, 4):
            _append(cache, seed)
        keys, values = cache.keys, cache.values  # 6 tokens, views of the buffer
        kept = keys.clone(), values.clone()
        returned = _append(cache, 4) and cache.append(*_kv(seed=5), torch.tensor([[7]]), None)
        returned_kept = [t.clone() for t in returned[:2]]
        cache.crop(4)  # below what was handed out: the buffer is given up
        for seed in range(6, 12):
            _append(cache, seed)
    assert torch.equal(keys, kept[0]) and torch.equal(values, kept[1])
    assert all(torch.equal(a, b) for a, b in zip(returned[:2], returned_kept, strict=True))
    assert len(cache) == 10 and torch.equal(cache.keys[:, :, :4], kept[0][:, :, :4])


def test_crop_keeps_the_buffer_where_nothing_handed_out_reaches_past_it():
    """Steps of MultiHeadAttention hand nothing of the buffer out: a crop keeps it and the
    next steps write over the tokens forgotten; once the keys were read at 6 tokens, a
    crop to 4 gives it up and the keys read keep their values."""
    attn = model(ALiBi(4))
    x = torch.randn(1, 9, 16)
    cache = KVCache()
    with torch.no_grad():
        attn(x[:, :3], causal=True, cache=cache)
        for t in range(3, 6):
            attn(x[:, t : t + 1], causal=True, cache=cache)
        storage = cache._keys.untyped_storage().data_ptr()
        cache.crop(4)
        attn(x[:, 8:9], causal=True, cache=cache)
        assert cache._keys.untyped_storage().data_ptr() == storage and len(cache) == 5
        attn(x[:, 5:6], causal=True, cache=cache)
        keys = cache.keys  # 6 tokens handed out
        kept = keys.clone()
        cache.crop(4)
        attn(x[:, 6:7], causal=True, cache=cache)
    assert cache._keys.untyped_storage().data_ptr() != storage and torch.equal(keys, kept)
    assert torch.equal(cache.keys[:, :, :4], kept[:, :, :4])
    assert _known_run(cache.positions) == (0, 4)


def test_crop_for_speculative_decoding_equals_the_full_pass():
    """Three draft tokens decoded, two rejected and cropped, then the accepted sequence
    decoded on: the outputs of the full pass over what was accepted."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, position=ALiBi(4)).double().eval()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    drafts = torch.randn(2, 3, 16, dtype=torch.float64)
    with torch.no_grad():
        full = attn(x, causal=True)
        cache = KVCache()
        steps = _prefill_and_step(attn, x, cache)
        attn(drafts, causal=True, cache=cache)  # three drafts at once, rejected
        assert len(cache) == 8
        cache.crop(5)
        steps += [attn(x[:, t : t + 1], causal=True, cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-12)
    assert _known_run(cache.positions) == (0, 8)


def test_crop_and_its_errors():
    cache = KVCache()
    padding = torch.tensor([[True, False, False]])
    cache.append(*_kv(m=3), torch.tensor([[4, 5, 9]]), padding)
    cache.crop(2)
    assert len(cache) == 2 and cache.positions.tolist() == [[4, 5]]
    assert cache.key_padding.tolist() == [[True, False]]
    with pytest.raises(ValueError, match=r"length must be in \[0, 2\] .* got 3; cache.reset\(\)"):
        cache.crop(3)
    with pytest.raises(ValueError, match=r"length must be in \[0, 2\]"):
        cache.crop(-1)
    with pytest.raises(TypeError, match=r"length must be an int, got 1.0 \(float\)"):
        cache.crop(1.0)
    cache.crop(0)
    assert len(cache) == 0 and cache.keys is None and cache.next_position == 0


def test_copies_of_a_cache_decode_apart():
    """A shallow copy shares the tokens held but not the buffer: each decodes on its own
    (a beam split in two); a deep copy shares nothing."""
    cache = KVCache()
    with torch.no_grad():
        cache.append(*_kv(m=3), torch.arange(3)[None], None)
        _append(cache, 1)
        _append(cache, 2)
        before = cache._keys.clone()
        shallow, deep = copy.copy(cache), copy.deepcopy(cache)
        assert deep.keys.untyped_storage().data_ptr() != cache.keys.untyped_storage().data_ptr()
        mine, theirs, deep_new = _append(cache, 3)[0], _append(shallow, 4)[0], _append(deep, 5)[0]
        assert torch.equal(cache.keys[:, :, 5:], mine)  # the copy's step wrote elsewhere
        cache.crop(3)  # below what the copy holds: given up, the copy's tokens kept
        _append(cache, 6)
    assert torch.equal(shallow.keys[:, :, :5], before) and torch.equal(
        shallow.keys[:, :, 5:], theirs
    )
    assert torch.equal(deep.keys[:, :, :5], before) and torch.equal(deep.keys[:, :, 5:], deep_new)
    assert len(cache) == 4 and not torch.equal(mine, theirs)


def test_extended_gives_new_tensors_and_leaves_the_buffer_alone():
    cache = KVCache()
    with torch.no_grad():
        cache.append(*_kv(m=3), torch.arange(3)[None], None)
        _append(cache, 1)
        held = cache._keys.clone()
        entries = cache.extended(*_kv(seed=7), torch.tensor([[4]]), None)
        entries[0].zero_()
        _append(cache, 2)
    assert torch.equal(cache.keys[:, :, :4], held)
    assert entries[0].untyped_storage().data_ptr() != cache.keys.untyped_storage().data_ptr()


def test_grad_mode_concatenates_and_gradients_reach_the_cached_keys():
    """In grad mode the cache holds no buffer (a write in place would change what autograd
    saved); a buffer made without gradients is given up by the first step with them."""
    cache = KVCache()
    k0 = torch.randn(1, 2, 3, 4, requires_grad=True)
    with torch.no_grad():
        cache.append(k0.detach(), k0.detach(), torch.arange(3)[None], None)
        _append(cache, 1)
    assert cache._buffer is not None
    k1 = torch.randn(1, 2, 1, 4, requires_grad=True)
    keys, _, _, _ = cache.append(k1, k1, torch.tensor([[4]]), None)
    assert cache._buffer is None and keys.requires_grad
    keys.sum().backward()
    assert torch.equal(k1.grad, torch.ones_like(k1))


def test_inference_mode_steps_then_no_grad_steps_share_the_buffer():
    """The buffer is made outside inference mode: steps without it write into the buffer
    that inference-mode steps made (an inference tensor refuses writes outside)."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, position=ALiBi(4)).double().eval()
    x = torch.randn(1, 10, 16, dtype=torch.float64)
    cache = KVCache()
    with torch.inference_mode():
        full = attn(x, causal=True)
        steps = [attn(x[:, :4], causal=True, cache=cache)]
        steps += [attn(x[:, t : t + 1], causal=True, cache=cache) for t in range(4, 6)]
    storage = cache._keys.untyped_storage().data_ptr()
    with torch.no_grad():
        steps += [attn(x[:, t : t + 1], causal=True, cache=cache) for t in range(6, 10)]
    assert cache._keys.untyped_storage().data_ptr() == storage
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-12)


def test_new_keys_of_another_dtype_concatenate_as_cat_does():
    cache = KVCache()
    with torch.no_grad():
        k0, v0 = _kv(m=3)
        cache.append(k0, v0, torch.arange(3)[None], None)
        k1, v1 = _kv(seed=1, dtype=torch.float64)
        keys, _, _, _ = cache.append(k1, v1, torch.tensor([[3]]), None)
    assert keys.dtype == torch.float64 and torch.equal(keys, torch.cat((k0, k1), 2))
    assert cache._buffer is None


def test_what_autograd_saved_of_a_tensor_handed_out_stays_valid():
    """A later step writes the buffer through a version counter of its own: a graph that
    saved the cache's keys still runs its backward."""
    attn = model(ALiBi(4))
    x = torch.randn(1, 6, 16)
    cache = KVCache()
    with torch.no_grad():
        attn(x[:, :3], causal=True, cache=cache)
        attn(x[:, 3:4], causal=True, cache=cache)
    weight = torch.randn(4, requires_grad=True)
    loss = (cache.keys * weight).sum()  # saves the keys, a view of the buffer
    with torch.no_grad():
        attn(x[:, 4:5], causal=True, cache=cache)
        attn(x[:, 5:6], causal=True, cache=cache)
    loss.backward()
    assert torch.allclose(weight.grad, cache.keys[:, :, :4].sum((0, 1, 2)))


def test_a_deep_copy_made_in_inference_mode_decodes_outside_it():
    attn = model(ALiBi(4)).double()
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    with torch.inference_mode():
        full = attn(x, causal=True)
        cache = KVCache()
        steps = _prefill_and_step(attn, x, cache)
        beam = copy.deepcopy(cache)  # its buffer an inference tensor
    with torch.no_grad():
        steps += [attn(x[:, t : t + 1], causal=True, cache=beam) for t in range(5, 8)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-12)
    assert not beam._buffer[0].is_inference()


def test_a_failed_step_lets_the_buffer_it_made_go():
    from posenc import RelativePositionBias

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, position=RelativePositionBias(4, 4)).eval()
    cache = KVCache()
    with torch.no_grad():
        attn(torch.randn(1, 4, 16), causal=True, cache=cache)  # no buffer yet
        with pytest.raises(ValueError, match=r"\.resize\(5\)"):
            attn(torch.randn(1, 1, 16), causal=True, cache=cache)  # would make one
    assert cache._written is None and cache._buffer is None and len(cache) == 4


def test_copies_keep_the_class_and_subclassed_tensors_concatenate():
    class Tagged(torch.Tensor):
        pass

    class MyCache(KVCache):
        pass

    cache = MyCache()
    assert type(copy.copy(cache)) is MyCache and type(copy.deepcopy(cache)) is MyCache
    with torch.no_grad():
        k, v = (t.as_subclass(Tagged) for t in _kv(m=3))
        cache.append(k, v, run_positions(0, 3), None)
        keys, _, _, _ = cache.append(
            *(t.as_subclass(Tagged) for t in _kv(seed=1)), run_positions(3, 1), None
        )
    assert type(keys) is Tagged and cache._buffer is None


def test_values_that_do_not_match_the_keys_are_refused():
    cache = KVCache()
    with torch.no_grad():
        cache.append(*_kv(m=3), run_positions(0, 3), None)
        _append(cache, 1)  # a buffer, which copy_ would broadcast into
        k, _ = _kv(m=2, seed=2)
        with pytest.raises(
            ValueError, match=r"cache holds values of shape .* new values have shape \(1, 1, 1, 4\)"
        ):
            cache.append(k, torch.randn(1, 1, 1, 4), run_positions(4, 2), None)
        with pytest.raises(ValueError, match=r"new values have shape \(1, 2, 2, 5\)"):
            cache.append(k, torch.randn(1, 2, 2, 5), run_positions(4, 2), None)
    assert len(cache) == 4


def test_crop_takes_any_integer():
    np = pytest.importorskip("numpy")
    cache = KVCache()
    cache.append(*_kv(m=3), run_positions(0, 3), None)
    cache.crop(np.int64(2))
    assert len(cache) == 2
    with pytest.raises(TypeError, match="length must be an int, got True"):
        cache.crop(True)


def test_padded_steps_check_only_the_keys_they_add(monkeypatch):
    """A left-padded batch's cached steps check for non-finite values (which the padding
    must hide) only the keys and values the cache has not found finite yet: in the first
    step over a buffer all of them, then each step's new token alone; the outputs are each
    sequence's alone. A write through ``cache.keys`` (its version counter) makes the next
    step read them all again, and a NaN written at a padded key stays hidden."""
    import posenc.engine.inputs as inputs

    checked = []
    finite = inputs._finite
    monkeypatch.setattr(inputs, "_finite", lambda xs: checked.append(xs) or finite(xs))
    m = model(ALiBi(4))
    torch.manual_seed(1)
    first, second = torch.randn(1, 9, 16), torch.randn(1, 12, 16)
    prompt = torch.cat((torch.cat((torch.zeros(1, 3, 16), first[:, :4]), 1), second[:, :7]))
    padding = torch.tensor([[True] * 3 + [False] * 4, [False] * 7])  # [2, 7]: 3 pads
    alone = [forward(m, x, causal=True) for x in (first, second)]
    cache = KVCache()
    element = 2 * 4 * 4  # b * h * d: one token of q, k or v
    with torch.no_grad():
        m(prompt, causal=True, key_padding_mask=padding, cache=cache)
        steps = []
        for t in range(5):
            checked.clear()
            x = torch.cat((first[:, 4 + t : 5 + t], second[:, 7 + t : 8 + t]))  # [2, 1, 16]
            steps.append(m(x, causal=True, cache=cache))
            read = sum(part.numel() for xs in checked for part in xs) // element
            assert read == (1 + 2 * (8 + t) if t == 0 else 1 + 2), (t, read)  # q, k, v
        out = torch.cat(steps, 1)  # [2, 5, 16]
        for row, (full, logit) in enumerate(alone):
            n = full.shape[1]
            assert_close(out[row], full[0, n - 5 :], terms=16, logit=logit)
        x = torch.randn(2, 1, 16)
        clean = m(x, causal=True, cache=copy.deepcopy(cache))
        cache.keys[0, :, 1] = float("nan")  # a padded key of the first sequence
        checked.clear()
        again = m(x, causal=True, cache=cache)
        read = sum(part.numel() for xs in checked for part in xs) // element
        assert read >= 2 * 13, "all the keys and values read again"
        torch.testing.assert_close(again, clean, rtol=0, atol=1e-6)  # the NaN hidden
        cache.keys[1, :, 2] = float("nan")  # a key the second sequence sees
        out = m(x, causal=True, cache=cache)
    assert out[1].isnan().all() and not out[0].isnan().any()


def test_what_a_cache_found_finite_holds_while_its_buffer_is_unchanged():
    """The count of keys a step found finite (``_found_finite``) serves the next steps over
    the same buffer, capped at the tokens cached (a crop, the tokens a failed step wrote);
    none after a write through the buffer's views, a new buffer (grown, or after keys
    assigned), a copy, or a step that found nothing."""
    torch.manual_seed(0)
    cache = KVCache(capacity=32)

    def step(n=1, found=True):
        k, v = torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)
        keys, values, positions, padding = cache._step(k, v, torch.arange(n)[None], None)
        known = cache._finite_keys(keys, values)
        if found:
            cache._found_finite(keys.shape[2])
        cache.store(keys, values, positions, padding)
        return known

    with torch.no_grad():
        assert step(4) == 0  # the first tensors held as given: no buffer
        assert step() == 0  # a new buffer
        assert [step() for _ in range(3)] == [5, 6, 7]
        assert step(found=False) == 8 and step() == 8  # (that step found nothing)
        cache.crop(6)  # the tokens past 6 are written again: the count goes down with it
        assert step(found=False) == 6 and step() == 6
        cache._step(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.arange(3)[None], None)
        cache._found_finite(11)
        cache._discard()  # a failed step: its count is not held
        assert step() == 8
        cache.values[0, 0, 0, 0] = 1.0  # a write through a view of the buffer
        assert step() == 0 and step() == 10
        other = copy.copy(cache)
        deep = copy.deepcopy(cache)
        assert step() == 11
        for fork in (other, deep):
            cache, kept = fork, cache
            assert step() == 0  # a buffer of its own
            cache = kept
        cache.keys = cache.keys.clone()  # the buffer given up
        cache.values = cache.values.clone()
        assert step() == 0 and step() == 13
        assert step(20) == 0  # past the buffer's capacity: a new, larger one
    with torch.inference_mode():  # a deep copy made here writes into its inference tensors
        deep = copy.deepcopy(cache)
        cache = deep
        assert [step(), step()] == [0, 0]  # (which have no version counter: nothing found)


def test_a_hidden_nan_written_after_a_crop_stays_hidden():
    """A crop, then a step whose new token is padding and NaN (written over a token a step
    before found finite): the later steps check it again, and the query that cannot see
    it gets what it gets when the token is finite."""
    m = model(ALiBi(4))
    torch.manual_seed(2)
    prompt, steps = torch.randn(2, 8, 16), torch.randn(5, 2, 1, 16)
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[0, :3] = True

    def run(bad):
        cache = KVCache()
        with torch.no_grad():
            m(prompt, causal=True, key_padding_mask=padding, cache=cache)
            for x in steps[:3]:
                m(x, causal=True, cache=cache)
            cache.crop(9)
            x = steps[3].clone()
            x[0, 0, 0] = bad  # row 0's new token: padding
            m(x, causal=True, cache=cache, key_padding_mask=torch.tensor([[True], [False]]))
            return m(steps[4], causal=True, cache=cache)

    clean, out = run(0.5), run(float("nan"))
    assert out.isfinite().all()
    torch.testing.assert_close(out, clean, rtol=0, atol=1e-6)
