"""Place 2 against float64 references written here, rotary-embedding-torch and HF Llama."""

from __future__ import annotations

import math

import pytest
import torch

from posenc import KVCache, MultiHeadAttention, sinusoidal_shift
from posenc.rotary import (
    DynamicNTKScaling,
    LinearScaling,
    NTKScaling,
    Rotary,
    Rotary2D,
    YaRNScaling,
    apply_rotary,
)
from tolerances import assert_close


def atol32(x):
    """A float32 rotation of ``x``: cos and sin rounded once, two products and a sum, each
    within half an ulp of values up to ``max|x|``; 8 ulps of ``max|x|`` bound them all."""
    return 8 * torch.finfo(torch.float32).eps * float(x.abs().max())


def reference_rope(x, positions, *, base=10000.0, interleaved=False, rotary_dim=None):
    """Rotate each pair by p * theta_i with an explicit 2x2 matrix, float64, loops."""
    n, d = x.shape[2:]
    r = d if rotary_dim is None else rotary_dim
    out = x.double().clone()
    for i in range(r // 2):
        theta = base ** (-2 * i / r)
        a, c = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
        for t in range(n):
            angle = float(positions[t]) * theta
            rot = torch.tensor(
                [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]],
                dtype=torch.float64,
            )
            pair = torch.stack((x[:, :, t, a], x[:, :, t, c]), -1).double()  # [b, h, 2]
            new = pair @ rot.T
            out[:, :, t, a], out[:, :, t, c] = new[..., 0], new[..., 1]
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_matches_float64_reference(interleaved, rotary_dim):
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    rq, rk = Rotary(8, interleaved=interleaved, rotary_dim=rotary_dim)(q, k, offset=3)
    positions = torch.arange(7) + 3
    expected = reference_rope(q, positions, interleaved=interleaved, rotary_dim=rotary_dim)
    assert_close(rq, expected, terms=4)
    expected_k = reference_rope(k, positions, interleaved=interleaved, rotary_dim=rotary_dim)
    assert_close(rk, expected_k, terms=4)


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_interleaved_matches_rotary_embedding_torch(rotary_dim):
    rotary_embedding_torch = pytest.importorskip("rotary_embedding_torch")
    torch.manual_seed(0)
    q = torch.randn(2, 3, 20, 16)
    oracle = rotary_embedding_torch.RotaryEmbedding(dim=rotary_dim)
    got, _ = Rotary(16, interleaved=True, rotary_dim=rotary_dim)(q, q)
    # the oracle rounds its angles (up to position 19) in float32
    assert_close(
        got, oracle.rotate_queries_or_keys(q), magnitude=float(q.abs().max()) * 19, terms=4
    )


def _llama(rope_parameters, heads=3, head_dim=16, max_len=32):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        max_position_embeddings=max_len,
        rope_parameters={"rope_theta": 10000.0, **rope_parameters},
    )
    return LlamaRotaryEmbedding(config), apply_rotary_pos_emb


@pytest.mark.parametrize(
    ("rope_parameters", "scaling"),
    [
        ({"rope_type": "default"}, None),
        ({"rope_type": "linear", "factor": 4.0}, LinearScaling(4.0)),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
            YaRNScaling(4.0, 32),
        ),
        ({"rope_type": "dynamic", "factor": 2.0}, DynamicNTKScaling(2.0, 32)),
    ],
    ids=["default", "linear", "yarn", "dynamic"],
)
def test_half_split_matches_hf_llama(rope_parameters, scaling):
    embedding, apply = _llama(rope_parameters)
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 20, 16), torch.randn(2, 3, 20, 16)
    positions = torch.arange(20)[None].expand(2, 20) + torch.tensor([[0], [40]])
    cos, sin = embedding(q, positions)
    hq, hk = apply(q, k, cos, sin)

    def size(x, p):  # HF rounds its angles in float32: their error grows with the position
        return float(x.abs().max()) * max(1, int(p.max()))

    if scaling is not None and scaling.dynamic:
        for row in range(2):  # HF's dynamic length is per call: compare row by row
            cos, sin = embedding(q[row : row + 1], positions[row : row + 1])
            hq_row, hk_row = apply(q[row : row + 1], k[row : row + 1], cos, sin)
            rq, rk = Rotary(16, scaling=scaling)(
                q[row : row + 1], k[row : row + 1], positions[row], positions[row]
            )
            assert_close(rq, hq_row, magnitude=size(q, positions[row]), terms=4)
            assert_close(rk, hk_row, magnitude=size(k, positions[row]), terms=4)
        return
    rq, rk = Rotary(16, scaling=scaling)(q, k, positions, positions)
    assert_close(rq, hq, magnitude=size(q, positions), terms=4)
    assert_close(rk, hk, magnitude=size(k, positions), terms=4)


def test_ntk_scaling_is_a_larger_base():
    torch.manual_seed(0)
    q = torch.randn(1, 1, 5, 8)
    got, _ = Rotary(8, scaling=NTKScaling(4.0))(q, q)
    expected = reference_rope(q, torch.arange(5), base=10000.0 * 4.0 ** (8 / 6))
    assert_close(got, expected, terms=4)


@pytest.mark.parametrize("interleaved", [False, True])
def test_relative_property(interleaved):
    """(R_m q) . (R_n k) depends only on n - m."""
    torch.manual_seed(0)
    rope = Rotary(16, interleaved=interleaved)
    q, k = (
        torch.randn(1, 1, 1, 16, dtype=torch.float64),
        torch.randn(1, 1, 1, 16, dtype=torch.float64),
    )
    scores = {}
    for m, n in [(0, 5), (10, 15), (1000, 1005), (3, 1), (103, 101)]:
        rq, rk = rope(q, k, torch.tensor([m]), torch.tensor([n]))
        scores.setdefault(n - m, []).append(float((rq * rk).sum()))
    for values in scores.values():
        assert max(values) - min(values) < 1e-9


