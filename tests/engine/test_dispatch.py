"""The dispatcher (engine/dispatch.py): which path auto takes, and inputs in any layout."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    TableBias,
    ValueTable,
    block_rows,
    lean_and_math,
    offset_rows,
    spy_on,
)
from torch import nn

import posenc
from posenc.engine import Mask, attend, explain_call, grid, offset_bias, offset_term, tuning
from tolerances import assert_close, logit_size


@pytest.mark.parametrize("name", ["t5", "relative", "shaw", "swin-2d", "relative-2d"])
def test_fast_paths_take_inputs_in_projection_layout(monkeypatch, name):
    """q, k, v as a projection gives them, ``[b, n, h, d]`` viewed as ``[b, h, n, d]`` (not
    contiguous): every fast path with a written-out backward, outputs and gradients."""
    from posenc import (
        RelativePositionBias,
        RelativeQueryEmbedding,
        RelativeQueryEmbedding2D,
        ShawRelativePosition,
        T5RelativeBias,
    )

    b, h, d, n = 2, 3, 8, 24
    engine, scheme = {
        "t5": (
            offset_bias._OffsetFusedAttention,
            lambda: T5RelativeBias(h, num_buckets=8, max_distance=16),
        ),
        "relative": (offset_term._OffsetTermAttention, lambda: RelativeQueryEmbedding(n, d)),
        "shaw": (offset_term._OffsetTermAttention, lambda: ShawRelativePosition(d, 3)),
        "swin-2d": (grid._GridFusedAttention, lambda: RelativePositionBias((4, 6), h)),
        "relative-2d": (grid._GridTermAttention, lambda: RelativeQueryEmbedding2D((4, 6), d)),
    }[name]
    calls = spy_on(monkeypatch, engine)
    monkeypatch.setattr(tuning, "FAR_PAIRS", 0)  # Shaw's far parts too
    monkeypatch.setattr(tuning, "GRID_BIAS_PAIRS", 0)  # the 2-D bias's gate
    block_rows(monkeypatch, 5)
    offset_rows(monkeypatch, 5, b, n, n)
    torch.manual_seed(1)
    scheme = scheme().double()
    for p in scheme.parameters():
        nn.init.normal_(p, std=1.0)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float64).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    pos = torch.arange(n)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(n, n))
    assert calls
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a)


def test_auto_choice(monkeypatch):
    """auto: SDPA with nothing positional (or with dropout), a bias or a value term written
    out where the scores are few, the lean engine above that, the math reference for a
    value term with dropout."""
    pos = torch.arange(4)[None]
    q = torch.zeros(1, 1, 4, 2)

    def path(scheme, dropout_p=0.0):
        args = dict(scheme=scheme, q_pos=pos, k_pos=pos, mask=Mask(4, 4), dropout_p=dropout_p)
        return explain_call(q, q, q, **args).path

    assert path(None) == "sdpa"
    assert path(TableBias(1)) == "materialised"
    assert path(ValueTable(2)) == "materialised"
    monkeypatch.setattr(tuning, "MATERIALISED_SCORES", 0)  # the size of a long sequence
    assert path(TableBias(1)) == "lean-fused"
    assert path(ValueTable(2)) == "lean"
    assert path(TableBias(1), dropout_p=0.1) == "sdpa"
    assert path(ValueTable(2), dropout_p=0.1) == "math"
    with pytest.raises(ValueError, match="backend='lean' has no attention dropout"):
        attend(
            q,
            q,
            q,
            scheme=None,
            q_pos=pos,
            k_pos=pos,
            mask=Mask(4, 4),
            backend="lean",
            dropout_p=0.5,
        )


def test_auto_takes_flex_on_cuda_only_for_what_a_score_mod_expresses(monkeypatch):
    """On CPU ``auto`` never takes FlexAttention (no CPU backward); on CUDA (simulated: the
    device test patched) it takes it for biases and bounded query terms, and says why not
    for a value term, dropout or an unbounded term."""
    import posenc
    from posenc.engine import dispatch

    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    alibi = posenc.ALiBi(2)
    cpu = posenc.explain(q, k, v, position=alibi)
    assert cpu.path != "flex" and "not on CUDA" in cpu.reasons["flex"]
    monkeypatch.setattr(dispatch, "_on_cuda", lambda q: True)
    shaw_keys = posenc.ShawRelativePosition(8, 3, values=False)
    for scheme in (alibi, shaw_keys):
        assert posenc.explain(q, k, v, position=scheme, causal=True).path == "flex"
    # a term of the key alone (the absolute query embedding) is folded into the keys: SDPA
    absolute = posenc.AbsoluteQueryEmbedding(16, 8)
    assert posenc.explain(q, k, v, position=absolute, causal=True).path == "sdpa"

    class Unbounded(nn.Module):
        def score_term(self, q, q_pos, k_pos):
            return (k_pos - q_pos.T).double()[None, None].expand(*q.shape[:3], -1)

    for why, scheme in {
        "a value term": posenc.ShawRelativePosition(8, 3),
        "no bounded reach": Unbounded(),
    }.items():
        explanation = posenc.explain(q, k, v, position=scheme)
        assert explanation.path != "flex" and why in explanation.reasons["flex"], why
    # attention dropout: SDPA, which has it, before FlexAttention, which has not
    assert posenc.explain(q, k, v, position=alibi, dropout_p=0.1).path == "sdpa"
    assert posenc.explain(q, k, v, position=posenc.Rotary(8)).path == "sdpa"


@pytest.mark.compile
def test_auto_on_cuda_runs_flex_equal_to_math(monkeypatch):
    import posenc
    from posenc.engine import dispatch

    monkeypatch.setattr(dispatch, "_on_cuda", lambda q: True)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 64, 8) for _ in range(3))
    t5 = posenc.T5RelativeBias(2)
    with torch.no_grad():
        got = posenc.attention(q, k, v, position=t5, causal=True, window=16)
        want = posenc.attention(q, k, v, position=t5, causal=True, window=16, backend="math")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_path_but_math_and_sdpa_refuses_a_contextual_term_and_says_why():
    """A contextual term reads each query's whole row of masked logits: ``auto`` and ``lean``
    take the math path, ``sdpa`` takes the term as its float mask, and every other path
    (FlexAttention, the mask blocks, the per-offset and grid paths, the lean engine) names
    the contextual term."""
    import posenc
    from posenc.engine import dispatch
    from posenc.hooks import hooks_of

    class Counted(nn.Module):
        def contextual_term(self, logits, q, q_pos, k_pos):
            return -torch.sigmoid(logits).flip(-1).cumsum(-1).flip(-1)

    scheme = Counted()
    q, k, v = (torch.randn(2, 2, 12, 8) for _ in range(3))
    pos = torch.arange(12)[None]
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 9:] = True
    for mask in (Mask(12, 12), Mask(12, 12, causal=True), Mask(12, 12, key_padding=padding)):
        call = dispatch.Call(q, k, v, hooks_of(scheme), pos, pos, mask, 8**-0.5, 0.0, scheme)
        for path in dispatch.PATHS["auto"]:
            plan = path.plan(call)
            if path.name == "math":
                assert callable(plan)
            else:
                assert isinstance(plan, str) and "contextual term" in plan, (path.name, plan)
        assert callable(dispatch._plan_sdpa(call))
    told = posenc.explain(q, k, v, position=scheme, causal=True)
    assert told.path == "math" and "contextual term" in told.reasons["sdpa"]
    assert posenc.explain(q, k, v, position=scheme, backend="lean").path == "math"
    with pytest.raises(ValueError, match="backend='flex' cannot add a contextual term"):
        posenc.explain(q, k, v, position=scheme, backend="flex")


class _ShiftedKeysAndBias(nn.Module):
    """A per-offset bias peaked at offset +200 and an absolute key term ``q . R[k_pos]``
    that the fast paths fold into the keys (``key_shift``)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.heads = 1
        self.table = table  # [n, d]

    def offset_bias(self, q_pos, k_pos):
        offsets = torch.arange(
            int(k_pos[0, 0] - q_pos[0, -1]), int(k_pos[0, -1] - q_pos[0, 0]) + 1
        )  # [n_q + n_k - 1]
        return -(offsets - 200).abs().to(torch.float32)[None]  # [1, W]

    def score_bias(self, q_pos, k_pos):
        offsets = k_pos[:, None, :] - q_pos[:, :, None]  # [B', n_q, n_k]
        return -(offsets - 200).abs().to(torch.float32)[:, None]  # [B', 1, n_q, n_k]

    def score_term(self, q, q_pos, k_pos):
        rows = self.table[k_pos].to(q.dtype).unsqueeze(1)  # [B', 1, n_k, d]
        return q @ rows.transpose(-2, -1)  # [b, h, n_q, n_k]

    def key_shift(self, q, q_pos, k_pos):
        return self.table[k_pos].to(q.dtype).unsqueeze(1)  # [B', 1, n_k, d]


