"""posenc.engine.reference: the attention formula op by op, which writes into its own scores
where that gives the same values."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.diagonals import pad_rows, skew_rows
from posenc.engine import Mask, attend, plans, reference, tuning
from posenc.engine.reference import _forward_in_place, _math, _plus
from posenc.families.terms import offset_term_logits, table_logits
from posenc.hooks import Hooks


def test_plus_writes_into_the_scores_only_where_the_sum_is_the_same_tensor():
    scores = torch.zeros(2, 3, 4, 5)
    assert _plus(scores, torch.ones(3, 1, 5), own=True) is scores
    assert bool((scores == 1).all())
    wider = _plus(scores, torch.ones(3, 1, 5, dtype=torch.float64), own=True)
    assert wider.dtype == torch.float64 and bool((scores == 1).all())  # promoted, untouched
    larger = _plus(torch.zeros(1, 3, 4, 5), torch.ones(2, 3, 4, 5), own=True)
    assert larger.shape == (2, 3, 4, 5)
    assert _plus(scores, torch.ones(5), own=False) is not scores
    assert bool((scores == 1).all())


class HeldBias:
    """A bias per clipped offset from a table it is handed ``[h, 9]``."""

    def __init__(self, table):
        self.table = table

    def score_bias(self, q_pos, k_pos):
        offsets = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-4, 4) + 4  # [B', n_q, n_k]
        return self.table[:, offsets].transpose(0, 1)  # [B', h, n_q, n_k]


def test_the_formula_under_vmap_over_a_table_equals_a_loop():
    """vmap over the bias's table with q, k, v shared: the scores are not batched, the bias
    is, so the formula must not write the bias into them (vmap cannot)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    tables = torch.randn(3, 2, 9, dtype=torch.float64)
    pos = torch.arange(6)[None]

    def run(table):
        mask = Mask(6, 6, causal=True)
        return attend(q, k, v, scheme=HeldBias(table), q_pos=pos, k_pos=pos, mask=mask,
                      backend="math")[0]  # fmt: skip

    batched = torch.func.vmap(run)(tables)
    looped = torch.stack([run(t) for t in tables])
    torch.testing.assert_close(batched, looped, rtol=1e-12, atol=1e-12)


def _written_out_hooks(h: int, d: int, d_v: int, parts: str) -> Hooks:
    """Hooks read from random tables (float64): ``parts`` names which of a bias per clipped
    offset, a term of the queries and a value term of the weights are set."""
    gen = torch.Generator().manual_seed(3)
    bias_table = torch.randn(h, 9, dtype=torch.float64, generator=gen)
    keys = torch.randn(9, d, dtype=torch.float64, generator=gen)
    values = torch.randn(9, d_v, dtype=torch.float64, generator=gen)

    def offsets(q_pos, k_pos):
        return (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-4, 4) + 4  # [B', n_q, n_k]

    def score_bias(q_pos, k_pos):
        return bias_table[:, offsets(q_pos, k_pos)].transpose(0, 1).float()  # [B', h, n_q, n_k]

    def score_term(q, q_pos, k_pos):
        return torch.einsum("bhid,bijd->bhij", q, keys[offsets(q_pos, k_pos)])

    def value_term(weights, q_pos, k_pos):
        return torch.einsum("bhij,bijd->bhid", weights, values[offsets(q_pos, k_pos)])

    return Hooks(
        score_bias=score_bias if "bias" in parts else None,
        score_term=score_term if "term" in parts else None,
        value_term=value_term if "value" in parts else None,
    )


def _masks(b: int, n_q: int, n_k: int) -> dict[str, Mask]:
    padding = torch.zeros(b, n_k, dtype=torch.bool)
    padding[0, 2:] = True
    padding[1, :] = True  # every key of the second sequence: its queries see none
    allowed = torch.rand(b, 1, n_q, n_k, generator=torch.Generator().manual_seed(4)) > 0.3
    float_mask = torch.randn(1, 3, n_q, n_k, dtype=torch.float64)
    return {
        "none": Mask(n_q, n_k),
        "causal": Mask(n_q, n_k, causal=True),
        "padding, a row of no key": Mask(n_q, n_k, key_padding=padding),
        "allowed and a float mask": Mask(n_q, n_k, allowed=allowed, bias=float_mask),
    }