def test_pairs_are_the_sinusoidal_shift_blocks():
    """Interleaved RoPE at offset t is the transpose of sinusoidal_shift(t), pair by pair."""
    x = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    rotated, _ = Rotary(8, interleaved=True)(x, x, offset=7)
    shift = sinusoidal_shift(7, 8).double()
    assert_close(rotated[0, 0, 0], shift.T @ x[0, 0, 0], dtype=torch.float32, terms=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_keeps_dtype_and_accuracy(dtype):
    torch.manual_seed(0)
    q = torch.randn(1, 2, 6, 32)
    positions = torch.arange(6) + 100_000
    got, _ = Rotary(32)(q.to(dtype), q.to(dtype), positions, positions)
    assert got.dtype == dtype
    expected = reference_rope(q.to(dtype).double(), positions)
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.double(), expected, atol=4 * tol, rtol=2 * tol)


def test_large_positions_accurate_in_float32():
    torch.manual_seed(0)
    q = torch.randn(1, 1, 3, 16)
    positions = torch.tensor([999_998, 999_999, 1_000_000])
    got, _ = Rotary(16)(q, q, positions, positions)
    assert_close(got, reference_rope(q, positions), terms=4)


def test_module_cast_to_bf16_stays_accurate():
    rope = Rotary(16).to(torch.bfloat16)
    assert not list(rope.state_dict())
    q = torch.randn(1, 1, 4, 16)
    positions = torch.arange(4) + 5000
    got, _ = rope(q, q, positions, positions)
    assert_close(got, reference_rope(q, positions), terms=4)


def test_offset_decoding_equals_rows_of_full_rotation():
    torch.manual_seed(0)
    rope = Rotary(8)
    q = torch.randn(2, 2, 10, 8)
    full, _ = rope(q, q)
    for t in (0, 4, 9):
        step, _ = rope(q[:, :, t : t + 1], q[:, :, t : t + 1], offset=t)
        torch.testing.assert_close(step, full[:, :, t : t + 1])


def test_hook_with_batched_positions():
    torch.manual_seed(0)
    rope = Rotary(8)
    q = torch.randn(2, 2, 5, 8)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    rq, _ = rope.rotate(q, q, positions, positions)
    for row in range(2):
        expected = reference_rope(q[row : row + 1], positions[row])
        assert_close(rq[row : row + 1], expected, terms=4)


def test_yarn_attention_factor_and_dynamic_below_length():
    yarn = YaRNScaling(4.0, 64)
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    q = torch.randn(1, 1, 8, 16)
    plain, _ = Rotary(16)(q, q)
    dynamic, _ = Rotary(16, scaling=DynamicNTKScaling(2.0, 64))(q, q)
    torch.testing.assert_close(dynamic, plain)  # 8 tokens < 64: unchanged
    assert not Rotary(16, scaling=DynamicNTKScaling(2.0, 64)).supports_cache
    assert Rotary(16, scaling=NTKScaling(2.0)).supports_cache


# ----- Rotary2D ---------------------------------------------------------------------------------


