"""Kept routes (engine/kept.py): a call replays the route the dispatcher chose for its
signature, with the same values (and, with gradients, the same gradients), and takes the
dispatcher again whenever anything the choice read differs."""

from __future__ import annotations

import contextlib
import copy
import gc
import types
import weakref

import pytest
import torch
from engine_helpers import TableBias
from torch import nn

import posenc
from posenc import (
    ALiBi,
    DynamicNTKScaling,
    RelativePositionBias,
    RelativeQueryEmbedding,
    Rotary,
    Rotary2D,
    RotaryMixed,
    RotaryND,
    T5RelativeBias,
    XPos,
)
from posenc._rotary_buffer import rotated
from posenc.engine import Mask, attend, dispatch, kept, plans, tuning
from posenc.indices import run_positions
from tolerances import assert_close, logit_size

B, H, N, D = 2, 4, 12, 8


@pytest.fixture(autouse=True)
def _threads_for_op_by_op():
    """At least ``OPS_FORWARD_THREADS`` threads, as on the machines the routes below were
    chosen for: with fewer (a 1-core machine) the materialised path runs a term through
    SDPA with a float mask, which keeps no route. Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, tuning.OPS_FORWARD_THREADS))
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def walks(monkeypatch):
    """A list that grows by one each time the dispatcher walks its paths."""
    calls = []
    walk = dispatch._walk
    monkeypatch.setattr(dispatch, "_walk", lambda *a: calls.append(1) or walk(*a))
    return calls


def _qkv(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(B, H, N, D, dtype=dtype) for _ in range(3)]


def _call(scheme, q, k, v, mask=None, pos=None, **kwargs):
    pos = run_positions(0, N) if pos is None else pos
    mask = Mask(N, N) if mask is None else mask
    return attend(q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask, **kwargs)[0]


def _math(scheme, q, k, v, pos=None):
    return _call(scheme, q, k, v, pos=pos, backend="math")


SCHEMES = {
    "none": lambda: None,
    "alibi": lambda: ALiBi(H),
    "t5": lambda: T5RelativeBias(H, num_buckets=8, max_distance=16),
    "swin-1d": lambda: RelativePositionBias((1, N), H),
    "swin-2d": lambda: RelativePositionBias((3, 4), H),
    "table": lambda: TableBias(H),
    "relative": lambda: RelativeQueryEmbedding(2 * N, D),  # a score term: op by op, in place
}


def _learned(name):
    scheme = SCHEMES[name]()
    if scheme is not None:
        torch.manual_seed(1)
        for p in scheme.parameters():
            nn.init.normal_(p)
    return scheme


@pytest.mark.parametrize("name", list(SCHEMES))
def test_a_replayed_call_equals_the_dispatchers_bit_for_bit(name, walks):
    """The second call of a signature runs the kept route (no walk), and gives the first
    call's values to the bit (the same kernel call on the same bias), which are the
    definition's (the math path, float64)."""
    scheme = _learned(name)
    q, k, v = _qkv()
    with torch.no_grad():
        first = _call(scheme, q, k, v)
        assert len(walks) == 1
        again = _call(scheme, q, k, v)
        assert len(walks) == 1, "the second call replays"
        other = _qkv(seed=3)
        fresh = _call(scheme, *other)  # other values, the same signature
    assert len(walks) == 1
    assert torch.equal(again, first)
    dscheme = None if scheme is None else scheme.double()
    for out, inputs in ((first, (q, k, v)), (fresh, other)):
        ref = _math(dscheme, *(x.double() for x in inputs))
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_a_rotation_before_the_call_replays_the_plain_kernel(walks):
    """A rotary scheme adds nothing to the scores: its call (rotated before, as
    ``posenc bench`` and ``attention`` do) replays SDPA's kernel on the rotated tensors."""
    scheme = Rotary(D)
    q, k, v = _qkv()
    pos = run_positions(0, N)
    with torch.no_grad():
        outs = [_call(scheme, *scheme.rotate(q, k, pos, pos), v, pos=pos) for _ in range(2)]
    assert len(walks) == 1
    assert torch.equal(outs[0], outs[1])
    ref = torch.nn.functional.scaled_dot_product_attention(*scheme.rotate(q, k, pos, pos), v)
    torch.testing.assert_close(outs[1], ref, atol=1e-6, rtol=0)


def test_attention_and_the_module_replay_too(walks):
    """``posenc.attention`` and ``MultiHeadAttention`` in evaluation reach the same routes."""
    scheme = ALiBi(H)
    q, k, v = _qkv()
    mha = posenc.MultiHeadAttention(H * D, H, position=T5RelativeBias(H)).eval()
    x = torch.randn(B, N, H * D)
    with torch.no_grad():
        outs = [posenc.attention(q, k, v, position=scheme) for _ in range(3)]
        mha_outs = [mha(x) for _ in range(3)]
    assert len(walks) == 2
    assert torch.equal(outs[0], outs[2]) and torch.equal(mha_outs[0], mha_outs[2])


def test_the_kept_bias_and_the_computed_one_replay_in_turn(walks):
    """ALiBi's route reads its kept bias, then ``score_bias`` where the kept one is None
    (positions that are no run of the default kind): both as the definition."""
    scheme = ALiBi(H)
    q, k, v = _qkv()
    shuffled = torch.randperm(N)[None]
    with torch.no_grad():
        _call(scheme, q, k, v)
        out = _call(scheme, q, k, v, pos=shuffled)  # the same shapes: replayed
    assert len(walks) == 1
    ref = _math(scheme.double(), *(x.double() for x in (q, k, v)), pos=shuffled)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


class _Mine(ALiBi):
    """ALiBi under another class, whose hooks a test may change."""


@pytest.mark.parametrize(
    ("change", "walked"),
    [
        ("tuning", 3),  # the lean engine's path: no route kept for it
        ("threads", 2),
        ("shape", 2),
        ("dtype", 2),
        ("backend", 3),
        ("class hook", 2),
        ("grad", 2),  # a key of its own: kept, then replayed
        ("mask", 2),  # the causal mask alone: a key of its own, kept, then replayed
        ("window", 3),  # any other mask: no route
    ],
)
def test_whatever_the_choice_reads_takes_the_dispatcher_again(change, walked, walks, monkeypatch):
    """A call whose signature differs in anything the dispatcher's choice reads walks the
    paths again (and keeps the new route where it is one), and gives the definition."""
    scheme = _Mine(H)
    q, k, v = _qkv()
    with torch.no_grad():
        _call(scheme, q, k, v)
    assert len(walks) == 1
    kwargs, mask, steepness = {}, None, 1.0
    if change == "tuning":  # the materialised path's budgets: the lean engine now
        monkeypatch.setattr(tuning, "MATERIALISED_SCORES", 1)
        monkeypatch.setattr(tuning, "KEPT_BIAS_PAIRS", 0)
    elif change == "threads":
        threads = torch.get_num_threads()
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    elif change == "shape":
        q = q[:, :, :-1]
    elif change == "dtype":
        q, k, v = (x.double() for x in (q, k, v))
    elif change == "backend":
        kwargs["backend"] = "lean"
    elif change == "class hook":  # a steeper bias, set on the class after the route was kept
        original = ALiBi.score_bias
        steeper = lambda self, q_pos, k_pos: 2 * original(self, q_pos, k_pos)  # noqa: E731
        monkeypatch.setattr(_Mine, "score_bias", steeper, raising=False)
        steepness = 2.0
    elif change == "mask":
        mask = Mask(N, N, causal=True)
    elif change == "window":
        mask = Mask(N, N, causal=True, behind=4)
    n_q = q.shape[2]
    pos = run_positions(0, n_q)
    for _ in range(2):
        if change == "grad":
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = _call(scheme, *leaves, mask=Mask(n_q, N), pos=pos)
        else:
            with torch.no_grad():
                out = attend(
                    q, k, v, scheme=scheme, q_pos=pos, k_pos=run_positions(0, N),
                    mask=Mask(n_q, N) if mask is None else mask, **kwargs,
                )[0]  # fmt: skip
    assert len(walks) == walked
    bias = steepness * ALiBi(H)(n_q, N).double()  # [h, n_q, n_k], the paper's
    if change in ("mask", "window"):
        offsets = torch.arange(n_q)[:, None] - torch.arange(N)  # i - j
        hidden = (offsets < 0) | ((offsets >= 4) if change == "window" else False)
        bias = bias.masked_fill(hidden, float("-inf"))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.detach().double() for x in (q, k, v)), attn_mask=bias
    )
    torch.testing.assert_close(out.detach().double(), ref, atol=1e-5, rtol=0)


def test_a_bias_of_another_shape_takes_the_dispatcher_and_its_error(walks):
    """A scheme whose bias changes shape after its route was kept (its heads changed) is
    not replayed: the dispatcher's shape check names the hook."""
    scheme = TableBias(H)
    q, k, v = _qkv()
    with torch.no_grad():
        _call(scheme, q, k, v)
        scheme.table = nn.Parameter(torch.randn(H + 1, 2 * scheme.span + 1))
        with pytest.raises(ValueError, match="score_bias hook returned shape"):
            _call(scheme, q, k, v)
    assert len(walks) == 2


