"""flex.py: posenc's FlexAttention factories against the dense definition.

Each ``score_mod`` is applied eagerly to a whole score matrix with broadcast indices (what
FlexAttention's own eager reference does), so outputs and gradients (to q, k, v and the
scheme's tables) are compared without compiling; a few tests run compiled FlexAttention
forward (no backward on CPU in torch 2.13)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import posenc
import posenc.flex
from posenc import attention
from tolerances import assert_close, logit_size

SCHEMES = {
    "alibi": lambda: posenc.ALiBi(2),
    "t5": lambda: posenc.T5RelativeBias(2, num_buckets=8, max_distance=16),
    "swin-1d": lambda: posenc.RelativePositionBias(12, 2),
    "swin-2d": lambda: posenc.RelativePositionBias((3, 4), 2),
    "shaw-keys": lambda: posenc.ShawRelativePosition(8, 3, values=False),
    "relative": lambda: posenc.RelativeQueryEmbedding(12, 8),
    "relative-per-head": lambda: posenc.RelativeQueryEmbedding(12, 8, heads=2),
}


def build(name):
    torch.manual_seed(0)
    scheme = SCHEMES[name]()
    for p in scheme.parameters():
        nn.init.normal_(p, std=0.5)
    return scheme.double()


def dense_flex(q, k, v, score_mod, keep=None, scale=None):
    """FlexAttention by its definition: the score_mod on every (b, h, i, j) at once."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # [b, h, n_q, n_k]
    idx = (
        torch.arange(b)[:, None, None, None],
        torch.arange(h)[None, :, None, None],
        torch.arange(n_q)[None, None, :, None],
        torch.arange(n_k)[None, None, None, :],
    )
    scores = score_mod(scores, *idx)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v


