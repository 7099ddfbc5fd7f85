"""The hook protocol (posenc/hooks.py): which hooks a scheme defines, and their checks."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import nn

from posenc import hooks as posenc_hooks
from posenc.engine import Mask, attend
from posenc.hooks import DERIVED_HOOKS, HOOK_NAMES, Hooks, hooks_of


def run(backend, scheme, q, k, v, q_pos, k_pos, mask):
    out, _ = attend(q, k, v, scheme=scheme, q_pos=q_pos, k_pos=k_pos, mask=mask, backend=backend)
    return out


def test_a_subclass_overriding_a_hook_drops_the_parents_fast_forms():
    """A steeper ALiBi (score_bias overridden) must not run on ALiBi's offset_bias."""
    from posenc import ALiBi, RelativeQueryEmbedding

    class SteeperALiBi(ALiBi):
        def score_bias(self, q_pos, k_pos):
            return 1.1 * super().score_bias(q_pos, k_pos)

    class SteeperSlopes(ALiBi):  # the natural way: no hook overridden, fast forms kept
        def slopes(self, device=None):
            return 1.1 * super().slopes(device)

    class Both(ALiBi):  # a hook and its fast form redefined in one class: kept
        def score_bias(self, q_pos, k_pos):
            return super().score_bias(q_pos, k_pos)

        def offset_bias(self, q_pos, k_pos):
            return super().offset_bias(q_pos, k_pos)

    class Tripled:  # a mixin: listed before the scheme, its score_bias comes first
        def score_bias(self, q_pos, k_pos):
            return 3 * super().score_bias(q_pos, k_pos)

    class TripledALiBi(Tripled, ALiBi):
        pass

    class Doubled(RelativeQueryEmbedding):
        def score_term(self, q, q_pos, k_pos):
            return 2 * super().score_term(q, q_pos, k_pos)

    assert hooks_of(SteeperALiBi(4)).offset_bias is None
    assert hooks_of(SteeperALiBi(4)).kept_score_bias is None
    assert hooks_of(SteeperALiBi(4)).flex_score_mod is None
    assert hooks_of(SteeperSlopes(4)).offset_bias is not None
    assert hooks_of(Both(4)).offset_bias is not None
    assert hooks_of(ALiBi(4)).offset_bias is not None
    assert hooks_of(Doubled(16, 8)).offset_term is None
    for extra in ("offset_bias", "kept_score_bias", "flex_score_mod"):
        assert getattr(hooks_of(TripledALiBi(4)), extra) is None
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(16)[None]
    for scheme in (SteeperALiBi(4), SteeperSlopes(4), TripledALiBi(4), Doubled(16, 8).double()):
        expected = run("math", scheme, q, k, v, pos, pos, Mask(16, 16))
        torch.testing.assert_close(run("auto", scheme, q, k, v, pos, pos, Mask(16, 16)), expected)
    long = torch.arange(600)[None]  # the per-offset bias path
    q, k, v = (torch.randn(1, 4, 600, 8, dtype=torch.float64) for _ in range(3))
    expected = run("math", TripledALiBi(4), q, k, v, long, long, Mask(600, 600))
    got = run("auto", TripledALiBi(4), q, k, v, long, long, Mask(600, 600))
    torch.testing.assert_close(got, expected)


def test_every_hook_has_a_protocol_that_the_schemes_satisfy():
    """One Protocol per hook (runtime-checkable), and each scheme of the package satisfies
    the protocols of the hooks it defines."""
    import posenc
    from posenc import hooks

    for name in HOOK_NAMES:
        assert isinstance(getattr(hooks, name.title().replace("_", "")), type)
    examples = {
        hooks.Rotate: posenc.Rotary(8),
        hooks.ScoreBias: posenc.ALiBi(2),
        hooks.ScoreTerm: posenc.RelativeQueryEmbedding(8, 8),
        hooks.ValueTerm: posenc.ShawRelativePosition(8, 2),
        hooks.OffsetBias: posenc.T5RelativeBias(2),
        hooks.KeptScoreBias: posenc.ALiBi(2),
    }
    for protocol, scheme in examples.items():
        assert isinstance(scheme, protocol), (protocol, scheme)
    assert not isinstance(posenc.ALiBi(2), hooks.ScoreTerm)