@pytest.mark.numerical
@pytest.mark.parametrize("parts", ["bias", "term", "bias term", "value", "bias term value"])
@pytest.mark.parametrize(
    "masked", ["none", "causal", "padding, a row of no key", "allowed and a float mask"]
)
@pytest.mark.parametrize("n_k", [7, 16])
def test_the_forward_in_one_buffer_equals_the_formula_op_by_op(parts, masked, n_k):
    """float64: the in-place forward equals :func:`_math` with the fast hooks, for a bias (a
    float32 one: cast into the buffer), a term, a value term alone (the GEMM adds to
    nothing) and together, under each kind of mask, with queries laid out [b, n, h, d]
    (not contiguous as [b, h, n, d]); 16 keys a row take the softmax in place, 7 the
    second buffer."""
    b, h, n_q, d, d_v = 2, 3, 5, 4, 6
    torch.manual_seed(0)
    q = torch.randn(b, n_q, h, d, dtype=torch.float64).transpose(1, 2)  # [b, h, n_q, d]
    k = torch.randn(b, h, n_k, d, dtype=torch.float64)
    v = torch.randn(b, h, n_k, d_v, dtype=torch.float64)
    q_pos, k_pos = torch.arange(2, 2 + n_q)[None], torch.arange(n_k)[None]
    hooks = _written_out_hooks(h, d, d_v, parts)
    mask = _masks(b, n_q, n_k)[masked]
    with torch.no_grad():
        expected = _math(q, k, v, hooks, q_pos, k_pos, mask, 0.3, 0.0, reference=False)[0]
        out = _forward_in_place(q, k, v, hooks, q_pos, k_pos, mask, 0.3, 0.0)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    if masked.startswith("padding"):
        assert bool((out[1] == 0).all())  # a query with no visible key gets 0


def test_the_forward_in_one_buffer_runs_where_nothing_records_a_graph(monkeypatch):
    """``auto``'s op-by-op forward runs in one buffer in no-grad mode, and as the formula
    op by op when grad mode is on (ALiBi's constant bias, gradients for q, k, v alone,
    where OPS_GRAD_BIAS_SCORES allows it; a bias alone in one buffer where
    OPS_IN_PLACE_BIAS_SCORES allows it)."""
    monkeypatch.setattr(plans, "_threads", lambda: 2)
    monkeypatch.setattr(tuning, "OPS_IN_PLACE_BIAS_SCORES", tuning.OPS_IN_PLACE_SCORES)
    monkeypatch.setattr(tuning, "OPS_GRAD_BIAS_SCORES", tuning.OPS_FORWARD_SCORES)
    ran = []
    in_place, ops = plans._forward_in_place, plans._math
    monkeypatch.setattr(
        plans, "_forward_in_place", lambda *a, **kw: ran.append("in place") or in_place(*a, **kw)
    )
    monkeypatch.setattr(plans, "_math", lambda *a, **kw: ran.append("ops") or ops(*a, **kw))
    # as many queries as value channels: the weights the graph keeps outweigh no values
    q, k, v = (torch.randn(2, 4, 8, 8, requires_grad=True) for _ in range(3))
    scheme = posenc.ALiBi(4)
    with torch.no_grad():
        quiet = posenc.attention(q, k, v, position=scheme)
    loud = posenc.attention(q, k, v, position=scheme)
    assert ran == ["in place", "ops"]
    torch.testing.assert_close(quiet, loud.detach(), rtol=0, atol=1e-6)


