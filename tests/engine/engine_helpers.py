"""Schemes, runners and path forcers shared by the engine tests (tests/engine/)."""

from __future__ import annotations

import torch
from torch import nn

from posenc.engine import Mask, attend, common, grid, tuning
from posenc.indices import run_offsets
from tolerances import assert_close


class TableBias(nn.Module):
    """A learned relative bias per head, gathered from a table (T5/Swin-like)."""

    def __init__(self, heads, span=8):
        super().__init__()
        self.span = span
        self.table = nn.Parameter(torch.randn(heads, 2 * span + 1))

    def score_bias(self, q_pos, k_pos):
        rel = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-self.span, self.span) + self.span
        return self.table[:, rel].transpose(0, 1)  # [h, B', n_q, n_k] -> [B', h, n_q, n_k]


class QueryTerm(nn.Module):
    """q_i . r[clip(j - i)]: a content-dependent term with a learned table."""

    def __init__(self, head_dim, span=4):
        super().__init__()
        self.span = span
        self.table = nn.Parameter(torch.randn(2 * span + 1, head_dim))

    def score_term(self, q, q_pos, k_pos):
        rel = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-self.span, self.span) + self.span
        logits = q @ self.table.T  # [b, h, n_q, 2s+1]
        index = rel[:, None].expand(q.shape[0], q.shape[1], -1, -1)  # [b, h, n_q, n_k]
        return logits.gather(-1, index)


class ValueTable(nn.Module):
    """Shaw-like value term: weights summed per clipped distance, times a table."""

    def __init__(self, head_dim, span=3):
        super().__init__()
        self.span = span
        self.values = nn.Parameter(torch.randn(2 * span + 1, head_dim))

    def value_term(self, weights, q_pos, k_pos):
        rel = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-self.span, self.span) + self.span
        buckets = weights.new_zeros(*weights.shape[:-1], 2 * self.span + 1)
        buckets.scatter_add_(-1, rel[:, None].expand_as(weights), weights)
        return buckets @ self.values  # [b, h, n_q, d]


SCHEMES = {
    "none": lambda h, d: None,
    "bias": lambda h, d: TableBias(h),
    "term": lambda h, d: QueryTerm(d),
    "value": lambda h, d: ValueTable(d),
}


MASKS = {
    "none": lambda b, nq, nk: {},
    "causal": lambda b, nq, nk: {"causal": True},
    "lengths": lambda b, nq, nk: {"lengths": torch.randint(0, nk + 1, (b, nq))},
    "padding": lambda b, nq, nk: {"key_padding": torch.rand(b, nk) < 0.4},
    "documents": lambda b, nq, nk: {
        "q_doc": torch.arange(nq)[None].expand(b, nq) // 5,
        "k_doc": torch.arange(nk)[None].expand(b, nk) // 5,
    },
}


def run(backend, scheme, q, k, v, q_pos, k_pos, mask):
    out, _ = attend(q, k, v, scheme=scheme, q_pos=q_pos, k_pos=k_pos, mask=mask, backend=backend)
    return out


def spy_on(monkeypatch, engine):
    """A list that grows by one each time ``engine.apply`` runs: which path was taken."""
    calls = []
    apply = engine.apply
    monkeypatch.setattr(engine, "apply", lambda *a: calls.append(1) or apply(*a))
    return calls


