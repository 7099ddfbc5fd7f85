"""posenc.engine.learned: a tensor that requires grad and that a scheme's hooks read gets its
gradient on every path, a leaf or a tensor with a history, as the math path gives it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import posenc
from posenc.engine import Mask, attend, explain_call
from posenc.engine.learned import (
    _reads_own_only,
    learned_inputs,
    own_learning,
    substituted,
)
from posenc.hooks import hooks_of
from schemes import SCHEMES
from tolerances import assert_close, logit_size

SPAN = 8


def _offsets(q_pos, k_pos):
    return (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-SPAN, SPAN) + SPAN  # [B', n_q, n_k]


class HeldBias:
    """A user's scheme that is not a module: a bias per clipped offset read from a table
    it is handed (``[h, 2 SPAN + 1]``, a leaf or a tensor with a history)."""

    def __init__(self, table):
        self.table = table

    def score_bias(self, q_pos, k_pos):
        return self.table[:, _offsets(q_pos, k_pos)].transpose(0, 1)  # [B', h, n_q, n_k]


class HeldOffsetBias(HeldBias):
    """The same with its per-offset form, which the per-offset path reads."""

    def offset_bias(self, q_pos, k_pos):
        first, last = int(k_pos[0, 0] - q_pos[0, -1]), int(k_pos[0, -1] - q_pos[0, 0])
        return self.table[:, torch.arange(first, last + 1).clamp(-SPAN, SPAN) + SPAN]


class HeldValue(HeldBias):
    """A value term per clipped offset read from a held ``[2 SPAN + 1, d]`` table, beside the
    bias: the general lean path (the fused kernels add no value term)."""

    def __init__(self, table, values):
        super().__init__(table)
        self.values = values

    def value_term(self, weights, q_pos, k_pos):
        index = _offsets(q_pos, k_pos)[:, None].expand_as(weights)  # [b, h, n_q, n_k]
        buckets = weights.new_zeros(*weights.shape[:-1], 2 * SPAN + 1)
        return buckets.scatter_add(-1, index, weights) @ self.values  # [b, h, n_q, d]


def _run(scheme, backend, n, *, mask=None, inputs_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64, generator=g) for _ in range(3))
    q, k, v = (x.requires_grad_(inputs_grad) for x in (q, k, v))
    pos = torch.arange(n)[None]
    mask = Mask(n, n) if mask is None else mask
    path = explain_call(q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask, backend=backend)
    out, _ = attend(q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask, backend=backend)
    return path.path, out, (q, k, v)


def _loss(out):
    return (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum()


def _grads(make, backend, n, **kw):
    """``(path, [out, d base, d values?, dq, dk, dv])`` of a fresh scheme from ``make(base,
    values)`` on leaves ``base [2, 2 SPAN + 1]`` and ``values [2 SPAN + 1, 8]``."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(2, 2 * SPAN + 1, dtype=torch.float64, generator=g).requires_grad_()
    values = torch.randn(2 * SPAN + 1, 8, dtype=torch.float64, generator=g).requires_grad_()
    scheme = make(base, values)
    path, out, inputs = _run(scheme, backend, n, **kw)
    _loss(out).backward()
    return path, [out, base.grad, values.grad, *(x.grad for x in inputs)]


#: schemes reading a leaf they are handed, and a tensor computed from it (with a history)
MAKERS = {
    "bias-leaf": lambda base, values: HeldBias(base),
    "bias-history": lambda base, values: HeldBias(base * 2 - 1),
    "offset-leaf": lambda base, values: HeldOffsetBias(base),
    "offset-history": lambda base, values: HeldOffsetBias(base.exp()),
    "value-history": lambda base, values: HeldValue(base * 2, values.tanh()),
}