def test_checked_hooks_pass_declining_extras_and_reject_wrong_shapes():
    from posenc.hooks import checked_hooks

    class Declines(nn.Module):
        def score_bias(self, q_pos, k_pos):
            return torch.zeros(1, 1, q_pos.shape[-1], k_pos.shape[-1])

        def offset_bias(self, q_pos, k_pos):
            return None  # positions not one run: the engine falls back

    scheme = Declines()
    hooks = checked_hooks(hooks_of(scheme), scheme, 2, 4, 8)
    pos = torch.arange(3)[None]
    assert hooks.offset_bias(pos, pos) is None
    assert hooks.score_bias(pos, pos).shape == (1, 1, 3, 3)

    class ThreeHeads(nn.Module):
        def score_bias(self, q_pos, k_pos):
            return torch.zeros(1, 3, q_pos.shape[-1], k_pos.shape[-1])

    wrong = checked_hooks(hooks_of(ThreeHeads()), ThreeHeads(), 2, 4, 8)
    with pytest.raises(ValueError, match=r"score_bias hook returned shape \(1, 3, 3, 3\)"):
        wrong.score_bias(pos, pos)

    class KeptForThree(Declines):
        def kept_score_bias(self, q_pos, k_pos):
            return torch.zeros(1, 3, q_pos.shape[-1], k_pos.shape[-1])

    class Marked(Hooks):
        pass

    marked = Marked(score_bias=Declines().score_bias)
    assert type(checked_hooks(marked, Declines(), 2, 4, 8)) is Marked
    wrong = checked_hooks(hooks_of(KeptForThree()), KeptForThree(), 2, 4, 8)
    assert wrong.kept_score_bias is not None
    with pytest.raises(ValueError, match=r"kept_score_bias hook returned shape \(1, 3, 3, 3\)"):
        wrong.kept_score_bias(pos, pos)


class CountedBias(nn.Module):
    """A contextual term in a few lines: a learned slope times the gates of the masked
    logits counted from each key to the end of the row (CoPE's positions, no table), beside
    a content-free bias, which the logits it reads include."""

    def __init__(self):
        super().__init__()
        self.slope = nn.Parameter(torch.tensor(-0.7, dtype=torch.float64))

    def score_bias(self, q_pos, k_pos):
        return -0.3 * (k_pos[:, None, :] - q_pos[:, :, None]).abs()[:, None].double()

    def contextual_term(self, logits, q, q_pos, k_pos):
        return self.slope * torch.sigmoid(logits).flip(-1).cumsum(-1).flip(-1)


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto", "lean"])
def test_a_contextual_term_reads_the_scaled_masked_logits_on_every_backend(backend):
    """The hook gets the scheme's logits ``(q k^T) * scale + score_bias``, masked keys at
    -inf (a float attn_mask's -inf entries too), and its term is added after the scaling,
    beside the float attn_mask's values, which it does not read: outputs and gradients (q,
    k, v, the scheme's parameter) against that definition written here with dense float64
    tensors."""
    from posenc import attention, hooks

    torch.manual_seed(0)
    b, h, n, d = 2, 2, 6, 4
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    added = torch.randn(1, h, n, n, dtype=torch.float64)  # a float attn_mask
    added[0, 1, 4, 2] = float("-inf")  # one more masked key
    padding = torch.tensor([[False] * n, [False] * (n - 2) + [True] * 2])
    scheme = CountedBias()
    assert isinstance(scheme, hooks.ContextualTerm) and "contextual_term" in HOOK_NAMES
    got = attention(q, k, v, position=scheme, causal=True, key_padding_mask=padding,
                    attn_mask=added, backend=backend)  # fmt: skip
    pos = torch.arange(n)
    keep = (pos[None, :] <= pos[:, None])[None, None] & ~padding[:, None, None, :]
    keep = keep & (added > float("-inf"))
    logits = q @ k.transpose(-2, -1) / d**0.5 + scheme.score_bias(pos[None], pos[None])
    logits = logits.masked_fill(~keep, float("-inf"))  # [b, h, n, n]
    count = torch.sigmoid(logits).flip(-1).cumsum(-1).flip(-1)
    want = (logits + scheme.slope * count + added).softmax(-1) @ v
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    leaves = (q, k, v, scheme.slope)
    cotangent = torch.randn_like(want)
    for a, c in zip(
        torch.autograd.grad(got, leaves, cotangent),
        torch.autograd.grad(want, leaves, cotangent),
        strict=True,
    ):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


