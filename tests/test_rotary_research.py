"""xPos (Sun et al. 2022) against the paper's equation written out here in float64 loops
(each pair as an explicit 2x2 rotation times a power of zeta, and the scores as sums of
complex numbers), against torchscale's formula reimplemented here, its gradients
(``torch.autograd.gradcheck``), inside attention on every backend and with a KV cache,
its position range and its errors. The cross-scheme tests run it through the registry."""

from __future__ import annotations

import cmath
import math
import re

import pytest
import torch

from posenc import KVCache, MultiHeadAttention, XPos, attention, registry
from posenc.rotary_research import xpos_decay, xpos_scale
from tolerances import assert_close

GAMMA = 0.4


def zeta(k: int, d: int, gamma: float = GAMMA) -> float:
    """The paper's decay of pair ``k``: ``(k / (d/2) + gamma) / (1 + gamma)``."""
    return (k / (d / 2) + gamma) / (1 + gamma)


def theta(k: int, d: int, base: float = 10000.0) -> float:
    """RoPE's frequency of pair ``k``: ``base ** (-2k/d)``."""
    return base ** (-2 * k / d)


def pair_channels(d: int, interleaved: bool) -> list[tuple[int, int]]:
    return [(2 * k, 2 * k + 1) if interleaved else (k, k + d // 2) for k in range(d // 2)]


def row(positions: torch.Tensor, b: int) -> list[int]:
    """The positions of batch row ``b`` of ``[B', n]`` positions."""
    return positions[b if positions.shape[0] > 1 else 0].tolist()


def paper_rotated(x, positions, *, key, scale_base, interleaved=True):
    """Pair ``(a, c)`` of ``x [b, h, n, d]`` at position ``p``: ``zeta_k ** (+-p / s)`` times
    ``[[cos p theta_k, -sin p theta_k], [sin p theta_k, cos p theta_k]] @ (x_a, x_c)``,
    ``+`` for queries, ``-`` for keys. float64, loops."""
    b, _, n, d = x.shape
    out = torch.empty(x.shape, dtype=torch.float64)
    for bi in range(b):
        pos = row(positions, bi)
        for t in range(n):
            p = pos[t]
            for k, (a, c) in enumerate(pair_channels(d, interleaved)):
                factor = zeta(k, d) ** ((-p if key else p) / scale_base)
                cos, sin = math.cos(p * theta(k, d)), math.sin(p * theta(k, d))
                xa, xc = x[bi, :, t, a].double(), x[bi, :, t, c].double()  # [h]
                out[bi, :, t, a] = factor * (cos * xa - sin * xc)
                out[bi, :, t, c] = factor * (sin * xa + cos * xc)
    return out


def paper_scores(q, k, q_pos, k_pos, *, scale_base, interleaved=True):
    """``Re[sum_k q~_k conj(k~_k) zeta_k^((m - n)/s) e^(i (m - n) theta_k)]`` for every query
    ``m`` and key ``n``, each pair a complex number ``x_a + i x_c``: ``[b, h, n_q, n_k]``,
    float64, loops."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    qs, ks = q.double().tolist(), k.double().tolist()
    out = torch.empty(b, h, n_q, n_k, dtype=torch.float64)
    for bi in range(b):
        qp, kp = row(q_pos, bi), row(k_pos, bi)
        for hi in range(h):
            for i in range(n_q):
                for j in range(n_k):
                    m, n = qp[i], kp[j]
                    total = 0j
                    for pk, (a, c) in enumerate(pair_channels(d, interleaved)):
                        qz = complex(qs[bi][hi][i][a], qs[bi][hi][i][c])
                        kz = complex(ks[bi][hi][j][a], ks[bi][hi][j][c])
                        total += (
                            qz
                            * kz.conjugate()
                            * zeta(pk, d) ** ((m - n) / scale_base)
                            * cmath.exp(1j * (m - n) * theta(pk, d))
                        )
                    out[bi, hi, i, j] = total.real
    return out


def close64(got, want):
    """float64 against float64 loops: ``exp`` of an argument ``x`` rounded to ``eps * |x|``
    moves the factor by that much relative, far below 1e-10 at these positions."""
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * scale)


#: (q positions, k positions): consecutive, shifted, scattered, and per batch row
POSITIONS = [
    ([list(range(6))], [list(range(6))]),
    ([list(range(40, 46))], [list(range(37, 46))]),
    ([[5, 9, 2, 40]], [[0, 1, 7, 33, 40, 41]]),
    ([list(range(4)), [10, 3, 12, 30]], [list(range(5)), [0, 2, 11, 12, 29]]),
]
IDS = ["consecutive", "shifted", "scattered", "per-row"]


def _inputs(q_pos, k_pos, *, d=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, len(q_pos[0]), d, generator=gen, dtype=dtype)
    k = torch.randn(2, 2, len(k_pos[0]), d, generator=gen, dtype=dtype)
    return q, k, torch.tensor(q_pos), torch.tensor(k_pos)


# ----- the maths ------------------------------------------------------------------------------


def test_decay_and_scale_are_the_papers():
    d = 8
    torch.testing.assert_close(
        xpos_decay(d), torch.tensor([zeta(k, d) for k in range(d // 2)], dtype=torch.float64)
    )
    assert xpos_decay(d).dtype == torch.float64
    assert float(xpos_decay(d, gamma=1.0)[0]) == 0.5  # gamma / (1 + gamma)
    positions = torch.tensor([[0, 3, -7, 1000]])
    got = xpos_scale(positions, xpos_decay(d), 16.0)  # [1, 4, d/2]
    want = torch.tensor(
        [[[zeta(k, d) ** (p / 16) for k in range(d // 2)] for p in (0, 3, -7, 1000)]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(
        xpos_scale(positions, xpos_decay(d), 16.0, inverse=True), 1 / want, rtol=1e-12, atol=0
    )


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize(("q_pos", "k_pos"), POSITIONS, ids=IDS)
def test_rotation_equals_the_papers_map(q_pos, k_pos, interleaved):
    q, k, qp, kp = _inputs(q_pos, k_pos)
    xpos = XPos(8, scale_base=16.0, interleaved=interleaved)
    rq, rk = xpos.rotate(q, k, qp, kp)
    assert rq.dtype == rk.dtype == torch.float64
    close64(rq, paper_rotated(q, qp, key=False, scale_base=16.0, interleaved=interleaved))
    close64(rk, paper_rotated(k, kp, key=True, scale_base=16.0, interleaved=interleaved))


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize(("q_pos", "k_pos"), POSITIONS, ids=IDS)
def test_scores_equal_the_papers_equation(q_pos, k_pos, interleaved):
    q, k, qp, kp = _inputs(q_pos, k_pos)
    rq, rk = XPos(8, scale_base=16.0, interleaved=interleaved).rotate(q, k, qp, kp)
    want = paper_scores(q, k, qp, kp, scale_base=16.0, interleaved=interleaved)
    close64(rq @ rk.transpose(-2, -1), want)


@pytest.mark.parametrize(("q_pos", "k_pos"), POSITIONS, ids=IDS)
def test_float32_rotation_is_the_float64_one_rounded(q_pos, k_pos):
    q, k, qp, kp = _inputs(q_pos, k_pos, dtype=torch.float32)
    rq, rk = XPos(8, scale_base=16.0).rotate(q, k, qp, kp)
    assert rq.dtype == rk.dtype == torch.float32
    for got, x, pos, key in ((rq, q, qp, False), (rk, k, kp, True)):
        want = paper_rotated(x, pos, key=key, scale_base=16.0)
        # each element: a factor rounded once, two products and a sum of values up to
        # max|x| * the largest factor of these positions
        top = max(zeta(0, 8) ** (-abs(p) / 16.0) for p in pos.flatten().tolist())
        assert_close(got, want, magnitude=float(x.abs().max()) * top, terms=4)


def test_scores_are_relative():
    """Translation invariance: moving every position by the same amount leaves the scores
    unchanged, in float64 and (within its range) float32."""
    q_pos, k_pos = [[3, 4, 9, 20]], [[0, 1, 2, 3, 9, 17, 25]]
    q, k, qp, kp = _inputs(q_pos, k_pos)
    xpos = XPos(8, scale_base=16.0)
    rq, rk = xpos.rotate(q, k, qp, kp)
    base = rq @ rk.transpose(-2, -1)
    for shift in (1, 250, -600):
        rq, rk = xpos.rotate(q, k, qp + shift, kp + shift)
        close64(rq @ rk.transpose(-2, -1), base)
    xpos32 = XPos(8)  # scale_base 512: range 35,694 in float32
    q32, k32 = q.float(), k.float()
    rq, rk = xpos32.rotate(q32, k32, qp, kp)
    base = paper_scores(q, k, qp, kp, scale_base=512.0)
    # the terms of a score: |q~_k| |k~_k| zeta_k^((m - n)/s), at most the largest of them
    size = float((q.abs() @ k.abs().transpose(-2, -1)).max()) * zeta(0, 8) ** (-25 / 512)
    for shift in (0, 3000, -3000, 35000 - 25):
        rq, rk = xpos32.rotate(q32, k32, qp + shift, kp + shift)
        assert_close(rq @ rk.transpose(-2, -1), base, magnitude=size, terms=8)


def test_gradients_of_q_and_k():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    qp, kp = torch.tensor([[2, 7, 3, 11]]), torch.tensor([[0, 4, 7, 8, 11]])
    for interleaved in (True, False):
        xpos = XPos(6, scale_base=4.0, interleaved=interleaved)
        assert torch.autograd.gradcheck(xpos.rotate, (q, k, qp, kp))

        def scores(a, b, xpos=xpos):
            ra, rb = xpos.rotate(a, b, qp, kp)
            return ra @ rb.transpose(-2, -1)

        assert torch.autograd.gradcheck(scores, (q, k))


# ----- torchscale's formula, a second oracle ----------------------------------------------------


def torchscale_xpos(x, *, downscale, scale_base, centre):
    """torchscale's XPOS (torchscale/component/xpos_relative_position.py) on ``x [B, L, d]``
    at offset 0, written here from its formula: the angles ``t * 10000 ** (-j / (d/2))`` at
    ``t = 0 .. L-1``, the scale ``((2j + 0.4 d) / (1.4 d)) ** (t' / scale_base)`` at ``t'``
    from ``floor(-L / 2)`` (``centre=False``: from 0), inverted for keys; cos and sin times
    the scale, each repeated for the two channels of a pair, and ``x * cos +
    rotate_every_two(x) * sin`` with ``rotate_every_two(x)[2j] = -x[2j+1]``,
    ``[2j+1] = x[2j]``."""
    length, d = x.shape[1], x.shape[2]
    x = x.double()
    scale = (torch.arange(0, d, 2, dtype=torch.float64) + 0.4 * d) / (1.4 * d)  # [d/2]
    start = math.floor(-length / 2) if centre else 0
    steps = torch.arange(start, start + length, dtype=torch.float64)  # [L]
    scale = scale ** (steps[:, None] / scale_base)  # [L, d/2]
    inv_freq = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float64) / (d // 2))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq  # [L, d/2]
    if downscale:
        scale = 1 / scale
    cos = (angles.cos() * scale).repeat_interleave(2, -1)  # [L, d]
    sin = (angles.sin() * scale).repeat_interleave(2, -1)
    swapped = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)  # [B, L, d]
    return x * cos + swapped * sin


@pytest.mark.parametrize("length", [7, 8])
def test_matches_torchscale_formula_at_offset_0(length):
    """The reference centres the positions of each call; its scores do not see it (the
    shift cancels in ``m - n``), and without the centring its rotation is ours."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, length, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, length, 16, generator=gen, dtype=torch.float64)
    xpos = XPos(16, scale_base=4.0)  # a short scale base: the decay shows within 8 tokens
    rq, rk = xpos(q, k)
    flat_q, flat_k = q.flatten(0, 1), k.flatten(0, 1)  # [b, h, L, d] -> [b*h, L, d]
    for centre in (False, True):
        tq = torchscale_xpos(flat_q, downscale=False, scale_base=4.0, centre=centre)
        tk = torchscale_xpos(flat_k, downscale=True, scale_base=4.0, centre=centre)
        if not centre:
            close64(rq.flatten(0, 1), tq)
            close64(rk.flatten(0, 1), tk)
        close64((rq @ rk.transpose(-2, -1)).flatten(0, 1), tq @ tk.transpose(-2, -1))


def test_the_two_layouts_pair_the_same_channels_with_the_same_decay():
    """``interleaved=False`` pairs ``(k, k + d/2)`` with ``theta_k`` and ``zeta_k``: the
    interleaved rotation of the channels permuted into pairs ``(2k, 2k+1)``."""
    q, k, qp, kp = _inputs(*POSITIONS[2])
    d = 8
    order = torch.tensor([c for pair in pair_channels(d, False) for c in pair])  # half -> pairs
    half = XPos(d, scale_base=16.0, interleaved=False).rotate(q, k, qp, kp)
    pairs = XPos(d, scale_base=16.0).rotate(q[..., order], k[..., order], qp, kp)
    for got, want in zip(half, pairs, strict=True):
        close64(got[..., order], want)


def test_forward_positions_offset_and_layouts():
    q, k, qp, kp = _inputs(*POSITIONS[3])
    xpos = XPos(8, scale_base=16.0)
    want = xpos.rotate(q, k, qp, kp)
    for got, expected in zip(xpos(q, k, qp, kp), want, strict=True):
        assert torch.equal(got, expected)
    # [b, h, n, d] <-> [b, n, h, d]
    got = xpos(q.transpose(1, 2), k.transpose(1, 2), qp, kp, layout="bnhd")
    for g, w in zip(got, want, strict=True):
        close64(g.transpose(1, 2), w)
    # default positions: offset + arange(n)
    q, k = q[:, :, :4], k[:, :, :4]
    positions = torch.arange(4)[None] + 9
    for g, w in zip(xpos(q, k, offset=9), xpos.rotate(q, k, positions, positions), strict=True):
        assert torch.equal(g, w)


# ----- inside attention ------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["math", "auto", "lean", "sdpa"])
def test_attention_equals_the_definition(backend, causal):
    """softmax of the paper's scores / sqrt(d) (keys after the query amplified when not
    causal), on every backend, float64; the query positions trail the keys (a decoding
    block) and are shifted."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    qp, kp = torch.arange(5, 9)[None] + 20, torch.arange(9)[None] + 20
    xpos = XPos(8, scale_base=16.0)
    got = attention(
        q, k, v, position=xpos, positions=qp, key_positions=kp, causal=causal, backend=backend
    )
    scores = paper_scores(q, k, qp, kp, scale_base=16.0) / math.sqrt(8)
    if causal:  # query i (position 25 + i) sees the keys up to its own position
        scores = scores.masked_fill(kp[0][None, :] > qp[0][:, None], float("-inf"))
    close64(got, scores.softmax(-1) @ v)


def test_multi_head_attention_backends_agree_outputs_and_gradients():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 10, 16, generator=gen, dtype=torch.float64)
    padding = torch.zeros(2, 10, dtype=torch.bool)
    padding[1, -3:] = True
    results = {}
    for backend in ("math", "auto", "lean", "sdpa"):
        torch.manual_seed(0)
        model = MultiHeadAttention(16, 2, position=XPos(8, scale_base=8.0), backend=backend)
        model = model.double()
        xi = x.clone().requires_grad_()
        out = model(xi, key_padding_mask=padding, causal=True, positions=torch.arange(10) + 30)
        (out * out.detach().cos()).sum().backward()
        results[backend] = (out, xi.grad, [p.grad for p in model.parameters()])
    reference = results.pop("math")
    for out, dx, grads in results.values():
        close64(out, reference[0])
        close64(dx, reference[1])
        for got, want in zip(grads, reference[2], strict=True):
            close64(got, want)


@pytest.mark.parametrize("backend", ["math", "auto"])
def test_decoding_with_a_cache_equals_one_causal_pass(backend):
    """Keys are cached rotated and scaled: the factors are of the position alone."""
    torch.manual_seed(0)
    model = MultiHeadAttention(16, 2, position=XPos(8, scale_base=8.0), backend=backend)
    model = model.double().eval()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    full = model(x, causal=True)
    cache = KVCache()
    steps = [model(x[:, :5], causal=True, cache=cache)]
    steps += [model(x[:, t : t + 1], causal=True, cache=cache) for t in range(5, 12)]
    close64(torch.cat(steps, 1), full)
    assert len(cache) == 12


# ----- range -----------------------------------------------------------------------------------


def test_max_position_is_the_documented_range():
    xpos = XPos(8)
    # the class docstring's numbers, and its formula s * ln(1/tiny) / ln((1 + gamma)/gamma)
    documented = {torch.float32: 35694, torch.bfloat16: 35694, torch.float16: 3966}
    documented[torch.float64] = 289519
    for dtype, bound in documented.items():
        reach = math.log(1 / torch.finfo(dtype).tiny) / math.log((1 + GAMMA) / GAMMA)
        assert xpos.max_position(dtype) == bound == math.floor(512 * reach), dtype
    assert XPos(8, scale_base=1024.0).max_position(torch.float16) in (2 * 3966, 2 * 3966 + 1)
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype"):
        xpos.max_position(torch.int64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_positions_at_the_bound_stay_finite_and_exact(dtype):
    xpos = XPos(8)
    bound = xpos.max_position(dtype)
    gen = torch.Generator().manual_seed(5)
    q64 = torch.rand(1, 1, 2, 8, generator=gen, dtype=torch.float64) * 2 - 1  # |x| <= 1
    k64 = torch.rand(1, 1, 2, 8, generator=gen, dtype=torch.float64) * 2 - 1
    for pos in ([bound, bound - 3], [-bound, 3 - bound]):
        positions = torch.tensor([pos])
        rq, rk = xpos.rotate(q64.to(dtype), k64.to(dtype), positions, positions)
        assert rq.isfinite().all() and rk.isfinite().all()
        # the factors are normal numbers: the shrunk side keeps every element (elements
        # below 1 may go subnormal, within the scores' absolute rounding below)
        assert (rq != 0).all() and (rk != 0).all()
        scores = rq.double() @ rk.double().transpose(-2, -1)
        want = paper_scores(q64.to(dtype), k64.to(dtype), positions, positions, scale_base=512.0)
        size = float((q64.abs() @ k64.abs().transpose(-2, -1)).max()) * 3.5 ** (3 / 512)
        assert_close(scores, want, magnitude=size, terms=8, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_positions_past_the_bound_raise_with_the_fix(dtype):
    xpos = XPos(8)
    bound = xpos.max_position(dtype)
    q = torch.zeros(1, 2, 2, 8, dtype=dtype)
    inside = torch.tensor([[0, bound]])
    for side, bad in (("q_pos", bound + 1), ("k_pos", -bound - 1)):
        q_pos = torch.tensor([[0, bad]]) if side == "q_pos" else inside
        k_pos = torch.tensor([[0, bad]]) if side == "k_pos" else inside
        with pytest.raises(
            ValueError, match=rf"{side} holds position {bad}.*\|p\| <= {bound}"
        ) as e:
            xpos.rotate(q, q, q_pos, k_pos)
        # the scale base that the message names serves the position
        needed = float(re.search(r"scale_base >= (\d+)", str(e.value)).group(1))
        XPos(8, scale_base=needed).rotate(q, q, q_pos, k_pos)
    with pytest.raises(ValueError, match=rf"q_positions holds position {bound + 1}"):
        xpos(q, q, torch.tensor([0, bound + 1]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=rf"offset={bound} \+ arange\(n\) holds position"):
        xpos(q, q, offset=bound)
    model = MultiHeadAttention(16, 2, position=xpos).to(dtype)
    with pytest.raises(ValueError, match=rf"q_pos holds position {bound + 1}"):
        model(torch.zeros(1, 2, 16, dtype=dtype), positions=torch.tensor([bound, bound + 1]))


def test_the_range_is_not_read_on_the_meta_device():
    xpos = XPos(8)
    with torch.device("meta"):
        q = torch.zeros(1, 2, 3, 8, dtype=torch.float16)
        positions = torch.full((1, 3), 10**6)
    rq, _ = xpos.rotate(q, q, positions, positions)
    assert rq.device.type == "meta" and rq.shape == q.shape


# ----- construction and errors ------------------------------------------------------------------


def test_construction_registry_and_repr():
    xpos = XPos(8)
    assert (xpos.scale_base, xpos.gamma, xpos.base, xpos.interleaved) == (512.0, 0.4, 1e4, True)
    assert xpos.supports_cache and xpos.state_dict() == {} and not list(xpos.parameters())
    assert repr(xpos) == (
        "XPos(head_dim=8, scale_base=512.0, gamma=0.4, base=10000.0, interleaved=True)"
    )
    entry = registry.get("xpos")
    assert (entry.place, entry.relative, entry.learned, entry.shared) == (2, True, False, True)
    assert entry.default_in == () and entry.cache
    built = entry.build(registry.Shape(heads=2, head_dim=16, max_len=32))
    assert isinstance(built, XPos) and built.head_dim == 16
    with torch.device("meta"):
        assert XPos(8).head_dim == 8


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"head_dim": 7}, ValueError, r"head_dim must be even \(channels are rotated in pairs"),
        ({"head_dim": 0}, ValueError, r"head_dim must be >= 1, got 0"),
        ({"head_dim": 8.0}, TypeError, r"head_dim must be an int, got 8.0"),
        ({"scale_base": 0}, ValueError, r"scale_base must be a finite number > 0, got 0"),
        ({"scale_base": "512"}, TypeError, r"scale_base must be a number, got '512'"),
        ({"gamma": -0.4}, ValueError, r"gamma must be a finite number > 0, got -0.4"),
        ({"base": float("inf")}, ValueError, r"base must be a finite number > 0, got inf"),
    ],
)
def test_constructor_errors(kwargs, error, match):
    kwargs = {"head_dim": 8, **kwargs}
    head_dim = kwargs.pop("head_dim")
    with pytest.raises(error, match=match):
        XPos(head_dim, **kwargs)


def test_forward_and_attention_errors():
    xpos = XPos(8)
    q = torch.zeros(1, 2, 3, 8)
    cases = [
        ((q[..., :6], q), {}, ValueError, r"q must have last dimension head_dim=8"),
        ((q[0], q), {}, ValueError, r"q must have shape \[b, h, n, d\]"),
        ((q, q.long()), {}, TypeError, r"k must be a floating-point tensor"),
        ((q, q), {"layout": "nhbd"}, ValueError, r"layout must be 'bhnd'.*got 'nhbd'"),
        ((q, q), {"offset": 1.5}, TypeError, r"offset must be an int, got 1.5"),
        ((q, q, torch.arange(3.0)), {}, TypeError, r"q_positions must be an integer tensor"),
        ((q, q, None, torch.arange(4)), {}, ValueError, r"k_positions must cover the sequence"),
    ]
    for args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            xpos(*args, **kwargs)
    with pytest.raises(ValueError, match=r"XPos was built for head_dim=8 .* head_dim=4"):
        MultiHeadAttention(16, 4, position=xpos)