def test_the_path_is_chosen_for_the_keys_with_their_shift_folded_in():
    """A path whose condition reads the keys' values (the per-offset bias's span) is chosen
    for ``k + key_shift``, the keys it runs on: huge keys that the shift cancels take the
    path their shifted values allow, explain names it, and it equals the math path."""
    torch.manual_seed(0)
    n, d = 300, 8
    q, v = torch.randn(1, 1, n, d), torch.randn(1, 1, n, d)
    k = torch.randn(1, 1, n, d) * 0.1
    k[..., 0] += 1000.0
    table = -k[0, 0].clone()
    table[:, 0] = -1000.0  # k + shift: small keys, but for a first channel of 0
    scheme = _ShiftedKeysAndBias(table)
    pos = torch.arange(n)[None]
    told = explain_call(q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=Mask(n, n)).path
    q, k, v, table = (t.double() for t in (q, k, v, table))
    scheme.table = table
    args = dict(scheme=scheme, q_pos=pos, k_pos=pos, mask=Mask(n, n))
    results = {}
    for backend in ("auto", "math"):
        with torch.no_grad():
            plain, _ = attend(q, k, v, backend=backend, **args)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = attend(*leaves, backend=backend, **args)
        results[backend] = [plain, out, *torch.autograd.grad(out.square().sum(), leaves)]
    for a, c in zip(results["auto"], results["math"], strict=True):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-9)
    assert told == "lean-fused"  # the span of k + shift, not of k, keeps offset-bias out