def test_checked_hooks_check_the_contextual_term():
    from posenc.hooks import checked_hooks

    class OneKeyShort(nn.Module):
        def contextual_term(self, logits, q, q_pos, k_pos):
            return logits[..., :-1]

    pos = torch.arange(3)[None]
    q, logits = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 3)
    good = checked_hooks(hooks_of(CountedBias()), CountedBias(), 2, 4, 8)
    assert good.contextual_term(logits, q, pos, pos).shape == (2, 4, 3, 3)
    wrong = checked_hooks(hooks_of(OneKeyShort()), OneKeyShort(), 2, 4, 8)
    with pytest.raises(
        ValueError, match=r"contextual_term hook returned shape \(2, 4, 3, 2\), expected "
    ):
        wrong.contextual_term(logits, q, pos, pos)


def test_hooks_are_found_on_the_class_the_instance_a_submodule_or_a_getattr():
    """hooks_of reads the hook names once per class, and still finds a hook set on the
    instance, a submodule of a hook's name, and a hook a class's own ``__getattr__`` gives;
    a hook a property declines (Shaw's value_term with values=False) is absent."""
    from posenc import ALiBi, ShawRelativePosition

    def bias(q_pos, k_pos):
        return torch.zeros(1, 1, q_pos.shape[-1], k_pos.shape[-1])

    class Bias(nn.Module):
        def forward(self, q_pos, k_pos):
            return bias(q_pos, k_pos)

    class Dynamic:
        def __getattr__(self, name):
            if name == "score_bias":
                return bias
            raise AttributeError(name)

    assert hooks_of(ALiBi(2)).score_bias is not None and hooks_of(ALiBi(2)).score_term is None
    on_instance = nn.Module()
    assert hooks_of(on_instance).score_bias is None  # the class is read, and cached
    on_instance.score_bias = bias
    assert hooks_of(on_instance).score_bias is bias
    as_module = nn.Module()
    as_module.score_bias = Bias()
    assert isinstance(hooks_of(as_module).score_bias, Bias)
    assert hooks_of(Dynamic()).score_bias is bias
    assert hooks_of(ShawRelativePosition(8, 2, values=False)).value_term is None
    assert hooks_of(ShawRelativePosition(8, 2)).value_term is not None


def test_a_hook_added_to_a_class_after_its_first_use_is_found():
    """Hooks are read from the classes as they are at each call: a hook patched onto a class
    (or a base class) after a first call is used, not silently skipped."""

    def bias(q_pos, k_pos):
        return torch.zeros(1, 1, q_pos.shape[-1], k_pos.shape[-1])

    class Base(nn.Module):
        pass

    class Child(Base):
        pass

    assert hooks_of(Child()).score_bias is None
    Base.score_bias = staticmethod(bias)
    assert hooks_of(Child()).score_bias is bias


