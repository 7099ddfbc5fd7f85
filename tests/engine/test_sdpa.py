"""posenc.engine.sdpa: SDPA's fused CPU kernel with gradients, its node given a second
derivative from SDPA's math kernel by a hook (the values and first-order gradients
SDPA's own), and the dispatcher's SDPA route without the create_graph wrapper on the CPU."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

import posenc
from posenc.engine import sdpa, tuning


def _masks(n_q, n_k, dtype):
    torch.manual_seed(3)
    allowed = torch.rand(2, 1, n_q, n_k) > 0.3
    allowed[..., 0] = True
    return {
        "none": (None, False),
        "float": (torch.randn(1, 3, n_q, n_k, dtype=dtype), False),
        "bool": (allowed, False),
        "causal": (None, True),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("which", "n_q", "n_k"),
    [(which, 6, 6) for which in ("none", "float", "bool", "causal")]
    + [(which, 4, 9) for which in ("none", "float", "bool")],  # SDPA's causal flag: squares
)
def test_the_kernel_route_equals_sdpa_bit_for_bit(dtype, which, n_q, n_k):
    """Values and gradients of q, k, v (one tensor passed as k and v) equal SDPA's own, bit
    for bit, from its fused kernel's node (the route is SDPA's fused kernel itself); and
    where SDPA's own graph has no second derivative, the route's gives the math kernel's."""
    attn_mask, causal = _masks(n_q, n_k, dtype)[which]
    torch.manual_seed(0)
    q = torch.randn(2, 3, n_q, 8, dtype=dtype)
    kv = torch.randn(2, 3, n_k, 8, dtype=dtype)
    weights = torch.randn(2, 3, n_q, 8, dtype=dtype)
    results = []
    for kernel in (F.scaled_dot_product_attention, sdpa._kernel):
        leaves = [q.clone().requires_grad_(), kv.clone().requires_grad_()]
        if kernel is F.scaled_dot_product_attention:
            out = kernel(*leaves, leaves[1], attn_mask=attn_mask, is_causal=causal, scale=0.3)
        else:
            out = kernel(*leaves, leaves[1], attn_mask, 0.0, causal, 0.3)
        (out * weights).sum().backward(retain_graph=True)
        results.append((out, *(x.grad for x in leaves), out.grad_fn, leaves))
    (*expected, native, plain), (*found, node, hooked) = results
    assert type(node).__name__ == sdpa._FLASH_CPU_NODE, type(native).__name__
    for a, b in zip(found, expected, strict=True):
        assert torch.equal(a, b)
    (g,) = torch.autograd.grad(results[1][0].square().sum(), hooked[0], create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="not implemented"):
        (g_plain,) = torch.autograd.grad(results[0][0].square().sum(), plain[0], create_graph=True)
        g_plain.sum().backward()


def test_without_gradients_or_with_a_learned_mask_sdpa_runs_itself():
    """No gradient asked for, dropout, or a mask that asks for one: SDPA itself (its math
    kernel differentiates the mask)."""
    q = torch.randn(1, 2, 5, 4, requires_grad=True)
    with torch.no_grad():
        assert sdpa._kernel(q, q, q, None, 0.0, False, 0.5).grad_fn is None
    dropped = sdpa._kernel(q, q, q, None, 0.1, False, 0.5)
    assert type(dropped.grad_fn).__name__ != sdpa._FLASH_CPU_NODE
    mask = torch.zeros(1, 2, 5, 5, requires_grad=True)
    out = sdpa._kernel(q.detach(), q.detach(), q.detach(), mask, 0.0, False, 0.5)
    assert type(out.grad_fn).__name__ != sdpa._FLASH_CPU_NODE
    (grad,) = torch.autograd.grad(out.sum(), mask)
    assert grad.shape == mask.shape


def _second_derivatives(scheme, backend, x, **kwargs):
    """The gradient of a gradient penalty: d/dx sum((d/dx sum(out * sin(out)))^2)."""
    leaf = x.clone().requires_grad_()
    out = posenc.attention(leaf * 2, leaf * 3, leaf, position=scheme, backend=backend, **kwargs)
    (g,) = torch.autograd.grad((out * out.detach().sin()).sum(), leaf, create_graph=True)
    (gg,) = torch.autograd.grad(g.square().sum(), leaf)
    return out, g, gg


