"""rotary_nd.py against float64 loops written here, the official RoPE-Mixed code's algebra,
posenc's Rotary/Rotary2D, and HF transformers' Qwen2-VL M-RoPE."""

from __future__ import annotations

import math

import pytest
import torch

from posenc import KVCache, MultiHeadAttention, Rotary, Rotary2D, attention
from posenc.rotary_nd import RotaryMixed, RotaryND, grid_coordinates, mixed_frequencies
from tolerances import assert_close

F64 = torch.float64


# ----- references: the papers' definitions, one channel pair at a time --------------------------


def pair_spec(scheme):
    """``[(channel a, channel c, angle(head, coords))]``: each rotated pair and its angle, read
    from the definitions (not from the module's code)."""
    d = scheme.head_dim
    if isinstance(scheme, RotaryMixed):  # pairs (2t, 2t+1); theta_x * column + theta_y * row
        f = scheme.freqs.detach().double()
        return [
            (2 * t, 2 * t + 1, lambda h, c, t=t: float(f[0, h, t] * c[1] + f[1, h, t] * c[0]))
            for t in range(d // 2)
        ]
    spec = []
    if scheme.style == "axial":  # axis a: its own 1-D RoPE on its block of 2 * axes[a] channels
        offset = 0
        for a, p in enumerate(scheme.axes):
            for i in range(p):
                theta = scheme.base ** (-2 * i / (2 * p))
                spec.append((offset + i, offset + p + i, lambda h, c, a=a, th=theta: c[a] * th))
            offset += 2 * p
        return spec
    owner = [a for a, p in enumerate(scheme.axes) for _ in range(p)]  # M-RoPE's sections
    for j in range(d // 2):
        theta = scheme.base ** (-2 * j / d)
        spec.append((j, j + d // 2, lambda h, c, a=owner[j], th=theta: c[a] * th))
    return spec


def rotation(angle):
    return torch.tensor(
        [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]], dtype=F64
    )


def reference_rotate(x, coords, spec):
    """``x [b, h, n, d]`` rotated pair by pair with explicit 2x2 matrices, float64; ``coords``
    a list of n coordinate tuples, None for a token that is not rotated."""
    out = x.double().clone()
    for h in range(x.shape[1]):
        for t, c in enumerate(coords):
            if c is None:
                continue
            for a, b, angle in spec:
                pair = torch.stack((x[:, h, t, a], x[:, h, t, b]), -1).double()  # [b, 2]
                new = pair @ rotation(angle(h, c)).T
                out[:, h, t, a], out[:, h, t, b] = new[:, 0], new[:, 1]
    return out


def reference_scores(q, k, q_coords, k_coords, spec, h=0):
    """``s_ij = sum_pairs q_i^T R(angle(c_j) - angle(c_i)) k_j`` for ``q [n_q, d]``, ``k [n_k,
    d]`` of head ``h``: the score as a function of the rotation between the two tokens."""
    out = torch.zeros(len(q_coords), len(k_coords), dtype=F64)
    for i, ci in enumerate(q_coords):
        for j, cj in enumerate(k_coords):
            for a, b, angle in spec:
                qp = torch.stack((q[i, a], q[i, b])).double()
                kp = torch.stack((k[j, a], k[j, b])).double()
                out[i, j] += qp @ rotation(angle(h, cj) - angle(h, ci)) @ kp
    return out


def grid_cells(size, prefix_tokens=0):
    """The coordinates of ``P`` prefix tokens (None) then the row-major grid, by hand."""
    cells = [()]
    for extent in size:
        cells = [(*c, i) for c in cells for i in range(extent)]
    return [None] * prefix_tokens + cells


SCHEMES = {
    "mixed": lambda: RotaryMixed(8, 2, size=(3, 4), prefix_tokens=1),
    "axial-3d": lambda: RotaryND(8, (2, 1, 1), size=(2, 3, 2), prefix_tokens=1, base=100.0),
    "mrope-3d": lambda: RotaryND(8, (1, 2, 1), size=(2, 3, 2), base=100.0, style="mrope"),
    "mrope-2d": lambda: RotaryND(12, (2, 4), size=(3, 4), prefix_tokens=2, style="mrope"),
}


def build(name, seed=0):
    torch.manual_seed(seed)
    scheme = SCHEMES[name]()
    if isinstance(scheme, RotaryMixed):  # frequencies of size ~1: every angle counts
        with torch.no_grad():
            scheme.freqs.normal_()
    return scheme


# ----- the rotation ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMES))
def test_rotation_matches_the_pairwise_loop_reference(name):
    scheme = build(name)
    n = scheme.prefix_tokens + math.prod(scheme.size)
    torch.manual_seed(1)
    q, k = torch.randn(2, 2, n, scheme.head_dim), torch.randn(2, 2, n, scheme.head_dim)
    rq, rk = scheme(q, k)
    spec, cells = pair_spec(scheme), grid_cells(scheme.size, scheme.prefix_tokens)
    assert_close(rq, reference_rotate(q, cells, spec), terms=2)  # a 2x2 product per channel
    assert_close(rk, reference_rotate(k, cells, spec), terms=2)
    pos = torch.arange(n)[None]
    hq, hk = scheme.rotate(q, k, pos, pos)  # the attention hook at the flat positions
    assert torch.equal(hq, rq) and torch.equal(hk, rk)
    assert torch.equal(rq[:, :, : scheme.prefix_tokens], q[:, :, : scheme.prefix_tokens])


@pytest.mark.parametrize("name", list(SCHEMES))
def test_scores_are_a_rotation_by_the_coordinate_difference(name):
    """``(R(c_i) q) . (R(c_j) k) = q^T R(angle(c_j) - angle(c_i)) k``, and shifting every
    coordinate by one vector leaves the scores unchanged."""
    scheme = build(name).double()
    axes = len(scheme.size)
    gen = torch.Generator().manual_seed(2)
    coords = torch.randint(-5, 9, (7, axes), generator=gen)
    q, k = (torch.randn(1, 2, 7, scheme.head_dim, dtype=F64, generator=gen) for _ in range(2))
    rq, rk = scheme.rotate_at(q, k, coords, coords)
    scores = rq @ rk.transpose(-1, -2)  # [1, 2, 7, 7]
    listed = [tuple(int(v) for v in c) for c in coords]
    spec = pair_spec(scheme)
    for h in range(2):
        want = reference_scores(q[0, h], k[0, h], listed, listed, spec, h=h)
        torch.testing.assert_close(scores[0, h], want, rtol=0, atol=1e-12)
    shift = torch.randint(-50, 50, (axes,), generator=gen)
    sq, sk = scheme.rotate_at(q, k, coords + shift, coords + shift)
    torch.testing.assert_close(sq @ sk.transpose(-1, -2), scores, rtol=0, atol=1e-11)
    assert not torch.allclose(sq, rq)  # the rotation itself moved


def test_official_complex_form_columns_then_rows():
    """The official ``compute_mixed_cis`` / ``apply_rotary_emb`` algebra: adjacent channels as
    a complex number times ``exp(i (t_x theta_x + t_y theta_y))`` with ``t_x = t % W`` (the
    column) and ``t_y = t // W`` (the row); the CLS token in front left as it is."""
    torch.manual_seed(0)
    height, width, heads, d = 3, 5, 2, 8
    rope = RotaryMixed(d, heads, size=(height, width), prefix_tokens=1).double()
    x = torch.randn(2, heads, 1 + height * width, d, dtype=F64)
    got, _ = rope(x, x)
    t = torch.arange(height * width, dtype=F64)
    t_x, t_y = t % width, torch.div(t, width, rounding_mode="floor")
    freqs = rope.freqs.detach()  # [2, h, d/2]
    angles = t_x[None, :, None] * freqs[0][:, None] + t_y[None, :, None] * freqs[1][:, None]
    cis = torch.polar(torch.ones_like(angles), angles)  # [h, n, d/2]
    patches = torch.view_as_complex(x[:, :, 1:].reshape(2, heads, -1, d // 2, 2).contiguous())
    want = torch.view_as_real(patches * cis).flatten(3)
    torch.testing.assert_close(got[:, :, 1:], want, rtol=0, atol=1e-12)
    assert torch.equal(got[:, :, :1], x[:, :, :1])


def test_axial_with_two_equal_axes_is_rotary2d():
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 13, 8), torch.randn(2, 2, 13, 8)
    got = RotaryND(8, (2, 2), size=(3, 4), prefix_tokens=1)(q, k)
    want = Rotary2D(8, size=(3, 4), prefix_tokens=1)(q, k)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("axes", [(1, 2, 1), (4,), (2, 2)])
def test_mrope_with_equal_coordinates_is_1d_rope(axes):
    """M-RoPE's text tokens: ``(p, p, p)`` on every axis is the 1-D RoPE of ``p``."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    pos = torch.tensor([0, 3, 4, 9, 10, 200])
    coords = pos[:, None].expand(-1, len(axes))
    got = RotaryND(8, axes, style="mrope", base=500.0).rotate_at(q, k, coords, coords)
    want = Rotary(8, base=500.0)(q, k, pos, pos)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, terms=2)


def test_grid_coordinates_are_row_major():
    cells = torch.arange(12)
    want = torch.tensor([c for c in grid_cells((2, 3, 2))])
    assert torch.equal(grid_coordinates(cells, (2, 3, 2)), want)
    assert torch.equal(grid_coordinates(cells, (12,)), cells[:, None])


# ----- HF transformers' Qwen2-VL M-RoPE as the oracle ------------------------------------------


def test_mrope_equals_hf_qwen2_vl_on_a_text_image_text_sequence():
    qwen = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
    config_module = pytest.importorskip("transformers.models.qwen2_vl.configuration_qwen2_vl")
    sections, d, base = [2, 3, 3], 16, 1000.0
    config = config_module.Qwen2VLTextConfig(
        hidden_size=2 * d,
        num_attention_heads=2,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": base, "mrope_section": sections},
    )
    hf_rope = qwen.Qwen2VLRotaryEmbedding(config)
    # 3 text tokens, a 2 x 3 image (t = 3, rows 3..4, columns 3..5), then 2 text tokens at
    # the next position after the image's largest, as Qwen2-VL's get_rope_index lays them
    text = [(p, p, p) for p in range(3)]
    image = [(3, 3 + r, 3 + c) for r in range(2) for c in range(3)]
    after = [(6 + p, 6 + p, 6 + p) for p in range(2)]
    coords = torch.tensor(text + image + after)  # [n, 3] (t, h, w)
    n = coords.shape[0]
    position_ids = coords.T[:, None, :]  # [3, 1, n], HF's layout
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, n, d), torch.randn(1, 2, n, d)
    cos, sin = hf_rope(q, position_ids)  # [1, n, d] each, cat(half, half)
    want_q, want_k = qwen.apply_rotary_pos_emb(q, k, cos, sin)
    rope = RotaryND(d, sections, base=base, style="mrope")
    got_q, got_k = rope.rotate_at(q, k, coords, coords)
    # HF computes the angles in float32: off by a few ulps of the largest angle (<= 8 rad)
    angle = float(coords.max())
    atol = 8 * torch.finfo(torch.float32).eps * (1 + angle) * float(q.abs().max())
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=atol)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=atol)
    angles = rope.angles(coords[None])[0]  # [n, d/2]
    torch.testing.assert_close(angles.cos().float(), cos[0, :, : d // 2], rtol=0, atol=1e-5)
    torch.testing.assert_close(angles.sin().float(), sin[0, :, : d // 2], rtol=0, atol=1e-5)


# ----- RoPE-Mixed's initialisation (naver-ai/rope-vit, init_random_2d_freqs) --------------------


def test_mixed_initialisation_has_the_official_structure():
    d, heads, base = 16, 3, 10.0
    phi = torch.tensor([0.3, 2.0, 5.5], dtype=F64)
    freqs = mixed_frequencies(d, phi, base)
    assert freqs.shape == (2, heads, d // 2)
    magnitude = torch.tensor([base ** (-4 * t / d) for t in range(d // 4)], dtype=F64)
    for h in range(heads):
        for half, turn in ((0, 0.0), (1, math.pi / 2)):
            part = slice(half * d // 4, (half + 1) * d // 4)
            fx, fy = freqs[0, h, part], freqs[1, h, part]
            torch.testing.assert_close(torch.hypot(fx, fy), magnitude, rtol=0, atol=1e-15)
            direction = torch.atan2(fy, fx)
            want = math.remainder(float(phi[h]) + turn, 2 * math.pi)  # atan2's (-pi, pi]
            torch.testing.assert_close(
                direction, torch.full_like(direction, want), atol=1e-12, rtol=0
            )


def test_mixed_module_draws_the_official_initialisation():
    """The official loop, by hand: per head ``angles = rand(1) * 2 pi``, then
    ``cat(m cos(a), m cos(pi/2 + a))`` for x and ``cat(m sin(a), m sin(pi/2 + a))`` for y."""
    d, heads = 8, 4
    torch.manual_seed(7)
    rope = RotaryMixed(d, heads)
    torch.manual_seed(7)
    mag = 1 / (10.0 ** (torch.arange(0, d, 4)[: d // 4].float() / d))
    want_x, want_y = [], []
    for _ in range(heads):
        a = torch.rand(1) * 2 * torch.pi
        want_x.append(torch.cat([mag * torch.cos(a), mag * torch.cos(torch.pi / 2 + a)]))
        want_y.append(torch.cat([mag * torch.sin(a), mag * torch.sin(torch.pi / 2 + a)]))
    want = torch.stack([torch.stack(want_x), torch.stack(want_y)])
    assert rope.freqs.dtype == torch.float32 and rope.freqs.requires_grad
    # values <= 1, each a float32 sin or cos and a product: a few ulps of 1
    torch.testing.assert_close(rope.freqs.detach(), want, rtol=0, atol=4 * torch.finfo().eps)
    # the directions are uniform on the circle: 8 bins of 4096 heads, each 512 +- 5 sigma
    many = RotaryMixed(4, 4096).freqs.detach().double()
    direction = torch.atan2(many[1, :, 0], many[0, :, 0]) % (2 * math.pi)
    counts = torch.histc(direction, bins=8, min=0, max=2 * math.pi)
    assert (counts - 512).abs().max() < 5 * math.sqrt(4096 * (1 / 8) * (7 / 8))
    before = rope.freqs.detach().clone()
    rope.reset_parameters()
    assert not torch.equal(rope.freqs, before)


# ----- gradients --------------------------------------------------------------------------------


def test_gradcheck_mixed_including_the_frequencies():
    rope = RotaryMixed(4, 2, size=(2, 3), prefix_tokens=1).double()
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 7, 4, dtype=F64, generator=gen, requires_grad=True) for _ in "qk")
    freqs = (rope.freqs.detach() + 0.3).requires_grad_()

    def rotated(q, k, freqs):
        return torch.func.functional_call(rope, {"freqs": freqs}, (q, k))

    assert torch.autograd.gradcheck(rotated, (q, k, freqs))  # the hook = forward: tested


@pytest.mark.parametrize("style", ["axial", "mrope"])
def test_gradcheck_nd(style):
    rope = RotaryND(6, (1, 1, 1), size=(2, 1, 2), prefix_tokens=1, style=style)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 5, 6, dtype=F64, generator=gen, requires_grad=True) for _ in "qk")
    assert torch.autograd.gradcheck(lambda q, k: rope(q, k), (q, k))


# ----- inside attention ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMES))
def test_attention_backends_agree_outputs_and_gradients(name):
    shape = build(name)
    n, dim = shape.prefix_tokens + math.prod(shape.size), 2 * shape.head_dim
    x = torch.randn(2, n, dim, dtype=F64, generator=torch.Generator().manual_seed(3))
    padding = torch.zeros(2, n, dtype=torch.bool)
    padding[1, -2:] = True
    results = {}
    for backend in ("math", "auto", "lean", "sdpa"):
        scheme = build(name).double()
        torch.manual_seed(1)
        model = MultiHeadAttention(dim, 2, position=scheme, backend=backend).double()
        xi = x.clone().requires_grad_()
        out = model(xi, key_padding_mask=padding, causal=True)
        (out * out.detach().cos()).sum().backward()
        grads = {key: p.grad for key, p in model.named_parameters()}
        results[backend] = (out, xi.grad, grads)
    want_out, want_dx, want_grads = results.pop("math")
    for backend, (out, dx, grads) in results.items():
        torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12, msg=backend)
        torch.testing.assert_close(dx, want_dx, rtol=1e-10, atol=1e-12, msg=backend)
        for key, grad in want_grads.items():
            torch.testing.assert_close(grads[key], grad, rtol=1e-10, atol=1e-12, msg=key)
    if "position.freqs" in want_grads:
        assert want_grads["position.freqs"].abs().sum() > 0


@pytest.mark.parametrize("name", list(SCHEMES))
def test_decoding_in_raster_order_with_a_cache_equals_the_full_grid(name):
    scheme = build(name).double()
    n = scheme.prefix_tokens + math.prod(scheme.size)
    torch.manual_seed(1)
    model = MultiHeadAttention(scheme.head_dim * 2, 2, position=scheme).double().eval()
    x = torch.randn(2, n, scheme.head_dim * 2, dtype=F64)
    with torch.no_grad():
        full = model(x, causal=True)
        cache = KVCache()
        steps = [model(x[:, :5], causal=True, cache=cache)]
        steps += [model(x[:, t : t + 1], causal=True, cache=cache) for t in range(5, n)]
    atol = 4 * n * torch.finfo(F64).eps * float(full.abs().max())  # n products, two orders
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=atol, rtol=0)


def test_attention_hook_equals_rotating_first():
    """attention(q, k, v, position=scheme) is SDPA on the queries and keys rotated by hand."""
    scheme = build("mrope-3d").double()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8, dtype=F64) for _ in "qkv")
    rq, rk = scheme(q, k)
    want = torch.nn.functional.scaled_dot_product_attention(rq, rk, v, is_causal=True)
    got = attention(q, k, v, position=scheme, causal=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ----- layouts, sizes, errors -------------------------------------------------------------------


def test_bnhd_layout_and_per_call_size():
    rope = build("axial-3d")
    torch.manual_seed(0)
    q, k = torch.randn(2, 13, 2, 8), torch.randn(2, 13, 2, 8)  # [b, n, h, d]
    rq, rk = rope(q, k, layout="bnhd")
    eq, ek = rope(q.transpose(1, 2), k.transpose(1, 2))
    assert torch.equal(rq, eq.transpose(1, 2)) and torch.equal(rk, ek.transpose(1, 2))
    coords = grid_coordinates(torch.arange(12), (2, 3, 2))
    aq, _ = rope.rotate_at(q[:, 1:], k[:, 1:], coords, coords, layout="bnhd")
    assert torch.equal(aq, rq[:, 1:])
    # another grid per call; the constructor's size stays the default
    small = rope(q[:, :5].transpose(1, 2), k[:, :5].transpose(1, 2), size=(1, 2, 2))
    want = RotaryND(8, (2, 1, 1), size=(1, 2, 2), prefix_tokens=1, base=100.0)(
        q[:, :5].transpose(1, 2), k[:, :5].transpose(1, 2)
    )
    assert torch.equal(small[0], want[0]) and rope.size == (2, 3, 2)
    rope.size = (1, 2, 2)  # the attention hook reads .size
    pos = torch.arange(5)[None]
    hooked, _ = rope.rotate(q[:, :5].transpose(1, 2), k[:, :5].transpose(1, 2), pos, pos)
    assert torch.equal(hooked, want[0])


def test_errors():
    q = torch.randn(1, 2, 13, 8)
    pos = torch.arange(13)[None]
    with pytest.raises(ValueError, match="head_dim must be a multiple of 4 for RoPE-Mixed"):
        RotaryMixed(6, 2)
    with pytest.raises(TypeError, match=r"heads must be an int, got 2.0"):
        RotaryMixed(8, 2.0)
    with pytest.raises(ValueError, match=r"size must be a tuple of 2 extents \(H, W\).*got \(3,"):
        RotaryMixed(8, 2, size=(3,))
    with pytest.raises(ValueError, match=r"size\[1\] must be >= 1, got 0"):
        RotaryND(8, (2, 2), size=(3, 0))
    with pytest.raises(ValueError, match=r"axes .* must add up to head_dim/2=4, got \(2, 1\)"):
        RotaryND(8, (2, 1))
    with pytest.raises(ValueError, match=r"axes must be a non-empty tuple .*got \(\)"):
        RotaryND(8, ())
    with pytest.raises(TypeError, match=r"axes\[0\] must be an int"):
        RotaryND(8, (2.0, 2))
    with pytest.raises(ValueError, match=r"style must be 'axial' .* or 'mrope' .*got 'half'"):
        RotaryND(8, (2, 2), style="half")
    with pytest.raises(ValueError, match=r"head_dim must be even"):
        RotaryND(7, (2, 2))
    with pytest.raises(TypeError, match=r"prefix_tokens must be an int .*got True \(bool\)"):
        RotaryND(8, (2, 2), prefix_tokens=True)
    with pytest.raises(ValueError, match=r"prefix_tokens must be >= 0 .*got -1; pass 0"):
        RotaryMixed(8, 2, prefix_tokens=-1)
    with pytest.raises(ValueError, match=r"RotaryND needs the grid size .* size=\(S_0, S_1\)"):
        RotaryND(8, (2, 2)).rotate(q, q, pos, pos)
    with pytest.raises(ValueError, match=r"RotaryMixed.forward needs the grid size"):
        RotaryMixed(8, 2)(q, q)
    rope = RotaryMixed(8, 2, size=(3, 4), prefix_tokens=1)  # positions 0..12
    with pytest.raises(
        ValueError,
        match=r"query positions reach 13 but RotaryMixed\(size=\(3, 4\), prefix_tokens=1\) has "
        r"positions 0..12 \(1 prefix tokens, then 3\*4 grid cells",
    ):
        rope.rotate(q, q, pos + 1, pos)
    with pytest.raises(ValueError, match=r"key positions reach -1"):
        rope.rotate(q, q, pos, pos - 1)
    with pytest.raises(ValueError, match=r"q has 12 tokens .* needs 13 = 1 \+ 3\*4"):
        rope(q[:, :, 1:], q[:, :, 1:])
    with pytest.raises(ValueError, match=r"layout must be 'bhnd' .* or 'bnhd' .*got 'nhd'"):
        rope(q, q, layout="nhd")
    with pytest.raises(ValueError, match=r"q must have last dimension head_dim=8"):
        rope(q[..., :4], q[..., :4])
    with pytest.raises(TypeError, match=r"q must be a floating-point tensor"):
        rope(q.long(), q)
    coords = torch.zeros(13, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"q_coords must have shape \[n, N\] or \[B', n, N\] "):
        rope.rotate_at(q, q, coords[:, :1], coords)
    with pytest.raises(TypeError, match=r"k_coords must be an integer or float tensor"):
        rope.rotate_at(q, q, coords, coords.bool())
    # per-head frequencies: another head count, or keys shared by query heads (GQA)
    with pytest.raises(ValueError, match=r"built for heads=2, head_dim=8 .* heads=4, head_dim=4"):
        MultiHeadAttention(16, 4, position=RotaryMixed(8, 2, size=(3, 4)))
    with pytest.raises(ValueError, match=r"RotaryND was built for head_dim=8 .*head_dim=4"):
        MultiHeadAttention(16, 4, position=RotaryND(8, (2, 2), size=(3, 4)))
    gqa = MultiHeadAttention(16, 2, kv_heads=1, position=RotaryMixed(8, 2, size=(3, 4)))
    with pytest.raises(ValueError, match=r"k has 1 heads .* use kv_heads=heads"):
        gqa(torch.randn(1, 12, 16))


def test_grouped_query_attention_with_nd_rope_is_repeated_keys():
    scheme = build("mrope-3d").double()
    torch.manual_seed(0)
    q = torch.randn(2, 4, 12, 8, dtype=F64)
    k, v = torch.randn(2, 2, 12, 8, dtype=F64), torch.randn(2, 2, 12, 8, dtype=F64)
    got = attention(q, k, v, position=scheme, causal=True)
    want = attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), position=scheme, causal=True
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_meta_construction_and_repr():
    with torch.device("meta"):
        rope = RotaryMixed(8, 2, size=(3, 4))
    assert rope.freqs.is_meta
    rope.to_empty(device="cpu")
    rope.reset_parameters()
    assert rope.freqs.isfinite().all()
    assert "heads=2" in repr(rope)
    assert "style='mrope'" in repr(RotaryND(8, (2, 2), style="mrope"))