@pytest.mark.compile
def test_a_compiled_call_follows_a_hook_added_after_it_compiled():
    """Traced by Dynamo, hooks_of guards on the dicts it reads: a hook set on the instance,
    on its class or as a submodule after the first compiled call recompiles, and the call
    then gives the eager output with that hook (the math path's, which differs from
    ALiBi's)."""
    from posenc import ALiBi

    class Doubled(ALiBi):
        pass

    def steep(q_pos, k_pos):  # a bias ALiBi never gives: -3 |j - i|
        return -3.0 * (k_pos[:, None, None, :] - q_pos[:, None, :, None]).abs().float()

    class Steep(nn.Module):
        def forward(self, q_pos, k_pos):
            return steep(q_pos, k_pos)

    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    pos = torch.arange(6)[None]
    mask = Mask(6, 6)

    def changes():
        yield "instance", Doubled(2), lambda s: setattr(s, "score_bias", steep)
        yield "class", Doubled(2), lambda s: setattr(Doubled, "score_bias", staticmethod(steep))
        # (a class's score_bias would shadow a submodule of that name: a bare module)
        yield "submodule", nn.Module(), lambda s: setattr(s, "score_bias", Steep())

    for where, scheme, change in changes():
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda q, k, v, s=scheme: run("auto", s, q, k, v, pos, pos, mask),
            backend="eager",
            fullgraph=True,
        )
        with torch.no_grad():
            torch.testing.assert_close(
                compiled(q, k, v), run("math", scheme, q, k, v, pos, pos, mask)
            )
            change(scheme)
            expected = run("math", scheme, q, k, v, pos, pos, mask)
            assert not torch.allclose(expected, run("math", ALiBi(2), q, k, v, pos, pos, mask)), (
                where
            )
            torch.testing.assert_close(compiled(q, k, v), expected, msg=where)
        if "score_bias" in vars(Doubled):
            del Doubled.score_bias
    torch._dynamo.reset()


@pytest.mark.compile
@pytest.mark.parametrize("name", ["alibi", "sandwich", "rotary", "t5", "swin-2d", "shaw"])
def test_a_compiled_call_does_not_recompile_for_an_attribute_no_hook_reads(name):
    """Traced, hooks_of guards on which hook names the instance's dict holds, not on the
    rest of it: setting an attribute the attention never reads between compiled calls
    keeps one graph (a guard on every key and value would recompile each call, and past
    Dynamo's recompile limit run the call uncompiled)."""
    from torch._dynamo.utils import counters

    from posenc import MultiHeadAttention, registry

    scheme = registry.build(name, registry.Shape(2, 8, 12, (3, 4)))
    model = MultiHeadAttention(16, 2, position=scheme).eval()
    x = torch.randn(2, 12, 16)
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with torch.no_grad():
            for step in range(3):
                scheme.step = step
                compiled(x)
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()


def test_a_hook_behind_a_descriptor_that_needs_an_instance_is_found():
    """Hook names are read from the class dicts, not by running the class's descriptors
    without an instance (one that reads the instance would raise there, and the hook would
    be dropped: attention without the scheme)."""

    def bias(q_pos, k_pos):
        return torch.zeros(1, 1, q_pos.shape[-1], k_pos.shape[-1])

    class FromInstance:
        def __get__(self, obj, owner=None):
            return obj.implementation  # no branch for obj None: raises on the class

    class Scheme(nn.Module):
        score_bias = FromInstance()

        def __init__(self):
            super().__init__()
            self.implementation = bias

    assert hooks_of(Scheme()).score_bias is bias


def _hooks_by_definition(scheme):
    """hooks_of written the slow obvious way: every hook name looked up on the instance,
    each extra's owner found by walking the MRO's class dicts."""
    found = {}
    for name in Hooks.__dataclass_fields__:
        fn = getattr(scheme, name, None)
        if callable(fn):
            found[name] = fn

    def owner(name):  # the instance's, but for what a class's cached_property cached there
        cls = next((c for c in type(scheme).__mro__ if name in vars(c)), None)
        cached = cls is not None and isinstance(vars(cls)[name], functools.cached_property)
        return None if name in vars(scheme) and not cached else cls

    mro = type(scheme).__mro__
    for extra, base in DERIVED_HOOKS.items():
        if extra in found and base in found and owner(extra) is not None:
            base_cls, extra_cls = owner(base), owner(extra)
            if base_cls is None or mro.index(base_cls) < mro.index(extra_cls):
                del found[extra]
    return found