#: (maker, n, mask) -> the path the call takes (so that each fast path is covered)
CASES = [
    ("bias-leaf", 64, None, "auto", "materialised"),
    ("bias-leaf", 300, None, "auto", "lean-fused"),
    ("bias-history", 64, None, "auto", "materialised"),
    ("bias-history", 64, None, "lean", "lean-fused"),
    ("bias-history", 300, None, "auto", "lean-fused"),
    ("bias-history", 300, "padding", "lean", "mask-blocks"),
    ("offset-leaf", 300, None, "auto", "offset-bias"),
    ("offset-history", 300, None, "auto", "offset-bias"),
    ("offset-history", 300, "causal", "lean", "offset-bias"),
    ("value-history", 40, None, "lean", "lean"),
    ("value-history", 300, "padding", "lean", "mask-blocks"),
]


def _mask(kind, n):
    if kind is None:
        return None
    if kind == "causal":
        return Mask(n, n, causal=True)
    return Mask(n, n, key_padding=torch.arange(n)[None].expand(2, n) >= n - 7)


@pytest.mark.parametrize(("maker", "n", "mask", "backend", "path"), CASES)
def test_a_tensor_the_hooks_read_gets_the_math_paths_gradient(maker, n, mask, backend, path):
    taken, fast = _grads(MAKERS[maker], backend, n, mask=_mask(mask, n))
    assert taken == path
    _, slow = _grads(MAKERS[maker], "math", n, mask=_mask(mask, n))
    for name, a, c in zip(["out", "base", "values", "q", "k", "v"], slow, fast, strict=True):
        torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("backend", ["auto", "lean"])
def test_only_the_hooks_tensor_asks_for_a_gradient(backend):
    """q, k, v without gradients: the call still differentiates the table (it took the path
    as a call without gradients before)."""
    n = 300
    grads = {}
    for name in ("math", backend):
        base = torch.linspace(-2, 2, 2 * (2 * SPAN + 1), dtype=torch.float64).view(2, -1)
        base.requires_grad_()
        _, out, _ = _run(HeldBias(base * 3), name, n, inputs_grad=False)
        _loss(out).backward()
        grads[name] = base.grad
    assert grads[backend] is not None
    torch.testing.assert_close(grads[backend], grads["math"], rtol=1e-10, atol=1e-10)