def test_grad_mode_with_nothing_to_differentiate_runs_in_one_buffer(monkeypatch):
    """Grad mode on but nothing requiring grad (an evaluation without ``no_grad``) records
    no graph: the forward in one buffer (a bias alone there where
    OPS_IN_PLACE_BIAS_SCORES allows it), the no-grad values."""
    monkeypatch.setattr(plans, "_threads", lambda: 2)
    monkeypatch.setattr(tuning, "OPS_IN_PLACE_BIAS_SCORES", tuning.OPS_IN_PLACE_SCORES)
    ran = []
    in_place = plans._forward_in_place
    monkeypatch.setattr(
        plans, "_forward_in_place", lambda *a, **kw: ran.append("in place") or in_place(*a, **kw)
    )
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    for scheme in (posenc.ALiBi(4), posenc.T5RelativeBias(4, num_buckets=8, max_distance=16)):
        scheme.requires_grad_(False)
        out = posenc.attention(q, k, v, position=scheme)
        with torch.no_grad():
            quiet = posenc.attention(q, k, v, position=scheme)
        assert not out.requires_grad
        assert torch.equal(out, quiet)
    assert ran == ["in place"] * 4


def test_a_tensor_only_the_bias_reads_gets_its_gradient_in_grad_mode(monkeypatch):
    """Grad mode, q, k, v and the scheme's parameters asking for nothing, but the bias reads
    a tensor that requires grad (a scheme that is not a module): the formula in autograd
    ops, whose gradient for that tensor is the math path's (float64)."""
    monkeypatch.setattr(plans, "_threads", lambda: 2)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    values, grads = torch.randn(4, 9, dtype=torch.float64), {}
    for backend in ("math", "auto"):
        table = values.clone().requires_grad_()
        out = posenc.attention(q, k, v, position=HeldBias(table), backend=backend)
        (out * torch.linspace(-1, 1, 8, dtype=torch.float64)).sum().backward()
        grads[backend] = table.grad
    assert grads["auto"] is not None
    torch.testing.assert_close(grads["auto"], grads["math"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("n_k", "in_place"), [(16, True), (32, True), (7, False), (49, False)])
def test_the_softmax_writes_into_the_scores_only_for_rows_of_whole_vectors(
    monkeypatch, n_k, in_place
):
    """Rows of a multiple of SOFTMAX_IN_PLACE_COLUMNS keys take the softmax in place; others
    a second buffer (a partial vector stored at a row's end stalls the next row's load)."""
    softmaxes = []
    original = reference._softmax_out

    def spy(scores, dim, half, *, out):
        softmaxes.append(out.data_ptr() == scores.data_ptr())
        return original(scores, dim, half, out=out)

    monkeypatch.setattr(reference, "_softmax_out", spy)
    q, k, v = (torch.randn(1, 2, n, 4) for n in (3, n_k, n_k))
    pos = torch.arange(n_k)[None]
    hooks = Hooks(score_bias=lambda q_pos, k_pos: torch.zeros(1, 2, q_pos.shape[-1], n_k))
    with torch.no_grad():
        out = _forward_in_place(q, k, v, hooks, pos[:, :3], pos, Mask(3, n_k), 0.5, 0.0)
    assert softmaxes == [in_place]
    expected = torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1) @ v
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def _same(got, want, per_head):
    """The bits of the families' form for a shared table; for a per-head one the engine
    multiplies the queries head by head over the batch (one GEMM per head, the families'
    product one per batch entry and head: another blocking of the same sums), equal to
    rounding (``assert_close``'s tolerances for the dtype, values of order 1)."""
    if per_head:
        torch.testing.assert_close(got, want)
    else:
        assert torch.equal(got, want)