@pytest.mark.parametrize(
    ("build", "n", "kwargs"),
    [
        (lambda: None, 12, {}),
        (lambda: None, 12, {"causal": True}),
        (lambda: posenc.Rotary(8), 12, {"key_padding_mask": torch.arange(12)[None] > 9}),
        (lambda: posenc.ALiBi(2), 12, {}),
    ],
    ids=["none", "causal", "rotary, padding", "alibi, sdpa route"],
)
def test_a_gradient_penalty_through_the_sdpa_route_equals_math_with_no_wrapper(
    monkeypatch, build, n, kwargs
):
    """float64: the first and second derivatives through auto's SDPA route equal the math
    path's, and the route's output node is the kernel's (no create_graph wrapper); ALiBi's
    constant bias on the materialised path's SDPA route (OPS_GRAD_BIAS_SCORES at 0)."""
    monkeypatch.setattr(tuning, "OPS_GRAD_BIAS_SCORES", 0)
    torch.manual_seed(0)
    x = torch.randn(1, 2, n, 8, dtype=torch.float64)
    scheme = build()
    out = posenc.attention(x.clone().requires_grad_(), x, x, position=scheme, **kwargs)
    assert "TwiceDifferentiable" not in type(out.grad_fn).__name__
    auto = _second_derivatives(scheme, "auto", x, **kwargs)
    math = _second_derivatives(scheme, "math", x, **kwargs)
    for a, b in zip(auto, math, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_dropout_keeps_the_wrapper():
    """Attention dropout (SDPA's math kernel, a mask drawn per call) takes the create_graph
    wrapper as before."""
    x = torch.randn(1, 2, 8, 4, requires_grad=True)
    out = posenc.attention(x, x, x, dropout_p=0.1)
    assert "TwiceDifferentiable" in type(out.grad_fn).__name__


def test_the_kernel_route_backwards_twice_with_retain_graph_and_raises_without():
    x = torch.randn(1, 2, 8, 4, requires_grad=True)
    loss = posenc.attention(x * 2, x, x).square().sum()
    (first,) = torch.autograd.grad(loss, x, retain_graph=True)
    (second,) = torch.autograd.grad(loss, x)
    assert torch.equal(first, second)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(loss, x)


def test_a_second_derivative_sets_none_of_sdpas_process_flags(monkeypatch):
    """The create_graph backward calls SDPA's math kernel itself: no ``sdpa_kernel()``
    context, whose save and restore of the process's flags interleave across threads."""
    set_flags = []
    for name in ("flash", "mem_efficient", "math", "cudnn", "overrideable"):
        flag = f"_set_sdp_use_{name}"
        if hasattr(torch._C, flag):
            monkeypatch.setattr(torch._C, flag, lambda on, name=name: set_flags.append(name))
    torch.manual_seed(0)
    x = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    _second_derivatives(None, "auto", x)
    assert set_flags == []


@pytest.mark.parametrize("shape", [(0, 2, 5, 4), (2, 0, 5, 4), (2, 2, 5, 0)])
def test_empty_inputs_keep_sdpas_own_answer_and_a_second_derivative(shape):
    """No batch, no heads or no channels: SDPA itself (the fused kernel's route would crash
    on no heads) with its answer (no channels: every score 0, each query the mean of the
    values), and the wrapper's second derivative."""
    torch.manual_seed(0)
    q = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*shape[:3], 3, dtype=torch.float64)
    out = posenc.attention(q * 2, q, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q * 2, q, v))
    assert type(out.grad_fn).__name__ != sdpa._FLASH_CPU_NODE
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert g.shape == shape
    assert sdpa._kernel(q, q, v, None, 0.0, False, 0.5).shape == (*shape[:3], 3)


def test_no_query_heads_against_one_key_head():
    """Grouped-query attention with no query heads: an empty output, with gradients."""
    q = torch.randn(2, 0, 5, 8, requires_grad=True)
    k = torch.randn(2, 1, 5, 8, requires_grad=True)
    out = posenc.attention(q, k, k)
    assert out.shape == (2, 0, 5, 8)
    out.sum().backward()
    assert k.grad.abs().sum() == 0