class Table(nn.Module):
    """A learned table per clipped offset, as a module's parameter."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.linspace(-1, 1, 2 * (2 * SPAN + 1)).view(2, -1))

    def score_bias(self, q_pos, k_pos):
        return self.table[:, _offsets(q_pos, k_pos)].transpose(0, 1)


class Scale(nn.Module):
    def forward(self, w):
        return 3 * w


@pytest.mark.parametrize("touched", [False, True])
@pytest.mark.parametrize("through", [Scale, nn.Tanh])
def test_a_history_shared_with_the_rest_of_the_model_is_counted_once(through, touched):
    """A module scheme whose table is parametrised (by a user's class, or torch's) and
    cached: the cached table (a tensor with a history; first computed inside attention, or
    before it) is read by two calls and enters the loss; the parameter's gradient on the
    lean paths equals math's (read through a stand-in, its history differentiated once)."""
    grads = {}
    for backend in ("math", "lean"):
        scheme = Table().double()
        parametrize.register_parametrization(scheme, "table", through())
        assert not _reads_own_only(scheme)
        with parametrize.cached():
            if touched:
                scheme.table.sum()
            path, out, _ = _run(scheme, backend, 300)
            _, out2, _ = _run(scheme, backend, 300, seed=1)
            (_loss(out) + _loss(out2) + scheme.table.square().sum()).backward()
        grads[backend] = scheme.parametrizations.table.original.grad
    assert path == "lean-fused"
    torch.testing.assert_close(grads["lean"], grads["math"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("maker", ["bias-leaf", "bias-history", "value-history"])
def test_second_derivatives_through_a_held_tensor_are_the_definitions(maker):
    """A gradient penalty (create_graph=True) through a fast path, on the gradients of ``q``
    and of the held tensor's leaf: its derivatives equal math's."""
    results = {}
    for backend in ("math", "lean"):
        g = torch.Generator().manual_seed(7)
        base = torch.randn(2, 2 * SPAN + 1, dtype=torch.float64, generator=g).requires_grad_()
        values = torch.randn(2 * SPAN + 1, 8, dtype=torch.float64, generator=g).requires_grad_()
        _, out, (q, _, _) = _run(MAKERS[maker](base, values), backend, 40)
        dq, dbase = torch.autograd.grad(_loss(out), (q, base), create_graph=True)
        penalty = dq.square().sum() + dbase.square().sum()
        results[backend] = torch.autograd.grad(penalty, (base, values), allow_unused=True)
    for a, c in zip(results["math"], results["lean"], strict=True):
        if a is None:
            assert c is None
        else:
            torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-10)


def test_learned_inputs_splits_leaves_from_histories_and_skips_parameters():
    base = torch.zeros(2, 2 * SPAN + 1, requires_grad=True)
    table = base * 2
    q, pos = torch.zeros(1, 2, 5, 8), torch.arange(5)[None]
    values = torch.zeros(2 * SPAN + 1, 8, requires_grad=True)
    scheme = HeldValue(table, values.exp())
    leaves, histories = learned_inputs(scheme, hooks_of(scheme), q, pos, pos)
    assert leaves == [] and [id(x) for x in histories] == [id(table), id(scheme.values)]
    scheme = HeldBias(base)
    leaves, histories = learned_inputs(scheme, hooks_of(scheme), q, pos, pos)
    assert [id(x) for x in leaves] == [id(base)] and histories == []
    with torch.no_grad():
        assert learned_inputs(scheme, hooks_of(scheme), q, pos, pos) == ([], [])


def test_posencs_own_schemes_are_not_probed():
    for name, entry in SCHEMES.items():
        scheme = entry.build(2, 8, 16, (4, 4))
        assert _reads_own_only(scheme), name


def test_a_scheme_that_may_read_other_tensors_is_probed():
    from posenc import ALiBi, T5RelativeBias

    class Configured(T5RelativeBias):  # sets posenc's class up, reads what it reads
        def __init__(self):
            super().__init__(2, num_buckets=8)

    class Mine(T5RelativeBias):
        def bias(self, buckets):
            return super().bias(buckets)

    assert _reads_own_only(None)
    assert _reads_own_only(Configured())
    assert not _reads_own_only(HeldBias(torch.zeros(1)))
    assert not _reads_own_only(Mine(2))
    replaced = ALiBi(2)
    replaced.slopes = lambda: torch.ones(2)
    assert not _reads_own_only(replaced)
    held = ALiBi(2)
    held._extra = torch.ones(2, requires_grad=True)
    assert not _reads_own_only(held)
    tanh = T5RelativeBias(2)
    parametrize.register_parametrization(tanh.embedding, "weight", nn.Tanh())
    assert not _reads_own_only(tanh)  # a torch class, but a cached table has a history


class PastFuture:
    """Slopes for keys behind the query and ahead of it, each read only for the queries
    that have such keys (row 0 has none behind)."""

    def __init__(self, past, future):
        self.past, self.future = past, future

    def score_bias(self, q_pos, k_pos):
        offsets = (k_pos[:, None, :] - q_pos[:, :, None]).double()[:, None]  # [B', 1, n_q, n_k]
        bias = offsets.new_zeros(offsets.shape[0], 2, *offsets.shape[2:])
        if bool((offsets > 0).any()):
            bias = bias - offsets.clamp(min=0) * self.future[:, None, None]
        if bool((offsets < 0).any()):
            bias = bias - (-offsets).clamp(min=0) * self.past[:, None, None]
        return bias  # [B', 2, n_q, n_k]


def test_a_tensor_read_for_some_rows_only_gets_its_gradient():
    grads = {}
    for backend in ("math", "lean"):
        past = torch.tensor([0.1, 0.2], dtype=torch.float64, requires_grad=True)
        future = torch.tensor([0.3, 0.05], dtype=torch.float64, requires_grad=True)
        _, out, _ = _run(PastFuture(past, future), backend, 300)
        _loss(out).backward()
        grads[backend] = (past.grad, future.grad)
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-10)