def _offset_hooks(h, d, per_head, dtype, calls, clip=None):
    """A term per offset ``j - i`` (offsets -20 .. 20, or clipped to ``+-clip`` as Shaw's),
    as :class:`~posenc.hooks.Hooks` with its ``score_term`` written out by a gather and
    its ``offset_term`` (the rows of a run, or with ``clip`` the table of ``2 clip + 1``
    rows and each offset's row), each call of either named in ``calls``."""
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(*((h,) if per_head else ()), 41, d, dtype=dtype, generator=gen)
    reach = 20 if clip is None else clip

    def score_term(q, q_pos, k_pos):
        calls.append("score_term")
        offsets = (k_pos[0][None, :] - q_pos[0][:, None]).clamp(-reach, reach)  # [n_q, n_k]
        rows = table[..., offsets + 20, :]  # [(h,) n_q, n_k, d]
        return torch.einsum("bhid,hijd->bhij" if per_head else "bhid,ijd->bhij", q, rows)

    def offset_term(q_pos, k_pos):
        calls.append("offset_term")
        first = int(k_pos[0, 0] - q_pos[0, -1])
        width = q_pos.shape[-1] + k_pos.shape[-1] - 1
        if clip is None:
            return table[..., first + 20 : first + 20 + width, :]
        index = torch.arange(first, first + width).clamp(-clip, clip) + clip  # [W]
        return table[..., 20 - clip : 21 + clip, :], index

    return Hooks(score_term=score_term, offset_term=offset_term)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("positions", ["both sides", "decoding"])
def test_a_clipped_offset_term_is_gathered_from_its_tables_logits(per_head, grad, positions):
    """``offset_term`` giving a clipped table and each offset's row (Shaw's keys): the
    queries against the rows the offsets meet, read at each pair's row (the skew of the
    index), in one buffer without gradients and op by op with them; ``score_term`` is not
    called, and the values (and gradients) are the families' form's (``offset_term_logits``:
    the product over the offsets met, gathered; their bits for a shared table,
    :func:`_same`), also where the offsets meet one side of the clip alone (a decoding
    step: one query after 199 keys)."""
    b, h, d, clip = 2, 3, 32, 8
    n_q, n_k = (6, 9) if positions == "both sides" else (1, 200)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, requires_grad=grad) for n in (n_q, n_k, n_k))
    first = 3 if positions == "both sides" else 199
    q_pos, k_pos = torch.arange(first, first + n_q)[None], torch.arange(n_k)[None]
    calls = []
    hooks = _offset_hooks(h, d, per_head, torch.float32, calls, clip=clip)
    full, _ = hooks.offset_term(q_pos, k_pos)  # [(h,) 2 clip + 1, d]
    calls.clear()

    def rows(offsets):  # the primitive: the row of each clipped offset
        return full[..., offsets.clamp(-clip, clip) + clip, :]

    def gathered(q, q_pos, k_pos):  # the families' score_term
        return offset_term_logits(q, rows, q_pos, k_pos, clip)

    mask = Mask(n_q, n_k, causal=True)
    alone = Hooks(score_term=gathered)
    with torch.set_grad_enabled(grad):
        if grad:
            out = _math(q, k, v, hooks, q_pos, k_pos, mask, 0.3, 0.0, reference=False)[0]
            expected = _math(q, k, v, alone, q_pos, k_pos, mask, 0.3, 0.0, reference=False)[0]
        else:
            out = _forward_in_place(q, k, v, hooks, q_pos, k_pos, mask, 0.3, 0.0)
            expected = _forward_in_place(q, k, v, alone, q_pos, k_pos, mask, 0.3, 0.0)
    assert calls == ["offset_term"]
    _same(out, expected, per_head)
    literal = Hooks(score_term=hooks.score_term)
    with torch.no_grad():
        formula = _math(q, k, v, literal, q_pos, k_pos, mask, 0.3, 0.0, reference=False)[0]
    torch.testing.assert_close(out.detach(), formula, rtol=1e-5, atol=1e-6)
    if grad:
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        want = torch.autograd.grad(expected.sum(), (q, k, v))
        for got, wanted in zip(grads, want, strict=True):
            _same(got, wanted, per_head)