@pytest.mark.parametrize("where", ["instance", "property", "function mode", "key shift"])
def test_calls_whose_hooks_or_modes_have_no_key_keep_no_route(where, walks):
    """A hook set on the instance or given by a property (which may answer otherwise next
    time), a torch function mode (``with torch.device(...)``), or a key shift folded into
    the keys (absolute query embedding: the replay would skip it) keep no route: every
    call walks the paths, and gives the definition."""
    q, k, v = _qkv()
    if where == "instance":
        scheme = ALiBi(H)
        scheme.score_bias = lambda q_pos, k_pos: ALiBi.score_bias(scheme, q_pos, k_pos)
    elif where == "property":

        class Dynamic(nn.Module):
            @property
            def score_bias(self):
                return lambda q_pos, k_pos: torch.zeros(1, H, N, N)

        scheme = Dynamic()
    elif where == "key shift":
        scheme = posenc.AbsoluteQueryEmbedding(N, D)
    else:
        scheme = ALiBi(H)
    with torch.no_grad():
        for _ in range(3):
            if where == "function mode":
                with torch.device("cpu"):
                    out = _call(scheme, q, k, v)
            else:
                out = _call(scheme, q, k, v)
    assert len(walks) == 3
    assert not kept._ROUTES
    if where == "key shift":
        ref = _math(scheme.double(), *(x.double() for x in (q, k, v)))
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("values", [True, False])
def test_hooks_a_property_gives_as_the_schemes_methods_keep_a_route(values, walks):
    """Shaw's value hooks are properties that give the scheme's own bound methods, or are
    absent (``values=False``): the key holds the answer, so its calls keep a route and
    replay it (one walk), with the first call's bits and the definition's values. Setting
    ``has_values`` on the instance changes the answer, so the next call walks again and
    computes what the scheme now says (no value term)."""
    scheme = posenc.ShawRelativePosition(D, 3, values=values)
    q, k, v = _qkv()
    with torch.no_grad():
        outs = [_call(scheme, q, k, v) for _ in range(3)]
        assert len(walks) == 1
        assert torch.equal(outs[0], outs[2])
        ref = _math(scheme.double(), *(x.double() for x in (q, k, v)))
        torch.testing.assert_close(outs[2].double(), ref, atol=1e-5, rtol=0)
        if values:
            scheme.has_values = False  # now keys only: value_term is absent
            out = _call(scheme, q, k, v)
            assert len(walks) == 2
            keys_only = posenc.ShawRelativePosition(D, 3, values=False).double()
            keys_only.keys.copy_(scheme.keys)
            ref = _math(keys_only, *(x.double() for x in (q, k, v)))
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


class _Lent(nn.Module):
    """A bias hook given by a property as another module's bound method."""

    def __init__(self, other: nn.Module) -> None:
        super().__init__()
        self.other = [other]  # (not a submodule)

    @property
    def score_bias(self):
        return self.other[0].score_bias


class _Broken(nn.Module):
    """A bias hook given by a property that raises what is not an AttributeError."""

    @property
    def score_bias(self):
        raise RuntimeError("this property fails")


def test_a_property_that_answers_otherwise_keeps_no_route(walks):
    """A property that gives another object's method (which that object may replace) keeps
    no route: each call walks, and reads the method given then; one that raises what is
    not an ``AttributeError`` keeps none either, and the call raises it."""
    scheme = _Lent(ALiBi(H))
    q, k, v = _qkv()
    with torch.no_grad():
        for _ in range(2):
            out = _call(scheme, q, k, v)
        assert len(walks) == 2 and not kept._ROUTES
        torch.testing.assert_close(out, _call(ALiBi(H), q, k, v), atol=1e-6, rtol=0)
        with pytest.raises(RuntimeError, match="this property fails"):
            _call(_Broken(), q, k, v)
    assert not kept._ROUTES


class _Toggle(nn.Module):
    """A bias hook given by a property as the scheme's own method, or absent when off."""

    def __init__(self):
        super().__init__()
        self.on = True

    def _bias(self, q_pos, k_pos):
        return -(k_pos[:, None, None, :] - q_pos[:, None, :, None]).abs().float()

    @property
    def score_bias(self):
        if not self.on:
            raise AttributeError("off")
        return self._bias


def test_a_property_that_defines_no_hook_is_not_a_hook_in_a_replay():
    """A property that raises ``AttributeError`` defines no hook: a call of ``q, k, v``
    alone raises the full call's ``TypeError`` (no hook at all), also where a module's call
    (which does not check the hooks) kept the route of SDPA's kernel for it."""
    scheme = _Toggle()
    mha = posenc.MultiHeadAttention(H * D, H, position=scheme)
    scheme.on = False
    q = torch.randn(B, H, N, D)
    with torch.no_grad():
        mha(torch.randn(B, N, H * D))
        assert list(kept._ROUTES[scheme].values()) == [()]
        with pytest.raises(TypeError, match="defines none of the attention hooks"):
            posenc.attention(q, q, q, position=scheme)
        scheme.on = True
        out = posenc.attention(q, q, q, position=scheme)
    ref = _math(scheme.double(), *(q.double() for _ in range(3)))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_a_method_made_for_the_instance_keeps_no_route_and_the_scheme_goes():
    """A property giving a method whose function was made for the instance (a closure over
    it) keeps no route: a key holding that function would keep the scheme alive."""

    class Closing(nn.Module):
        @property
        def score_bias(self):
            def bias(module, q_pos, k_pos):
                return torch.zeros(1, H, q_pos.shape[-1], k_pos.shape[-1]) * len(str(self))

            return types.MethodType(bias, self)

    scheme = Closing()
    gone = weakref.ref(scheme)
    with torch.no_grad():
        for _ in range(2):
            _call(scheme, *_qkv())
    assert not kept._ROUTES
    del scheme
    gc.collect()
    assert gone() is None


def test_a_buffer_that_asks_for_a_gradient_is_in_the_key():
    """A table kept as a buffer that requires grad: the formula op by op is kept; frozen,
    the call walks again (its bias is constant now: SDPA's kernel) and gives the
    dispatcher's values and gradients to the bit."""
    scheme = _learned("t5")
    table = scheme.embedding.weight.detach().clone()
    del scheme.embedding.weight
    scheme.embedding.register_buffer("weight", table.requires_grad_())

    def run():
        q, k, v = (x.requires_grad_() for x in _qkv())
        out = _call(scheme, q, k, v)
        return out, *torch.autograd.grad(out.sum(), (q, k, v))

    run()
    assert list(kept._ROUTES[scheme].values()) == [plans._MATH_ROUTE]
    table.requires_grad_(False)
    got = run()
    assert len(kept._ROUTES[scheme]) == 2
    assert all(torch.equal(a, b) for a, b in zip(got, _walked(run), strict=True))


def test_routes_go_with_their_scheme_and_are_bounded(monkeypatch):
    """Routes live in a weak dictionary (a scheme collected takes them along) and at most
    KEPT_ROUTES per scheme (one more empties the scheme's)."""
    scheme = ALiBi(H)
    with torch.no_grad():
        for n in range(2, 2 + tuning.KEPT_ROUTES):
            q = torch.randn(1, H, n, D)
            pos = run_positions(0, n)
            attend(q, q, q, scheme=scheme, q_pos=pos, k_pos=pos, mask=Mask(n, n))
        assert len(kept._ROUTES[scheme]) == tuning.KEPT_ROUTES
        q = torch.randn(1, H, 40, D)
        pos = run_positions(0, 40)
        attend(q, q, q, scheme=scheme, q_pos=pos, k_pos=pos, mask=Mask(40, 40))
    assert len(kept._ROUTES[scheme]) == 1
    ref = weakref.ref(scheme)
    del scheme
    gc.collect()
    assert ref() is None and not kept._ROUTES


def test_no_route_is_kept_at_a_bound_of_zero(monkeypatch, walks):
    """``tuning.KEPT_ROUTES = 0`` keeps no route: every call walks the paths."""
    monkeypatch.setattr(tuning, "KEPT_ROUTES", 0)
    scheme = ALiBi(H)
    q, k, v = _qkv()
    with torch.no_grad():
        outs = [_call(scheme, q, k, v) for _ in range(3)]
    assert len(walks) == 3 and not kept._ROUTES
    assert torch.equal(outs[0], outs[2])


def test_an_unhashable_scheme_runs_without_a_route(walks):
    """A scheme that cannot key a weak dictionary (``__eq__`` without ``__hash__``) keeps
    no route and runs as before."""

    class Unhashable:
        def __eq__(self, other):
            return self is other

        def score_bias(self, q_pos, k_pos):
            return -(k_pos[:, None, None, :] - q_pos[:, None, :, None]).abs().float()

    scheme = Unhashable()
    q, k, v = _qkv()
    with torch.no_grad():
        outs = [_call(scheme, q, k, v) for _ in range(2)]
    assert len(walks) == 2
    assert torch.equal(outs[0], outs[1])


def _walked(fn):
    """``fn()`` with no route kept or replayed (``KEPT_ROUTES`` 0): the dispatcher's answer."""
    limit = tuning.KEPT_ROUTES
    tuning.KEPT_ROUTES = 0
    try:
        return fn()
    finally:
        tuning.KEPT_ROUTES = limit


CALLS = {
    # (scheme, q [b, h, n_q, d], k and v heads, n_k, d_v, positions per sequence, kwargs)
    "scale": ("alibi", (2, 4, 12, 8), 4, 12, 8, False, {"scale": 0.3}),
    "grouped heads": ("t5", (2, 4, 12, 8), 2, 12, 8, False, {}),
    "one query, many keys": ("alibi", (2, 4, 1, 8), 1, 20, 8, False, {}),
    "other value channels": ("table", (2, 4, 12, 8), 4, 12, 16, False, {}),
    "positions per sequence": ("table", (2, 4, 12, 8), 4, 12, 8, True, {}),
    "empty batch": ("alibi", (0, 4, 12, 8), 4, 12, 8, False, {}),
    "float64": ("swin-2d", (2, 4, 12, 8), 4, 12, 8, False, {"dtype": torch.float64}),
    "bfloat16": ("alibi", (2, 4, 12, 8), 4, 12, 8, False, {"dtype": torch.bfloat16}),
    "no scheme, scale": ("none", (2, 4, 12, 8), 4, 12, 8, False, {"scale": 2.0}),
}


@pytest.mark.parametrize("case", list(CALLS))
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_every_kind_of_call_replays_what_the_dispatcher_gives(case, mode, walks):
    """Calls of every shape the engine takes (a scale, grouped heads, decoding, other value
    channels, positions per sequence, an empty batch, float64, bfloat16), in no-grad and
    inference mode: the replayed call (the second of its signature, on other values)
    equals, bit for bit, the dispatcher's answer for it with no route kept."""
    name, (b, h, n_q, d), h_kv, n_k, d_v, per_sequence, kwargs = CALLS[case]
    dtype = kwargs.pop("dtype", torch.float32)
    scheme = _learned(name)
    if scheme is not None:
        scheme = scheme.to(dtype)
    torch.manual_seed(0)
    if per_sequence:
        q_pos = torch.stack([torch.randperm(n_q) for _ in range(b)])  # [b, n_q]
        k_pos = q_pos
    else:
        q_pos, k_pos = run_positions(n_k - n_q, n_q), run_positions(0, n_k)

    def call(seed):
        torch.manual_seed(seed)
        q = torch.randn(b, h, n_q, d, dtype=dtype)
        k = torch.randn(b, h_kv, n_k, d, dtype=dtype)
        v = torch.randn(b, h_kv, n_k, d_v, dtype=dtype)
        run = lambda: attend(  # noqa: E731
            q, k, v, scheme=scheme, q_pos=q_pos, k_pos=k_pos, mask=Mask(n_q, n_k), **kwargs
        )[0]
        return run(), _walked(run)

    with getattr(torch, mode)():
        call(0)
        walked_before = len(walks)
        got, want = call(1)
    assert torch.equal(got, want)
    kept_any = bool(kept._UNSCHEMED) if scheme is None else scheme in kept._ROUTES
    if kept_any:  # replayed: only the reference walked
        assert len(walks) == walked_before + 1