def test_the_mask_is_saved_through_autograd():
    """The mask goes through the saved-tensor hooks as SDPA's own node's does (activation
    checkpointing and offloading see it)."""
    q = torch.randn(1, 2, 6, 4, requires_grad=True)
    mask = torch.randn(1, 2, 6, 6)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = sdpa._kernel(q, q, q, mask, 0.0, False, 0.5)
    assert type(out.grad_fn).__name__ == sdpa._FLASH_CPU_NODE
    assert any(t is mask for t in packed)


def test_a_second_derivative_for_the_inputs_asked_for_one_tensor_thrice():
    """float64: ``create_graph=True`` through the kernel's node for one input of three (the
    engine asks the node for that one alone), and for one tensor passed as q, k and v:
    each differentiable again, equal to SDPA's math kernel's."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(1, 2, 6, 6, dtype=torch.float64)

    def math(q, k, v):
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, mask, 0.0, False, scale=0.4
        )[0]

    for args, wrt in (((x, k, k), k), ((x, x, x), x)):
        results = []
        for attend in (lambda *a: sdpa._kernel(*a, mask, 0.0, False, 0.4), math):
            out = attend(*args)
            assert attend is math or type(out.grad_fn).__name__ == sdpa._FLASH_CPU_NODE
            (g,) = torch.autograd.grad(out.sin().sum(), wrt, create_graph=True)
            (gg,) = torch.autograd.grad(g.square().sum(), x)
            results.append((g, gg))
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_the_hook_holds_no_tensor():
    """The hook keeps nothing of the call: the queries go when the kernel's node lets its
    saved tensors go (a backward that does not keep the graph), the output still alive."""
    x = torch.randn(1, 2, 6, 4, requires_grad=True)
    q = x * 2
    gone = weakref.ref(q)
    out = sdpa._kernel(q, x, x, None, 0.0, False, 0.5)
    assert type(out.grad_fn).__name__ == sdpa._FLASH_CPU_NODE
    del q
    assert gone() is not None  # saved by the node
    out.sum().backward()
    assert gone() is None


def test_without_a_current_node_the_dispatcher_wraps_the_route(monkeypatch):
    """A torch that does not tell a hook which node runs: the kernel's node gets no hook,
    and the dispatcher wraps the route for its second derivative, still the definition's
    (float64, against the math path)."""
    monkeypatch.setattr(sdpa, "_current_node", None)
    torch.manual_seed(0)
    x = torch.randn(1, 2, 12, 8, dtype=torch.float64)
    scheme = posenc.ALiBi(2)
    out = posenc.attention(x.clone().requires_grad_(), x, x, position=scheme)
    assert "TwiceDifferentiable" in type(out.grad_fn).__name__
    auto = _second_derivatives(scheme, "auto", x)
    math = _second_derivatives(scheme, "math", x)
    for a, b in zip(auto, math, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_a_second_derivative_under_activation_checkpointing():
    """float64, non-reentrant checkpointing (saved-tensor hooks that unpack once, which the
    node's own backward has done): the dispatcher wraps the route, and the second
    derivative is the math path's."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    x0 = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    results = []
    for backend in ("auto", "math"):
        x = x0.clone().requires_grad_()
        run = lambda t: posenc.attention(t * 2, t * 3, t, backend=backend)  # noqa: B023, E731
        out = checkpoint(run, x, use_reentrant=False)
        (g,) = torch.autograd.grad(out.sin().sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), x)
        results.append((out, g, gg))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not sdpa.differentiable_twice()
        out = posenc.attention(x0.clone().requires_grad_(), x0, x0)
    assert "TwiceDifferentiable" in type(out.grad_fn).__name__


