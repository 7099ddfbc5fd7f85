"""_rotary_buffer (an attention call without gradients rotates into the kept buffer) and the
_rotary_runs functions it calls (runs_into, rotate_runs_into); the layout of a rotation's
gradient in an attention call."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import posenc
from posenc import KVCache, MultiHeadAttention, Rotary
from posenc._rotary_buffer import runs_into as rotary_runs_into
from posenc._rotary_runs import rotate_runs_into, runs_into
from posenc.engine import tuning, workspace
from posenc.indices import run_positions
from posenc.rotary_scaling import LinearScaling
from tolerances import assert_close, logit_size


def reference_rotation(x, positions, *, base=10000.0, interleaved=False, rotary_dim=None):
    """Each pair turned by ``p * base^(-2i/r)``: a 2x2 matrix per position, float64."""
    d = x.shape[-1]
    r = d if rotary_dim is None else rotary_dim
    out = x.double().clone()
    for i in range(r // 2):
        a, c = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
        for t, p in enumerate(positions.tolist()):
            angle = p * base ** (-2 * i / r)
            cos, sin = math.cos(angle), math.sin(angle)
            xa, xc = x[..., t, a].double(), x[..., t, c].double()
            out[..., t, a], out[..., t, c] = xa * cos - xc * sin, xa * sin + xc * cos
    return out


def reference_attention(q, k, v, positions, **rope):
    """softmax(rot(q) rot(k)^T / sqrt(d)) v, float64, grouped key heads repeated."""
    q, k = (reference_rotation(x, positions, **rope) for x in (q, k))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.double().repeat_interleave(q.shape[1] // v.shape[1], 1)
    weights = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
    return weights @ v


@pytest.fixture
def buffered(monkeypatch):
    """Every rotation without gradients in an attention call takes the kept buffer; the
    thread's buffers are handed back before and after."""
    monkeypatch.setattr(tuning, "ROTATION_BUFFER_ELEMENTS", 1)
    workspace.release_workspace()
    yield
    workspace.release_workspace()