def _named_hooks(hooks):
    return {name: fn for name, fn in vars(hooks).items() if fn is not None}


def _same(found, expected):
    """The same hook names, each the same callable (a property that builds a new function
    per lookup, such as Shaw's offset_value, compared by what it builds)."""
    assert found.keys() == expected.keys()
    for name, fn in found.items():
        other = expected[name]
        assert fn == other or fn.__qualname__ == other.__qualname__, name


def test_hooks_of_finds_each_hook_and_owner_as_the_definition_does():
    """One pass over the class dicts gives every scheme's hooks, and keeps or drops each
    extra, as looking up every name and walking the MRO for each does."""
    from posenc import ALiBi, RelativeQueryEmbedding
    from schemes import SCHEMES

    schemes = [entry.build(4, 8, 16, (4, 4)) for entry in SCHEMES.values()]

    class Mixin:
        def score_bias(self, q_pos, k_pos):
            return 2 * super().score_bias(q_pos, k_pos)

    class Mixed(Mixin, ALiBi):  # the mixin's score_bias comes first: ALiBi's extras go
        pass

    on_instance = ALiBi(4)  # a hook set on the instance: its class's extras go
    on_instance.score_bias = lambda q_pos, k_pos: torch.zeros(
        1, 4, q_pos.shape[-1], k_pos.shape[-1]
    )
    pair = ALiBi(4)  # a hook and its extra set on the instance together: both kept
    pair.score_bias = on_instance.score_bias
    pair.offset_bias = lambda q_pos, k_pos: None

    class Submodule(nn.Module):
        def forward(self, q, q_pos, k_pos):
            return torch.zeros(q.shape[0], q.shape[1], q.shape[2], k_pos.shape[-1])

    holder = RelativeQueryEmbedding(max_len=16, head_dim=8)
    holder.value_term = Submodule()  # a submodule named as a hook: nn.Module's __getattr__

    class NotAModule:
        def score_bias(self, q_pos, k_pos):
            return torch.zeros(1, 1, q_pos.shape[-1], k_pos.shape[-1])

    for scheme in [*schemes, Mixed(4), on_instance, pair, holder, NotAModule()]:
        _same(_named_hooks(hooks_of(scheme)), _hooks_by_definition(scheme))
    assert "offset_bias" not in _named_hooks(hooks_of(Mixed(4)))
    assert "offset_bias" not in _named_hooks(hooks_of(on_instance))
    assert "offset_bias" in _named_hooks(hooks_of(pair))
    assert _named_hooks(hooks_of(holder))["value_term"] is holder.value_term


def test_hooks_of_answers_the_same_when_a_lookup_writes_into_the_instance():
    """A hook or an extra exposed through functools.cached_property writes itself into the
    instance on its first lookup; it is still its class's: the first call keeps or drops
    the extra as every later call does, and a parent's cached extra is dropped under a
    subclass's own hook (the lean path then computes the subclass's bias, as math does)."""

    class Parent(nn.Module):
        def score_bias(self, q_pos, k_pos):
            return torch.zeros(1, 1, q_pos.shape[-1], k_pos.shape[-1])

        @functools.cached_property
        def offset_bias(self):
            return lambda q_pos, k_pos: torch.zeros(1, q_pos.shape[-1] + k_pos.shape[-1] - 1)

    class Steeper(Parent):
        def score_bias(self, q_pos, k_pos):
            return -(k_pos[:, None, None, :] - q_pos[:, None, :, None]).abs().float()

    class CachedHook(nn.Module):
        @functools.cached_property
        def score_bias(self):
            return lambda q_pos, k_pos: torch.zeros(1, 1, q_pos.shape[-1], k_pos.shape[-1])

        def offset_bias(self, q_pos, k_pos):
            return torch.zeros(1, q_pos.shape[-1] + k_pos.shape[-1] - 1)

    for scheme in (Steeper(), CachedHook()):
        kept = [hooks_of(scheme).offset_bias is not None for _ in range(3)]
        assert kept == [kept[-1]] * 3, type(scheme).__name__
        _same(_named_hooks(hooks_of(scheme)), _hooks_by_definition(scheme))
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 6, 8).unbind(0)
    scheme = Steeper()
    pos = torch.arange(6)[None]
    first, second = (run("lean", scheme, q, k, v, pos, pos, Mask(6, 6)) for _ in range(2))
    assert torch.equal(first, second)
    assert hooks_of(scheme).offset_bias is None  # the parent's, under Steeper's score_bias
    expected = run("math", scheme, q, k, v, pos, pos, Mask(6, 6))
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-5)


