"""Kept routes (engine/kept.py): a call without gradients replays the route the dispatcher
chose for its signature, with the same values, and takes the dispatcher again whenever
anything the choice read differs."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from engine_helpers import TableBias
from torch import nn

import posenc
from posenc import (
    ALiBi,
    RelativePositionBias,
    Rotary,
    T5RelativeBias,
)
from posenc.engine import Mask, attend, dispatch, kept, tuning
from posenc.indices import run_positions

B, H, N, D = 2, 4, 12, 8


@pytest.fixture(autouse=True)
def no_routes():
    """Each test starts and ends with no route kept."""
    kept.clear()
    yield
    kept.clear()


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
        ("grad", 3),  # no route with gradients
        ("mask", 3),  # nor with a mask
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
    if change == "tuning":  # the materialised path's budget: the lean engine now
        monkeypatch.setattr(tuning, "MATERIALISED_SCORES", 1)
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
    if change == "mask":
        bias = bias.masked_fill(torch.ones(n_q, N, dtype=torch.bool).triu(1), float("-inf"))
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