@pytest.mark.parametrize(("b", "h", "n_q", "layout"), [
    (1, 4, 5, "bhnd"), (3, 4, 5, "bhnd"), (3, 4, 5, "bnhd"), (3, 1, 5, "bhnd"), (3, 4, 1, "bhnd"),
])  # fmt: skip
def test_a_per_head_tables_product_runs_head_by_head_over_the_batch(b, h, n_q, layout):
    """``q @ table^T`` for a per-head table: with more than one batch entry one product per
    head over the batch's queries, written head first (into the buffer where given), and
    read through a view in ``[b, h, n_q, W']`` order; its skew is the skew of the same
    values laid out batch first; against a float64 einsum, for ``q`` laid out as a
    projection's output too (``[b, n_q, h, d]`` transposed), one head, one query."""
    n_k, d = 7, 8
    torch.manual_seed(0)
    q = torch.randn(b, h, n_q, d, dtype=torch.float64)
    if layout == "bnhd":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [b, h, n_q, d], strided
    table = torch.randn(h, n_q + n_k - 1 + 3, d, dtype=torch.float64)  # [h, W', d]
    want = torch.einsum("bhnd,hwd->bhnw", q, table)
    for flat in (None, torch.empty(b * h * n_q * table.shape[1], dtype=torch.float64)):
        logits = reference._rows_product(q, table, out=flat)
        torch.testing.assert_close(logits, want, rtol=1e-12, atol=1e-12)
        first = logits.transpose(0, 1) if b > 1 else logits  # [h, b, ...] or [b, h, ...]
        assert first.is_contiguous()
        if flat is not None:
            assert logits.data_ptr() == flat.data_ptr()
        skewed = reference._skew(logits, n_k)
        assert skewed.shape == (b, h, n_q, n_k)
        assert torch.equal(skewed, skew_rows(logits.contiguous(), n_k))
    shared = torch.randn(n_q + n_k - 1, d, dtype=torch.float64)  # a shared table: as it was
    assert reference._rows_product(q, shared).is_contiguous()


def test_a_clipped_terms_graph_keeps_each_pairs_row_not_the_logits():
    """With gradients, the gathered term's node keeps the index of each pair's row, not
    the logits ``[b, h, n_q, R']`` (gather's own node keeps its input until the backward,
    which reads its shape alone); its first and second-order gradients match finite
    differences (float64), as the table's and the queries' do through the whole formula."""
    b, h, d, clip, n = 2, 2, 4, 2, 7
    calls = []
    hooks = _offset_hooks(h, d, False, torch.float64, calls, clip=clip)
    torch.manual_seed(0)
    q = torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(n)[None]
    table, index = reference._run_rows(hooks, q, pos, pos)  # [2 clip + 1, d], [2n - 1]
    term = reference._term_of_rows(q, table, index, n)  # [b, h, n, n]
    saved = term.grad_fn.saved_tensors
    assert [(t.dtype, t.shape) for t in saved] == [(torch.int64, (b, h, n, n))]
    table = table.clone().requires_grad_()

    def term_of(q, table):
        return reference._term_of_rows(q, table, index, n)

    assert torch.autograd.gradcheck(term_of, (q, table))
    assert torch.autograd.gradgradcheck(term_of, (q, table))