def lean_and_math(scheme, q, k, v, q_pos, k_pos, mask):
    """``{backend: [out, dq, dk, dv, *parameter grads]}`` for math and lean, one weighted loss."""
    results = {}
    weights = torch.linspace(-1, 1, q.shape[-1], dtype=q.dtype)
    params = [] if scheme is None else list(scheme.parameters())
    for backend in ("math", "lean"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        for p in params:
            p.grad = None
        out = run(backend, scheme, *leaves, q_pos, k_pos, mask)
        (out * weights).sum().backward()
        results[backend] = [out, *(t.grad for t in leaves), *(p.grad for p in params)]
    return results


def assert_results_close(results, dtype, logit: float, keys: int) -> None:
    """lean's ``[out, dq, dk, dv, *parameter grads]`` equal math's: float64 within 1e-10;
    float32 within :func:`tolerances.assert_close`'s tolerance after a softmax over ``keys``
    keys whose largest logit's terms are of size ``logit`` (:func:`tolerances.logit_size`),
    the output at its own size and the gradients at the size of the largest of them: all
    are sums of the score gradients ``dS = P * (dP - rowsum(P * dP))``, whose rounding
    stays where they cancel (a peaked softmax; a table row every key of a row shares, whose
    gradient is 0 up to rounding), so a gradient's own size can be far below its terms'."""
    names = ["out", "dq", "dk", "dv"] + [f"grad {i}" for i in range(len(results["math"]) - 4)]
    grads = max(float(g.abs().max()) for g in results["math"][1:] if g is not None)
    for name, a, c in zip(names, results["math"], results["lean"], strict=True):
        if dtype == torch.float64 or a is None:
            torch.testing.assert_close(c, a, atol=1e-10, rtol=1e-10, msg=name)
        else:
            size = None if name == "out" else grads
            assert_close(c, a, magnitude=size, terms=keys, logit=logit, msg=name)


def assert_lean_matches_math(scheme, b: int, h: int, n: int, d: int, mask: Mask | None = None):
    """Random float64 ``q, k, v [b, h, n, d]`` (seed 0) at positions ``0 .. n-1``: lean's
    output and every gradient equal math's."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(n, n) if mask is None else mask)
    for a, c in zip(grads["math"], grads["lean"], strict=True):
        torch.testing.assert_close(c, a)


def block_rows(monkeypatch, rows: int) -> None:
    """Exactly ``rows`` query rows a block on the lean engine's paths that take
    :func:`lean_block_rows` (which never gives fewer than 16)."""
    monkeypatch.setattr(common, "lean_block_rows", lambda b, h, n_q, n_k: max(1, min(n_q, rows)))


def offset_rows(monkeypatch, rows: int, b: int, n_q: int, n_k: int) -> None:
    """About ``rows`` query rows a block on the per-offset bias path: its kernel calls (always
    under a causal mask; without one a call takes every query) and its written-out backward
    (one head; half with pairs)."""
    monkeypatch.setattr(tuning, "CAUSAL_ROWS", rows)
    monkeypatch.setattr(tuning, "WRITTEN_BLOCK_ELEMENTS", b * rows * n_k)


def grid_rows(monkeypatch, rows: int | None, height: int, width: int) -> None:
    """``rows`` map rows a block on the grid paths, forward and written-out backward (None:
    as the engine chooses, which for a small map is all of them); with ``rows`` given, a
    buffer holds one head's copies (several head groups forward; a backward block of two
    heads then takes fewer map rows)."""
    if rows is None:
        return
    monkeypatch.setattr(tuning, "GRID_KERNEL_ROWS", rows * width)
    monkeypatch.setattr(common, "_written_rows", lambda b, g, n_q, n_k, elements=None: rows * width)
    copy = grid._GridBias.copy_size(height, width)
    monkeypatch.setattr(tuning, "GRID_BUFFER_ELEMENTS", rows * copy)


def _offset_scheme(name, heads):
    from posenc import ALiBi, RelativePositionBias, T5RelativeBias

    torch.manual_seed(1)
    scheme = {
        "alibi": lambda: ALiBi(heads),
        "t5": lambda: T5RelativeBias(heads, num_buckets=8, max_distance=16),
        "relative": lambda: RelativePositionBias(450, heads),
    }[name]()
    for p in scheme.parameters():
        nn.init.normal_(p, std=2.0)  # learned tables far from zero
    return scheme


class CyclicTerm(nn.Module):
    """``q_i . table[(j - i) mod 5]``: an offset_term given as (table, index) whose index is
    not a clipped run (the engine takes the rows themselves)."""

    def __init__(self, head_dim):
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, head_dim))

    def score_term(self, q, q_pos, k_pos):
        rel = (k_pos[:, None, :] - q_pos[:, :, None]) % 5  # [B', n_q, n_k]
        return torch.einsum("bhid,bijd->bhij", q, self.table[rel].expand(q.shape[0], -1, -1, -1))

    def offset_term(self, q_pos, k_pos):
        first = int(k_pos[0, 0] - q_pos[0, -1])
        offsets = torch.arange(first, first + q_pos.shape[-1] + k_pos.shape[-1] - 1)
        return self.table, offsets % 5


class ClippedPerHead(nn.Module):
    """``q_i . table[h, clip(j - i, -2, 2) + 2]``: a clipped table per head (Shaw's keys are
    shared by the heads), so the far parts take a row per head."""

    def __init__(self, heads, head_dim):
        super().__init__()
        self.table = nn.Parameter(torch.randn(heads, 5, head_dim))

    def score_term(self, q, q_pos, k_pos):
        rel = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(-2, 2) + 2  # [B', n_q, n_k]
        return torch.einsum("bhid,hbijd->bhij", q, self.table[:, rel])

    def offset_term(self, q_pos, k_pos):
        first = int(k_pos[0, 0] - q_pos[0, -1])
        offsets = torch.arange(first, first + q_pos.shape[-1] + k_pos.shape[-1] - 1)
        return self.table, offsets.clamp(-2, 2) + 2


def _padded_schemes(h: int, d: int) -> dict[str, object]:
    from posenc import (
        ALiBi,
        RelativePositionBias,
        RelativeQueryEmbedding,
        ShawRelativePosition,
        T5RelativeBias,
    )

    return {
        "alibi": ALiBi(h),
        "t5": T5RelativeBias(h, num_buckets=8, max_distance=16),
        "swin-1d": RelativePositionBias(40, h),
        "relative": RelativeQueryEmbedding(40, d),
        "shaw": ShawRelativePosition(d, 3),
        "bias": TableBias(h),
        "value": ValueTable(d),
    }


PADDINGS = {  # per batch element: (visible keys first, end) of n_k keys
    "right": lambda n_k: [(0, n_k), (0, n_k - 5)],
    "left": lambda n_k: [(4, n_k), (0, n_k)],
    "one empty": lambda n_k: [(0, 0), (2, n_k - 1)],
}


class SharedOffsetBias(nn.Module):
    """A learned bias per offset shared by the heads: ``offset_bias`` in its ``[1, W]`` form."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.values = nn.Parameter(torch.randn(2 * n - 1))

    def score_bias(self, q_pos, k_pos):
        offsets = k_pos[:, None, :] - q_pos[:, :, None]  # [B', n_q, n_k]
        return self.values[offsets + self.n - 1].unsqueeze(1)  # [B', 1, n_q, n_k]

    def offset_bias(self, q_pos, k_pos):
        offsets = run_offsets(q_pos, k_pos)
        return None if offsets is None else self.values[offsets + self.n - 1][None]


EPS32 = torch.finfo(torch.float32).eps