@pytest.mark.parametrize("extra", ["weights", "dropout"])
def test_weights_or_dropout_after_a_kept_route_take_the_dispatcher(extra, walks):
    """A call that asks for weights (the math path) or dropout (a walk) does not replay
    the route a call of its shapes kept."""
    scheme = ALiBi(H)
    q, k, v = _qkv()
    kwargs = {"need_weights": True} if extra == "weights" else {"dropout_p": 0.5}
    pos = run_positions(0, N)
    with torch.no_grad():
        _call(scheme, q, k, v)
        out, weights = attend(
            q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=Mask(N, N), **kwargs
        )
    if extra == "weights":
        assert len(walks) == 1 and weights.shape == (B, H, N, N)
        ref = _math(scheme.double(), *(x.double() for x in (q, k, v)))
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    else:
        assert len(walks) == 2 and weights is None


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("mode", ["forward AD", "vmap", "dispatch mode", "jit trace"])
def test_modes_that_change_what_runs_keep_and_replay_no_route(mode, walks):
    """Inside a forward-mode AD level, ``torch.func.vmap``, a dispatch mode or
    ``torch.jit.trace`` no route is kept, and one kept before is not replayed: the paths
    there differ (op by op, traced), and the call gives the definition."""
    import torch.autograd.forward_ad as fwad
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    scheme = ALiBi(H).double()
    q, k, v = (x.double() for x in _qkv())
    pos = run_positions(0, N)
    run = lambda q, k, v: _call(scheme, q, k, v, pos=pos)  # noqa: E731
    with torch.no_grad():
        run(q, k, v)  # a route kept outside the mode
        walked = len(walks)
        if mode == "forward AD":
            with fwad.dual_level():
                out = fwad.unpack_dual(run(fwad.make_dual(q, torch.ones_like(q)), k, v)).primal
        elif mode == "vmap":
            out = torch.func.vmap(lambda q: run(q[None], k[:1], v[:1])[0])(q)
            k, v = k[:1].expand_as(k), v[:1].expand_as(v)
        elif mode == "dispatch mode":
            with Passing():
                out = run(q, k, v)
        else:
            out = torch.jit.trace(run, (q, k, v), check_trace=False)(q, k, v)
    assert len(walks) > walked
    assert set(kept._ROUTES[scheme]) == set(kept._ROUTES[scheme])  # the kept one unchanged
    assert len(kept._ROUTES[scheme]) == 1
    # ALiBi's bias is computed in float32 and cast: 1e-6, not float64's rounding
    torch.testing.assert_close(out, _math(scheme, q, k, v, pos=pos), atol=1e-6, rtol=0)


def test_the_route_reads_the_kept_bias_first(walks):
    """A scheme with a kept bias: its route asks ``kept_score_bias`` first, as the path does
    (no new bias computed per call), and ``score_bias`` only where that gives none."""

    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.asked, self.keep = [], True
            self.kept = -(torch.arange(N)[None, :] - torch.arange(N)[:, None]).abs().float()

        def score_bias(self, q_pos, k_pos):
            self.asked.append("bias")
            return self.kept[None, None].clone()  # [1, 1, N, N]

        def kept_score_bias(self, q_pos, k_pos):
            self.asked.append("kept")
            return self.kept[None, None] if self.keep else None

    scheme = Counted()
    q, k, v = _qkv()
    with torch.no_grad():
        first = _call(scheme, q, k, v)
        scheme.asked.clear()
        again = _call(scheme, q, k, v)
        assert scheme.asked == ["kept"]
        scheme.keep = False
        scheme.asked.clear()
        computed = _call(scheme, q, k, v)
        assert scheme.asked == ["kept", "bias"]
    assert len(walks) == 1
    assert torch.equal(first, again) and torch.equal(first, computed)


def test_a_kept_bias_of_another_shape_raises_as_the_dispatcher_does(walks):
    """A ``kept_score_bias`` that returns a wrong shape after its route was kept: the replay
    declines, and the dispatcher's check names the hook (even where ``score_bias`` would
    give the right shape)."""

    class Odd(nn.Module):
        wrong = False

        def score_bias(self, q_pos, k_pos):
            return torch.zeros(1, H, q_pos.shape[-1], k_pos.shape[-1])

        def kept_score_bias(self, q_pos, k_pos):
            heads = H + 1 if self.wrong else H
            return torch.zeros(1, heads, q_pos.shape[-1], k_pos.shape[-1])

    scheme = Odd()
    q, k, v = _qkv()
    with torch.no_grad():
        _call(scheme, q, k, v)
        scheme.wrong = True
        with pytest.raises(ValueError, match="kept_score_bias hook returned shape"):
            _call(scheme, q, k, v)
    assert len(walks) == 2


def test_the_device_is_in_the_signature(monkeypatch, walks):
    """A route kept for meta tensors (where the op-by-op forward is not taken: not the CPU)
    is not replayed for CPU tensors of the same shapes, whose path is op by op here."""
    monkeypatch.setattr(tuning, "OPS_IN_PLACE_BIAS_SCORES", 1 << 20)
    monkeypatch.setattr(plans, "_threads", lambda: 2)
    scheme = TableBias(H).to("meta")  # the same module on both devices (moved in place)
    with torch.no_grad():
        meta = [torch.empty(B, H, N, D, device="meta") for _ in range(3)]
        pos = run_positions(0, N, "meta")
        attend(*meta, scheme=scheme, q_pos=pos, k_pos=pos, mask=Mask(N, N))
        assert len(kept._ROUTES[scheme]) == 1
        scheme.to_empty(device="cpu")
        nn.init.normal_(scheme.table)
        q, k, v = _qkv()
        out = _call(scheme, q, k, v)
    assert len(walks) == 2
    torch.testing.assert_close(
        out.double(), _math(scheme.double(), *(x.double() for x in (q, k, v))), atol=1e-5, rtol=0
    )


def test_a_staticmethod_or_descriptor_hook_keeps_no_route(walks):
    """A hook whose class entry is not a plain function (a staticmethod, a descriptor that
    answers per instance) keeps no route: the key could not tell two answers apart."""

    class Switchable:
        def __init__(self, fn):
            self.fn = fn

        def __get__(self, obj, cls=None):
            if obj is None:
                return self.fn
            return self.fn.__get__(obj, cls) if obj.on else None

    class Switch(nn.Module):
        on = True

        @Switchable
        def score_bias(self, q_pos, k_pos):
            return -4.0 * (k_pos[:, None, None, :] - q_pos[:, None, :, None]).abs().float()

    class Static(nn.Module):
        @staticmethod
        def score_bias(q_pos, k_pos):
            return -(k_pos[:, None, None, :] - q_pos[:, None, :, None]).abs().float()

    q, k, v = _qkv()
    for scheme in (Switch(), Static()):
        with torch.no_grad():
            outs = [_call(scheme, q, k, v) for _ in range(2)]
            if isinstance(scheme, Switch):
                scheme.on = False
                plain = _call(scheme, q, k, v)  # the hook off: SDPA alone
                assert torch.equal(plain, _call(None, q, k, v))
        assert not kept._ROUTES and torch.equal(outs[0], outs[1])
    assert len(walks) == 6


FROZEN = {
    "none": lambda: None,
    "alibi": lambda: ALiBi(H),
    "t5 frozen": lambda: T5RelativeBias(H, num_buckets=8, max_distance=16).requires_grad_(False),
    "swin-2d frozen": lambda: RelativePositionBias((3, 4), H).requires_grad_(False),
}


def _grads(scheme, seed, needs=(True, True, True), **kwargs):
    """``(out, gradients of q, k, v)`` of one call in grad mode, on fresh leaves (those in
    ``needs`` ask for a gradient); a gradient not asked for is None."""
    torch.manual_seed(seed)
    leaves = [torch.randn(B, H, N, D).requires_grad_(need) for need in needs]
    out = _call(scheme, *leaves, **kwargs)
    grad_out = torch.randn_like(out)
    wrt = [x for x in leaves if x.requires_grad]
    found = iter(torch.autograd.grad(out, wrt, grad_out) if wrt else ())
    return out, [next(found) if x.requires_grad else None for x in leaves], leaves, grad_out


@pytest.mark.parametrize("name", list(FROZEN))
def test_a_replayed_call_with_gradients_equals_the_dispatchers(name, walks):
    """In grad mode a constant bias (the paper's ALiBi, a frozen table) or none keeps its
    route too: the second call of its signature replays it (no walk) and gives, bit for
    bit, the output and the gradients of q, k, v that the dispatcher gives with no route
    kept, which are the definition's (the math path, float64)."""
    if FROZEN[name]() is not None:
        torch.manual_seed(1)
    scheme = FROZEN[name]()
    if scheme is not None:
        for p in scheme.parameters():
            nn.init.normal_(p)
    _grads(scheme, 0)
    assert len(walks) == 1
    out, grads, leaves, grad_out = _grads(scheme, 1)
    assert len(walks) == 1, "the second call replays"
    want, want_grads, _, _ = _walked(lambda: _grads(scheme, 1))
    assert torch.equal(out, want)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))
    dscheme = None if scheme is None else scheme.double()
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref = _math(dscheme, *ref_leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=0)


def test_a_replayed_route_is_differentiable_twice():
    """A gradient with ``create_graph=True`` through a replayed route is differentiable
    again, with the definition's second derivative (the math path, float64)."""
    scheme = ALiBi(H)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    _call(scheme, q, k, v)
    assert len(kept._ROUTES[scheme]) == 1

    def second(fn):
        out = fn(q, k, v)
        (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        return torch.autograd.grad(gq.square().sum(), (q, k, v))

    got = second(lambda q, k, v: _call(scheme, q, k, v))
    want = second(lambda q, k, v: _math(scheme, q, k, v))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-7)