@pytest.mark.numerical
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masked", ["none", "causal"])
def test_the_forward_in_one_buffer_writes_an_offset_terms_logits_into_it(per_head, dtype, masked):
    """A scheme with an ``offset_term`` gives the rows of a run of positions: the queries
    against them are written into the buffer and skewed from there, ``score_term`` is not
    called, and the output is the same call's through ``score_term`` (for a shared table
    its bits: the same product, then the same skew and scale; :func:`_same`); in float64
    the formula's values, and a float64 reference's, the slow obvious way."""
    b, h, n_q, n_k, d = 2, 3, 6, 9, 8
    torch.manual_seed(0)
    q = torch.randn(b, n_q, h, d, dtype=dtype).transpose(1, 2)  # [b, h, n_q, d], strided
    k, v = torch.randn(b, h, n_k, d, dtype=dtype), torch.randn(b, h, n_k, 5, dtype=dtype)
    q_pos, k_pos = torch.arange(3, 3 + n_q)[None], torch.arange(n_k)[None]
    mask = Mask(n_q, n_k, causal=masked == "causal")
    calls = []
    hooks = _offset_hooks(h, d, per_head, dtype, calls)

    def skewed(q, q_pos, k_pos):  # the families' score_term of a run (offset_term_logits)
        rows = pad_rows(hooks.offset_term(q_pos, k_pos), tuning.GEMM_COLUMNS)
        return skew_rows(table_logits(q, rows), k_pos.shape[-1])

    with torch.no_grad():
        out = _forward_in_place(q, k, v, hooks, q_pos, k_pos, mask, 0.3, 0.0)
        assert calls == ["offset_term"]
        alone = Hooks(score_term=skewed)
        expected = _forward_in_place(q, k, v, alone, q_pos, k_pos, mask, 0.3, 0.0)
        gathered = Hooks(score_term=hooks.score_term)
        formula = _math(q, k, v, gathered, q_pos, k_pos, mask, 0.3, 0.0, reference=False)[0]
    _same(out, expected, per_head)
    wide = tuple(x.double() for x in (q, k, v))
    table = hooks.offset_term(torch.tensor([[20]]), torch.arange(41)[None]).double()  # -20 .. 20
    scores = torch.zeros(b, h, n_q, n_k, dtype=torch.float64)
    for i in range(n_q):
        for j in range(n_k):
            row = table[..., k_pos[0, j] - q_pos[0, i] + 20, :]  # the offset's row
            scores[:, :, i, j] = (wide[0][:, :, i] * (wide[1][:, :, j] + row)).sum(-1) * 0.3
            if masked == "causal" and j > i + n_k - n_q:
                scores[:, :, i, j] = float("-inf")
    reference_out = torch.softmax(scores, -1) @ wide[2]
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), reference_out, rtol=tol, atol=tol)
    if dtype == torch.float64:
        torch.testing.assert_close(out, formula, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_head", [False, True])
def test_the_formula_with_fast_hooks_reads_an_offset_terms_rows(per_head):
    """``_math`` with the fast hooks takes ``offset_term``'s rows for a run of positions
    (``score_term`` not called): the values and the gradients of ``q``, ``k``, ``v`` and the
    table are the same call's through the families' ``score_term`` of a run (for a shared
    table their bits, :func:`_same`); the reference hooks (``reference=True``) call
    ``score_term`` itself."""
    b, h, n_q, n_k, d = 2, 3, 6, 9, 8
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for n in (n_q, n_k, n_k))
    q_pos, k_pos = torch.arange(3, 3 + n_q)[None], torch.arange(n_k)[None]
    calls = []
    hooks = _offset_hooks(h, d, per_head, torch.float32, calls)
    table = hooks.offset_term(torch.tensor([[20]]), torch.arange(41)[None])._base
    table.requires_grad_()
    calls.clear()

    def skewed(q, q_pos, k_pos):  # the families' score_term of a run (offset_term_logits)
        rows = pad_rows(hooks.offset_term(q_pos, k_pos), tuning.GEMM_COLUMNS)
        return skew_rows(table_logits(q, rows), k_pos.shape[-1])

    mask = Mask(n_q, n_k, causal=True)
    out = _math(q, k, v, hooks, q_pos, k_pos, mask, 0.3, 0.0, reference=False)[0]
    assert calls == ["offset_term"]
    alone = Hooks(score_term=skewed)
    expected = _math(q, k, v, alone, q_pos, k_pos, mask, 0.3, 0.0, reference=False)[0]
    _same(out, expected, per_head)
    grad = torch.randn(out.shape)
    got = torch.autograd.grad(out, (q, k, v, table), grad)
    want = torch.autograd.grad(expected, (q, k, v, table), grad)
    for mine, wanted in zip(got, want, strict=True):
        _same(mine, wanted, per_head)
    calls.clear()
    _math(q, k, v, hooks, q_pos, k_pos, mask, 0.3, 0.0, reference=True)
    assert calls == ["score_term"]


