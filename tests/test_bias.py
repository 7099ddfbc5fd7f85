"""Place 3 against HF transformers (Swin, T5), the ALiBi paper's rule, and loops."""

from __future__ import annotations

import math

import pytest
import torch

from posenc import (
    ALiBi,
    MultiHeadAttention,
    RelativePositionBias,
    T5RelativeBias,
    alibi_slopes,
    load_relative_position_bias,
    relative_position_index,
    resize_relative_position_table,
    t5_bucket,
)

transformers = pytest.importorskip("transformers")


# ----- Swin ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [(3, 3), (2, 5), (7, 7)])
def test_swin_bias_equals_hf(window):
    from transformers.models.swin.modeling_swin import SwinRelativePositionBias

    torch.manual_seed(0)
    oracle = SwinRelativePositionBias(4, window)
    torch.nn.init.normal_(oracle.relative_position_bias_table)
    ours = RelativePositionBias(window, 4)
    ours.load_state_dict({"table": oracle.relative_position_bias_table.detach()})
    torch.testing.assert_close(ours(), oracle()[0], atol=0, rtol=0)


def test_swin_bias_by_definition_loop_and_1d():
    torch.manual_seed(0)
    wh, ww, heads = 2, 3, 2
    bias = RelativePositionBias((wh, ww), heads)
    dense = bias()
    for i in range(wh * ww):
        for j in range(wh * ww):
            dr, dc = i // ww - j // ww, i % ww - j % ww  # query minus key (Swin)
            row = (dr + wh - 1) * (2 * ww - 1) + dc + ww - 1
            torch.testing.assert_close(dense[:, i, j], bias.table[row])
    one = RelativePositionBias(4, heads)
    assert one.table.shape == (7, heads)
    for i in range(4):
        for j in range(4):
            torch.testing.assert_close(one()[:, i, j], one.table[i - j + 3])


def test_swin_2d_grid_table_and_whole_window_bias_equal_the_definition():
    """The 2-D table's grid of every offset is its rows reversed (read directly, not
    through the primitive), and the bias of the whole window in order (its pairs' rows kept
    between calls) equals Swin's rule pair by pair; a subclass's primitive is used."""
    from posenc import GridBias

    torch.manual_seed(0)
    wh, ww, heads = 3, 4, 2
    bias = RelativePositionBias((wh, ww), heads)
    torch.testing.assert_close(
        bias.grid_table(), GridBias.grid_table(bias), atol=0, rtol=0
    )  # the family's form: the primitive on every offset
    tokens = torch.arange(wh * ww)[None]
    for q_pos, k_pos in ((tokens, tokens), (tokens, tokens.clone()), (tokens.flip(-1), tokens)):
        dense = bias.score_bias(q_pos, k_pos)[0]  # [h, N, N]
        for i, p in enumerate(q_pos[0].tolist()):
            for j, r in enumerate(k_pos[0].tolist()):
                dr, dc = p // ww - r // ww, p % ww - r % ww  # query minus key (Swin)
                row = (dr + wh - 1) * (2 * ww - 1) + dc + ww - 1
                torch.testing.assert_close(dense[:, i, j], bias.table[row], atol=0, rtol=0)

    class Doubled(type(bias)):
        def bias(self, rows, cols):
            return 2 * super().bias(rows, cols)

    doubled = Doubled((wh, ww), heads)
    doubled.load_state_dict(bias.state_dict())
    torch.testing.assert_close(doubled.grid_table(), 2 * bias.grid_table(), atol=0, rtol=0)
    torch.testing.assert_close(
        doubled.score_bias(tokens, tokens), 2 * bias.score_bias(tokens, tokens), atol=0, rtol=0
    )


def test_swin_hook_positions_block_and_errors():
    torch.manual_seed(0)
    bias = RelativePositionBias((3, 4), 2)
    dense = bias()
    tokens = torch.arange(12)[None]
    torch.testing.assert_close(bias.score_bias(tokens, tokens)[0], dense)
    block = bias.score_bias(tokens[:, 4:8], tokens)  # a block of queries against all keys
    torch.testing.assert_close(block[0], dense[:, 4:8])
    with pytest.raises(
        ValueError, match=r"q_pos must be in \[0, 12\) \(token indices of a \(3, 4\) window\)"
    ):
        bias.score_bias(torch.tensor([[12]]), tokens)
    with pytest.raises(
        ValueError, match="RelativePositionBias was built for heads=2 but the attention has heads=4"
    ):
        bias.validate_attention(heads=4, head_dim=8)
    with pytest.raises(ValueError, match=r"window must be an int W or a pair \(Wh, Ww\)"):
        RelativePositionBias((1, 2, 3), 2)