def test_the_grad_flags_are_in_the_signature(walks):
    """Which of q, k, v ask for a gradient is part of the key: a call that differs there
    walks again (and keeps a route of its own), and each gives the dispatcher's gradients;
    so does a call in grad mode after one without."""
    scheme = ALiBi(H)
    with torch.no_grad():
        _call(scheme, *_qkv())
    flags = [(True, False, False), (True, True, True), (False, False, False)]
    for needs in flags:
        out, grads, _, _ = _grads(scheme, 2, needs)
        want, want_grads, _, _ = _walked(lambda: _grads(scheme, 2, needs))  # noqa: B023
        assert torch.equal(out, want)
        for g, w in zip(grads, want_grads, strict=True):
            assert (g is None and w is None) or torch.equal(g, w)
    assert len(walks) == 1 + 2 * len(flags)  # each flag set walked once, and for _walked
    assert len(kept._ROUTES[scheme]) == 1 + len(flags)
    for needs in flags:  # each replayed now
        _grads(scheme, 3, needs)
    assert len(walks) == 1 + 2 * len(flags)


def test_a_learned_scheme_replays_its_formula_and_a_probed_one_keeps_no_route(walks):
    """In grad mode a scheme of posenc's whose parameters ask for a gradient keeps the
    materialised path's formula op by op (the key holds which of its parameters do): the
    second call replays it (one walk) with the first call's values and gradients, the
    parameters' included. A scheme that may read another tensor asking for a gradient (the
    dispatcher probes its hooks in every call) keeps none: each call walks, and the tensor
    read gets its gradient."""
    learned = T5RelativeBias(H, num_buckets=8, max_distance=16)
    weight = torch.tensor(0.5, requires_grad=True)

    class Steep:  # not posenc's own: it reads `weight`
        def score_bias(self, q_pos, k_pos):
            return -weight * (k_pos[:, None, None, :] - q_pos[:, None, :, None]).abs().float()

    grads = []
    for _ in range(2):
        q, k, v = (x.requires_grad_() for x in _qkv())
        out = _call(learned, q, k, v)
        grads.append((out, *torch.autograd.grad(out.sum(), (q, k, v, *learned.parameters()))))
    assert len(walks) == 1 and list(kept._ROUTES[learned].values()) == [plans._MATH_ROUTE]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    for _ in range(2):
        _call(Steep(), *_qkv()).sum().backward()
    assert len(walks) == 3 and len(kept._ROUTES) == 1
    assert weight.grad is not None


@pytest.mark.parametrize("name", ["t5", "swin-2d", "relative"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_learned_tables_formula_is_replayed_with_its_gradients(name, causal, walks):
    """With gradients for ``q, k, v`` and the table, the replayed formula op by op gives the
    dispatcher's values and gradients (the table's included) to the bit, and a float64
    definition's; ``posenc.attention`` with ``q, k, v`` alone replays it too."""
    scheme = _learned(name)
    mask = Mask(N, N, causal=causal)

    def run():
        q, k, v = (x.requires_grad_() for x in _qkv())
        out = _call(scheme, q, k, v, mask=mask)
        grads = torch.autograd.grad(out, (q, k, v, *scheme.parameters()), torch.ones_like(out))
        return out, *grads

    first = run()
    replayed = run()
    assert len(walks) == 1 and list(kept._ROUTES[scheme].values()) == [plans._MATH_ROUTE]
    walked = _walked(run)
    assert all(torch.equal(a, b) for a, b in zip(replayed, walked, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, walked, strict=True))
    wide = copy.deepcopy(scheme).double()
    q, k, v = (x.double().requires_grad_() for x in _qkv())
    ref = _call(wide, q, k, v, mask=mask, backend="math")
    grads = torch.autograd.grad(ref, (q, k, v, *wide.parameters()), torch.ones_like(ref))
    for got, want in zip(replayed, (ref, *grads), strict=True):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
    if not causal:
        q, k, v = (x.requires_grad_() for x in _qkv())
        assert posenc.explain(q, k, v, position=scheme).replayed
        out = posenc.attention(q, k, v, position=scheme)
        assert torch.equal(out, replayed[0])


def test_a_table_frozen_thawed_or_replaced_reads_as_it_is_now(walks):
    """The key holds which of the table's parameters ask for a gradient: frozen after its
    formula was kept, a call walks again (the constant bias then goes to SDPA's kernel) and
    the table gets no gradient; thawed again, the kept formula replays and the table gets
    its gradient. A table replaced by a new parameter is read as it is now."""
    scheme = _learned("t5")
    q, k, v = (x.requires_grad_() for x in _qkv())
    for _ in range(2):
        _call(scheme, q, k, v).sum().backward()
    assert len(walks) == 1
    scheme.requires_grad_(False)
    scheme.zero_grad(set_to_none=True)
    frozen = _call(scheme, q, k, v)
    frozen.sum().backward()
    assert len(walks) == 2 and all(p.grad is None for p in scheme.parameters())
    scheme.requires_grad_(True)
    again = _call(scheme, q, k, v)
    again.sum().backward()
    assert len(walks) == 2 and all(p.grad is not None for p in scheme.parameters())
    torch.testing.assert_close(again, frozen, atol=1e-6, rtol=0)
    table = scheme.embedding.weight
    scheme.embedding.weight = nn.Parameter(2 * table.detach())
    out = _call(scheme, q, k, v)
    assert len(walks) == 2  # the same key: replayed, on the new table
    torch.testing.assert_close(out, _walked(lambda: _call(scheme, q, k, v)), atol=0, rtol=0)
    ref = _call(scheme, q, k, v, backend="math")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("name", "walked"), [("swin-1d", 2), ("rotary-mixed", 3)])
def test_a_frozen_scheme_thawed_takes_the_dispatcher(name, walked, walks):
    """A frozen table or rotation keeps a route in grad mode; thawed (its parameters asking
    for a gradient again) the call takes the dispatcher (for the rotation, whose bias-free
    route is the same kernel, the wrapper that differentiates the parameters as the
    hooks read them, which plans its path again inside), and the parameters get their
    gradients."""
    if name == "swin-1d":
        scheme = RelativePositionBias((1, N), H)
    else:
        scheme = posenc.RotaryMixed(D, H, size=(3, 4))
    scheme.requires_grad_(False)
    q, k, v = (x.requires_grad_() for x in _qkv())  # the same grad flags in every call
    for _ in range(2):
        posenc.attention(q, k, v, position=scheme)
    assert len(walks) == 1
    scheme.requires_grad_(True)
    out = posenc.attention(q, k, v, position=scheme)
    out.sum().backward()
    assert len(walks) == walked
    assert all(p.grad is not None for p in scheme.parameters())


def test_a_bias_that_asks_for_a_gradient_is_not_replayed(walks):
    """A posenc scheme whose table became a buffer that asks for a gradient (no parameter,
    nothing set on the instance: the key is the same) is not replayed with gradients: the
    dispatcher runs it op by op, and the buffer gets its gradient."""
    scheme = RelativePositionBias((1, N), H)
    table = scheme.table.detach().clone()
    del scheme.table
    scheme.register_buffer("table", table)
    _call(scheme, *_qkv())
    _call(scheme, *_qkv())
    assert len(walks) == 1
    table.requires_grad_(True)
    out = _call(scheme, *_qkv())
    out.sum().backward()
    assert len(walks) == 2 and table.grad is not None


def test_a_raised_limit_for_op_by_op_keeps_no_route_with_gradients(monkeypatch, walks):
    """Where OPS_GRAD_BIAS_SCORES lets a constant bias with gradients run op by op, the
    choice weighs the bias the scheme keeps against SDPA's: no route is kept."""
    monkeypatch.setattr(tuning, "OPS_GRAD_BIAS_SCORES", 1 << 20)
    scheme = ALiBi(H)
    for _ in range(3):
        _grads(scheme, 0)
    assert len(walks) == 3 and not kept._ROUTES


def test_no_route_is_replayed_under_saved_tensor_hooks(walks):
    """Under saved-tensor hooks (activation checkpointing, offloading) SDPA's fused kernel
    has no second derivative of its own and the dispatcher wraps the route: a route kept
    outside them is not replayed inside, and none is kept there."""
    scheme = ALiBi(H)
    _grads(scheme, 0)
    _grads(scheme, 1)
    assert len(walks) == 1
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        for _ in range(2):
            out, _, _, _ = _grads(scheme, 2)
    assert len(walks) == 1 + 2 * 2  # each call walked, and its wrapper planned again
    assert len(kept._ROUTES[scheme]) == 1
    assert "TwiceDifferentiable" in type(out.grad_fn).__name__


def test_explain_says_whether_the_route_is_replayed(walks):
    """``posenc.explain`` reports ``replayed`` exactly where calls keep their route (in the
    grad mode it is called in): the second call then walks no path; a mask other than the
    causal one alone or a scheme of a user's own with gradients keep none (a learned
    table of posenc's keeps the formula op by op)."""
    q, k, v = _qkv()
    grad_q = q.clone().requires_grad_()
    learned = T5RelativeBias(H, num_buckets=8, max_distance=16)
    cases = [
        (ALiBi(H), {}, False, True),
        (ALiBi(H), {}, True, True),
        (None, {}, True, True),
        (ALiBi(H), {"causal": True}, False, True),
        (ALiBi(H), {"causal": True, "window": 3}, False, False),
        (learned, {}, True, True),
        (learned, {}, False, True),
        (TableBias(H), {}, True, False),
        (TableBias(H), {}, False, True),
    ]
    for scheme, kwargs, grad, replayed in cases:
        kept.clear()
        with torch.set_grad_enabled(grad):
            x = grad_q if grad else q
            explanation = posenc.explain(x, k, v, position=scheme, **kwargs)
            assert explanation.replayed is replayed, (scheme, kwargs, grad)
            assert ("replayed:" in str(explanation)) is replayed
            walked = len(walks)
            for _ in range(2):
                posenc.attention(x, k, v, position=scheme, **kwargs)
        assert len(walks) - walked == (1 if replayed else 2), (scheme, kwargs, grad)


# ----- the calls of q, k, v alone (replay_unmasked) ----------------------------------------


@pytest.fixture
def full_calls(monkeypatch):
    """A list that grows by one each time ``posenc.attention`` or the module makes a call in
    full (checks, default positions, mask): the calls ``replay_unmasked`` answered do not."""
    calls = []
    attention_module = __import__("posenc.attention", fromlist=["_core"])
    core = attention_module._core
    monkeypatch.setattr(
        attention_module, "_core", lambda *a, **kw: calls.append(1) or core(*a, **kw)
    )
    return calls


@pytest.mark.parametrize("name", list(SCHEMES))
def test_attention_of_q_k_v_alone_replays_before_its_checks(name, full_calls, walks):
    """The second call of ``posenc.attention(q, k, v, position=...)`` runs the kept route
    without the checks, the default positions nor the mask of the full call, and gives
    its values to the bit; the first equals the definition (math path, float64)."""
    scheme = _learned(name)
    q, k, v = _qkv()
    with torch.no_grad():
        outs = [posenc.attention(q, k, v, position=scheme) for _ in range(3)]
    assert len(full_calls) == 1 and len(walks) == 1
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    ref = _math(None if scheme is None else scheme.double(), *(x.double() for x in (q, k, v)))
    torch.testing.assert_close(outs[2].double(), ref, atol=1e-5, rtol=0)


def test_the_module_of_query_alone_replays_before_its_positions(full_calls, walks):
    """``MultiHeadAttention`` in evaluation, self- and cross-attention (other lengths): the
    second call replays, with the full call's values to the bit."""
    torch.manual_seed(0)
    mha = posenc.MultiHeadAttention(H * D, H, position=ALiBi(H)).eval()
    x, y = torch.randn(B, N, H * D), torch.randn(B, N + 3, H * D)
    with torch.no_grad():
        selfs = [mha(x) for _ in range(2)]
        crosses = [mha(x, y) for _ in range(2)]
    assert len(full_calls) == 2 and len(walks) == 2
    assert torch.equal(selfs[0], selfs[1]) and torch.equal(crosses[0], crosses[1])
    with torch.no_grad():  # explicit positions: the full call, arange as the default
        explicit = mha(x, y, key_positions=torch.arange(N + 3), positions=torch.arange(N))
    assert torch.equal(crosses[1], explicit)


@pytest.mark.parametrize(
    "extra",
    [
        dict(causal=True),
        dict(positions=torch.arange(N)),
        dict(key_padding_mask=torch.zeros(B, N, dtype=torch.bool)),
        dict(valid_lens=torch.full((B,), N)),
        dict(document_ids=torch.zeros(B, N, dtype=torch.long)),
        dict(attn_mask=torch.ones(N, N, dtype=torch.bool)),
        dict(window=4),
        dict(dropout_p=0.1),
    ],
    ids=lambda extra: next(iter(extra)),
)
def test_any_other_argument_takes_the_full_call(extra, full_calls):
    """A call with anything besides q, k, v (a mask, positions, dropout) makes the call in
    full."""
    scheme = ALiBi(H)
    q, k, v = _qkv()
    with torch.no_grad():
        for _ in range(2):
            posenc.attention(q, k, v, position=scheme)
            posenc.attention(q, k, v, position=scheme, **extra)
    assert len(full_calls) == 3


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (dict(dropout_p=False), "dropout_p must be a float in"),
        (dict(dropout_p=-0.0 - 1), "dropout_p must be in"),
        (dict(scale=True), "scale must be a number"),
        (dict(scale=-1.0), "scale must be a finite number > 0"),
        (dict(scale=float("inf")), "scale must be a finite number > 0"),
        (dict(backend="nope"), "backend must be one of"),
        (dict(causal=0), "causal must be True or False"),
    ],
    ids=lambda x: repr(x) if not isinstance(x, dict) else "=".join(map(repr, *x.items())),
)
def test_arguments_the_checks_reject_raise_after_a_kept_route(extra, error):
    """Arguments the full call's checks reject raise as they do, a route kept or not."""
    scheme = ALiBi(H)
    q, k, v = _qkv()
    with torch.no_grad():
        posenc.attention(q, k, v, position=scheme)
        with pytest.raises((TypeError, ValueError), match=error):
            posenc.attention(q, k, v, position=scheme, **extra)


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("batch", "must share the batch"),
        ("dtype", "has dtype torch.float64 but q has torch.float32"),
        ("heads", "built for heads=8 but the attention has heads=4"),
    ],
)
def test_what_the_key_does_not_hold_is_checked_as_the_full_call_checks_it(case, error):
    """A route kept by the engine for shapes ``posenc.attention`` rejects (``k`` and ``v``
    of batch 1 against ``q`` of 2, which SDPA broadcasts), a dtype mixed in, or a scheme
    whose heads changed since: the call raises as the full call does, never replays."""
    scheme = ALiBi(H)
    q, k, v = _qkv()
    with torch.no_grad():
        if case == "batch":
            k, v = k[:1], v[:1]
            pos = run_positions(0, N)
            attend(q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=Mask(N, N))  # kept
        elif case == "dtype":
            posenc.attention(q, k, v, position=scheme)
            v = v.double()
        else:
            posenc.attention(q, k, v, position=scheme)
            scheme.heads = 2 * H  # rebuilt for other heads, the slopes' count with it
        with pytest.raises((ValueError, TypeError), match=error):
            posenc.attention(q, k, v, position=scheme)


