"""ALiBi (:mod:`posenc.alibi`): the paper's slopes, the bias, decoding offsets, casts and
errors. Its kept runs beside T5's, and the subclasses that opt out of them, are tested in
tests/test_bias.py."""

from __future__ import annotations

import math

import pytest
import torch

from posenc import ALiBi, alibi_slopes
from tolerances import tolerance


def reference_slopes(n):
    """The paper's rule, float64."""

    def power_of_two(m):
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + reference_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("heads", [1, 2, 4, 8, 16, 6, 12, 20, 3])
def test_alibi_slopes_follow_the_paper(heads):
    torch.testing.assert_close(
        alibi_slopes(heads).double(),
        torch.tensor(reference_slopes(heads), dtype=torch.float64),
        rtol=tolerance(torch.float32, 1.0),
        atol=0,
    )


def test_alibi_published_slopes_for_8_heads():
    assert alibi_slopes(8).tolist() == [1 / 2**i for i in range(1, 9)]


def test_alibi_bias_and_offset_decoding():
    alibi = ALiBi(4)
    dense = alibi(6, 6)
    slopes = alibi_slopes(4)
    for h in range(4):
        for i in range(6):
            for j in range(6):
                assert dense[h, i, j] == pytest.approx(-float(slopes[h]) * abs(j - i))
    for t in range(6):
        torch.testing.assert_close(alibi(1, t + 1, offset=t)[:, 0], dense[:, t, : t + 1])
    pos = torch.arange(6)[None]
    torch.testing.assert_close(alibi.score_bias(pos + 77, pos + 77)[0], dense)
    assert not list(alibi.state_dict())


def test_alibi_survives_bf16_cast():
    alibi = ALiBi(8).to(torch.bfloat16)
    bias = alibi(1, 1001, offset=1000)
    assert bias.dtype == torch.float32
    assert bias[0, 0, 0] == pytest.approx(-0.5 * 1000) and bias[0, 0, 1] == pytest.approx(
        -0.5 * 999
    )


def test_alibi_errors():
    with pytest.raises(ValueError, match="heads must be >= 1, got 0"):
        ALiBi(0)
    with pytest.raises(
        ValueError, match="ALiBi was built for heads=4 but the attention has heads=8"
    ):
        ALiBi(4).validate_attention(heads=8, head_dim=8)


def test_kept_score_bias_is_the_dense_bias_kept_between_calls():
    """With the paper's slopes and consecutive positions the dense bias is kept: the same
    tensor in each call (one query's: a view of one row kept for its offsets, the same
    memory in each call), of ``score_bias``'s values (the paper's ``-slope * |j - i|`` in
    float64), for queries before, among and after the keys."""
    import posenc.alibi as alibi_module

    alibi_module._paper_dense_bias.cache_clear()
    scheme = ALiBi(4)
    slopes = torch.tensor(reference_slopes(4), dtype=torch.float64)
    cases = ((0, 0, 7, 7), (30, 0, 1, 31), (5, 40, 3, 9), (3, 0, 1, 9), (70, 0, 1, 64))
    for q_start, k_start, n_q, n_k in cases:
        q_pos = torch.arange(q_start, q_start + n_q)[None]
        k_pos = torch.arange(k_start, k_start + n_k)[None]
        kept = scheme.kept_score_bias(q_pos, k_pos)
        assert kept.shape == (1, 4, n_q, n_k) and not kept.requires_grad
        again = ALiBi(4).kept_score_bias(q_pos.clone(), k_pos.clone())
        if n_q > 1:
            assert again is kept  # kept
        else:  # a view of the row kept for these offsets
            assert again.data_ptr() == kept.data_ptr() and again.stride() == kept.stride()
            assert kept._base is not None and kept._base.dim() == 2  # [h, below + above + 1]
        distance = (k_pos[0][None, :] - q_pos[0][:, None]).abs().double()  # [n_q, n_k]
        expected = -slopes[:, None, None] * distance  # [h, n_q, n_k]
        torch.testing.assert_close(kept[0].double(), expected, rtol=1e-6, atol=0)
        assert torch.equal(kept, scheme.score_bias(q_pos, k_pos))