def swin_1d_reference(table, q_pos, k_pos):
    """``B[h, i, j] = table[q_pos_i - k_pos_j + W - 1, h]`` for one sequence, by a loop."""
    width = (table.shape[0] + 1) // 2
    out = torch.empty(table.shape[1], len(q_pos), len(k_pos))
    for i, qp in enumerate(q_pos.tolist()):
        for j, kp in enumerate(k_pos.tolist()):
            out[:, i, j] = table[qp - kp + width - 1]
    return out


def test_swin_1d_positions_are_checked_and_biased_per_sequence():
    """Regression: the span of positions was measured across the whole batch, so two
    sequences that each fit the window (0..19 and 100..119, window 20) were rejected."""
    torch.manual_seed(0)
    bias = RelativePositionBias(20, 2)
    table = bias.table.detach()
    pos = torch.stack([torch.arange(20), torch.arange(100, 120)])  # [2, 20]
    cases = [
        (pos, pos),  # self-attention
        (pos[:, -1:], pos),  # decoding: the last query of each sequence against its keys
        (pos[:, 5:9], pos[:, 2:]),  # a block of queries against a run of keys
    ]
    for q_pos, k_pos in cases:
        got = bias.score_bias(q_pos, k_pos)  # [2, h, n_q, n_k]
        assert got.shape == (2, 2, q_pos.shape[1], k_pos.shape[1])
        for row in range(2):
            expected = swin_1d_reference(table, q_pos[row], k_pos[row])
            torch.testing.assert_close(got[row].detach(), expected, atol=0, rtol=0)
    # the rule is per sequence: sequence 1 alone reaches 21 apart (query 119, key 98)
    far = torch.stack([torch.arange(20), torch.arange(98, 118)])
    with pytest.raises(
        ValueError,
        match=r"positions are up to 21 apart in sequence 1 of the batch but this 1-D "
        r"RelativePositionBias has window=20 \(offsets up to 19\); build it with a window of "
        r"at least 22 or \.resize\(22\)",
    ):
        bias.score_bias(pos[:, -1:], far)
    with pytest.raises(ValueError, match=r"positions are up to 20 apart but"):
        bias.score_bias(torch.tensor([[20]]), torch.arange(20)[None])  # shared: no row named


def test_swin_1d_attention_with_far_apart_sequences_equals_each_alone():
    """Through MultiHeadAttention: each sequence gets the output it gets on its own (the
    bias is relative, so positions 100..119 act as 0..19)."""
    torch.manual_seed(1)
    attention = MultiHeadAttention(8, 2, position=RelativePositionBias(20, 2)).eval()
    x = torch.randn(2, 20, 8)
    pos = torch.stack([torch.arange(20), torch.arange(100, 120)])
    with torch.no_grad():
        got = attention(x, positions=pos)
        alone = torch.cat([attention(x[row : row + 1]) for row in range(2)])
    # the same logits up to rounding (the paths may differ); the outputs are mixes of
    # values of size max|v|: a few roundings of max|out| and of the logits' error
    eps = torch.finfo(torch.float32).eps
    atol = 16 * eps * float(alone.abs().max())
    torch.testing.assert_close(got, alone, atol=atol, rtol=0)


def test_swin_1d_dense_bias_needs_no_index_and_equals_swins():
    """The 1-D bias is read along the diagonals (no [W, W] index); it is Swin's gather."""
    torch.manual_seed(2)
    bias = RelativePositionBias(5, 3)
    assert not list(bias.buffers())
    expected = torch.nn.functional.embedding(relative_position_index(5), bias.table)
    torch.testing.assert_close(bias(), expected.permute(2, 0, 1), atol=0, rtol=0)
    # gradients: integer-valued, so every sum is exact whatever its order
    grad = torch.randint(-4, 5, (3, 5, 5)).float()
    (table_grad,) = torch.autograd.grad(bias(), bias.table, grad)
    (expected_grad,) = torch.autograd.grad(expected.permute(2, 0, 1), bias.table, grad)
    assert torch.equal(table_grad, expected_grad)