def _inputs(dtype, heads_kv=4, transposed=False, n=12, d=16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, n, 4, d, generator=gen, dtype=dtype)  # [b, n, h, d]: a projection's view
    q = q.transpose(1, 2) if transposed else q.transpose(1, 2).contiguous()  # [b, h, n, d]
    k, v = (torch.randn(2, heads_kv, n, d, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("heads_kv", "transposed"), [(4, False), (2, True)])
def test_attention_without_gradients_rotates_into_the_kept_buffer(
    buffered, interleaved, rotary_dim, dtype, heads_kv, transposed
):
    q, k, v = _inputs(dtype, heads_kv, transposed)
    rope = dict(interleaved=interleaved, rotary_dim=rotary_dim)
    with torch.no_grad():
        out = posenc.attention(q, k, v, position=Rotary(16, **rope))
    assert workspace.kept_elements() >= q.numel() + k.numel()  # the buffer was lent
    assert not workspace._kept.lent  # and handed back
    expected = reference_attention(q, k, v, torch.arange(12), **rope)
    rq = reference_rotation(q, torch.arange(12), **rope)
    rk = reference_rotation(k, torch.arange(12), **rope).repeat_interleave(4 // heads_kv, 1)
    assert_close(out, expected, terms=16, logit=logit_size(rq, rk), dtype=dtype)


def test_inference_mode_and_positions_given_as_a_run(buffered):
    q, k, v = _inputs(torch.float32)
    expected = reference_attention(q, k, v, torch.arange(5, 17))
    logit = logit_size(*(reference_rotation(x, torch.arange(5, 17)) for x in (q, k)))
    with torch.inference_mode():
        out = posenc.attention(q, k, v, position=Rotary(16), positions=torch.arange(5, 17))
    assert workspace.kept_elements() >= q.numel() + k.numel()
    assert_close(out, expected, terms=16, logit=logit)


def test_the_output_is_no_view_of_the_buffer_and_outlives_the_next_call(buffered):
    q, k, v = _inputs(torch.float32)
    rotary = Rotary(16)
    with torch.no_grad():
        first = posenc.attention(q, k, v, position=rotary)
        kept = first.clone()
        flat = next(iter(workspace._kept.buffers.values()))
        begin, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        assert not begin <= first.data_ptr() < end
        posenc.attention(q * 2, k * 3, v, position=rotary)  # writes the buffer again
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


def test_a_key_padding_mask_takes_the_buffer_too(buffered):
    q, k, v = _inputs(torch.float64)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 9:] = True
    with torch.no_grad():
        got = posenc.attention(q, k, v, position=Rotary(16), key_padding_mask=padding)
        assert workspace.kept_elements() >= q.numel() + k.numel()
        want = posenc.attention(
            q, k, v, position=Rotary(16), key_padding_mask=padding, backend="math"
        )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_weights_of_a_module_call_are_those_of_the_rotation(buffered):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 2, position=Rotary(16)).double().eval()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    with torch.no_grad():
        out, weights = m(x, need_weights=True)
        assert workspace.kept_elements() > 0
        q, k, v = (
            proj(x).unflatten(-1, (2, 16)).transpose(1, 2)
            for proj in (m.q_proj, m.k_proj, m.v_proj)
        )  # [b, h, n, d] each
    want = reference_attention(q, k, v, torch.arange(12))
    rq, rk = (reference_rotation(t, torch.arange(12)) for t in (q, k))
    torch.testing.assert_close(
        weights, (rq @ rk.transpose(-1, -2) / 4).softmax(-1), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(out, m.out_proj(want.transpose(1, 2).flatten(2)), rtol=0, atol=1e-12)


class _SubRotary(Rotary):
    pass


def _cos_sin_set_on_the_instance():
    rotary = Rotary(16)
    rotary.cos_sin = rotary.cos_sin  # the instance's own: the call must read it
    return rotary


@pytest.mark.parametrize(
    "make",
    [
        lambda: _SubRotary(16),
        _cos_sin_set_on_the_instance,
        lambda: Rotary(16, scaling=LinearScaling(2.0)),
    ],
    ids=["subclass", "cos-sin-on-the-instance", "scaling"],
)
def test_other_rotations_take_new_tensors(buffered, make):
    q, k, v = _inputs(torch.float64)
    rotary = make()
    with torch.no_grad():
        got = posenc.attention(q, k, v, position=rotary)
    assert workspace.kept_elements() == 0
    with torch.no_grad():
        rq, rk = rotary.rotate(q, k, run_positions(0, 12), run_positions(0, 12))
    want = torch.nn.functional.scaled_dot_product_attention(rq, rk, v)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_gradients_low_precision_and_small_calls_take_new_tensors(buffered, monkeypatch):
    q, k, v = _inputs(torch.float32)
    q.requires_grad_(True)
    posenc.attention(q, k, v, position=Rotary(16)).sum().backward()  # a graph: SDPA saves q, k
    assert q.grad is not None
    with torch.no_grad():
        posenc.attention(*(x.bfloat16() for x in (q, k, v)), position=Rotary(16))
    assert workspace.kept_elements() == 0
    monkeypatch.setattr(tuning, "ROTATION_BUFFER_ELEMENTS", q.numel() + 1)  # below it
    with torch.no_grad():
        posenc.attention(q, k, v, position=Rotary(16))
    assert workspace.kept_elements() == 0


def test_positions_that_are_no_run_hand_the_buffer_back_and_rotate_as_given(buffered):
    q, k, v = _inputs(torch.float64)
    positions = torch.tensor([0, 2, 3, 7, 8, 9, 10, 11, 13, 14, 15, 20])
    with torch.no_grad():
        got = posenc.attention(q, k, v, position=Rotary(16), positions=positions)
    assert not workspace._kept.lent
    torch.testing.assert_close(got, reference_attention(q, k, v, positions), rtol=0, atol=1e-12)


def test_a_kv_cache_keeps_the_keys_in_their_channel_order(buffered):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 2, position=Rotary(16)).eval()
    x = torch.randn(1, 6, 32)
    cache = KVCache()
    with torch.no_grad():
        full = m(x, causal=True)
        steps = [m(x[:, :4], causal=True, cache=cache), m(x[:, 4:], causal=True, cache=cache)]
    assert workspace.kept_elements() >= 2 * 6 * 16  # the full call took the buffer
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)