def test_a_rotating_or_hookless_scheme_takes_the_full_call(full_calls):
    """A rotation reads the positions (the full call rotates, then replays its route); an
    object with no hook of attention's is rejected by the full call's check even where
    the engine kept a route for it."""

    class NoHook(nn.Module):
        def kept_score_bias(self, q_pos, k_pos):
            return None

    q, k, v = _qkv()
    with torch.no_grad():
        for _ in range(2):
            posenc.attention(q, k, v, position=Rotary(D))
        assert len(full_calls) == 2
        odd = NoHook()
        pos = run_positions(0, N)
        attend(q, k, v, scheme=odd, q_pos=pos, k_pos=pos, mask=Mask(N, N))
        assert kept._routes(odd)  # the engine kept a route for it
        with pytest.raises(TypeError, match="defines none of the attention hooks"):
            posenc.attention(q, k, v, position=odd)


def test_kept_default_positions_written_into_are_built_anew():
    """The default positions kept for a scheme's replayed calls reach its hooks alone;
    positions written into in place all the same (their version counter moved) are not
    handed out again, and positions built in inference mode are usable outside it."""
    routes, cpu = kept._Routes(), torch.device("cpu")
    with torch.inference_mode():
        first = kept._default_positions(routes, N, N, cpu)
    assert first[0] is first[1] and not first[0].is_inference()
    assert kept._default_positions(routes, N, N, cpu)[0] is first[0]
    assert kept._default_positions(kept._Routes(), N, N, cpu)[0] is not first[0]  # per scheme
    first[0].add_(1)
    again = kept._default_positions(routes, N, N, cpu)
    assert again[0] is not first[0] and torch.equal(again[0], torch.arange(N)[None])
    cross = kept._default_positions(routes, N, N + 2, cpu)
    assert torch.equal(cross[0], torch.arange(N)[None])
    assert torch.equal(cross[1], torch.arange(N + 2)[None])


def test_a_write_past_the_version_counter_reaches_no_other_scheme():
    """A hook that writes into its positions through ``.data`` (which the hooks' contract
    forbids, and the version counter does not see) spoils no other scheme's calls: each
    scheme keeps its own default positions."""

    class Sloppy(nn.Module):
        def score_bias(self, q_pos, k_pos):
            q_pos.data.mul_(0)
            return torch.zeros(1, 1, q_pos.shape[-1], k_pos.shape[-1])

    scheme, sloppy = _learned("swin-1d"), Sloppy()
    q, k, v = _qkv()
    with torch.no_grad():
        ref = posenc.attention(q, k, v, position=scheme, positions=torch.arange(N))
        for _ in range(3):
            posenc.attention(q, k, v, position=sloppy)
            out = posenc.attention(q, k, v, position=scheme)
            assert torch.equal(out, ref)


def test_a_users_rotation_takes_the_full_call_and_computes_no_key(monkeypatch, full_calls):
    """A rotation hook of the user's (which may change what the key holds) takes the full
    call in each call, turned away before the route's key is computed: such a call pays
    no lookup."""

    class Turned(nn.Module):
        def rotate(self, q, k, q_pos, k_pos):
            return q.flip(-1), k.flip(-1)

    scheme = Turned()
    q, k, v = _qkv()
    with torch.no_grad():
        outs = [posenc.attention(q, k, v, position=scheme) for _ in range(2)]
        assert len(full_calls) == 2 and kept._routes(scheme)
        assert torch.equal(outs[0], outs[1])
        keys = []
        key = kept._key
        monkeypatch.setattr(kept, "_key", lambda *a: keys.append(a) or key(*a))
        assert kept.replay_unmasked(q, k, v, scheme, "auto", None, rotation=rotated) is None
    assert not keys