def inputs(b=2, n=12, seed=1):
    torch.manual_seed(seed)
    return [torch.randn(b, 2, n, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("positions", ["indices", "shared", "per-row"])
def test_score_mod_equals_the_definition_with_gradients(name, positions):
    scheme = build(name)
    q, k, v = inputs()
    if positions == "indices":
        pos, kwargs = None, {}
    elif positions == "shared":
        pos = torch.arange(12)
        kwargs = {"positions": pos}
    else:
        if name == "swin-2d":  # token indices of the map: another order per sequence
            pos = torch.stack([torch.arange(12), torch.arange(12).flip(0)])
        else:
            pos = torch.stack([torch.arange(12), torch.arange(12) + 5])
        kwargs = {"positions": pos}
    mod = posenc.flex.score_mod(scheme, pos, q=q)
    got = dense_flex(q, k, v, mod)
    want = attention(q, k, v, position=scheme, backend="math", **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    params = [p for p in scheme.parameters() if p.requires_grad]
    leaves = [q, k, v, *params]
    cotangent = torch.randn_like(want)
    for a, b in zip(
        torch.autograd.grad(got, leaves, cotangent, allow_unused=True),
        torch.autograd.grad(want, leaves, cotangent, allow_unused=True),
        strict=True,
    ):
        if b is None:
            assert a is None or not a.any()
            continue
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_term_and_a_bias_chain_and_the_scale_is_flex_attentions():
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.term = build("shaw-keys")
            self.bias = build("t5")

        def score_term(self, q, q_pos, k_pos):
            return self.term.score_term(q, q_pos, k_pos)

        def flex_term_mod(self, q, q_pos, k_pos, scale):
            return self.term.flex_term_mod(q, q_pos, k_pos, scale)

        def score_bias(self, q_pos, k_pos):
            return self.bias.score_bias(q_pos, k_pos)

        def flex_score_mod(self, q_pos, k_pos):
            return self.bias.flex_score_mod(q_pos, k_pos)

    q, k, v = inputs()
    both = Both()
    got = dense_flex(q, k, v, posenc.flex.score_mod(both, q=q, scale=0.2), scale=0.2)
    want = attention(q, k, v, position=both, scale=0.2, backend="math")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["alibi", "t5", "relative"])
def test_a_decoding_step_with_the_factories_equals_attention(name):
    """Three new queries after nine cached keys: block_mask(causal) aligns the queries with
    the last keys, and score_mod(offset=9) puts them at positions 9..11, as attention does."""
    scheme = build(name)
    torch.manual_seed(2)
    q = torch.randn(2, 2, 3, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64) for _ in range(2))
    bm = posenc.flex.block_mask(3, 12, causal=True)
    idx = (
        torch.arange(2)[:, None, None, None],
        torch.arange(2)[None, :, None, None],
        torch.arange(3)[None, None, :, None],
        torch.arange(12)[None, None, None, :],
    )
    want = attention(q, k, v, position=scheme, causal=True, backend="math")
    needs_q = name == "relative"
    for kwargs in ({"offset": 9}, {"q": q, "k_len": 12, "offset": 9}):
        if needs_q and "q" not in kwargs:
            continue
        mod = posenc.flex.score_mod(scheme, **kwargs)
        got = dense_flex(q, k, v, mod, keep=bm.mask_mod(*idx))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_with_q_the_positions_heads_and_ranges_are_checked():
    q4 = torch.randn(1, 4, 16, 8)
    with pytest.raises(ValueError, match="heads"):
        posenc.flex.score_mod(posenc.ALiBi(2), q=q4)
    with pytest.raises(ValueError, match="max_len"):
        posenc.flex.score_mod(posenc.RelativeQueryEmbedding(12, 8), q=q4, k_len=16)
    with pytest.raises(ValueError, match="pass key_positions"):
        posenc.flex.score_mod(posenc.ALiBi(4), torch.arange(16), q=q4, k_len=8)
    with pytest.raises(ValueError, match="positions"):
        posenc.flex.score_mod(posenc.ALiBi(4), torch.arange(5), q=q4)
    with pytest.raises(ValueError, match="offset must be an int >= 0"):
        posenc.flex.score_mod(posenc.ALiBi(4), offset=-1)


def test_a_long_reach_tabulates_only_the_offsets_the_positions_meet():
    """A relative embedding of max_len 4096 over 16 tokens: logits [b, h, 16, 31], not
    [b, h, 16, 8191]."""
    scheme = posenc.RelativeQueryEmbedding(4096, 8)
    q = torch.randn(1, 2, 16, 8)
    mod = posenc.flex.score_mod(scheme, q=q, k_len=16)
    captured = [
        c.cell_contents for c in mod.__closure__ if isinstance(c.cell_contents, torch.Tensor)
    ]
    assert [tuple(t.shape) for t in captured if t.ndim == 4] == [(1, 2, 16, 31)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"causal": True},
        {"window": 3},
        {"causal": True, "window": 4},
        {"key_padding_mask": torch.tensor([[False] * 12, [False] * 9 + [True] * 3])},
        {"valid_lens": torch.tensor([12, 7])},
        {"document_ids": torch.tensor([[0] * 5 + [1] * 7, [0] * 12])},
    ],
    ids=["causal", "window", "causal-window", "padding", "lengths", "documents"],
)
def test_block_mask_keeps_what_attention_keeps(kwargs):
    """The block mask's mask_mod (evaluated on every pair) against posenc.attention's own
    masking: the same output through the dense definition."""
    q, k, v = inputs()
    bm = posenc.flex.block_mask(12, **kwargs)
    idx = (
        torch.arange(2)[:, None, None, None],
        torch.arange(2)[None, :, None, None],
        torch.arange(12)[None, None, :, None],
        torch.arange(12)[None, None, None, :],
    )
    keep = bm.mask_mod(*idx)
    got = dense_flex(q, k, v, lambda s, *_: s, keep=keep)
    want = attention(q, k, v, backend="math", **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_block_mask_of_the_shape_alone_is_built_once():
    assert posenc.flex.block_mask(256, causal=True) is posenc.flex.block_mask(256, causal=True)
    assert posenc.flex.block_mask(256, causal=True, window=64) is not posenc.flex.block_mask(
        256, causal=True
    )


@pytest.mark.compile
def test_compiled_flex_attention_with_the_factories():
    """The factories through compiled FlexAttention (forward: no CPU backward): a clipped
    query term and a bias over packed causal documents, and the engine's flex path with a
    query term."""
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 128, 8) for _ in range(3))
    shaw = posenc.ShawRelativePosition(8, 4, values=False)
    docs = torch.tensor([[0] * 50 + [1] * 78, [0] * 128])
    positions = posenc.positions_from_documents(docs)
    compiled = torch.compile(flex_attention, dynamic=False)  # CPU: one graph per shape
    with torch.no_grad():
        got = compiled(
            q, k, v,
            score_mod=posenc.flex.score_mod(shaw, positions, q=q),
            block_mask=posenc.flex.block_mask(128, causal=True, document_ids=docs),
        )  # fmt: skip
        want = attention(q, k, v, position=shaw, causal=True, document_ids=docs, backend="math")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        relative = posenc.RelativeQueryEmbedding(128, 8)
        got = attention(q, k, v, position=relative, causal=True, backend="flex")
        want = attention(q, k, v, position=relative, causal=True, backend="math")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_errors_name_the_fix():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="rotates q and k before attention"):
        posenc.flex.score_mod(posenc.Rotary(8))
    with pytest.raises(TypeError, match="adds a value term"):
        posenc.flex.score_mod(posenc.ShawRelativePosition(8, 2))
    with pytest.raises(TypeError, match="pass q="):
        posenc.flex.score_mod(posenc.ShawRelativePosition(8, 2, values=False))
    with pytest.raises(TypeError, match="no bounded form"):
        posenc.flex.score_mod(posenc.AbsoluteQueryEmbedding(8, 8), q=q)
    with pytest.raises(TypeError, match="flex_attention needs no score_mod"):
        posenc.flex.score_mod(None)
    with pytest.raises(TypeError, match="defines none of the attention hooks"):
        posenc.flex.score_mod(posenc.SinusoidalEncoding(8))
    with pytest.raises(ValueError, match="window must be >= 1"):
        posenc.flex.block_mask(8, window=0)
    with pytest.raises(ValueError, match="document_ids is for self-attention"):
        posenc.flex.block_mask(4, 8, document_ids=torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["alibi", "t5", "swin-1d", "shaw-keys", "relative"])