def test_kept_score_bias_declines_what_it_does_not_keep():
    """None for learned slopes, a subclass's or the instance's own ``slopes``, ``bias`` or
    ``offset_bias``, positions that are not one run, and a bias above 2^22 elements; the
    engine then computes ``score_bias`` (which those define), and its result is the
    caller's."""

    class Halved(ALiBi):
        def slopes(self, device=None):
            return super().slopes(device) / 2

    class Steeper(ALiBi):
        def bias(self, offsets):
            return 2 * super().bias(offsets)

    class Shifted(ALiBi):
        def offset_bias(self, q_pos, k_pos):
            return super().offset_bias(q_pos, k_pos) - 1

    class Tripled:
        def score_bias(self, q_pos, k_pos):
            return 3 * super().score_bias(q_pos, k_pos)

    class TripledALiBi(Tripled, ALiBi):
        pass

    pos = torch.arange(6)[None]
    on_instance = ALiBi(2)
    on_instance.slopes = lambda device=None: torch.ones(2, device=device)
    schemes = (ALiBi(2, learned=True), Halved(2), Steeper(2), Shifted(2), TripledALiBi(2))
    for scheme in (*schemes, on_instance):
        assert scheme.kept_score_bias(pos, pos) is None
    assert ALiBi(2).kept_score_bias(torch.tensor([[0, 2, 3]]), pos) is None
    assert ALiBi(2).kept_score_bias(torch.arange(6).expand(2, 6), pos) is None  # per batch
    q_pos, k_pos = torch.arange(512)[None], torch.arange(513)[None]  # 16 x 512 x 513 > 2^22
    assert ALiBi(16).kept_score_bias(q_pos, k_pos) is None
    assert ALiBi(16).kept_score_bias(q_pos, k_pos[:, :512]) is not None  # 2^22
    import posenc.alibi as alibi_module

    alibi_module._paper_run_bias.cache_clear()
    one, many = torch.tensor([[6000]]), torch.arange(6001)[None]  # 6001 offsets: not kept
    assert ALiBi(8).kept_score_bias(one, many) is not None  # 8 x 6001: the dense bias kept
    assert alibi_module._paper_run_bias.cache_info().currsize == 0  # its run is not
    fresh = ALiBi(2).score_bias(pos, pos)
    fresh.mul_(0)  # the caller's own: nothing kept changes
    assert ALiBi(2).kept_score_bias(pos, pos).abs().max() > 0


def test_the_engine_reads_the_kept_bias_and_never_writes_into_it():
    """Every path that writes the bias out (the forward in one buffer, the formula op by op
    with gradients, SDPA with it as attn_mask, a mask added to it) leaves the kept tensor as
    it was, and gives the math path's output."""
    import posenc

    torch.manual_seed(0)
    scheme = ALiBi(4)
    pos = torch.arange(16)[None]
    kept = scheme.kept_score_bias(pos, pos)
    before = kept.clone()
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[1, 12:] = True
    for masked in (None, pad):
        expected = posenc.attention(q, k, v, position=scheme, key_padding_mask=masked,
                                    backend="math")  # fmt: skip
        for backend in ("auto", "sdpa"):
            for grad in (False, True):
                x = [t.clone().requires_grad_(grad) for t in (q, k, v)]
                with torch.set_grad_enabled(grad):
                    out = posenc.attention(*x, position=scheme, backend=backend,
                                           key_padding_mask=masked)  # fmt: skip
                if grad:
                    out.sum().backward()
                torch.testing.assert_close(out.detach(), expected, rtol=1e-10, atol=1e-12)
                assert torch.equal(kept, before)
    assert scheme.kept_score_bias(pos, pos) is kept


def test_one_querys_kept_bias_is_a_slice_of_a_row_shared_by_the_steps():
    """A decoding step's kept bias (one query over the keys before it) is a view of one row
    per power of two of its offsets: successive steps share the row, keep no dense bias,
    and read the paper's values."""
    import posenc.alibi as alibi_module

    alibi_module._paper_dense_bias.cache_clear()
    alibi_module._paper_row.cache_clear()
    scheme = ALiBi(4)
    slopes = torch.tensor(reference_slopes(4), dtype=torch.float64)
    rows = set()
    for p in (40, 41, 63):  # offsets -p .. 0: one row of offsets -64 .. 0
        kept = scheme.kept_score_bias(torch.tensor([[p]]), torch.arange(p + 1)[None])
        expected = -slopes[:, None] * torch.arange(p, -1, -1).double()  # [h, p + 1]
        torch.testing.assert_close(kept[0, :, 0].double(), expected, rtol=1e-6, atol=0)
        rows.add(kept._base.data_ptr())
    assert len(rows) == 1 and alibi_module._paper_dense_bias.cache_info().currsize == 0
    assert alibi_module._paper_row.cache_info().currsize == 1
    later = scheme.kept_score_bias(torch.tensor([[64]]), torch.arange(65)[None])
    assert later._base.shape == (4, 64 + 1) and later._base.data_ptr() in rows  # -64 .. 0
    ahead = scheme.kept_score_bias(torch.tensor([[2]]), torch.arange(5, 9)[None])  # 3 .. 6
    assert ahead._base.shape == (4, 8 + 1)  # offsets 0 .. 8