ROTATIONS = {
    "rotary": lambda: Rotary(D),
    "interleaved": lambda: Rotary(D, interleaved=True),
    "partial": lambda: Rotary(D, rotary_dim=D // 2),
    "ntk": lambda: Rotary(D, scaling=DynamicNTKScaling(2.0, original_max_len=4)),
    "2d": lambda: Rotary2D(D, size=(3, 4)),
    "nd": lambda: RotaryND(D, (D // 4, D // 4), size=(3, 4), style="mrope"),
    "mixed": lambda: RotaryMixed(D, H, size=(3, 4)),  # learned: no key with gradients
    "xpos": lambda: XPos(D),
}


@pytest.mark.parametrize("name", list(ROTATIONS))
@pytest.mark.parametrize("mode", ["no_grad", "inference", "grad"])
@pytest.mark.parametrize("n_k", [N, N - 5], ids=["self", "cross"])
def test_a_rotating_scheme_of_q_k_v_alone_replays_after_its_rotation(name, mode, n_k, full_calls):
    """The calls of ``posenc.attention(q, k, v, position=rotation)`` after the first rotate
    at the default positions (the keys' own where there are fewer keys) and run the kept
    route, without the full call's checks and mask: outputs and gradients (of ``q, k, v``
    and a learned rotation's parameters) to the bit of the full call's (explicit
    positions), which equals the definition (math path, float64). A learned rotation's
    calls with gradients keep no route (the full call in each)."""
    scheme = ROTATIONS[name]()
    learned = any(p.requires_grad for p in scheme.parameters())
    q, k, v = _qkv()
    k, v = k[:, :, :n_k], v[:, :, :n_k]
    context = {"no_grad": torch.no_grad, "inference": torch.inference_mode}.get(mode)

    def call(**kwargs):
        leaves = [x.clone().requires_grad_(mode == "grad") for x in (q, k, v)]
        if context is not None:
            with context():
                return posenc.attention(*leaves, position=scheme, **kwargs), None
        scheme.zero_grad(set_to_none=True)
        out = posenc.attention(*leaves, position=scheme, **kwargs)
        out.backward(torch.ones_like(out))
        return out, [x.grad for x in leaves] + [p.grad for p in scheme.parameters()]

    outs = [call() for _ in range(3)]
    assert len(full_calls) == (3 if learned and mode == "grad" else 1)
    full = call(positions=torch.arange(N), key_positions=torch.arange(n_k))  # the full call
    with torch.no_grad():  # the definition: softmax(rot(q) rot(k)^T / sqrt(d)) v, float64
        rq, rk = scheme.double().rotate(
            q.double(), k.double(), run_positions(0, N), run_positions(0, n_k)
        )
        ref = (rq @ rk.transpose(-1, -2) / D**0.5).softmax(-1) @ v.double()
        logit = logit_size(rq, rk)
    for out, grads in outs:
        assert torch.equal(out, full[0])
        if grads is not None:  # to the bit of the first (full) call's; q, k, v's of the other
            assert len(grads) == len(full[1]) and len(grads) == 3 + len(list(scheme.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(grads, outs[0][1], strict=True))
            assert all(torch.equal(a, b) for a, b in zip(grads[:3], full[1][:3], strict=True))
            size = max([float(g.abs().max()) for g in grads[3:]], default=0.0)
            for a, b in zip(grads[3:], full[1][3:], strict=True):  # arange's form may round
                assert_close(a, b, magnitude=size, terms=B * H * N * n_k, logit=logit)
    assert_close(outs[-1][0], ref, terms=D, logit=logit, dtype=torch.float32)


def test_a_replayed_rotation_lends_the_kept_buffer_and_hands_it_back(monkeypatch, full_calls):
    """A replayed rotation without gradients writes ``q`` and ``k`` into the thread's kept
    buffer as the full call does, and hands it back after the route has read them (also
    where the route raises)."""
    from posenc.engine import workspace

    monkeypatch.setattr(tuning, "ROTATION_BUFFER_ELEMENTS", 1)
    workspace.release_workspace()
    scheme = Rotary(D)
    q, k, v = _qkv()
    with torch.no_grad():
        outs = [posenc.attention(q, k, v, position=scheme) for _ in range(3)]
    assert len(full_calls) == 1 and not workspace._kept.lent
    assert workspace.kept_elements() >= q.numel() + k.numel()
    assert torch.equal(outs[0], outs[2])
    kernel = kept.sdpa._kernel

    def failing(*args):
        assert workspace._kept.lent  # the route reads the rotated q, k from the buffer
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(kept.sdpa, "_kernel", failing)
    with torch.no_grad(), pytest.raises(RuntimeError, match="kernel failed"):
        posenc.attention(q, k, v, position=scheme)
    monkeypatch.setattr(kept.sdpa, "_kernel", kernel)
    assert not workspace._kept.lent
    workspace.release_workspace()


@pytest.mark.parametrize("change", ["dtype", "shape", "grad", "device"])
def test_a_rotation_that_changes_what_the_key_holds_takes_the_full_call(
    change, monkeypatch, full_calls
):
    """A rotation patched in that returns another dtype, shape, grad flag or device than it
    was handed (posenc's own keeps them) is not replayed: the full call rotates again and
    runs or raises as it does."""
    scheme = Rotary(D)
    q, k, v = _qkv()
    changed = {
        "dtype": lambda x: x.double(),
        "shape": lambda x: x[:, :, :-1],
        "grad": lambda x: x.detach().requires_grad_(),
        "device": lambda x: x.to("meta"),
    }[change]
    with torch.no_grad():
        posenc.attention(q, k, v, position=scheme)
        posenc.attention(q, k, v, position=scheme)
        assert len(full_calls) == 1
        monkeypatch.setattr(scheme, "_rotate", lambda *a, **kw: tuple(
            changed(x) for x in Rotary._rotate(scheme, *a, **kw)
        ))  # fmt: skip
        # the full call runs, or raises its error (SDPA's, on tensors it does not take)
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            posenc.attention(q, k, v, position=scheme)
    assert len(full_calls) == 2  # the full call, not a replayed route


def test_a_rotation_beside_a_bias_rotates_once_per_call(monkeypatch, full_calls):
    """A scheme of posenc's classes that rotates and adds a bias (RoPE with ALiBi) keeps a
    bias route, which may decline after the rotation (past the scores' budget the kept
    bias runs only through SDPA's fused kernel, here turned off): its calls take the full
    call, which rotates once, then replays the route or walks."""

    class RopeALiBi(Rotary, ALiBi):
        def __init__(self, d, h):
            ALiBi.__init__(self, h)
            self.head_dim = self.rotary_dim = d
            self.base, self.interleaved, self.scaling = 10000.0, False, None

    rotations = []
    rotate = Rotary._rotate
    monkeypatch.setattr(Rotary, "_rotate", lambda *a, **kw: rotations.append(1) or rotate(*a, **kw))
    scheme = RopeALiBi(16, 8)
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 8, 512, 16) for _ in range(3))
    with torch.no_grad():
        posenc.attention(q, k, v, position=scheme)
        assert plans._KEPT_FUSED_ROUTE in kept._routes(scheme).values()
        outs = [posenc.attention(q, k, v, position=scheme)]
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            outs.append(posenc.attention(q, k, v, position=scheme))
            explicit = posenc.attention(q, k, v, position=scheme, positions=torch.arange(512))
    assert len(full_calls) == 4 and len(rotations) == 4
    assert torch.equal(outs[1], explicit) and outs[0].shape == explicit.shape


def test_a_replayed_rotation_raises_as_the_full_call_at_its_positions(full_calls):
    """A grid rotation made smaller after its route was kept raises at the default
    positions in the replay, as the full call raises."""
    scheme = Rotary2D(D, size=(3, 4))
    q, k, v = _qkv()
    with torch.no_grad():
        posenc.attention(q, k, v, position=scheme)
        scheme.size = (2, 4)
        with pytest.raises(ValueError) as replayed:
            posenc.attention(q, k, v, position=scheme)
        with pytest.raises(ValueError) as full:
            posenc.attention(q, k, v, position=scheme, positions=torch.arange(N))
    assert len(full_calls) == 2  # the first and the explicit one
    assert str(replayed.value) == str(full.value) and "positions reach 11" in str(full.value)


def test_the_module_with_a_rotation_replays_with_the_full_calls_values(full_calls):
    """``MultiHeadAttention`` with RoPE on its projections' views (``[b, n, h, d]``
    transposed): the second call in training with gradients replays, bit for bit, and
    equals the full call (explicit positions) in evaluation."""
    torch.manual_seed(0)
    mha = posenc.MultiHeadAttention(H * D, H, position=Rotary(D))
    x = torch.randn(B, N, H * D)
    outs, grads = [], []
    for _ in range(2):
        out = mha(x)
        out.sum().backward()
        outs.append(out)
        grads.append(mha.q_proj.weight.grad.clone())
        mha.zero_grad(set_to_none=True)
    assert len(full_calls) == 1
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    with torch.no_grad():
        assert torch.equal(mha(x, positions=torch.arange(N)), outs[0])


def test_the_module_validates_its_scheme_when_built_not_per_call(full_calls):
    """A module's scheme is validated when the module is built; its calls, replayed or not,
    do not call ``validate_attention`` (``posenc.attention`` does, in each call)."""

    class Checked(ALiBi):
        calls = 0

        def validate_attention(self, heads, head_dim):
            Checked.calls += 1
            super().validate_attention(heads, head_dim)

    torch.manual_seed(0)
    mha = posenc.MultiHeadAttention(H * D, H, position=Checked(H)).eval()
    built = Checked.calls
    x = torch.randn(B, N, H * D)
    q, k, v = _qkv()
    with torch.no_grad():
        outs = [mha(x) for _ in range(3)]
        assert Checked.calls == built and len(full_calls) == 1
        for _ in range(3):
            posenc.attention(q, k, v, position=mha.position)
    assert torch.equal(outs[0], outs[2])
    assert Checked.calls == built + 3


def test_a_hook_that_writes_into_its_positions_spoils_no_later_call(full_calls):
    """A scheme whose hook writes into the positions it is handed (the hooks' contract
    forbids it) moves their version counter: the next call gets positions built anew, and
    equals the full call's."""

    class Writer(ALiBi):
        def kept_score_bias(self, q_pos, k_pos):
            bias = super().kept_score_bias(q_pos, k_pos)
            q_pos.add_(0)  # a write: the version counter moves, the values stay
            return bias

    scheme = Writer(H)
    q, k, v = _qkv()
    with torch.no_grad():
        outs = [posenc.attention(q, k, v, position=scheme) for _ in range(3)]
        explicit = posenc.attention(q, k, v, position=scheme, positions=torch.arange(N))
    assert torch.equal(outs[2], explicit) and torch.equal(outs[1], explicit)


def test_a_term_is_replayed_in_one_buffer_without_gradients_and_op_by_op_with_them(walks):
    """A score term without gradients runs op by op in one buffer; its route is kept and
    replayed (with the hooks checked as the path checks them), bit for bit; in grad mode
    the same call keeps a route of its own (the formula op by op, the key holding which of
    the table's parameters ask for a gradient): one walk more, then replayed, with the
    formula's values."""
    scheme = _learned("relative")
    q, k, v = _qkv()
    with torch.no_grad():
        outs = [_call(scheme, q, k, v) for _ in range(3)]
    assert len(walks) == 1 and kept._ROUTES[scheme]
    assert plans._IN_PLACE_ROUTE in kept._ROUTES[scheme].values()
    assert torch.equal(outs[0], outs[2])
    with torch.no_grad():
        assert torch.equal(_walked(lambda: _call(scheme, q, k, v)), outs[2])
    before = len(walks)
    for _ in range(2):
        out = _call(scheme, q, k, v)
    assert len(walks) == before + 1
    assert plans._MATH_ROUTE in kept._ROUTES[scheme].values()
    torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=0)


def test_a_replayed_term_of_another_shape_raises_as_the_dispatcher_does(walks):
    """A score term whose shape changes after its route was kept raises the dispatcher's
    error naming the hook, in a replayed call too."""

    class Term(nn.Module):
        heads = H

        def score_term(self, q, q_pos, k_pos):
            return torch.zeros(q.shape[0], self.heads, q_pos.shape[-1], k_pos.shape[-1])

    scheme = Term()
    q, k, v = _qkv()
    with torch.no_grad():
        _call(scheme, q, k, v)
        _call(scheme, q, k, v)
        assert len(walks) == 1
        scheme.heads = H + 1
        with pytest.raises(ValueError, match="score_term hook returned shape"):
            _call(scheme, q, k, v)
        with pytest.raises(ValueError, match="score_term hook returned shape"):
            posenc.attention(q, k, v, position=scheme)


def test_a_route_is_kept_under_the_state_its_choice_read(monkeypatch, walks):
    """A hook that changes what the key holds while the route runs (here a tuning
    constant) does not file the route under the state it left: the next call, in that
    state, takes the dispatcher's answer for it."""
    monkeypatch.setattr(tuning, "OPS_IN_PLACE_SCORES", tuning.OPS_IN_PLACE_SCORES)

    class Term(nn.Module):
        first = True

        def score_term(self, q, q_pos, k_pos):
            if Term.first:
                Term.first = False
                tuning.OPS_IN_PLACE_SCORES = 0  # the next calls: SDPA with the term as mask
            return torch.full((1, 1, q_pos.shape[-1], k_pos.shape[-1]), 0.1)

    scheme = Term()
    q, k, v = _qkv()
    with torch.no_grad():
        _call(scheme, q, k, v)
        got = _call(scheme, q, k, v)
        want = _walked(lambda: _call(scheme, q, k, v))
    assert torch.equal(got, want)


def test_explain_says_no_route_is_replayed_for_a_scheme_that_cannot_keep_one():
    """A scheme that cannot key a weak dictionary (``__slots__`` without ``__weakref__``)
    keeps no route, and ``explain`` says so."""

    class Term:
        __slots__ = ()

        def score_term(self, q, q_pos, k_pos):
            return torch.ones(1, 1, q_pos.shape[-1], k_pos.shape[-1])

    scheme = Term()
    q, k, v = _qkv()
    with torch.no_grad():
        for _ in range(2):
            posenc.attention(q, k, v, position=scheme)
        assert not posenc.explain(q, k, v, position=scheme).replayed
        assert posenc.explain(q, k, v, position=_learned("relative")).replayed
    assert kept._routes(scheme) is None and not kept.keyable(scheme) and kept.keyable(None)


# ----- causal calls ----------------------------------------------------------------------


def _causal(scheme, q, k, v, **kwargs):
    n_q, n_k = q.shape[2], k.shape[2]
    q_pos, k_pos = run_positions(n_k - n_q, n_q), run_positions(0, n_k)
    mask = Mask(n_q, n_k, causal=True)
    return attend(q, k, v, scheme=scheme, q_pos=q_pos, k_pos=k_pos, mask=mask, **kwargs)[0]


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_causal_call_replays_what_the_dispatcher_gives(name, mode, walks):
    """The causal mask alone (as many queries as keys) keeps its route under a key of its
    own: the second call of its signature walks no path and equals, bit for bit, the
    dispatcher's answer with no route kept, which is the definition's (float64: the bias
    masked above the diagonal, written out here; the relative embedding's score term
    against the math path)."""
    scheme = _learned(name)
    with getattr(torch, mode)():
        _causal(scheme, *_qkv())
        walked = len(walks)
        q, k, v = _qkv(seed=5)
        got = _causal(scheme, q, k, v)
        assert len(walks) == walked, "replayed"
        want = _walked(lambda: _causal(scheme, q, k, v))
    assert torch.equal(got, want)
    dscheme = None if scheme is None else scheme.double()
    pos = run_positions(0, N)
    scores = q.double() @ k.double().transpose(-1, -2) / D**0.5  # [b, h, n, n]
    if dscheme is not None and hasattr(dscheme, "score_bias"):
        scores = scores + dscheme.score_bias(pos, pos)
    elif dscheme is not None:  # a score term (the relative embedding): the math path's
        ref = _causal(dscheme, *(x.double() for x in (q, k, v)), backend="math")
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)
        return
    hidden = torch.ones(N, N, dtype=torch.bool).triu(1)
    ref = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v.double()
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["none", "alibi"])
def test_a_causal_call_with_gradients_replays_with_the_dispatchers_gradients(name, walks):
    """With gradients (frozen schemes): the replayed causal call's output and gradients
    equal the dispatcher's to the bit."""
    scheme = SCHEMES[name]()

    def grads(run):
        leaves = [x.requires_grad_() for x in _qkv(seed=7)]
        out = run(leaves)
        return (out, *torch.autograd.grad(out.square().sum(), leaves))

    grads(lambda xs: _causal(scheme, *xs))
    walked = len(walks)
    got = grads(lambda xs: _causal(scheme, *xs))
    assert len(walks) == walked
    want = _walked(lambda: grads(lambda xs: _causal(scheme, *xs)))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_causal_replay_leaves_non_finite_values_to_the_dispatcher(walks):
    """A NaN in the last key (hidden from every query but the last) after a kept causal
    route: the call takes the dispatcher, which zeroes the hidden token, so that the other
    rows stay finite and equal the clean call's."""
    scheme = ALiBi(H)
    q, k, v = _qkv()
    with torch.no_grad():
        clean = _causal(scheme, q, k, v)
        walked = len(walks)
        k_bad = k.clone()
        k_bad[:, :, -1] = float("nan")
        out = _causal(scheme, q, k_bad, v)
    assert len(walks) == walked + 1, "not replayed"
    assert torch.equal(out[:, :, :-1], clean[:, :, :-1])
    assert out[:, :, -1].isnan().all()