def test_rotary2d_rows_then_columns():
    torch.manual_seed(0)
    height, width, d = 3, 4, 8
    q = torch.randn(1, 2, height * width, d)
    got, _ = Rotary2D(d)(q, q, size=(height, width))
    pos = torch.arange(height * width)
    rows = reference_rope(q[..., : d // 2], pos // width)
    cols = reference_rope(q[..., d // 2 :], pos % width)
    assert_close(got, torch.cat((rows, cols), -1), terms=4)


def test_rotary2d_scores_depend_on_2d_offsets_only():
    torch.manual_seed(0)
    rope = Rotary2D(8, size=(5, 5))
    q, k = (
        torch.randn(1, 1, 25, 8, dtype=torch.float64),
        torch.randn(1, 1, 25, 8, dtype=torch.float64),
    )
    q = q[:, :, :1].expand(-1, -1, 25, -1)  # the same vector at every cell
    k = k[:, :, :1].expand(-1, -1, 25, -1)
    rq, rk = rope(q, k)
    score = (rq @ rk.transpose(-1, -2))[0, 0]
    # cell (0,0)->(1,2) and (2,1)->(3,3) share the offset (1, 2)
    assert abs(float(score[0, 1 * 5 + 2] - score[2 * 5 + 1, 3 * 5 + 3])) < 1e-9


def test_rotary2d_hook_and_errors():
    rope = Rotary2D(8, size=(2, 3))
    q = torch.randn(1, 1, 6, 8)
    pos = torch.arange(6)[None]
    hooked, _ = rope.rotate(q, q, pos, pos)
    torch.testing.assert_close(hooked, rope(q, q)[0])
    with pytest.raises(ValueError, match=r"q has 6 tokens .* but size=\(2, 2\) .* needs 4"):
        rope(q, q, size=(2, 2))
    with pytest.raises(ValueError, match="head_dim must be a multiple of 4"):
        Rotary2D(6)
    with pytest.raises(ValueError, match="Rotary2D needs the grid size"):
        Rotary2D(8).rotate(q, q, pos, pos)


def reference_rope2d(x, size, prefix_tokens=0):
    """Rows on the first half, columns on the second, from the float64 loop reference; the
    first ``prefix_tokens`` tokens untouched."""
    height, width = size
    d = x.shape[-1]
    cells = torch.arange(height * width)
    grid = x[:, :, prefix_tokens:]
    rows = reference_rope(grid[..., : d // 2], cells // width)
    cols = reference_rope(grid[..., d // 2 :], cells % width)
    return torch.cat((x[:, :, :prefix_tokens].double(), torch.cat((rows, cols), -1)), 2)


@pytest.mark.parametrize("prefix_tokens", [1, 5])
def test_rotary2d_prefix_tokens_are_not_rotated(prefix_tokens):
    torch.manual_seed(0)
    size = (3, 4)
    n = prefix_tokens + 12
    q, k = torch.randn(2, 2, n, 8), torch.randn(2, 2, n, 8)
    rope = Rotary2D(8, size=size, prefix_tokens=prefix_tokens)
    rq, rk = rope(q, k)
    assert torch.equal(rq[:, :, :prefix_tokens], q[:, :, :prefix_tokens])
    assert torch.equal(rk[:, :, :prefix_tokens], k[:, :, :prefix_tokens])
    grid_q, grid_k = Rotary2D(8, size=size)(q[:, :, prefix_tokens:], k[:, :, prefix_tokens:])
    torch.testing.assert_close(rq[:, :, prefix_tokens:], grid_q, atol=atol32(q), rtol=0)
    torch.testing.assert_close(rk[:, :, prefix_tokens:], grid_k, atol=atol32(k), rtol=0)
    expected = reference_rope2d(q, size, prefix_tokens)
    torch.testing.assert_close(rq.double(), expected, atol=atol32(q), rtol=0)
    # the attention hook at the default positions is the same rotation
    pos = torch.arange(n)[None]
    hooked, _ = rope.rotate(q, k, pos, pos)
    torch.testing.assert_close(hooked, rq, atol=atol32(q), rtol=0)


def test_rotary2d_per_call_size_equals_a_module_of_that_size():
    torch.manual_seed(0)
    rope = Rotary2D(8, size=(4, 4), prefix_tokens=1)
    q, k = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    rq, rk = rope(q, k, size=(2, 3))
    eq, ek = Rotary2D(8, size=(2, 3), prefix_tokens=1)(q, k)
    torch.testing.assert_close(rq, eq, atol=atol32(q), rtol=0)
    torch.testing.assert_close(rk, ek, atol=atol32(k), rtol=0)
    torch.testing.assert_close(
        rq.double(), reference_rope2d(q, (2, 3), prefix_tokens=1), atol=atol32(q), rtol=0
    )
    assert rope.size == (4, 4)  # the constructor's size stays the default
    with pytest.raises(
        ValueError, match=r"q has 7 tokens .* size=\(4, 4\) .* needs 17 = 1 \+ 4\*4"
    ):
        rope(q, k)


def test_rotary2d_bnhd_layout_equals_the_transposed_default():
    torch.manual_seed(0)
    rope = Rotary2D(8, size=(3, 4), prefix_tokens=1)
    q, k = torch.randn(2, 13, 3, 8), torch.randn(2, 13, 3, 8)  # [b, n, h, d]
    rq, rk = rope(q, k, layout="bnhd")
    assert rq.shape == q.shape and rq.is_contiguous()
    eq, ek = rope(q.transpose(1, 2), k.transpose(1, 2))  # [b, n, h, d] -> [b, h, n, d]
    torch.testing.assert_close(rq, eq.transpose(1, 2), atol=atol32(q), rtol=0)
    torch.testing.assert_close(rk, ek.transpose(1, 2), atol=atol32(k), rtol=0)
    expected = reference_rope2d(q.transpose(1, 2), (3, 4), prefix_tokens=1).transpose(1, 2)
    torch.testing.assert_close(rq.double(), expected, atol=atol32(q), rtol=0)
    with pytest.raises(
        ValueError,
        match=r"q has 3 tokens .*; q has 13 on its heads axis: if it is \[b, n, h, d\], "
        r"pass layout='bnhd'",
    ):
        rope(q, k)
    with pytest.raises(ValueError, match=r"layout must be 'bhnd' .* or 'bnhd' .*got 'nhd'"):
        rope(q, k, layout="nhd")


@pytest.mark.parametrize(("n", "reach"), [(17, 16), (36, 35)])
def test_rotary2d_in_attention_rejects_tokens_past_the_grid(n, reach):
    """Rotary2D(8, size=(4, 4)) used to read 17 or 36 tokens as rows pos // 4 past the grid."""
    attn = MultiHeadAttention(16, 2, position=Rotary2D(8, size=(4, 4)))
    with pytest.raises(
        ValueError,
        match=rf"query positions reach {reach} but Rotary2D\(size=\(4, 4\), prefix_tokens=0\) "
        r"has positions 0..15 .* so the rows would wrap past the grid; set size=\(H, W\)",
    ):
        attn(torch.randn(1, n, 16))
    attn(torch.randn(1, 16, 16))  # the whole grid


def test_rotary2d_hook_rejects_positions_outside_prefix_and_grid():
    rope = Rotary2D(8, size=(2, 3), prefix_tokens=1)  # positions 0..6
    q = torch.randn(1, 1, 7, 8)
    pos = torch.arange(7)[None]
    rope.rotate(q, q, pos, pos)
    with pytest.raises(ValueError, match=r"query positions reach 7 .* has positions 0..6"):
        rope.rotate(q, q, pos + 1, pos)
    with pytest.raises(ValueError, match=r"key positions reach -1 .* has positions 0..6"):
        rope.rotate(q, q, pos, pos - 1)
    attn = MultiHeadAttention(16, 2, position=rope)
    attn(torch.randn(1, 7, 16))  # CLS + the 2 x 3 grid
    with pytest.raises(ValueError, match=r"query positions reach 7 .* prefix_tokens=1\) has"):
        attn(torch.randn(1, 8, 16))
    with pytest.raises(ValueError, match=r"query positions reach 9"):
        attn(torch.randn(1, 2, 16), positions=torch.tensor([5, 9]))


@pytest.mark.parametrize("prefix_tokens", [0, 1])
def test_rotary2d_decoding_in_raster_order_equals_the_full_grid(prefix_tokens):
    """Positions index the flattened sequence: a KV cache fed in raster order (a part of the
    grid first, then one token at a time) gives the outputs of the whole grid."""
    torch.manual_seed(0)
    rope = Rotary2D(8, size=(3, 4), prefix_tokens=prefix_tokens)
    attn = MultiHeadAttention(16, 2, position=rope).double().eval()
    n = prefix_tokens + 12
    x = torch.randn(2, n, 16, dtype=torch.float64)
    with torch.no_grad():
        full = attn(x, causal=True)
        cache = KVCache()
        steps = [attn(x[:, :5], causal=True, cache=cache)]
        steps += [attn(x[:, t : t + 1], causal=True, cache=cache) for t in range(5, n)]
    # float64: each output sums n products of terms of size max|full|, in two orders
    atol = 4 * n * torch.finfo(torch.float64).eps * float(full.abs().max())
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=atol, rtol=0)


def test_rotary2d_prefix_tokens_errors():
    with pytest.raises(TypeError, match=r"prefix_tokens must be an int .*got 1.0 \(float\)"):
        Rotary2D(8, prefix_tokens=1.0)
    with pytest.raises(TypeError, match=r"prefix_tokens must be an int .*got True \(bool\)"):
        Rotary2D(8, prefix_tokens=True)
    with pytest.raises(ValueError, match=r"prefix_tokens must be >= 0 .*got -1; pass 0"):
        Rotary2D(8, prefix_tokens=-1)
    assert "prefix_tokens=2" in repr(Rotary2D(8, size=(2, 2), prefix_tokens=2))


def test_errors():
    with pytest.raises(
        ValueError, match=r"head_dim must be even \(channels are rotated in pairs\), got 7"
    ):
        Rotary(7)
    with pytest.raises(ValueError, match="rotary_dim must be <= head_dim=8, got 10"):
        Rotary(8, rotary_dim=10)
    with pytest.raises(TypeError, match="scaling must be a RotaryScaling"):
        Rotary(8, scaling="yarn")
    with pytest.raises(ValueError, match=r"factor must be >= 1 .*got 0.5"):
        LinearScaling(0.5)
    rope = Rotary(8)
    with pytest.raises(ValueError, match=r"q must have last dimension head_dim=8"):
        rope(torch.randn(1, 1, 3, 6), torch.randn(1, 1, 3, 6))
    with pytest.raises(ValueError, match=r"q must have shape \[b, h, n, d\]"):
        rope(torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(
        ValueError, match="Rotary was built for head_dim=8 but the attention has head_dim=4"
    ):
        rope.validate_attention(heads=2, head_dim=4)
    with pytest.raises(ValueError, match="q_positions must cover the sequence"):
        rope(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8), torch.arange(4))


# ----- layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_bnhd_layout_equals_the_transposed_default(interleaved, rotary_dim):
    """q, k as [b, n, h, d] (flash-attn, torchtune) with layout="bnhd" are rotated along n."""
    torch.manual_seed(0)
    rope = Rotary(16, interleaved=interleaved, rotary_dim=rotary_dim)
    q, k = torch.randn(2, 7, 3, 16), torch.randn(2, 5, 3, 16)  # [b, n, h, d]
    q_pos = torch.stack([torch.arange(7), torch.arange(7) + 40])  # [b, n_q]
    rq, rk = rope(q, k, q_pos, layout="bnhd", offset=2)
    assert rq.shape == q.shape and rk.shape == k.shape and rq.is_contiguous()
    eq, ek = rope(q.transpose(1, 2), k.transpose(1, 2), q_pos, offset=2)  # -> [b, h, n, d]
    torch.testing.assert_close(rq, eq.transpose(1, 2), atol=atol32(q), rtol=0)
    torch.testing.assert_close(rk, ek.transpose(1, 2), atol=atol32(k), rtol=0)
    for row in range(2):
        expected = reference_rope(
            q[row : row + 1].transpose(1, 2),
            q_pos[row],
            interleaved=interleaved,
            rotary_dim=rotary_dim,
        ).transpose(1, 2)
        torch.testing.assert_close(rq[row : row + 1].double(), expected, atol=atol32(q), rtol=0)
    expected_k = reference_rope(
        k.transpose(1, 2), torch.arange(5) + 2, interleaved=interleaved, rotary_dim=rotary_dim
    ).transpose(1, 2)
    torch.testing.assert_close(rk.double(), expected_k, atol=atol32(k), rtol=0)


def test_layout_errors_name_the_sequence_axis():
    rope = Rotary(16)
    q = torch.randn(2, 7, 3, 16)  # [b, n, h, d] with n = 7, h = 3
    with pytest.raises(
        ValueError,
        match=r"q_positions has 7 positions but q of shape \(2, 7, 3, 16\) has n=3 tokens on "
        r"the sequence axis of layout='bhnd' \[b, h, n, d\]; q has 7 on its heads axis: if it "
        r"is \[b, n, h, d\], pass layout='bnhd'",
    ):
        rope(q, q, torch.arange(7))
    with pytest.raises(ValueError, match=r"k_positions has 3 positions .* pass layout='bhnd'"):
        rope(q, q, torch.arange(7), torch.arange(3), layout="bnhd")
    with pytest.raises(ValueError, match="q_positions must cover the sequence.*n=7"):
        rope(q, q, torch.arange(5), layout="bnhd")
    with pytest.raises(ValueError, match=r"layout must be 'bhnd' .* or 'bnhd' .*got 'BNHD'"):
        rope(q, q, layout="BNHD")
    with pytest.raises(ValueError, match=r"layout must be .*got None"):
        rope(q, q, layout=None)
    with pytest.raises(ValueError, match=r"q must have shape \[b, n, h, d\] \(layout='bnhd'\)"):
        rope(torch.randn(7, 16), torch.randn(7, 16), layout="bnhd")


@pytest.mark.compile
def test_compile_fullgraph_parity():
    rope = Rotary(16, scaling=YaRNScaling(2.0, 16))
    q, k = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    compiled = torch.compile(rope, fullgraph=True)
    for a, b in zip(compiled(q, k, offset=3), rope(q, k, offset=3), strict=True):
        torch.testing.assert_close(a, b)


def _per_call(rotary, x, positions):
    """The rotation from cos and sin computed in the call (:func:`apply_rotary`)."""
    cos, sin = rotary.cos_sin(positions)  # [1, n, r/2] float64
    work = torch.promote_types(x.dtype, torch.float32)
    return apply_rotary(x, cos.to(work), sin.to(work), interleaved=rotary.interleaved)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_runs_of_positions_rotate_with_kept_tables_as_with_tables_of_the_call(
    interleaved, rotary_dim, dtype
):
    """Queries and keys at runs of positions (a decoding step's one query after the keys)
    take tables kept between calls and a rotation of three ops; values and gradients equal
    the per-call tables' to a few ulps, and both the float64 reference."""
    import posenc._rotary_runs as rotary_module

    # pairs (2i, 2i+1) take complex phases, pairs (i, i + r/2) the expanded tables
    kept = rotary_module._run_phases if interleaved else rotary_module._run_tables
    kept.cache_clear()
    rotary = Rotary(8, interleaved=interleaved, rotary_dim=rotary_dim)
    torch.manual_seed(0)
    q = torch.randn(2, 3, 1, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 3, 6, 8, dtype=dtype, requires_grad=True)
    q_pos, k_pos = torch.tensor([[5]]), torch.arange(6)[None]
    for _ in range(2):
        rq, rk = rotary.rotate(q, k, q_pos, k_pos)
    assert kept.cache_info().hits == 2  # the second call's two runs
    eps = torch.finfo(dtype).eps
    for x, pos, out in ((q, q_pos, rq), (k, k_pos, rk)):
        expected = _per_call(rotary, x, pos)
        torch.testing.assert_close(
            out, expected, rtol=0, atol=2 * eps * float(x.detach().abs().max())
        )
        reference = reference_rope(
            x.detach(), pos[0], interleaved=interleaved, rotary_dim=rotary_dim
        )
        assert_close(out, reference, terms=4)
    grad = torch.randn_like(rk)
    (gk,) = torch.autograd.grad(rk, k, grad)
    (gk_call,) = torch.autograd.grad(_per_call(rotary, k, k_pos), k, grad)
    torch.testing.assert_close(gk, gk_call, rtol=0, atol=4 * eps * float(grad.abs().max()))


def _swapped_reference(rotary, x, n, first=0):
    """The rotation in out-of-place ops (the swapped copy) with the kept tables of the
    positions ``first .. first + n - 1``."""
    import posenc._rotary_runs as rotary_module

    work = torch.promote_types(x.dtype, torch.float32)
    r = rotary.rotary_dim
    tables = rotary_module._run_tables(r, rotary.base, rotary.interleaved, first, n, work, x.device)
    cos, sin = tables.unbind(0)
    out = rotary_module._swapped_sum(x[..., :r].to(work), cos, sin, rotary.interleaved)
    return torch.cat((out.to(x.dtype), x[..., r:]), dim=-1)


@pytest.mark.parametrize("rotary_dim", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_pairs_written_in_place_equal_the_swapped_copy(monkeypatch, rotary_dim, dtype):
    """Pairs ``(i, i + r/2)``: without a graph, and with one (through the rotation's own
    autograd Function), each pair's products are added into ``x * cos`` in place (no
    swapped copy: ``torch.cat`` runs only for a partial rotary_dim's pass-through
    channels, no ``flip``): bit for bit the values of the out-of-place form; the input is
    left as it was."""
    import posenc._rotary_runs as rotary_module

    rotary = Rotary(8, rotary_dim=rotary_dim)
    torch.manual_seed(0)
    q = torch.randn(2, 3, 6, 8, dtype=dtype)
    pos = torch.arange(6)[None]
    expected = _swapped_reference(rotary, q, 6)
    kept = q.clone()
    copies = []
    original_cat, original_flip = torch.cat, torch.Tensor.flip
    monkeypatch.setattr(
        rotary_module.torch, "cat", lambda *a, **kw: copies.append(1) or original_cat(*a, **kw)
    )
    monkeypatch.setattr(
        torch.Tensor, "flip", lambda *a, **kw: copies.append(1) or original_flip(*a, **kw)
    )
    for context in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with context():
            leaf = q.clone().requires_grad_(context is torch.enable_grad)
            found, _ = rotary.rotate(leaf, q, pos, pos)
        assert torch.equal(found.detach(), expected)
    assert torch.equal(q, kept)
    assert len(copies) == (0 if rotary_dim is None else 6)  # 3 calls x (q, k): pass-through


@pytest.mark.parametrize("both", [False, True], ids=["q", "q-and-k"])
def test_the_rotations_backward_is_the_rotation_by_the_opposite_angles(both):
    """Pairs ``(i, i + r/2)``, float64: the gradient through the rotation's autograd
    Function (``q``'s alone, or ``q``'s and ``k``'s as one node) equals autograd's through
    the swapped copy (to rounding: one fused multiply-add more where the CPU's addcmul fuses
    them), and it is differentiable again (gradgradcheck)."""
    import posenc._rotary_runs as rotary_module

    interleaved = False
    rotary = Rotary(8, interleaved=interleaved)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=both)
    q_pos, k_pos = torch.arange(6)[None], torch.arange(2, 7)[None]
    grads = torch.randn(2, 3, 6, 8, dtype=torch.float64), torch.randn(2, 3, 5, 8).double()
    out = rotary.rotate(x, y, q_pos, k_pos)
    node = "_RotationPairBackward" if both else "_RotationBackward"
    assert type(out[0].grad_fn).__name__ == node
    leaves = (x, y) if both else (x,)
    found = torch.autograd.grad(out[: len(leaves)], leaves, grads[: len(leaves)])
    swapped = _swapped_reference(rotary, x, 6), _swapped_reference(rotary, y, 5, first=2)
    expected = torch.autograd.grad(swapped[: len(leaves)], leaves, grads[: len(leaves)])
    for a, b in zip(found, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-15, atol=1e-15)
    args = (8, rotary.base, interleaved, 0, 6, torch.float64, x.device)
    tables = rotary_module._run_tables(*args)
    if both:
        back = rotary_module._run_back_sin(*args)
        assert torch.equal(back, -tables[1])  # the backward's, kept too
        three = (tables[0], tables[1], back)
        torch.autograd.gradgradcheck(
            lambda a, b: rotary_module._RotationPair.apply(a, b, three, three, interleaved),
            (x, y[:, :, :1].expand(2, 3, 6, 8).clone().requires_grad_()),
        )
        again = rotary.rotate(x, y, q_pos, k_pos)[1]  # k's output alone read: q gets none
        again.backward(grads[1])
        assert x.grad is None  # (not a zero gradient turned back)
        torch.testing.assert_close(y.grad, expected[1], rtol=1e-15, atol=1e-15)
    else:
        cos, sin = tables.unbind(0)
        torch.autograd.gradgradcheck(
            lambda a: rotary_module._Rotation.apply(a, cos, sin, interleaved), (x,)
        )


def _phase_count(monkeypatch):
    """Count the rotations by complex phases (one per tensor rotated, alone or as a pair;
    not their backwards)."""
    import posenc._rotary_runs as rotary_module

    calls = []
    original = rotary_module._times_phase

    def counted(x, phase, strides=None):
        if strides is None:
            calls.append(1)
        return original(x, phase, strides)

    monkeypatch.setattr(rotary_module, "_times_phase", counted)
    return calls


def test_the_phases_are_the_tables_cos_and_sin():
    """``cos + i sin`` of the kept phases holds the very cos and sin of the kept tables."""
    import posenc._rotary_runs as rotary_module

    for real, complex_dtype in (
        (torch.float32, torch.complex64),
        (torch.float64, torch.complex128),
    ):
        phases = rotary_module._run_phases(8, 500.0, 3, 5, complex_dtype, torch.device("cpu"))
        cos, sin = rotary_module._run_tables(8, 500.0, True, 3, 5, real, torch.device("cpu"))
        assert torch.equal(phases.real, cos[..., 0::2])
        assert torch.equal(phases.imag, sin[..., 1::2])  # channel 2i+1 takes +sin_i


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("rotary_dim", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_interleaved_pairs_rotate_as_complex_numbers(monkeypatch, layout, rotary_dim, dtype):
    """Pairs ``(2i, 2i+1)`` at runs of positions rotate as complex numbers times
    ``cos + i sin`` (one kernel per tensor), with and without a graph: values against the
    float64 reference of the paper's 2x2 rotation, and gradients against the rotation of
    the gradient by the opposite angles, to the rounding of two products and a sum; the
    pass-through channels unchanged; the input kept; queries and keys at their own runs."""
    calls = _phase_count(monkeypatch)
    rotary = Rotary(8, interleaved=True, rotary_dim=rotary_dim)
    r = 8 if rotary_dim is None else rotary_dim
    torch.manual_seed(0)
    q = torch.randn(2, 3, 5, 8, dtype=dtype)
    k = torch.randn(2, 3, 6, 8, dtype=dtype)
    q_first, k_first = 4, 1
    if layout == "bnhd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [b, n, h, d] views
    axis = 2 if layout == "bhnd" else 1
    q_pos = torch.arange(q.shape[axis]) + q_first
    k_pos = torch.arange(k.shape[axis]) + k_first
    kept = q.clone(), k.clone()
    leaves = [x.clone().requires_grad_() for x in (q, k)]
    rq, rk = rotary(*leaves, q_pos, k_pos, layout=layout)
    assert len(calls) == 2
    assert rq.dtype == dtype and rq.shape == q.shape and rk.shape == k.shape
    grads = torch.randn_like(rq), torch.randn_like(rk)
    found = torch.autograd.grad((rq, rk), leaves, grads)

    def bhnd(x):
        return x if layout == "bhnd" else x.transpose(1, 2)

    for x, out, pos, grad, got_grad in zip(
        (q, k), (rq, rk), (q_pos, k_pos), grads, found, strict=True
    ):
        expected = reference_rope(bhnd(x), pos, interleaved=True, rotary_dim=rotary_dim)
        assert_close(bhnd(out), expected, terms=4, dtype=dtype)
        assert torch.equal(bhnd(out).detach()[..., r:], bhnd(x)[..., r:])
        back = reference_rope(bhnd(grad), -pos, interleaved=True, rotary_dim=rotary_dim)
        assert_close(bhnd(got_grad), back, terms=4, dtype=dtype)  # R(p)^T = R(-p)
    assert torch.equal(q, kept[0]) and torch.equal(k, kept[1])
    with torch.no_grad():
        again = rotary(q, k, q_pos, k_pos, layout=layout)
    assert torch.equal(again[0], rq.detach()) and torch.equal(again[1], rk.detach())


def test_interleaved_complex_rotation_returns_no_view(monkeypatch):
    """The rotated tensors are new real tensors, not views of complex ones: they can be
    detached and written in place as the tables' rotation allowed."""
    calls = _phase_count(monkeypatch)
    rotary = Rotary(8, interleaved=True)
    q = torch.randn(1, 2, 4, 8)
    with torch.no_grad():
        rq, rk = rotary(q, q)
    assert rq._base is None and rk._base is None
    rq.mul_(torch.ones((), requires_grad=True))  # a no-grad output written with grad on
    out, _ = rotary(q.clone().requires_grad_(), q)
    assert out._base is None and type(out.grad_fn).__name__ == "_PhaseRotationBackward"
    out.detach_()
    assert len(calls) == 4


def test_interleaved_complex_rotation_is_differentiable_twice(monkeypatch):
    """float64 gradcheck and gradgradcheck through the complex rotation (autograd's own
    ops), and its gradient is the rotation of the gradient by the opposite angles."""
    calls = _phase_count(monkeypatch)
    rotary = Rotary(6, interleaved=True)
    torch.manual_seed(0)
    x = torch.randn(1, 2, 4, 6, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(4)[None]

    def rotated(y):
        return rotary.rotate(y, y, pos, pos)[0]

    rotated(x)
    assert len(calls) == 2
    torch.autograd.gradcheck(rotated, (x,))
    torch.autograd.gradgradcheck(rotated, (x,))
    grad = torch.randn(1, 2, 4, 6, dtype=torch.float64)
    (found,) = torch.autograd.grad(rotated(x), x, grad)
    back = reference_rope(grad, -torch.arange(4), interleaved=True)  # R(p)^T = R(-p)
    torch.testing.assert_close(found, back, rtol=0, atol=1e-14)


def test_interleaved_pairs_that_cannot_be_viewed_as_complex_take_the_tables(monkeypatch):
    """A float32 tensor at an odd storage offset or with an odd stride has no complex view:
    it takes the expanded tables, with the same values to rounding."""
    calls = _phase_count(monkeypatch)
    rotary = Rotary(8, interleaved=True)
    torch.manual_seed(0)
    flat = torch.randn(1 + 2 * 3 * 5 * 8)
    odd_offset = flat[1:].view(2, 3, 5, 8)
    odd_stride = torch.randn(2, 3, 5, 9)[..., :8]  # the sequence's stride 9
    channels_apart = torch.randn(2, 3, 8, 5).transpose(-1, -2)  # the channels' stride 5
    negated = torch._neg_view(torch.randn(2, 3, 5, 8))  # a lazy negation: no dtype view
    pos = torch.arange(5)[None]
    for x in (odd_offset, odd_stride, channels_apart, negated):
        out, _ = rotary.rotate(x, x, pos, pos)
        assert_close(out, reference_rope(x, torch.arange(5), interleaved=True), terms=4)
    assert calls == []
    for x in (odd_stride, channels_apart):  # bfloat16: cast to a contiguous float32 copy
        x = x.to(torch.bfloat16)
        out, _ = rotary.rotate(x, x, pos, pos)
        assert_close(out, reference_rope(x, torch.arange(5), interleaved=True), terms=4)
    assert len(calls) == 4
    calls.clear()
    even = torch.randn(2, 3, 5, 8)
    rotary.rotate(even, odd_offset, pos, pos)  # one of the two without a view: no phases
    assert calls == []


def test_interleaved_pairs_inside_forward_ad_and_vmap_take_the_tables(monkeypatch):
    """A forward-mode AD level and a ``torch.func`` transform take the out-of-place
    rotation with real tables: the tangent is the rotated tangent."""
    import torch.autograd.forward_ad as fwAD

    calls = _phase_count(monkeypatch)
    rotary = Rotary(8, interleaved=True)
    torch.manual_seed(0)
    x, t = (
        torch.randn(2, 3, 5, 8, dtype=torch.float64),
        torch.randn(2, 3, 5, 8, dtype=torch.float64),
    )
    pos = torch.arange(5)[None]
    with fwAD.dual_level():
        out, _ = rotary.rotate(fwAD.make_dual(x, t), x, pos, pos)
        tangent = fwAD.unpack_dual(out).tangent
    torch.testing.assert_close(tangent, reference_rope(t, torch.arange(5), interleaved=True))
    out = torch.vmap(lambda y: rotary.rotate(y, y, pos, pos)[0])(torch.stack((x, t)))
    torch.testing.assert_close(out[0], reference_rope(x, torch.arange(5), interleaved=True))
    torch.testing.assert_close(out[1], reference_rope(t, torch.arange(5), interleaved=True))
    assert calls == []


def test_positions_that_are_no_run_or_a_scaling_take_the_tables_of_the_call(monkeypatch):
    import posenc._rotary_runs as rotary_module

    kept = []
    original = rotary_module._run_tables
    monkeypatch.setattr(rotary_module, "_run_tables", lambda *a: kept.append(a) or original(*a))
    q = torch.randn(1, 2, 4, 8)
    Rotary(8).rotate(q, q, torch.tensor([[0, 2, 3, 4]]), torch.tensor([[0, 2, 3, 4]]))
    Rotary(8).rotate(q, q, torch.arange(4).expand(2, 4), torch.arange(4).expand(2, 4))
    Rotary(8, scaling=LinearScaling(2.0)).rotate(q, q, torch.arange(4)[None], torch.arange(4)[None])
    assert kept == []
    Rotary(8).rotate(q, q, torch.arange(4)[None], torch.arange(2, 6)[None])
    assert [a[3:5] for a in kept] == [(0, 4), (2, 4)]  # (first, n) of the queries, the keys


def test_a_cos_sin_of_a_subclass_is_used_for_runs_of_positions_too():
    class Halved(Rotary):
        def cos_sin(self, positions, *, length=None):
            cos, sin = super().cos_sin(positions, length=length)
            return cos * 0.5, sin * 0.5

    q = torch.randn(1, 2, 4, 8)
    pos = torch.arange(4)[None]
    out, _ = Halved(8).rotate(q, q, pos, pos)
    torch.testing.assert_close(out, _per_call(Halved(8), q, pos), rtol=0, atol=0)
    torch.testing.assert_close(out, Rotary(8).rotate(q, q, pos, pos)[0] * 0.5)


def test_vmap_over_positions_rotates_each_entry():
    rotary, q = Rotary(8), torch.randn(1, 2, 4, 8)
    pos = torch.stack([torch.arange(4)[None] + s for s in (0, 3, 7)])  # [3, 1, 4]
    out = torch.vmap(lambda p: rotary.rotate(q, q, p, p)[0])(pos)
    for i in range(3):
        torch.testing.assert_close(out[i], _per_call(rotary, q, pos[i]), rtol=1e-6, atol=1e-6)


def test_jit_trace_records_the_out_of_place_rotation():
    """``torch.jit.trace`` with gradients on (a module's parameters ask for them) records
    the rotation in plain ops, so that the trace checks and saves, with the same values."""
    import io
    import warnings

    torch.manual_seed(0)
    model = MultiHeadAttention(32, 2, position=Rotary(16), backend="math").eval()
    x = torch.randn(2, 7, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's own deprecation warnings
        traced = torch.jit.trace(model, (x,))
        torch.jit.save(traced, io.BytesIO())
    torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(0, 2, 4, 8), (2, 2, 0, 8)])
def test_interleaved_complex_rotation_of_nothing(shape):
    """No batch or no tokens: the complex rotation, its backward from an expanded
    gradient (all strides 0) and its create_graph backward give empty tensors."""
    rotary = Rotary(8, interleaved=True)
    q = torch.randn(*shape, requires_grad=True)
    out, _ = rotary(q, q)
    assert out.shape == shape
    out.sum().backward()
    (again,) = torch.autograd.grad(rotary(q, q)[0].sum(), q, create_graph=True)
    assert q.grad.shape == shape and again.shape == shape


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_q_and_k_rotated_as_one_node_equal_each_rotated_alone(interleaved, layout, dtype):
    """Where ``q`` and ``k`` both ask for a gradient they rotate as one node of autograd's
    graph (:class:`_RotationPair`, :class:`_PhaseRotationPair`): their values and gradients
    (at their own runs of positions, in either layout, a gradient laid out as the input)
    are bit for bit those of each rotated alone, also through a backward of each output
    alone, one after the other; a batched gradient (``is_grads_batched``) equals the
    gradients one by one."""
    rotary = Rotary(8, interleaved=interleaved)
    torch.manual_seed(0)
    q = torch.randn(2, 3, 5, 8, dtype=dtype)
    k = torch.randn(2, 3, 7, 8, dtype=dtype)
    if layout == "bnhd":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()  # [b, n, h, d]
    axis = 2 if layout == "bhnd" else 1
    q_pos = torch.arange(q.shape[axis]) + 3
    k_pos = torch.arange(k.shape[axis])
    grads = torch.randn_like(q), torch.randn_like(k)
    # dense leaves in another order of strides than the gradients they get
    leaves = [x.transpose(0, 2).contiguous().transpose(0, 2).requires_grad_() for x in (q, k)]
    pair = rotary(*leaves, q_pos, k_pos, layout=layout)
    node = "_PhaseRotationPairBackward" if interleaved else "_RotationPairBackward"
    assert type(pair[0].grad_fn).__name__ == node and pair[0].grad_fn is pair[1].grad_fn
    found = torch.autograd.grad(pair, leaves, grads)
    dense = [x.detach() for x in leaves]  # q and k in the leaves' layout
    for i in range(2):
        leaf = dense[i].clone().requires_grad_()  # (clone keeps a dense layout)
        args = [leaf, dense[1], q_pos, k_pos] if i == 0 else [dense[0], leaf, q_pos, k_pos]
        alone = rotary(*args, layout=layout)[i]
        assert "Pair" not in type(alone.grad_fn).__name__
        (grad,) = torch.autograd.grad(alone, leaf, grads[i])
        assert torch.equal(pair[i], alone) and torch.equal(found[i], grad)
        assert found[i].stride() == leaves[i].stride()
    rq, rk = rotary(*leaves, q_pos, k_pos, layout=layout)  # a backward through each alone
    (by_q,) = torch.autograd.grad(rq, leaves[0], grads[0])
    (by_k,) = torch.autograd.grad(rk, leaves[1], grads[1])
    assert torch.equal(by_q, found[0]) and torch.equal(by_k, found[1])
    batched = torch.stack([torch.randn_like(k) for _ in range(3)])  # [3, *k.shape]
    outs = rotary(*leaves, q_pos, k_pos, layout=layout)
    (by_batch,) = torch.autograd.grad(
        outs[1], leaves[1], batched, is_grads_batched=True, retain_graph=True
    )
    for one, grad in zip(batched, by_batch, strict=True):
        (expected,) = torch.autograd.grad(outs[1], leaves[1], one, retain_graph=True)
        assert_close(grad, expected, terms=4)  # a rotation: two products and a sum


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_rotation_pair_of_one_tensor_and_its_second_derivative(interleaved):
    """``q`` and ``k`` one tensor (self-attention on a shared projection): the pair's node
    gives it the sum of both gradients, as a node per tensor does; float64 gradcheck and
    gradgradcheck through the pair (the complex pairs' node included)."""
    rotary = Rotary(8, interleaved=interleaved)
    torch.manual_seed(0)
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    q_pos, k_pos = torch.arange(5)[None], torch.arange(3, 8)[None]
    grads = torch.randn(1, 2, 5, 8, dtype=torch.float64), torch.randn(1, 2, 5, 8).double()
    rq, rk = rotary.rotate(x, x, q_pos, k_pos)
    assert "Pair" in type(rq.grad_fn).__name__ and rq.grad_fn is rk.grad_fn
    (found,) = torch.autograd.grad((rq, rk), x, grads)
    alone = [rotary.rotate(x, x.detach(), q_pos, k_pos)[0]]  # q's node alone
    alone.append(rotary.rotate(x.detach(), x, q_pos, k_pos)[1])  # k's node alone
    assert all("Pair" not in type(out.grad_fn).__name__ for out in alone)
    (expected,) = torch.autograd.grad(alone, x, grads)
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-14)

    def both(y):
        return sum(out.square().sum() for out in rotary.rotate(y, y, q_pos, k_pos))

    torch.autograd.gradcheck(both, (x,))
    torch.autograd.gradgradcheck(both, (x,))