def test_on_cuda_auto_runs_flex_and_the_tables_get_their_gradients(name):
    scheme = build(name).float().cuda()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8, device="cuda", requires_grad=True) for _ in range(3))
    assert posenc.explain(q, k, v, position=scheme, causal=True).path == "flex"
    leaves = [q, k, v, *scheme.parameters()]
    got = attention(q, k, v, position=scheme, causal=True)
    want = attention(q, k, v, position=scheme, causal=True, backend="math")
    pos = torch.arange(12, device="cuda")[None]
    logit = logit_size(q, k, scheme, pos, pos)
    assert_close(got, want, magnitude=float(v.abs().max()), terms=12, logit=logit)
    for a, b in zip(
        torch.autograd.grad(got.sum(), leaves, allow_unused=True),
        torch.autograd.grad(want.sum(), leaves, allow_unused=True),
        strict=True,
    ):
        if b is not None:  # a gradient sums n terms of the size of the largest
            assert_close(a, b, magnitude=float(b.abs().max()), terms=2 * 12, logit=logit)


@pytest.mark.compile
def test_flex_on_cpu_serves_a_learned_scheme_forward_and_its_backward_says_why_not():
    """A T5 table that requires grad, captured by the score_mod, failed to compile on CPU
    even in a forward; the forward runs without a graph, and a backward names the fix."""
    torch.manual_seed(0)
    m = posenc.MultiHeadAttention(16, 2, position=posenc.T5RelativeBias(2), backend="flex")
    x = torch.randn(1, 32, 16, requires_grad=True)
    out = m(x, causal=True)
    m.backend = "math"
    torch.testing.assert_close(out, m(x, causal=True), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="backend='flex' has no backward on CPU"):
        out.sum().backward()
    # the table alone asks for a gradient (a frozen backbone): the backward still says why
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    out = attention(q, k, v, position=m.position, causal=True, backend="flex")
    with pytest.raises(RuntimeError, match="backend='flex' has no backward on CPU"):
        out.sum().backward()
    # under no_grad, inputs that require grad are served (nothing to differentiate)
    with torch.no_grad():
        attention(q.requires_grad_(), k, v, position=m.position, causal=True, backend="flex")


def test_a_documents_mask_shared_by_the_batch_reads_its_one_row():
    from posenc.engine import Mask

    docs = torch.tensor([[0, 0, 1, 1]])  # [1, n]: shared by a batch of 2
    mod = Mask(4, 4, q_doc=docs, k_doc=docs).flex_mask_mod()
    b, h = torch.arange(2)[:, None, None, None], torch.zeros(1, 1, 1, 1, dtype=torch.long)
    keep = mod(b, h, torch.arange(4)[None, None, :, None], torch.arange(4)[None, None, None, :])
    keep = keep.expand(2, 1, 4, 4)  # the batch index is not read: broadcast
    assert torch.equal(keep[1, 0], docs[0][:, None] == docs[0])


@pytest.mark.compile
def test_flex_on_cpu_is_right_for_few_channels_at_lengths_eight_past_sixteen():
    """torch 2.13's compiled CPU FlexAttention returned NaN or wrong rows for q and k of 8
    or 16 channels when both lengths are 8 more than a multiple of 16; posenc widens them
    with zero channels, which change no score (a term's score_mod reads its own q)."""
    torch.manual_seed(0)
    for d in (16, 8):  # one compiled graph: both widened to the same channels
        q, k, v = (torch.randn(1, 2, 24, d) for _ in range(3))
        got = attention(q, k, v, backend="flex")
        torch.testing.assert_close(got, attention(q, k, v, backend="math"), rtol=0, atol=1e-5)
    scheme = posenc.ShawRelativePosition(16, 3, values=False)  # a query term: reads q itself
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    got = attention(q, k, v, position=scheme, backend="flex")
    want = attention(q, k, v, position=scheme, backend="math")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