@pytest.mark.parametrize("n, dtype", [(N, torch.float32), (64, torch.float64)])
@pytest.mark.parametrize(
    "bad",
    [("q", 3, float("nan")), ("k", -1, float("nan")), ("k", 5, float("-inf")),
     ("q", 0, float("inf")), ("v", -1, float("nan")), ("v", 2, float("inf"))],
)  # fmt: skip
def test_a_causal_replay_in_one_buffer_reads_q_and_k_in_its_logits(
    bad, n, dtype, walks, monkeypatch
):
    """The route of the forward in one buffer (a score term, no gradients), replayed under
    the causal mask, checks ``v`` alone before the call and ``q`` and ``k`` through the
    logits' sum (its own below FILLED_ELEMENTS scores, at n = 12; the one its fill takes
    at n = 64): a NaN or an infinity in any of them (a key hidden from every query but
    the last, a -inf that makes its scores -inf) sends the call to the dispatcher, whose
    answer it is (the rows that see the token NaN, the others the clean call's); a clean
    call replays, one tensor checked. With a zero scale (the engine's ``attend`` takes
    one; its GEMM may then skip ``q`` and ``k``) all three are checked first."""
    monkeypatch.setattr(plans, "_threads", lambda: 2)  # the forward in one buffer
    checked = []
    finite = kept.finite
    monkeypatch.setattr(kept, "finite", lambda *xs: checked.append(len(xs)) or finite(*xs))
    scheme = RelativeQueryEmbedding(2 * n, D).to(dtype)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, dtype=dtype) for _ in range(3))
    name, token, value = bad
    token %= n
    inputs = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    inputs[name][:, :, token, 1] = value
    for scale, tensors in ((None, 1), (0.0, 3)):
        with torch.no_grad():
            clean = _causal(scheme, q, k, v, scale=scale)
            assert list(kept._routes(scheme).values()) == [plans._IN_PLACE_ROUTE]
            walked, checked[:] = len(walks), []
            assert torch.equal(_causal(scheme, q, k, v, scale=scale), clean)
            assert len(walks) == walked and checked == [tensors], "replayed, so many checked"
            out = _causal(scheme, *inputs.values(), scale=scale)
            assert len(walks) == walked + 1, "not replayed"
            want = _walked(lambda: _causal(scheme, *inputs.values(), scale=scale))  # noqa: B023
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
        sees = torch.arange(n) >= token if name != "q" else torch.arange(n) == token
        assert out[:, :, sees].isnan().all()
        assert torch.equal(out[:, :, ~sees], clean[:, :, ~sees])


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("n_q", [1, 2, 5])
def test_a_causal_chunk_over_more_keys_replays_what_the_dispatcher_gives(name, n_q, walks):
    """A few tokens at once over a cache (queries aligned at the end of more keys, as a
    speculative decoder's drafts checked at once) keep their route: the second call walks
    no path, and equals the dispatcher's answer with no route kept to the bit, which is
    the definition's (float64: query ``i`` sees the keys up to ``i + n_k - n_q``). One
    query sees every key: Mask drops its causal mask, so that the step replays the route
    of the unmasked call."""
    scheme = _learned(name)
    torch.manual_seed(0)
    q = torch.randn(B, H, n_q, D)
    k, v = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    q_pos, k_pos = run_positions(N - n_q, n_q), run_positions(0, N)
    mask = Mask(n_q, N, causal=True)
    with torch.no_grad():
        first = _causal(scheme, q, k, v)
        walked = len(walks)
        again = _causal(scheme, q, k, v)
        assert len(walks) == walked == 1, "replayed"
        if n_q == 1:
            unmasked = attend(q, k, v, scheme=scheme, q_pos=q_pos, k_pos=k_pos, mask=Mask(1, N))
            assert len(walks) == 1, "the unmasked call's route is the step's"
            assert torch.equal(first, unmasked[0])
        request = kept.Request(q, k, v, scheme, q_pos, k_pos, mask, "auto", 0.0, False)
        assert kept.signature(request) is not None
        want = _walked(lambda: _causal(scheme, q, k, v))
    assert torch.equal(first, again) and torch.equal(first, want)
    dscheme = None if scheme is None else scheme.double()
    ref = attend(
        q.double(), k.double(), v.double(), scheme=dscheme, q_pos=q_pos, k_pos=k_pos,
        mask=mask, backend="math",
    )[0]  # fmt: skip
    if dscheme is None or hasattr(dscheme, "score_bias"):  # the definition, written out here
        scores = q.double() @ k.double().transpose(-1, -2) / D**0.5  # [b, h, n_q, n_k]
        if dscheme is not None:
            scores = scores + dscheme.score_bias(q_pos, k_pos)
        hidden = torch.ones(n_q, N, dtype=torch.bool).triu(N - n_q + 1)  # j > i + n_k - n_q
        ref = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v.double()
    torch.testing.assert_close(first.double(), ref, atol=1e-5, rtol=0)