def test_no_gradient_coming_into_the_node_with_create_graph():
    """A backward with ``create_graph=True`` that brings the kernel's node no gradient (a
    Function downstream returns None for it): nothing asked of the node, the rest of the
    gradient as the math path's."""

    class Drop(torch.autograd.Function):  # a + b, no gradient for a
        @staticmethod
        def forward(ctx, a, b):
            return a + b

        @staticmethod
        def backward(ctx, grad):
            return None, grad

    torch.manual_seed(0)
    x0 = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    grads = []
    for backend in ("auto", "math"):
        x = x0.clone().requires_grad_()
        z = Drop.apply(posenc.attention(x * 2, x, x, backend=backend), x.sin())
        (g,) = torch.autograd.grad(z.sum(), x, create_graph=True)
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_a_backward_that_names_no_node_keeps_the_kernels_gradients(monkeypatch):
    """Where the backward does not say which node runs (compiled autograd), the hook leaves
    the kernel's own gradients (SDPA's, bit for bit), and differentiating them again raises
    torch's error rather than giving another derivative."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 6, 4, requires_grad=True)
    out = sdpa._kernel(x * 2, x, x, None, 0.0, False, 0.5)
    assert type(out.grad_fn).__name__ == sdpa._FLASH_CPU_NODE
    monkeypatch.setattr(sdpa, "_current_node", lambda: None)
    (g,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    (want,) = torch.autograd.grad(
        F.scaled_dot_product_attention(x * 2, x, x, scale=0.5).square().sum(), x
    )
    assert torch.equal(g, want)
    with pytest.raises(RuntimeError, match="not implemented"):
        g.sum().backward()


# ----- the masked bias kept for the next call ---------------------------------------------


def _causal_keep(n, n_k=None):
    from posenc.engine import Mask

    n_k = n if n_k is None else n_k
    return Mask(n, n_k, causal=True).shared_keep(device=torch.device("cpu"))  # [1, 1, n, n_k]


def _filled(bias, keep, dtype):
    return bias.to(dtype).masked_fill(~keep, float("-inf"))


def test_a_bias_masked_again_with_the_causal_mask_is_the_kept_tensor():
    """The same bias (unchanged) under the causal mask of the same sizes in the same dtype:
    the tensor made before, equal to the bias filled at the hidden keys; a write into the
    bias (its version counter) or another dtype makes a new one; a bias that goes takes
    its masked copy along."""
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(1, 4, 8, 8, generator=gen)
    keep = _causal_keep(8)
    first = sdpa._causal_masked(bias, keep, torch.float32)
    assert torch.equal(first, _filled(bias, keep, torch.float32))
    assert sdpa._causal_masked(bias, keep, torch.float32) is first
    with torch.inference_mode():  # made outside inference mode: it serves these calls too
        assert sdpa._causal_masked(bias, keep, torch.float32) is first
    bias.mul_(2.0)  # its version moves: masked anew
    again = sdpa._causal_masked(bias, keep, torch.float32)
    assert again is not first and torch.equal(again, _filled(bias, keep, torch.float32))
    wide = sdpa._causal_masked(bias, keep, torch.float64)
    assert wide.dtype == torch.float64 and torch.equal(wide, _filled(bias, keep, torch.float64))
    gone = weakref.ref(bias)
    del bias
    assert gone() is None and len(sdpa._MASKED) == 0


def test_the_last_columns_of_a_tensor_are_its_columns_masked_once():
    """A bias that is the last ``n_k`` columns of a tensor, every row (ALiBi's for a chunk
    at the end of a growing count of keys): the same columns of that tensor masked once
    under the causal mask over its width, which hides what the causal mask over ``n_k``
    keys hides (query ``i`` of ``n_q`` sees key ``j <= i + n_k - n_q``); other views (the
    first columns, some rows) are masked as they are; a write into the tensor masks anew."""
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(1, 2, 3, 16, generator=gen)
    masked = set()
    for n_k in (9, 12, 16):  # (16: every column, a view all the same)
        bias, keep = whole[..., 16 - n_k :], _causal_keep(3, n_k)
        out = sdpa._causal_masked(bias, keep, torch.float32)
        hidden = torch.ones(3, n_k, dtype=torch.bool).triu(n_k - 3 + 1)  # j > i + n_k - n_q
        assert torch.equal(out, bias.masked_fill(hidden, float("-inf")))
        assert out._base is not None and out._base.shape == (1, 2, 3, 16)
        masked.add(out._base.data_ptr())
    assert len(masked) == 1  # masked once
    for bias in (whole[..., :9], whole[..., 1:, 7:]):  # not the last columns of every row
        n_q, n_k = bias.shape[-2:]
        keep = _causal_keep(n_q, n_k)
        out = sdpa._causal_masked(bias, keep, torch.float32)
        assert torch.equal(out, bias.masked_fill(~keep, float("-inf")))
        assert out._base is None or out._base.data_ptr() not in masked
    whole.mul_(2.0)  # its version moves: masked anew, of the new values
    bias, keep = whole[..., 4:], _causal_keep(3, 12)
    out = sdpa._causal_masked(bias, keep, torch.float32)
    assert out._base.data_ptr() not in masked
    assert torch.equal(out, bias.masked_fill(~keep, float("-inf")))


def test_a_bias_that_asks_for_a_gradient_or_an_inference_bias_is_masked_in_each_call():
    """A bias with a gradient in grad mode keeps its graph (the fill is differentiated: 0
    at hidden keys); an inference tensor (no version counter) is filled in each call."""
    keep = _causal_keep(6)
    bias = torch.randn(1, 2, 6, 6, requires_grad=True)
    masked = sdpa._causal_masked(bias, keep, torch.float32)
    assert masked.requires_grad and sdpa._causal_masked(bias, keep, torch.float32) is not masked
    (grad,) = torch.autograd.grad(masked.exp().nan_to_num(posinf=0.0).sum(), bias)
    torch.testing.assert_close(grad, bias.exp().detach() * keep)
    with torch.inference_mode():
        frozen = torch.randn(1, 2, 6, 6)
        first = sdpa._causal_masked(frozen, keep, torch.float32)
        assert sdpa._causal_masked(frozen, keep, torch.float32) is not first
        assert torch.equal(first, _filled(frozen, keep, torch.float32))


def test_a_causal_alibi_call_in_inference_mode_then_with_gradients():
    """The replay of a causal ALiBi call masks the bias ALiBi keeps once: the masked bias
    made by a replay in inference mode serves the replays with gradients, whose backward
    saves it (an inference tensor could not be saved), and every call equals the
    definition (float64)."""
    alibi = posenc.ALiBi(4).double()
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    sdpa._MASKED.clear()
    with torch.inference_mode():
        frozen = [posenc.attention(q, k, v, position=alibi, causal=True) for _ in range(2)]
    (masked,) = [entry[-1] for entry in sdpa._MASKED.values()]  # made by the replay
    assert not masked.is_inference()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = posenc.attention(*ref_leaves, position=alibi, causal=True, backend="math")
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
    for _ in range(2):  # the dispatcher, then the replay with the kept masked bias
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = posenc.attention(*leaves, position=alibi, causal=True)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert [entry[-1] for entry in sdpa._MASKED.values()] == [masked]
    for got in frozen:
        torch.testing.assert_close(got, ref.detach(), rtol=0, atol=1e-12)


class _StoredBias(torch.nn.Module):
    """A scheme whose bias is a tensor it stores (a parameter), as a user's may be."""

    def __init__(self, heads, n):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(1, heads, n, n))

    def score_bias(self, q_pos, k_pos):
        return self.table