class _RotationAndBias(nn.Module):
    """Learned rotation frequencies and a learned ALiBi-like slope in one scheme."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.heads = None
        self.theta = nn.Parameter(torch.linspace(0.1, 1.0, d // 2, dtype=torch.float64))
        self.slope = nn.Parameter(torch.tensor(0.3, dtype=torch.float64))

    def score_bias(self, q_pos, k_pos):
        return -(k_pos[:, None, None, :] - q_pos[:, None, :, None]).abs() * self.slope

    def rotate(self, q, k, q_pos, k_pos):
        def turned(x, pos):
            angles = pos.to(x.dtype)[:, None, :, None] * self.theta  # [B', 1, n, d/2]
            even, odd = x[..., 0::2], x[..., 1::2]
            cos, sin = angles.cos(), angles.sin()
            return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)

        return turned(q, q_pos), turned(k, k_pos)


@pytest.mark.parametrize("n", [12, 300])  # the materialised path; a wrapped lean path
def test_gradients_with_create_graph_count_each_path_once(n):
    """create_graph=True takes the math reference inside the wrapper: a parameter that feeds
    both the rotation (before the call) and nothing else, one that feeds the bias, and one
    tensor passed as q, k and v each get the gradient they get without create_graph, and
    the math path's, not twice or three times."""
    import posenc

    torch.manual_seed(0)
    scheme = _RotationAndBias(8)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for _ in range(3))
    x = q.clone().requires_grad_()
    grads = {}
    for backend in ("math", "auto"):
        for create_graph in (False, True):
            out = posenc.attention(q, k, v, position=scheme, backend=backend, causal=True)
            grads[backend, create_graph] = torch.autograd.grad(
                out.square().sum(), [scheme.theta, scheme.slope], create_graph=create_graph
            )
            out = posenc.attention(x, x, x, position=scheme, backend=backend, causal=True)
            (same,) = torch.autograd.grad(out.square().sum(), x, create_graph=create_graph)
            grads[backend, create_graph] += (same,)
    for key, found in grads.items():
        for a, c in zip(found, grads["math", False], strict=True):
            torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-12, msg=str(key))


def test_the_wrapped_fast_path_backwards_twice_with_retain_graph_and_lets_go_without():
    """The fast path's graph inside the create_graph wrapper: with retain_graph=True it is
    kept and a second backward gives the same gradients; without, the first backward lets
    it go (q, k, v are not held through the rest of the backward, a rotation's for one),
    and a second backward raises as autograd does (the lean path: SDPA's needs no
    wrapper on the CPU)."""
    torch.manual_seed(0)
    x = torch.randn(2, 2, 16, 8, requires_grad=True)
    pos = torch.arange(16)[None]

    def attended():
        out, _ = attend(x * 2, x * 3, x, q_pos=pos, k_pos=pos, mask=Mask(16, 16), backend="lean")
        node = out.grad_fn  # the wrapper's node, its ctx
        assert "TwiceDifferentiable" in type(node).__name__ and hasattr(node, "graph")
        return out.square().sum(), node

    loss, node = attended()
    (first,) = torch.autograd.grad(loss, x, retain_graph=True)
    assert hasattr(node, "graph")
    (second,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    assert not hasattr(node, "graph")
    loss, node = attended()
    loss.backward()
    assert not hasattr(node, "graph")
    torch.testing.assert_close(x.grad, first, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_the_wrapped_fast_path_keeps_history_it_shares_with_the_rest_of_the_model():
    """A table parametrised and cached (computed once, read by two attention calls): the
    first call's backward through the wrapper must not free the history the second
    shares, and the table's gradient equals the math path's."""
    from torch.nn.utils import parametrize

    import posenc

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    x0 = torch.randn(1, 2, 300, 8)  # 300 x 300 pairs: the offset-bias path, wrapped
    grads = {}
    for backend in ("math", "auto"):
        torch.manual_seed(1)
        scheme = posenc.T5RelativeBias(2)
        parametrize.register_parametrization(scheme.embedding, "weight", Double())
        x = x0.clone().requires_grad_()
        with parametrize.cached():
            y = posenc.attention(x, x, x, position=scheme, backend=backend)
            y = posenc.attention(y, y, y, position=scheme, backend=backend)
        y.square().sum().backward()
        grads[backend] = (x.grad, scheme.embedding.parametrizations.weight.original.grad)
    for a, c in zip(grads["math"], grads["auto"], strict=True):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "math", "sdpa", "lean"])