def test_a_causal_call_of_more_queries_than_keys_keeps_no_route():
    """More queries than keys (queries that see no key): no key, the dispatcher each time."""
    scheme = ALiBi(H)
    q, k, v = torch.randn(B, H, 6, D), torch.randn(B, H, 4, D), torch.randn(B, H, 4, D)
    request = kept.Request(
        q, k, v, scheme, run_positions(0, 6), run_positions(0, 4), Mask(6, 4, causal=True),
        "auto", 0.0, False,
    )  # fmt: skip
    assert kept.signature(request) is None


@pytest.mark.parametrize("bad", [("q", 1), ("k", -1), ("k", -4), ("v", -1), ("v", 0)])
def test_a_chunks_replay_leaves_non_finite_values_to_the_dispatcher(bad, walks):
    """A NaN after a kept chunk's route, in ``q``, in a key or value some query does not
    see (the last ``n_q``), or in a value every query sees: the call takes the dispatcher
    (a value every query sees unchecked: the replay gives it to every query as the
    dispatcher does), whose answer it is, to the bit."""
    scheme = ALiBi(H)
    torch.manual_seed(0)
    n_q = 4
    q = torch.randn(B, H, n_q, D)
    k, v = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    name, token = bad
    inputs = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    inputs[name][:, :, token, 0] = float("nan")
    with torch.no_grad():
        _causal(scheme, q, k, v)
        walked = len(walks)
        out = _causal(scheme, *inputs.values())
        checked = len(walks) == walked + 1  # the dispatcher ran it
        want = _walked(lambda: _causal(scheme, *inputs.values()))
    assert checked == (name != "v" or token != 0), "what the dispatcher checks, no more"
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    assert out.isnan().any()
    if name == "k" and token == -1:  # hidden from every query but the last
        assert out[:, :, -1].isnan().all() and not out[:, :, :-1].isnan().any()


# ----- few queries: the key count's band -------------------------------------------------


def _step(scheme, q, k, v, n_k, backend="auto"):
    """One query at the end of ``n_k`` keys (a decoding step: its causal mask hides
    nothing and is dropped)."""
    return attend(
        q, k[:, :, :n_k], v[:, :, :n_k], scheme=scheme, q_pos=run_positions(n_k - 1, 1),
        k_pos=run_positions(0, n_k), mask=Mask(1, n_k, causal=True), backend=backend,
    )[0]  # fmt: skip


def _chunk(scheme, q, k, v, n_k):
    """``q``'s queries at the end of ``n_k`` keys, under the causal mask (a speculative
    decoder's drafts checked at once over its cache)."""
    n_q = q.shape[2]
    return attend(
        q, k[:, :, :n_k], v[:, :, :n_k], scheme=scheme, q_pos=run_positions(n_k - n_q, n_q),
        k_pos=run_positions(0, n_k), mask=Mask(n_q, n_k, causal=True),
    )[0]  # fmt: skip


def _band_scheme(name):
    scheme = _learned(name)
    if name.startswith("swin"):  # a table long enough (a grid: 1-D instead)
        scheme = RelativePositionBias((1, 64), H)
    elif name == "relative":
        scheme = RelativeQueryEmbedding(128, D)
    return scheme


@pytest.mark.parametrize("name", list(SCHEMES))
def test_decoding_steps_replay_per_power_of_two_of_their_keys(name, walks):
    """Steps of a growing cache without gradients walk once per band of key counts, ``[2^(m
    - 1), 2^m)``, and give what the dispatcher gives at each count to the bit; so do a few
    queries at once under the causal mask (fewer than the band's least count)."""
    scheme = _band_scheme(name)
    torch.manual_seed(0)
    q, q3 = torch.randn(B, H, 1, D), torch.randn(B, H, 3, D)
    k, v = torch.randn(B, H, 40, D), torch.randn(B, H, 40, D)
    counts = range(3, 41)
    chunk_counts = range(5, 41)  # 3 queries below each band's least count from [4, 8) on
    with torch.no_grad():
        steps = [_step(scheme, q, k, v, n) for n in counts]
        assert len(walks) == len({n.bit_length() for n in counts}) == 5  # 3, 4-7 ... 32-40
        walks.clear()
        chunks = [_chunk(scheme, q3, k, v, n) for n in chunk_counts]
        assert len(walks) == 4  # 5-7, 8-15, 16-31, 32-40
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tuning, "KEPT_ROUTES", 0)  # the dispatcher at each count
            walked = [_step(scheme, q, k, v, n) for n in counts]
            walked_chunks = [_chunk(scheme, q3, k, v, n) for n in chunk_counts]
    assert all(torch.equal(a, b) for a, b in zip(steps, walked, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(chunks, walked_chunks, strict=True))


@pytest.mark.parametrize("causal", [False, True])
def test_more_queries_than_a_band_holds_walk_at_each_key_count(causal, walks, monkeypatch):
    """Past ``KEPT_BAND_QUERIES`` queries, or as many queries as the band's least key count
    or more, each key count has a key of its own: each walks, once."""
    monkeypatch.setattr(tuning, "KEPT_BAND_QUERIES", 2)
    scheme = ALiBi(H)
    torch.manual_seed(0)
    k, v = torch.randn(B, H, 40, D), torch.randn(B, H, 40, D)

    def call(q, n):
        n_q = q.shape[2]
        return attend(
            q, k[:, :, :n], v[:, :, :n], scheme=scheme, q_pos=run_positions(n - n_q, n_q),
            k_pos=run_positions(0, n), mask=Mask(n_q, n, causal=causal),
        )  # fmt: skip

    with torch.no_grad():
        for n in (*range(8, 14), 9):  # 3 queries, past KEPT_BAND_QUERIES
            call(torch.randn(B, H, 3, D), n)
        assert len(walks) == 6, "each key count walks, once"
        walks.clear()
        for n in range(4, 8):  # 2 queries: within the band [4, 8) but for 2 <= its least 4
            call(torch.randn(B, H, 2, D), n)
        assert len(walks) == 1
        for n in (2, 3):  # band [2, 4): 2 queries are not fewer than 2
            call(torch.randn(B, H, 2, D), n)
        assert len(walks) == 3


@pytest.mark.parametrize("name", ["none", "alibi"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_keys_without_gradients_give_zeros(name, mode):
    """Queries over no key (an empty cache, cross-attention to nothing), twice without
    gradients: no band (a key count of 0 has none), each query 0."""
    scheme = SCHEMES[name]()
    q, empty = torch.randn(B, H, 3, D), torch.randn(B, H, 0, D)
    with getattr(torch, mode)():
        for _ in range(2):
            out = posenc.attention(q, empty, empty, position=scheme)
            assert torch.equal(out, torch.zeros_like(q))
            step = attend(
                q[:, :, :1], empty, empty, scheme=scheme, q_pos=run_positions(0, 1),
                k_pos=run_positions(0, 0), mask=Mask(1, 0),
            )[0]  # fmt: skip
            assert torch.equal(step, torch.zeros_like(q[:, :, :1]))


def test_with_gradients_each_key_count_walks(walks):
    scheme = ALiBi(H)
    q = torch.randn(B, H, 1, D, requires_grad=True)
    k, v = torch.randn(B, H, 20, D), torch.randn(B, H, 20, D)
    for n in range(9, 14):
        _step(scheme, q, k, v, n).sum().backward()
    assert len(walks) == 5


def test_a_band_replays_its_route_past_a_limit_inside_it(monkeypatch, walks):
    """The scores' budget set inside a band: the step below it keeps the materialised
    route and the steps above, in the same band, replay it (the same values as the
    dispatcher's), which explain reports; the next band walks and takes the lean
    per-offset path, which keeps no route. (In float64: past the budget SDPA's fused
    kernel would take a float32 step's bias alone, a row within the keys and values.)"""
    scheme = T5RelativeBias(H, num_buckets=8, max_distance=16).double()
    monkeypatch.setattr(tuning, "MATERIALISED_SCORES", H * 20)  # 20 keys per query, b=1
    torch.manual_seed(0)
    q = torch.randn(1, H, 1, D, dtype=torch.float64)
    k, v = (torch.randn(1, H, 40, D, dtype=torch.float64) for _ in range(2))

    def explained(n):
        return posenc.engine.explain_call(
            q, k[:, :, :n], v[:, :, :n], scheme=scheme, q_pos=run_positions(n - 1, 1),
            k_pos=run_positions(0, n), mask=Mask(1, n, causal=True),
        )  # fmt: skip

    with torch.no_grad():
        assert explained(24).path == "offset-bias" and explained(17).path == "materialised"
        walks.clear()  # (explain walks too)
        below = _step(scheme, q, k, v, 17)  # band [16, 32): walks, materialised
        past = [_step(scheme, q, k, v, n) for n in (24, 31)]  # past 20: replayed
        assert len(walks) == 1
        far = [_step(scheme, q, k, v, n) for n in (33, 34)]  # band [32, 64): lean, no route
        assert len(walks) == 3
        said = explained(24)
        assert (said.path, said.replayed) == ("materialised", True)
        assert "another count of it chose materialised" in said.reasons["offset-bias"]
        assert "materialised" not in said.reasons and "replayed" in str(said)
        assert explained(34).path == "offset-bias"
        refs = [
            _step(scheme.double(), q.double(), k.double(), v.double(), n, "math")
            for n in (17, 24, 31, 33, 34)
        ]
    for out, ref in zip([below, *past, *far], refs, strict=True):
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