def test_swin_1d_rows_of_a_run_of_offsets_are_a_reversed_slice(monkeypatch):
    """Offsets that run_offsets built (known as a run without reading them) inside the
    window take the table's rows as a reversed slice (no gather), a tensor of their own,
    with the values and the table's gradient of the gather; the same offsets built
    elsewhere, a run written into, and traced offsets are gathered."""
    from posenc import bias as bias_module
    from posenc.indices import run_offsets

    torch.manual_seed(0)
    scheme = RelativePositionBias(6, 3).double()  # offsets -5 .. 5, row W - 1 - offset
    table = scheme.table
    offsets = run_offsets(torch.arange(2, 5)[None], torch.arange(6)[None])  # -4 .. 3
    selected = []
    original = bias_module.select_rows
    monkeypatch.setattr(bias_module, "select_rows", lambda *a: selected.append(1) or original(*a))
    rows = scheme.bias(offsets)  # [8, h]
    assert selected == []
    assert torch.equal(rows, torch.stack([table[5 - o] for o in range(-4, 4)]))
    assert rows.untyped_storage().data_ptr() != table.untyped_storage().data_ptr()
    gathered = scheme.bias(torch.arange(-4, 4))  # not known as a run
    assert selected == [1] and torch.equal(rows, gathered)
    grad = torch.randn_like(rows)
    (slice_grad,) = torch.autograd.grad(rows, table, grad)
    (gather_grad,) = torch.autograd.grad(gathered, table, grad)
    assert torch.equal(slice_grad, gather_grad)
    scheme.requires_grad_(False)  # (a trace takes the table as a constant)
    traced = torch.jit.trace(lambda o: scheme.bias(o), (offsets,), check_trace=False)
    assert selected == [1, 1]  # a gather, recorded for any offsets
    assert torch.equal(traced(torch.arange(-5, 3)), scheme.bias(torch.arange(-5, 3)))
    offsets[0] = 3  # written into: gathered again
    assert torch.equal(scheme.bias(offsets)[0], table[2])


def test_swin_gradient_reaches_table():
    bias = RelativePositionBias((2, 2), 2).double()
    tokens = torch.arange(4)[None]
    table = bias.table.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda t: _with_table(bias, t).score_bias(tokens, tokens), (table,)
    )


def _with_table(module, table):
    clone = RelativePositionBias(module.window, module.heads).double()
    del clone.table
    clone.table = table
    return clone


def test_resize_identity_and_smooth():
    torch.manual_seed(0)
    bias = RelativePositionBias((7, 7), 3)
    before = bias.table.detach().clone()
    bias.resize((7, 7))
    torch.testing.assert_close(bias.table.detach(), before, atol=0, rtol=0)

    def surface(u, v):  # a smooth function of the old grid's (row, column) index
        return torch.sin(u / 4.0)[:, None] + torch.cos(v / 3.0)[None, :]

    old = surface(torch.arange(13.0), torch.arange(13.0))  # [13, 13] offsets of a 7x7 window
    table = old.reshape(-1, 1).expand(-1, 3).contiguous()
    resized = resize_relative_position_table(table, (7, 7), (12, 12))
    assert resized.shape == (23 * 23, 3)
    # align_corners=False: new index k samples the old grid at (k + 0.5) * 13 / 23 - 0.5
    where = (torch.arange(23.0) + 0.5) * 13 / 23 - 0.5
    expected = surface(where, where)
    got = resized[:, 0].reshape(23, 23)
    inner = slice(2, -2)  # bicubic clamps at the border
    assert (got[inner, inner] - expected[inner, inner]).abs().max() < 0.03  # bicubic, a=-0.75
    assert (got[11, 11] - old[6, 6]).abs() < 1e-6  # offset (0, 0) stays exact
    constant = resize_relative_position_table(torch.full((169, 2), 0.7), (7, 7), (12, 12))
    torch.testing.assert_close(constant, torch.full((529, 2), 0.7))
    bias.resize((12, 12))
    assert (
        bias.window == (12, 12) and bias.index.shape == (144, 144) and bias().shape == (3, 144, 144)
    )