class Normalised(HeldBias):
    """The held table divided by a statistic of another tensor taken without grad."""

    def __init__(self, table, stat):
        super().__init__(table)
        self.stat = stat

    def score_bias(self, q_pos, k_pos):
        with torch.no_grad():
            size = self.stat.abs().amax()
        return super().score_bias(q_pos, k_pos) / size


def test_a_tensor_read_without_grad_gets_none_as_on_math():
    """No gradient reaches a tensor read under no_grad: None on every path, not zeros
    (which an optimizer with weight decay or momentum would still apply)."""
    grads = {}
    for backend in ("math", "lean"):
        table = torch.linspace(-1, 1, 2 * (2 * SPAN + 1), dtype=torch.float64).view(2, -1)
        table.requires_grad_()
        stat = torch.tensor([2.0, -3.0], dtype=torch.float64, requires_grad=True)
        taken, out, _ = _run(Normalised(table, stat), backend, 300)
        _loss(out).backward()
        assert stat.grad is None, taken
        grads[backend] = table.grad
    torch.testing.assert_close(grads["lean"], grads["math"], rtol=1e-10, atol=1e-10)


@pytest.mark.compile  # FlexAttention compiles its kernel (on a CPU, with AVX2 only)
def test_the_flex_path_runs_a_scheme_reading_a_tensor_with_a_history_on_cpu():
    """backend='flex' on CPU (forward only there) with a tensor with a history read by the
    scheme, in grad mode: it runs, as before the probe (which must not drop its mods)."""
    from posenc import ALiBi

    class Learned(ALiBi):
        def slopes(self, device=None):
            return self.raw.exp()

    scheme = Learned(2)
    scheme.raw = torch.tensor([-0.5, -1.5], requires_grad=True) * 1.0
    n = 16
    pos, mask = torch.arange(n)[None], Mask(n, n)
    q, k, v = (torch.randn(1, 2, n, 8) for _ in range(3))
    out = {
        backend: attend(q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask, backend=backend)[0]
        for backend in ("flex", "math")
    }
    logit = logit_size(q, k, scheme, pos, pos)
    assert_close(out["flex"], out["math"], terms=n, logit=logit)


def test_substituted_hooks_read_the_stand_in_and_drop_flex_mods():
    table, stand_in = torch.zeros(2, 2 * SPAN + 1), torch.ones(2, 2 * SPAN + 1)
    hooks = hooks_of(HeldBias(table))
    pos = torch.arange(4)[None]
    swapped = substituted(hooks, [table], [stand_in])
    assert bool((swapped.score_bias(pos, pos) == 1).all())
    assert bool((hooks.score_bias(pos, pos) == 0).all())
    from posenc import ALiBi

    alibi_hooks = hooks_of(ALiBi(2))
    assert alibi_hooks.flex_score_mod is not None
    assert substituted(alibi_hooks, [], []).flex_score_mod is None


def test_the_probe_does_not_report_the_queries_themselves():
    """A user's constant bias reads no tensor requiring grad: the probe finds none, for
    leaf queries and for queries with a history (slicing q inside the probe's mode used to
    report q itself, and a non-leaf q as a history)."""

    class Constant(nn.Module):
        def score_bias(self, q_pos, k_pos):
            return -(k_pos[:, None, None, :] - q_pos[:, None, :, None]).abs().float()

    scheme = Constant()
    pos = torch.arange(12)[None]
    leaf = torch.randn(1, 2, 12, 4, requires_grad=True)
    for q in (leaf, leaf * 2):
        assert learned_inputs(scheme, hooks_of(scheme), q, pos, pos) == ([], [])


@pytest.mark.parametrize("n", [8, 300])
def test_a_tensor_a_users_key_shift_reads_gets_its_gradient(n):
    """The fast paths fold a key shift into the keys; what the shift reads is still found
    and differentiated (a leaf that only the shift and its term read), as math does."""
    torch.manual_seed(0)
    table = torch.randn(512, 8, dtype=torch.float64, requires_grad=True)

    class Shift:  # not a module: the probe finds what it reads
        def score_term(self, q, q_pos, k_pos):
            return q @ table[k_pos[0]].transpose(-1, -2)[None, None]

        def key_shift(self, q, q_pos, k_pos):
            return table[k_pos[0]][None, None].expand(q.shape[0], q.shape[1], -1, -1)

        def score_bias(self, q_pos, k_pos):
            offsets = (k_pos[:, None, None, :] - q_pos[:, None, :, None]).abs()
            return -0.3 * offsets.to(torch.float64)

    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grads = {}
    for backend in ("math", "auto"):
        out = posenc.attention(q, k, v, position=Shift(), backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum(), (table, q, k, v))
    for found, expected in zip(grads["auto"], grads["math"], strict=True):
        torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-10)