def test_an_error_inside_the_call_hands_the_buffer_back(buffered, monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("inside attend")

    monkeypatch.setattr(importlib.import_module("posenc.attention"), "attend", failing)
    q, k, v = _inputs(torch.float32)
    with torch.no_grad(), pytest.raises(RuntimeError, match="inside attend"):
        posenc.attention(q, k, v, position=Rotary(16))
    assert workspace.kept_elements() > 0 and not workspace._kept.lent


def test_a_buffer_already_lent_leaves_it_alone(buffered):
    q, k, v = _inputs(torch.float64)
    with torch.no_grad():
        want = posenc.attention(q, k, v, position=Rotary(16))
        with workspace.borrowed(q.numel() + k.numel(), q.dtype, q.device) as flat:
            flat.fill_(7.0)  # what a caller holding the buffer wrote
            got = posenc.attention(q, k, v, position=Rotary(16))
            assert bool((flat == 7.0).all())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_rotate_runs_into_keeps_every_dot_product(interleaved, rotary_dim):
    q, k, _ = _inputs(torch.float64)
    pos = run_positions(3, 12)
    flat = torch.empty(q.numel() + k.numel(), dtype=q.dtype)
    with torch.no_grad():
        runs = runs_into(q, k, pos, pos)
        rq, rk = rotate_runs_into(q, k, runs, rotary_dim or 16, 10000.0, interleaved, flat)
    assert rq.data_ptr() == flat.data_ptr() and rq.shape == q.shape and rk.shape == k.shape
    want_q, want_k = (
        reference_rotation(x, torch.arange(3, 15), interleaved=interleaved, rotary_dim=rotary_dim)
        for x in (q, k)
    )
    torch.testing.assert_close(
        rq @ rk.transpose(-1, -2), want_q @ want_k.transpose(-1, -2), rtol=0, atol=1e-12
    )
    r = rotary_dim or 16
    if interleaved:  # the pairs stay in place: the rotation itself
        torch.testing.assert_close(rq, want_q, rtol=0, atol=1e-13)
    else:  # the pairs (i, i + r/2) side by side
        torch.testing.assert_close(rq[..., 0:r:2], want_q[..., : r // 2], rtol=0, atol=1e-13)
        torch.testing.assert_close(rq[..., 1:r:2], want_q[..., r // 2 : r], rtol=0, atol=1e-13)
    torch.testing.assert_close(rq[..., r:], q[..., r:], rtol=0, atol=0)


def test_runs_into_declines_what_the_buffer_does_not_take():
    q, k, _ = _inputs(torch.float32)
    pos = run_positions(0, 12)
    with torch.no_grad():
        assert runs_into(q, k, pos, pos) == [(0, 12)]
        assert runs_into(q, k, pos, run_positions(4, 12)) == [(0, 12), (4, 12)]
        assert runs_into(q.bfloat16(), k.bfloat16(), pos, pos) is None
        assert runs_into(q, k.double(), pos, pos) is None
        assert runs_into(q[:, :, :0], k, pos[:, :0], pos) is None
        assert runs_into(q, k, torch.tensor([[0, 2, *range(3, 13)]]), pos) is None
        assert rotary_runs_into(_SubRotary(16), q, k, pos, pos) is None
        assert rotary_runs_into(Rotary(16, scaling=LinearScaling(2.0)), q, k, pos, pos) is None
        assert rotary_runs_into(Rotary(16), q, k, pos, pos) == [(0, 12)]
    q.requires_grad_(True)
    assert runs_into(q, k, pos, pos) is None  # a graph would save the buffer
    assert runs_into(q.detach(), k.requires_grad_(True), pos, pos) is None


def test_a_patched_rotary_class_is_called_as_patched(buffered, monkeypatch):
    """A spy or mock on the class (its rotate, its tables, a hook added) is called: the
    buffer stands only for Rotary's own methods."""
    q, k, v = _inputs(torch.float64)
    seen = []
    rotate = Rotary.rotate

    def spy(self, *args):
        seen.append(1)
        return rotate(self, *args)

    monkeypatch.setattr(Rotary, "rotate", spy)
    with torch.no_grad():
        posenc.attention(q, k, v, position=Rotary(16))
    assert seen == [1] and workspace.kept_elements() == 0
    monkeypatch.undo()
    monkeypatch.setattr(tuning, "ROTATION_BUFFER_ELEMENTS", 1)
    cos_sin = Rotary.cos_sin
    monkeypatch.setattr(Rotary, "cos_sin", lambda self, *a, **kw: cos_sin(self, *a, **kw))
    pos = run_positions(0, 12)
    assert rotary_runs_into(Rotary(16), q, k, pos, pos) is None
    monkeypatch.undo()
    monkeypatch.setattr(Rotary, "score_term", lambda self, q, q_pos, k_pos: None, raising=False)
    assert rotary_runs_into(Rotary(16), q, k, pos, pos) is None
    monkeypatch.undo()
    assert rotary_runs_into(Rotary(16), q, k, pos, pos) == [(0, 12)]


# ----- calls with gradients: the rotations' backward ---------------------------------------


def _projected(n=12, d=16, heads=4, dtype=torch.float64, layout="projection"):
    """``q, k, v [b, h, n, d]`` asking for gradients: views of one projection's ``[b, n, 3,
    h, d]`` output (as a model's), or leaves of their own."""
    gen = torch.Generator().manual_seed(0)
    if layout == "leaves":
        leaves = [torch.randn(2, heads, n, d, generator=gen, dtype=dtype) for _ in range(3)]
        return tuple(x.requires_grad_() for x in leaves)
    qkv = torch.randn(2, n, 3, heads, d, generator=gen, dtype=dtype).requires_grad_()
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))  # [b, n, h, d] -> [b, h, n, d]
    return q, k, v


def _arriving(x):
    """The gradients that reach ``x``, as a list filled by a hook."""
    found = []
    x.register_hook(lambda grad: found.append(grad))
    return found


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["projection", "leaves"])
def test_gradients_of_a_rotated_call_are_the_definitions_in_the_inputs_layout(interleaved, layout):
    """float64, fused CPU kernel: the gradients of ``q``, ``k``, ``v`` equal those of the
    rotation and attention written out (2x2 matrices per position), and the rotation's
    gradient reaches ``q`` and ``k`` laid out as they are (the kernel writes its
    gradients ``[b, n, h, d]``; a contiguous leaf would otherwise take a copy of each), dense
    (a view of a projection's output is not: the order of its strides)."""
    q, k, v = _projected(layout=layout)
    rotary = Rotary(16, interleaved=interleaved)
    seen_q, seen_k = _arriving(q), _arriving(k)
    out = posenc.attention(q, k, v, position=rotary)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    grad = torch.randn_like(out)
    found = torch.autograd.grad(out, (q, k, v), grad)
    positions = torch.arange(12)
    expected_out = reference_attention(q, k, v, positions, interleaved=interleaved)
    expected = torch.autograd.grad(expected_out, (q, k, v), grad)
    for got, want in zip(found, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for seen, x in ((seen_q, q), (seen_k, k)):
        assert _order(seen[0]) == _order(x) and seen[0].permute(*_order(x)).is_contiguous()


def _order(x):
    """The dimensions of ``x`` from the largest stride to the smallest: its layout."""
    return sorted(range(x.ndim), key=lambda i: -x.stride(i))


@pytest.mark.parametrize("interleaved", [False, True])
def test_batched_gradients_through_a_rotation(interleaved):
    """Autograd's batched gradients (``is_grads_batched``, vmap over the backward) and a
    vectorized Jacobian: the rotation's backward takes no ``out=`` product there, nor a
    complex view of the pairs (vmap has no rule for either), and each row equals the
    gradient taken alone."""
    q, k, v = _projected(n=6, d=8, heads=2, layout="leaves")
    rotary = Rotary(8, interleaved=interleaved)
    out = posenc.attention(q, k, v, position=rotary)
    grads = torch.randn(3, *out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
    (batched,) = torch.autograd.grad(out, q, grads, is_grads_batched=True, retain_graph=True)
    for row, grad in zip(batched, grads, strict=True):
        (alone,) = torch.autograd.grad(out, q, grad, retain_graph=True)
        torch.testing.assert_close(row, alone, rtol=0, atol=1e-14)
    jacobian = torch.autograd.functional.jacobian(
        lambda x: posenc.attention(x, k.detach(), v.detach(), position=rotary),
        q.detach(),
        vectorize=True,
    )  # [b, h, n, d, b, h, n, d]
    (first,) = torch.autograd.grad(out[0, 0, 0, 0], q)
    torch.testing.assert_close(jacobian[0, 0, 0, 0], first, rtol=0, atol=1e-14)