def test_a_chunks_kept_bias_is_the_last_columns_of_a_block_shared_by_its_band():
    """Fewer queries than keys at the end of them (a chunk of tokens over a cache): the last
    ``n_k`` columns of one block kept per key count rounded up to a power of two, shared by
    the chunks of that band, of the paper's values; queries as many as keys, or not at
    the end, or a block past 2^22 elements keep the dense bias of their own shape."""
    import posenc.alibi as alibi_module

    alibi_module._paper_end_block.cache_clear()
    scheme = ALiBi(4)
    slopes = torch.tensor(reference_slopes(4), dtype=torch.float64)
    blocks = {}
    for n_q, n_k in ((3, 9), (3, 12), (3, 16), (3, 17), (5, 40), (2, 3)):
        q_pos = torch.arange(n_k - n_q, n_k)[None]
        k_pos = torch.arange(n_k)[None]
        kept = scheme.kept_score_bias(q_pos, k_pos)
        distance = (k_pos[0][None, :] - q_pos[0][:, None]).abs().double()  # [n_q, n_k]
        expected = -slopes[:, None, None] * distance  # [h, n_q, n_k]
        assert kept.shape == (1, 4, n_q, n_k)
        torch.testing.assert_close(kept[0].double(), expected, rtol=1e-6, atol=0)
        width = 1 << (n_k - 1).bit_length()
        assert kept._base.shape == (1, 4, n_q, width) and kept._base._base is None
        assert kept.storage_offset() == width - n_k  # the last columns, every row
        blocks.setdefault((n_q, width), set()).add(kept._base.data_ptr())
    assert all(len(ptrs) == 1 for ptrs in blocks.values())  # one block per band
    assert len(blocks) == 4 and alibi_module._paper_end_block.cache_info().currsize == 4
    square = scheme.kept_score_bias(torch.arange(8)[None], torch.arange(8)[None])
    shifted = scheme.kept_score_bias(torch.arange(4, 7)[None], torch.arange(8)[None])
    large = ALiBi(16).kept_score_bias(torch.arange(900, 1100)[None], torch.arange(1100)[None])
    for dense in (square, shifted, large):  # 16 x 200 x 2048 > 2^22; 16 x 200 x 1100 is not
        assert dense._base is None or dense._base.shape[-1] == dense.shape[-1]


@pytest.mark.parametrize("n_q", [3, 20])
def test_chunks_over_a_growing_cache_read_one_masked_block_per_band(n_q):
    """Chunks of ``n_q`` tokens at the end of a growing count of keys under the causal
    mask, through the engine (3 queries replay a route kept per band of key counts, 20
    choose their path in each call): each equals the definition (float64), and the bias
    the engine hands SDPA is the last columns of one block masked once for the band."""
    import posenc
    from posenc.engine import kept, sdpa

    kept.clear()
    torch.manual_seed(0)
    scheme = ALiBi(4)
    slopes = torch.tensor(reference_slopes(4), dtype=torch.float64)
    k, v = torch.randn(2, 4, 64, 8), torch.randn(2, 4, 64, 8)
    for n_k in range(40, 65, n_q):  # keys 33 .. 64: one band
        q = torch.randn(2, 4, n_q, 8)
        q_pos = torch.arange(n_k - n_q, n_k)
        with torch.no_grad():
            out = posenc.attention(
                q, k[:, :, :n_k], v[:, :, :n_k], position=scheme, positions=q_pos,
                key_positions=torch.arange(n_k), causal=True,
            )  # fmt: skip
        blocks = [bias for bias in sdpa._MASKED if bias.shape[-1] == 64]
        assert len(sdpa._MASKED) == 1 and len(blocks) == 1, "one masked block"
        distance = torch.arange(n_k)[None, :] - q_pos[:, None]  # [n_q, n_k]: j - i
        scores = q.double() @ k[:, :, :n_k].double().transpose(-1, -2) / 8**0.5
        scores = scores - slopes[:, None, None] * distance.abs()
        scores = scores.masked_fill(distance > 0, float("-inf"))
        want = scores.softmax(-1) @ v[:, :, :n_k].double()
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