def test_posenc_s_own_modules_are_those_of_its_package_as_imported():
    """The package is read from the engine's own module name (a vendored or second copy
    counts its own modules, not its neighbours')."""
    from posenc.engine.learned import PACKAGE, own_module

    assert PACKAGE == "posenc"
    assert own_module("posenc") and own_module("posenc.alibi") and own_module("posenc.engine.kept")
    assert not own_module("posenc_base.alibi") and not own_module("posencx")
    assert not own_module("myproject.schemes") and not own_module("torch.nn")


def test_own_learning_gives_the_grad_flags_of_a_scheme_that_reads_its_own_only():
    """``own_learning`` (one walk) is None for a scheme that may read other tensors (a
    user's class, a function or a learned tensor set on the instance, a parametrised
    table, a non-module) and otherwise gives the grad flag of each of its parameters and
    buffers (a submodule's too): for posenc's schemes learned and frozen, one with a
    frozen and one with a learning submodule, and None (no parameter)."""
    from posenc import ALiBi, T5RelativeBias

    class Mine(T5RelativeBias):
        def bias(self, buckets):
            return super().bias(buckets)

    class Holder(ALiBi):  # posenc's class, with a table in a submodule
        def __init__(self):
            super().__init__(2)
            self.inner = nn.Linear(1, 1)

    own = [None]
    for entry in SCHEMES.values():
        learned = entry.build(2, 8, 16, (4, 4))
        frozen = entry.build(2, 8, 16, (4, 4))
        if isinstance(frozen, nn.Module):
            frozen.requires_grad_(False)
        own += [learned, frozen]
    holder, thawed = Holder(), Holder()
    holder.requires_grad_(False)
    thawed.inner.bias.requires_grad_(False)
    own += [holder, thawed]
    with_function, with_tensor = ALiBi(2), ALiBi(2)
    with_function.slopes = lambda: torch.ones(2)
    with_tensor.extra = torch.zeros(2, requires_grad=True)
    parametrised = Table()
    parametrize.register_parametrization(parametrised, "table", Scale())
    parametrised.requires_grad_(False)
    for scheme in (object(), HeldBias(torch.zeros(1)), Mine(2), with_function, with_tensor):
        assert own_learning(scheme) is None and not _reads_own_only(scheme), scheme
    assert own_learning(parametrised) is None
    seen = set()
    for scheme in own:
        flags = own_learning(scheme)
        tensors = [] if not isinstance(scheme, nn.Module) else [*scheme.parameters()]
        tensors += [] if not isinstance(scheme, nn.Module) else [*scheme.buffers()]
        assert sorted(flags) == sorted(t.requires_grad for t in tensors), scheme
        assert _reads_own_only(scheme)
        seen.add(any(flags))
    assert seen == {True, False}
    assert sorted(own_learning(thawed)) == [False, True]


def test_a_cycle_of_modules_is_walked_once():
    """A scheme and a module that hold each other (a cycle of submodules) are walked once
    each: the grad-mode call that asks whether the scheme reads its own tensors only
    returns, with the definition's output."""
    from posenc import ALiBi

    class Holder(nn.Module):
        pass

    scheme, holder = ALiBi(2), Holder()
    scheme.owner = holder
    holder.scheme = scheme
    assert _reads_own_only(scheme) and own_learning(scheme) == ()  # Holder defines no method
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    out = posenc.attention(q, q, q, position=scheme)
    ref = posenc.attention(q, q, q, position=scheme, backend="math")
    torch.testing.assert_close(out, ref)