@pytest.mark.parametrize(
    "form", ["none", "an index of another length", "a float index", "another width", "other heads"]
)
def test_the_forward_in_one_buffer_takes_the_score_term_where_the_rows_do_not_fit(form):
    """``offset_term`` giving None (positions not one run), a table with an index of another
    length or dtype, rows of another width or of other heads: ``score_term`` runs, its
    values stand (a wrong ``offset_term`` never reaches the buffer)."""
    b, h, n, d = 1, 2, 5, 4
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    calls = []
    hooks = _offset_hooks(h, d, True, torch.float64, calls)
    rows = hooks.offset_term(pos, pos)  # [h, 2n - 1, d]
    given = {
        "none": None,
        "an index of another length": (rows, torch.arange(2 * n - 2)),
        "a float index": (rows, torch.arange(2 * n - 1.0)),
        "another width": rows[:, 1:],
        "other heads": rows[:1],
    }[form]
    calls.clear()
    wrong = Hooks(score_term=hooks.score_term, offset_term=lambda q_pos, k_pos: given)
    with torch.no_grad():
        out = _forward_in_place(q, k, v, wrong, pos, pos, Mask(n, n), 0.5, 0.0)
        gathered = Hooks(score_term=hooks.score_term)
        expected = _math(q, k, v, gathered, pos, pos, Mask(n, n), 0.5, 0.0, reference=False)[0]
    assert calls == ["score_term", "score_term"]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_outside_eager_code_the_formula_calls_the_score_term():
    """Under a torch function mode (as under ``torch.compile``, a ``torch.func`` transform
    or forward-mode AD, where reading the index's values would break the graph or meet a
    batched tensor) the formula calls ``score_term``, not ``offset_term``."""

    class Passing(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    b, h, n, d = 1, 2, 5, 4
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    calls = []
    hooks = _offset_hooks(h, d, False, torch.float64, calls, clip=2)
    with Passing():
        out = _math(q, k, v, hooks, pos, pos, Mask(n, n), 0.5, 0.0, reference=False)[0]
    assert calls == ["score_term"]
    calls.clear()
    expected = _math(q, k, v, hooks, pos, pos, Mask(n, n), 0.5, 0.0, reference=False)[0]
    assert calls == ["offset_term"]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_an_offset_term_without_a_score_term_adds_nothing():
    """``offset_term`` is another form of ``score_term``: a scheme that gives rows but no
    term (here beside a bias) gets no term added, op by op or in one buffer."""
    b, h, n, d = 1, 2, 5, 4
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    rows = torch.randn(2 * n - 1, d, dtype=torch.float64)
    bias = torch.randn(1, h, n, n, dtype=torch.float64)
    hooks = Hooks(score_bias=lambda q_pos, k_pos: bias, offset_term=lambda q_pos, k_pos: rows)
    expected = torch.softmax(q @ k.transpose(-1, -2) * 0.5 + bias, -1) @ v
    with torch.no_grad():
        out = _forward_in_place(q, k, v, hooks, pos, pos, Mask(n, n), 0.5, 0.0)
    formula = _math(q, k, v, hooks, pos, pos, Mask(n, n), 0.5, 0.0, reference=False)[0]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(formula, expected, rtol=1e-12, atol=1e-12)


def test_rows_that_require_grad_in_grad_mode_take_the_formula():
    """Grad mode with a table that requires grad: the formula op by op (the buffer's
    ``out=`` product has no graph), and the table gets its gradient."""
    b, h, n, d = 1, 2, 5, 4
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    table = torch.randn(2 * n - 1, d, dtype=torch.float64, requires_grad=True)

    def score_term(q, q_pos, k_pos):
        return torch.einsum("bhid,ijd->bhij", q, table[(pos[0][None, :] - pos[0][:, None]) + n - 1])

    hooks = Hooks(score_term=score_term, offset_term=lambda q_pos, k_pos: table)
    out = _forward_in_place(q, k, v, hooks, pos, pos, Mask(n, n), 0.5, 0.0)
    assert out.grad_fn is not None
    (grad,) = torch.autograd.grad(out.sum(), table)
    expected = _math(q, k, v, hooks, pos, pos, Mask(n, n), 0.5, 0.0, reference=False)[0]
    (expected_grad,) = torch.autograd.grad(expected.sum(), table)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shared", ["batch", "heads"])
def test_the_forward_in_one_buffer_broadcasts_a_shared_term(shared):
    """A score term shared by the batch ``[1, h, n_q, n_k]`` or the heads ``[b, 1, n_q, n_k]``
    fills the whole buffer (not a resized part of it): the formula's values."""
    b, h, n = 2, 3, 16
    q, k, v = (torch.randn(b, h, n, 4, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    term = torch.randn(1, h, n, n, dtype=torch.float64) if shared == "batch" else None
    term = torch.randn(b, 1, n, n, dtype=torch.float64) if term is None else term
    hooks = Hooks(score_term=lambda q, q_pos, k_pos: term)
    with torch.no_grad():
        out = _forward_in_place(q, k, v, hooks, pos, pos, Mask(n, n), 0.5, 0.0)
    expected = torch.softmax((q @ k.transpose(-1, -2) + term) * 0.5, dim=-1) @ v
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_the_forward_in_one_buffer_promotes_a_wider_value_term():
    """A value term in float64 for float32 inputs gives a float64 output, as the formula
    op by op does (not rounded into the float32 output)."""
    q, k, v = (torch.randn(1, 2, 16, 4) for _ in range(3))
    pos = torch.arange(16)[None]
    term = torch.full((1, 2, 16, 4), 1e-9, dtype=torch.float64)
    hooks = Hooks(value_term=lambda w, q_pos, k_pos: term)
    with torch.no_grad():
        out = _forward_in_place(q, k, v, hooks, pos, pos, Mask(16, 16), 0.5, 0.0)
        expected = _math(q, k, v, hooks, pos, pos, Mask(16, 16), 0.5, 0.0, reference=False)[0]
    assert out.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)


def test_no_grad_with_a_forward_ad_level_or_shared_keys_takes_the_formula(monkeypatch):
    """Forward-mode AD under ``no_grad`` (the buffer's ``out=`` ops have no derivative) and
    keys and values shared by the batch (``attend``'s ``[1, h, n_k, d]``) run the formula op
    by op: the tangent and the values equal the math path's."""
    import torch.autograd.forward_ad as fwad

    monkeypatch.setattr(plans, "_threads", lambda: 2)
    scheme = posenc.T5RelativeBias(2, num_buckets=8, max_distance=16).double()
    q, k, v, t = (torch.randn(2, 2, 16, 4, dtype=torch.float64) for _ in range(4))
    tangents = {}
    for backend in ("math", "auto"):
        with torch.no_grad(), fwad.dual_level():
            out = posenc.attention(fwad.make_dual(q, t), k, v, position=scheme, backend=backend)
            tangents[backend] = fwad.unpack_dual(out).tangent
    assert tangents["auto"] is not None
    torch.testing.assert_close(tangents["auto"], tangents["math"], rtol=1e-10, atol=1e-12)
    pos = torch.arange(16)[None]
    outs = {}
    for backend in ("math", "auto"):
        with torch.no_grad():
            outs[backend] = attend(q, k[:1], v[:1], scheme=scheme, q_pos=pos, k_pos=pos,
                                   mask=Mask(16, 16), backend=backend)[0]  # fmt: skip
    torch.testing.assert_close(outs["auto"], outs["math"], rtol=1e-10, atol=1e-12)