@pytest.mark.parametrize("n", [16, 300])
def test_grouped_keys_and_values_are_repeated_for_their_query_heads(backend, n):
    """Keys and values of fewer heads (grouped-query attention) serve consecutive query
    heads on every backend and at any size: the output of the heads repeated by hand
    (float64), and the gradients of the grouped keys and values summed over their heads."""
    torch.manual_seed(0)
    scheme = posenc.T5RelativeBias(8, num_buckets=8, max_distance=16).double()
    q = torch.randn(2, 8, n, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, n, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    pos = torch.arange(n)[None]
    mask = Mask(n, n, causal=True)
    out = attend(q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask, backend=backend)[0]
    k4, v4 = (x.detach().repeat_interleave(4, dim=1).requires_grad_() for x in (k, v))
    expected = attend(q.detach(), k4, v4, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask,
                      backend="math")[0]  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    for grouped, repeated in ((k, k4), (v, v4)):
        summed = repeated.grad.unflatten(1, (2, 4)).sum(dim=2)  # [b, h_kv, n, d]
        torch.testing.assert_close(grouped.grad, summed, rtol=1e-10, atol=1e-12)


def test_keys_of_heads_that_do_not_divide_the_queries_are_refused():
    q = torch.randn(1, 8, 4, 4)
    pos = torch.arange(4)[None]
    for k, v in (
        (torch.randn(1, 3, 4, 4),) * 2,
        (torch.randn(1, 2, 4, 4), torch.randn(1, 4, 4, 4)),
    ):
        for backend in ("auto", "math"):
            with pytest.raises(ValueError, match=r"k and v must have the same number of heads"):
                attend(q, k, v, q_pos=pos, k_pos=pos, mask=Mask(4, 4), backend=backend)
        with pytest.raises(ValueError, match=r"a divisor of q's 8"):
            explain_call(q, k, v, q_pos=pos, k_pos=pos, mask=Mask(4, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", ["consecutive", "shuffled"])
@pytest.mark.parametrize("name", ["alibi", "t5"])
def test_values_of_another_head_dim_take_the_paths_that_allow_them(name, positions, dtype):
    """v with a head dim other than q's (d_v != d) past the materialised path's sizes: the
    fused CPU kernels take one head dim, so the per-offset and fused lean paths decline
    (saying why) and the general lean engine runs it; outputs and gradients equal the
    math path's (float64)."""
    b, h, n, d, d_v = 1, 2, 300, 8, 16
    scheme = {
        "alibi": lambda: posenc.ALiBi(h),
        "t5": lambda: posenc.T5RelativeBias(h, num_buckets=8, max_distance=16),
    }[name]()
    torch.manual_seed(0)
    q, k = (torch.randn(b, h, n, d) for _ in range(2))
    v = torch.randn(b, h, n, d_v)
    kwargs = {"positions": torch.randperm(n)} if positions == "shuffled" else {}
    explanation = posenc.explain(q.to(dtype), k.to(dtype), v.to(dtype), position=scheme, **kwargs)
    assert explanation.path == "lean"
    if dtype == torch.float32:
        assert "values of another head dim" in explanation.reasons["lean-fused"]
    results = {}
    for backend, cast in (("auto", dtype), ("math", torch.float64)):
        leaves = [x.detach().to(cast).requires_grad_() for x in (q, k, v)]
        model = scheme.to(cast)
        out = posenc.attention(*leaves, position=model, backend=backend, **kwargs)
        out.float().square().sum().backward()
        results[backend] = [out, *(x.grad for x in leaves)]
    pos = kwargs.get("positions", torch.arange(n))[None]  # [1, n]
    logit = logit_size(q, k, scheme.float(), pos, pos)
    out, *grads = results["auto"]
    want_out, *want_grads = results["math"]
    assert_close(out, want_out, terms=d, logit=logit, dtype=dtype)
    size = max(float(g.abs().max()) for g in want_grads)  # a backward's at its largest
    for got, want in zip(grads, want_grads, strict=True):
        assert_close(got, want, terms=n, logit=logit, magnitude=size, dtype=dtype)