def test_load_7x7_checkpoint_into_12x12_module():
    torch.manual_seed(0)
    checkpoint = RelativePositionBias((7, 7), 4).state_dict()["table"]
    module = RelativePositionBias((12, 12), 4)
    with pytest.raises(RuntimeError, match="size mismatch"):
        module.load_state_dict({"table": checkpoint})  # the classic complaint
    load_relative_position_bias(module, checkpoint)
    torch.testing.assert_close(
        module.table.detach(), resize_relative_position_table(checkpoint, (7, 7), (12, 12))
    )
    # the centre offset (0, 0) keeps its value: it sits on both grids' centre
    centre_old, centre_new = (13 * 6 + 6), (23 * 11 + 11)
    assert (module.table[centre_new] - checkpoint[centre_old]).abs().max() < 0.05
    with pytest.raises(ValueError, match=r"table must have shape \[rows, heads=4\]"):
        load_relative_position_bias(module, torch.zeros(169, 3))
    with pytest.raises(ValueError, match="cannot infer the window of a table with 170 rows"):
        load_relative_position_bias(module, torch.zeros(170, 4))
    load_relative_position_bias(
        RelativePositionBias((6, 8), 4), torch.zeros(11 * 9, 4), old_window=(6, 5)
    )


# ----- T5 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 20), (16, 64)])
def test_t5_bucket_equals_hf_for_every_offset(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 301)[:, None] + torch.zeros(1, 3, dtype=torch.long)
    expected = T5Attention._relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    got = t5_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert torch.equal(got, expected)


@pytest.mark.parametrize("decoder", [False, True])
def test_t5_compute_bias_equals_hf(decoder):
    from transformers.models.t5.modeling_t5 import T5Attention

    torch.manual_seed(0)
    config = transformers.T5Config(d_model=32, d_kv=8, num_heads=4, is_decoder=decoder)
    oracle = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    ours = T5RelativeBias(4, num_buckets=32, max_distance=128, bidirectional=not decoder)
    ours.embedding.load_state_dict(oracle.relative_attention_bias.state_dict())
    for q_len, k_len, offset in [(10, 10, 0), (1, 21, 20), (5, 300, 295), (3, 7, 0)]:
        expected = oracle.compute_bias(q_len, k_len, past_seen_tokens=offset)[0]
        torch.testing.assert_close(ours(q_len, k_len, offset), expected, atol=0, rtol=0)


def test_t5_hook_translation_and_block():
    torch.manual_seed(0)
    bias = T5RelativeBias(2, num_buckets=8, max_distance=16)
    pos = torch.arange(20)[None]
    full = bias.score_bias(pos, pos)
    torch.testing.assert_close(bias.score_bias(pos + 1000, pos + 1000), full)
    torch.testing.assert_close(bias.score_bias(pos[:, 5:9], pos), full[:, :, 5:9])
    batched = bias.score_bias(torch.stack([pos[0], pos[0] + 3]), torch.stack([pos[0], pos[0] + 3]))
    assert batched.shape == (2, 2, 20, 20)
    torch.testing.assert_close(batched[1:], full)


def test_t5_gradcheck():
    bias = T5RelativeBias(2, num_buckets=8, max_distance=16).double()
    pos = torch.arange(6)[None]
    weight = bias.embedding.weight.detach().clone().requires_grad_()

    def f(w):
        buckets = t5_bucket(pos[0][None, :] - pos[0][:, None], num_buckets=8, max_distance=16)
        return torch.nn.functional.embedding(buckets, w)

    assert torch.autograd.gradcheck(f, (weight,))
    bias.score_bias(pos, pos).sum().backward()
    assert bias.embedding.weight.grad.abs().sum() > 0


def test_t5_errors():
    with pytest.raises(ValueError, match="num_buckets=2 is too small for bidirectional=True"):
        T5RelativeBias(2, num_buckets=2)
    with pytest.raises(ValueError, match="max_distance must exceed the exact range 8"):
        T5RelativeBias(2, num_buckets=32, max_distance=8)
    with pytest.raises(ValueError, match="offset must be >= 0, got -1"):
        T5RelativeBias(2)(3, 3, -1)
    with pytest.raises(TypeError, match="q_len must be an int"):
        T5RelativeBias(2)(3.0, 3)


# ----- FlexAttention score_mods -----------------------------------------------------------------