class _KeptByUser(_StoredBias):
    """The same, which also hands its table out as its kept bias."""

    def kept_score_bias(self, q_pos, k_pos):
        return self.table


@pytest.mark.parametrize("make", [_StoredBias, _KeptByUser])
def test_only_posencs_kept_bias_of_a_causal_replay_is_kept_masked(make):
    """A bias a user's scheme stores and changes behind its version counter (``.data``, as
    an EMA copy does), as its ``score_bias`` or its own ``kept_score_bias``, and a key
    padding mask, are masked in each call: nothing is kept (no weak reference on the
    user's tensor either: ``torch.utils.swap_tensors`` takes it), and each call follows the
    bias's values."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(3))
    scheme = make(4, 16)
    sdpa._MASKED.clear()
    with torch.no_grad():
        for _ in range(3):  # the dispatcher, then replays
            scheme.table.data.copy_(torch.randn(1, 4, 16, 16, generator=gen))
            out = posenc.attention(q, k, v, position=scheme, causal=True)
            ref = posenc.attention(q, k, v, position=scheme, causal=True, backend="math")
            torch.testing.assert_close(out, ref)
        padding = torch.zeros(2, 16, dtype=torch.bool)
        padding[1, -3:] = True
        for _ in range(2):
            posenc.attention(q, k, v, position=posenc.ALiBi(4), key_padding_mask=padding)
    assert len(sdpa._MASKED) == 0
    torch.utils.swap_tensors(scheme.table, torch.nn.Parameter(torch.zeros(1, 4, 16, 16)))
    assert not scheme.table.any()