def test_bias_fits_answers_as_the_hooks_check_of_a_score_bias():
    """``bias_fits`` (the kept route's check) agrees with the shapes ``checked_hooks`` lets
    a ``score_bias`` return, over every batch, head and length size around the call's."""
    from posenc.hooks import _EXPECTED, _fits, bias_fits

    b, h = 3, 4
    for pos_batch in (1, b):
        q_pos = torch.zeros(pos_batch, 5, dtype=torch.long)
        k_pos = torch.zeros(pos_batch, 7, dtype=torch.long)
        allowed = _EXPECTED["score_bias"]((1, h), b, 0, q_pos, k_pos)
        for shape in itertools.product((1, 2, 3), (1, 2, 4), (4, 5), (7, 8)):
            bias = torch.zeros(shape)
            assert bias_fits(bias, b, h, q_pos, k_pos) == _fits(bias.shape, allowed), shape
        for shape in ((h, 5, 7), (1, 1, 1, 5, 7)):
            assert not bias_fits(torch.zeros(shape), b, h, q_pos, k_pos)


def test_attribute_answers_as_getattr_without_the_modules_exception(monkeypatch):
    """``attribute(x, name)`` is ``getattr(x, name, None)`` for names on the class, a base,
    the instance, a parameter, a buffer, a submodule, a descriptor that needs an instance,
    a class with its own ``__getattr__`` and non-modules (None for no scheme, None); for a
    name a module lacks
    it answers None without calling ``nn.Module.__getattr__`` (which raises, for getattr
    to catch)."""
    from posenc import ALiBi, Rotary
    from posenc.hooks import attribute

    class FromInstance:
        def __get__(self, obj, owner=None):
            return obj.implementation

    class Scheme(ALiBi):
        score_term = FromInstance()

        def __init__(self):
            super().__init__(2)
            self.implementation = "term"
            self.set_here = "here"
            self.table = nn.Parameter(torch.zeros(1))
            self.register_buffer("kept", torch.zeros(1))
            self.inner = nn.Linear(1, 1)

    class Dynamic(nn.Module):
        def __getattr__(self, name):
            return "dynamic" if name == "rotate" else super().__getattr__(name)

    scheme = Scheme()
    names = ["score_term", "set_here", "table", "kept", "inner", "score_bias", "rotate", "no"]
    assert all(attribute(None, name) is None for name in [*names, "__class__"])
    for obj in (scheme, Rotary(8), Dynamic(), object(), 3):
        for name in [*names, "__class__"]:
            expected = getattr(obj, name, None)
            assert attribute(obj, name) is expected or attribute(obj, name) == expected
    assert attribute(Dynamic(), "rotate") == "dynamic"

    def raising(self, name):
        raise AssertionError(f"nn.Module.__getattr__ called for {name}")

    monkeypatch.setattr(nn.Module, "__getattr__", raising)
    monkeypatch.setattr(posenc_hooks, "_MODULE_GETATTR", raising)
    assert attribute(scheme, "rotate") is None and attribute(scheme, "no") is None
    assert attribute(scheme, "table") is scheme._parameters["table"]