SCORE_MOD_SCHEMES = {
    "alibi": lambda h, n: ALiBi(h),
    "t5": lambda h, n: T5RelativeBias(h, num_buckets=8, max_distance=16),
    "swin-2d": lambda h, n: RelativePositionBias((2, n // 2), h),
    "swin-1d": lambda h, n: RelativePositionBias(n, h),
}


@pytest.mark.parametrize("name", SCORE_MOD_SCHEMES)
@pytest.mark.parametrize(
    "positions",
    [
        torch.stack([torch.arange(8), torch.arange(8).flip(0)]),  # [b, n]: per sequence
        torch.arange(8)[None],  # [1, n]: shared by the batch
        torch.arange(8),  # [n]: shared by the batch
    ],
    ids=["per-sequence", "shared", "shared-1d"],
)
def test_score_mod_equals_dense_bias(name, positions):
    torch.manual_seed(0)
    b, h, n = 2, 3, 8
    scheme = SCORE_MOD_SCHEMES[name](h, n)
    q_pos = positions if positions.ndim == 2 else positions[None]
    score = torch.randn(b, h, n, n)
    mod = scheme.flex_score_mod(positions, positions)
    bi = torch.arange(b)[:, None, None, None]
    hi = torch.arange(h)[None, :, None, None]
    qi = torch.arange(n)[None, None, :, None]
    ki = torch.arange(n)[None, None, None, :]
    got = mod(score, bi, hi, qi, ki)
    expected = score + scheme.score_bias(q_pos, q_pos)  # [b, h, n, n] + [B', h, n, n]
    # one addition of the same two float32 numbers (ALiBi: and one product)
    atol = 2 * torch.finfo(torch.float32).eps * float(expected.detach().abs().max())
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


def test_score_mod_position_errors():
    with pytest.raises(TypeError, match=r"q_pos must be an integer tensor .* q_pos.long\(\)"):
        ALiBi(2).flex_score_mod(torch.arange(4.0), torch.arange(4))
    with pytest.raises(ValueError, match=r"k_pos must have shape \[n\], \[1, n\] .*got shape"):
        T5RelativeBias(2).flex_score_mod(torch.arange(4), torch.zeros(1, 2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="q_pos has batch size 2 but k_pos has batch size 3"):
        ALiBi(2).flex_score_mod(torch.zeros(2, 4, dtype=torch.long), torch.zeros(3, 4).long())
    with pytest.raises(ValueError, match=r"k_pos must be in \[0, 8\)"):
        RelativePositionBias((2, 4), 2).flex_score_mod(torch.arange(8), torch.arange(1, 9))
    with pytest.raises(ValueError, match="positions are up to 8 apart"):
        RelativePositionBias(8, 2).flex_score_mod(torch.arange(8), torch.arange(1, 9))


def attention_atol(q, k, v, scores):
    """A float32 bound on the error of ``softmax(scores) @ v`` from its magnitudes.

    Each logit is a ``d``-term dot product (error up to ``d * eps * |q_i| |k_j|`` times the
    scale) plus a bias (``eps * |score|``); a logit error ``delta`` moves the output by at
    most ``2 * delta * max|v|``, and the weighted sum over ``n`` keys adds ``n * eps * max|v|``.
    """
    eps = torch.finfo(torch.float32).eps
    d, n = q.shape[-1], k.shape[-2]
    dot = q.norm(dim=-1).max() * k.norm(dim=-1).max() / math.sqrt(d)
    logit = eps * (d * dot + scores.abs().max())
    return float((2 * logit + n * eps) * v.abs().max())


@pytest.mark.compile
@pytest.mark.parametrize("name", SCORE_MOD_SCHEMES)
def test_compiled_flex_attention_with_positions_shared_by_the_batch(name):
    """Regression: a score_mod read ``q_pos[b, q_idx]``, out of range for ``b >= 1`` when the
    positions are shared (``[1, n]``); FlexAttention raised IndexError."""
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    b, h, n, d = 2, 2, 16, 8
    scheme = SCORE_MOD_SCHEMES[name](h, n)
    if isinstance(scheme, RelativePositionBias):
        torch.nn.init.normal_(scheme.table)  # a bias that matters next to q.k
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    pos = torch.arange(n)[None]  # [1, n]: shared by both sequences
    # dynamic=False, as the engine compiles it: with automatic dynamic shapes, the second
    # table size recompiles symbolically and Inductor's CPU flex template fails to build
    # (torch 2.13: "cur_qSplitSize4 was not declared")
    compiled = torch.compile(flex_attention, dynamic=False)
    with torch.no_grad():
        got = compiled(q, k, v, score_mod=scheme.flex_score_mod(pos, pos))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + scheme.score_bias(pos, pos)
        expected = scores.softmax(-1) @ v
    torch.testing.assert_close(got, expected, atol=attention_atol(q, k, v, scores), rtol=0)


def test_meta_construction_and_state():
    with torch.device("meta"):
        swin = RelativePositionBias((3, 3), 2)
        t5 = T5RelativeBias(2)
    swin.to_empty(device="cpu")
    swin.reset_parameters()
    torch.testing.assert_close(swin.index, RelativePositionBias((3, 3), 2).index)
    assert list(swin.state_dict()) == ["table"]
    assert list(t5.state_dict()) == ["embedding.weight"]


# ----- the families the schemes belong to --------------------------------------------------


def test_each_bias_is_one_primitive_of_its_family():
    """ALiBi, T5 and a 1-D Swin table are offset biases, a 2-D Swin table a grid bias; the
    class the constructor picks is still a RelativePositionBias and loads Swin's table."""
    from posenc import GridBias, OffsetBias
    from posenc.bias import RelativePositionBias1D, RelativePositionBias2D

    one, two = RelativePositionBias(8, 2), RelativePositionBias((2, 3), 2)
    assert isinstance(one, RelativePositionBias1D) and isinstance(one, OffsetBias)
    assert isinstance(two, RelativePositionBias2D) and isinstance(two, GridBias)
    assert isinstance(one, RelativePositionBias) and isinstance(two, RelativePositionBias)
    assert isinstance(ALiBi(2), OffsetBias) and isinstance(T5RelativeBias(2), OffsetBias)
    offsets = torch.tensor([[-7, 0], [3, 7]])
    torch.testing.assert_close(one.bias(offsets), one.table[7 - offsets], atol=0, rtol=0)
    slopes = alibi_slopes(2)
    expected = -offsets.abs().float()[..., None] * slopes
    torch.testing.assert_close(ALiBi(2).bias(offsets), expected, atol=0, rtol=0)
    t5 = T5RelativeBias(2, num_buckets=8, max_distance=16)
    buckets = t5_bucket(offsets, num_buckets=8, max_distance=16)
    torch.testing.assert_close(t5.bias(offsets), t5.embedding.weight[buckets], atol=0, rtol=0)
    dr, dc = torch.tensor([-1, 0, 1]), torch.tensor([2, 0, -2])
    rows = (1 - dr) * 5 + (2 - dc)  # Swin's row: query minus key
    torch.testing.assert_close(two.bias(dr, dc), two.table[rows], atol=0, rtol=0)
    with pytest.raises(
        ValueError, match=r"RelativePositionBias2D takes a 2-D window, got window=5"
    ):
        RelativePositionBias2D(5, 2)


@pytest.mark.parametrize("name", ["alibi", "t5", "swin-1d"])
def test_score_mod_computing_the_bias_per_pair_equals_the_dense_bias(monkeypatch, name):
    """Where the offsets cannot be read to build a table (a GPU without a sync), the
    score_mod computes the primitive per pair and picks the head: the same bias."""
    import posenc.families.biases as biases

    monkeypatch.setattr(biases, "offset_span", lambda *args: None)
    torch.manual_seed(0)
    b, h, n = 2, 3, 8
    scheme = SCORE_MOD_SCHEMES[name](h, n)
    positions = torch.stack([torch.arange(8), torch.arange(8).flip(0)])
    score = torch.randn(b, h, n, n)
    index = [torch.arange(s).view([-1 if a == d else 1 for a in range(4)]) for d, s in
             enumerate((b, h, n, n))]  # fmt: skip
    got = scheme.flex_score_mod(positions, positions)(score, *index)
    expected = score + scheme.score_bias(positions, positions)
    atol = 2 * torch.finfo(torch.float32).eps * float(expected.detach().abs().max())
    torch.testing.assert_close(got.detach(), expected.detach(), atol=atol, rtol=0)


@pytest.mark.parametrize("scheme", ["t5", "t5-decoder", "alibi"])
def test_the_per_offset_bias_of_a_run_is_kept_and_equals_the_familys(monkeypatch, scheme):
    """T5's buckets and ALiBi's bias (the paper's slopes) of a run of offsets are kept
    between calls: the values equal the family's form (the primitive on each offset), for
    runs that start before, at and after the query; a run longer than the kept ones is
    built in each call, the same."""
    import posenc.alibi as alibi_module
    import posenc.bias as bias_module
    from posenc.families import OffsetBias

    bucketed = []  # the runs T5 computes buckets for
    bucket = bias_module.t5_bucket
    monkeypatch.setattr(
        bias_module,
        "t5_bucket",
        lambda rel, **kw: bucketed.append(rel.numel()) or bucket(rel, **kw),
    )
    sloped = []  # the times ALiBi's bias of a run (or a primitive) is computed
    slopes = alibi_module._paper_slopes
    monkeypatch.setattr(
        alibi_module, "_paper_slopes", lambda *args: sloped.append(args) or slopes(*args)
    )
    bias_module._run_buckets.cache_clear()
    alibi_module._paper_run_bias.cache_clear()

    def built(run):  # how many runs were computed so far
        return len(sloped if scheme == "alibi" else bucketed)

    module = {
        "t5": T5RelativeBias(4, num_buckets=8, max_distance=20),
        "t5-decoder": T5RelativeBias(4, num_buckets=8, max_distance=20, bidirectional=False),
        "alibi": ALiBi(4),
    }[scheme]
    for q_start, k_start, n_q, n_k in ((0, 0, 7, 7), (30, 0, 1, 31), (5, 40, 3, 9)):
        q_pos = torch.arange(q_start, q_start + n_q)[None]
        k_pos = torch.arange(k_start, k_start + n_k)[None]
        got = module.offset_bias(q_pos, k_pos)
        assert torch.equal(got, OffsetBias.offset_bias(module, q_pos, k_pos))
        before = built(got)
        assert built(module.offset_bias(q_pos.clone(), k_pos.clone())) == before
    long = torch.arange(5000)[None]  # 9999 offsets: above the kept runs
    got = module.offset_bias(long, long)
    assert torch.equal(got, OffsetBias.offset_bias(module, long, long))
    before = built(got)
    assert built(module.offset_bias(long, long)) != before


def test_a_learned_or_subclassed_bias_is_not_kept():
    """Learned ALiBi slopes change in training, and a subclass's own ``slopes`` or ``bias``
    (or one set on the instance) is its own: each takes the family's form, which reads them
    in each call. What a call returns is the caller's: writing into it changes nothing
    kept."""

    class Steeper(ALiBi):
        def bias(self, offsets):
            return 2 * super().bias(offsets)

    class Capped(T5RelativeBias):
        def bias(self, offsets):
            return super().bias(offsets).clamp(max=0.0)

    class Halved(ALiBi):
        def slopes(self, device=None):
            return super().slopes(device) / 2

    pos = torch.arange(6)[None]
    assert torch.equal(Steeper(2).offset_bias(pos, pos), 2 * ALiBi(2).offset_bias(pos, pos))
    for form in ("offset_bias", "score_bias"):
        halved = getattr(Halved(2), form)(pos, pos)
        assert torch.equal(halved, getattr(ALiBi(2), form)(pos, pos) / 2)
        assert torch.equal(Halved(2).bias(pos[0] - 2), ALiBi(2).bias(pos[0] - 2) / 2)
    capped = Capped(2, num_buckets=8, max_distance=20)
    plain = T5RelativeBias(2, num_buckets=8, max_distance=20)
    plain.load_state_dict(capped.state_dict())
    assert torch.equal(capped.offset_bias(pos, pos), plain.offset_bias(pos, pos).clamp(max=0.0))
    on_instance = ALiBi(2)  # set on the instance: the same as a subclass's
    on_instance.slopes = lambda device=None: torch.tensor([1.0, 2.0], device=device)
    assert torch.equal(on_instance.offset_bias(pos, pos)[1, :3], torch.tensor([-10.0, -8, -6]))
    table = T5RelativeBias(2, num_buckets=8, max_distance=20)
    table.bias = lambda offsets: torch.zeros(*offsets.shape, 2)
    assert table(4, 4).abs().max() == 0
    kept = ALiBi(2).offset_bias(pos, pos)
    kept.mul_(0)  # the caller's copy: nothing kept changes
    assert torch.equal(ALiBi(2).offset_bias(pos, pos), Steeper(2).offset_bias(pos, pos) / 2)
    learned = ALiBi(2, learned=True)
    with torch.no_grad():
        learned.log_slopes.add_(1.0)
    assert torch.equal(learned.offset_bias(pos, pos), math.e * ALiBi(2).offset_bias(pos, pos))
    learned.offset_bias(pos, pos).sum().backward()
    assert learned.log_slopes.grad is not None
