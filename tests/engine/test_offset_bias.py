"""The per-offset bias path (engine/offset_bias.py) against the math reference."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    SharedOffsetBias,
    _offset_scheme,
    assert_lean_matches_math,
    assert_results_close,
    lean_and_math,
    offset_rows,
    run,
    spy_on,
)

from posenc.engine import Mask, common, offset_bias, tuning, workspace
from tolerances import logit_size


@pytest.mark.parametrize("name", ["alibi", "t5", "relative"])
@pytest.mark.parametrize(
    ("q_range", "k_range", "offset_path"),
    [
        ((0, 37), (0, 37), True),  # self-attention
        ((24, 37), (0, 37), True),  # decoding: the last queries against a cache
        ((0, 300), (0, 300), True),  # ALiBi spans > BIAS_SPAN: raised per offset
        ((400, 410), (0, 300), None),  # ALiBi: no row meets the best offset -> general path
        ((0, 30), (5, 17), True),  # more queries than keys
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_offset_bias_path_equals_math(
    head_groups, monkeypatch, name, q_range, k_range, offset_path, dtype, causal
):
    """Consecutive positions, no mask or a causal one: the per-offset engine, outputs and
    every gradient."""
    calls = spy_on(monkeypatch, offset_bias._OffsetFusedAttention)
    b, h, d = 2, 3, 8
    n_q, n_k = q_range[1] - q_range[0], k_range[1] - k_range[0]
    offset_rows(monkeypatch, 7, b, n_q, n_k)
    scheme = _offset_scheme(name, h).to(dtype)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for n in (n_q, n_k, n_k))
    q_pos, k_pos = torch.arange(*q_range)[None], torch.arange(*k_range)[None]
    mask = Mask(n_q, n_k, causal=causal)
    grads = lean_and_math(scheme, q, k, v, q_pos, k_pos, mask)
    # learned tables here span < 60; a causal mask hides the last case's offsets above
    # -110, and -110, ALiBi's best visible one, is met by every row
    expected_path = offset_path or name != "alibi" or causal
    expected_path = expected_path and not (causal and n_q > n_k)  # rows with no key: general
    assert bool(calls) == expected_path
    assert_results_close(grads, dtype, logit_size(q, k, scheme, q_pos, k_pos), n_k)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("learn", [True, False])
def test_offset_bias_path_with_a_bias_shared_by_the_heads(head_groups, monkeypatch, causal, learn):
    """``[1, W]`` values, learned (``dS`` summed over heads too, every block) or frozen (the
    fused backward reads one row for every head)."""
    calls = spy_on(monkeypatch, offset_bias._OffsetFusedAttention)
    offset_rows(monkeypatch, 5, 2, 20, 20)
    torch.manual_seed(0)
    scheme = SharedOffsetBias(20).double().requires_grad_(learn)
    assert_lean_matches_math(scheme, 2, 3, 20, 8, Mask(20, 20, causal=causal))
    assert calls


def test_offset_bias_kernel_calls_stop_at_the_last_key_seen(monkeypatch):
    """Without a mask one kernel call takes every query and head; under a causal mask a block
    of queries takes only the keys its last query sees (reversed: the last ones)."""
    from posenc import ALiBi

    shapes = []
    forward = common._flash_cpu
    monkeypatch.setattr(
        common,
        "_flash_cpu",
        lambda q, k, *a, **kw: (
            shapes.append((q.shape[1], q.shape[2], k.shape[2])) or forward(q, k, *a, **kw)
        ),
    )
    monkeypatch.setattr(tuning, "CAUSAL_ROWS", 5)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8) for _ in range(3))
    pos = torch.arange(20)[None]
    run("lean", ALiBi(3), q, k, v, pos, pos, Mask(20, 20))
    assert shapes == [(3, 20, 20)]
    shapes.clear()
    run("lean", ALiBi(3), q, k, v, pos, pos, Mask(20, 20, causal=True))
    assert shapes == [(3, 5, 5), (3, 5, 10), (3, 5, 15), (3, 5, 20)]


@pytest.mark.parametrize("name", ["t5", "relative"])
def test_offset_bias_path_with_frozen_tables(monkeypatch, name):
    """No table gradient wanted: the fused backward, q/k/v gradients still exact."""
    calls = spy_on(monkeypatch, offset_bias._OffsetFusedAttention)
    fused_backward = []
    backward = common._flash_cpu_backward
    monkeypatch.setattr(
        common,
        "_flash_cpu_backward",
        lambda *a, **kw: fused_backward.append(1) or backward(*a, **kw),
    )
    offset_rows(monkeypatch, 5, 2, 20, 20)
    scheme = _offset_scheme(name, 3).double().requires_grad_(False)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(20)[None]
    results = {}
    for backend in ("math", "lean"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(backend, scheme, *leaves, pos, pos, Mask(20, 20))
        out.square().sum().backward()
        results[backend] = [out, *(t.grad for t in leaves)]
    assert calls and fused_backward
    for got, expected in zip(results["lean"], results["math"], strict=True):
        torch.testing.assert_close(got, expected)


def test_skewed_bias_blocks_are_the_toeplitz_rows():
    from posenc.indices import toeplitz

    values = torch.randn(3, 11 + 6 - 1)
    full = toeplitz(values, 11, 6)  # [h, n_q, n_k]
    groups = [slice(0, 2), slice(2, 3)]
    for shared in (False, True):
        vals = values[:1] if shared else values
        seen = []
        for heads, skewed in offset_bias._SkewedBias.per_group(vals, groups, 11, 6, rows=4):
            seen.append(heads)
            for start in (0, 4, 8):
                count = min(4, 11 - start)
                block = skewed.block(start, count)  # [1, g|1, count, n_k]
                want = full[:1] if shared else full[heads]
                torch.testing.assert_close(block[0], want[:, start : start + count], rtol=0, atol=0)
                first = skewed.block(start, count, keys=3)  # the first 3 keys
                torch.testing.assert_close(first, block[..., :3], rtol=0, atol=0)
        assert seen == groups


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 3, 7, 4),  # contiguous
        lambda: torch.randn(2, 7, 3, 4).transpose(1, 2),  # a projection's [b, n, h, d] view
        lambda: torch.randn(2, 3, 7, 8)[..., :4],  # rows of d that are not adjacent
        lambda: torch.randn(2, 1, 7, 4).expand(2, 3, 7, 4),  # heads broadcast
        lambda: torch.randn(2, 3, 9, 4)[:, :, 2:],  # an offset into the storage
        lambda: torch.randn(2, 3, 7, 5)[..., 1:],  # rows that start between multiples of d
        lambda: torch.randn(2, 3, 4, 7).transpose(2, 3),  # the head dim strided
        lambda: torch.randn(2, 3, 0, 4),  # no rows
    ],
)
@pytest.mark.parametrize("contiguous_out", [True, False])
def test_rows_reversed_equals_flip(make, contiguous_out):
    """The keys (or queries) reversed into a given tensor, by whole rows or by ``flip``."""
    x = make()
    out = torch.empty(x.shape) if contiguous_out else torch.empty((*x.shape[:-1], 9))[..., ::2]
    got = offset_bias._rows_reversed(x, out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, x.flip(2), rtol=0, atol=0)


def _in_kept_buffer(t: torch.Tensor) -> bool:
    """Whether ``t``'s values lie in one of the calling thread's kept buffers."""
    start, size = t.data_ptr(), t.numel() * t.element_size()
    return any(
        flat.data_ptr() <= start <= start + size <= flat.data_ptr() + flat.nbytes
        for flat in workspace._kept.buffers.values()
    )


def test_offset_bias_path_reverses_into_the_kept_buffer(monkeypatch):
    """The fused kernel reads the keys and values reversed from the thread's kept buffer
    in a forward without a backward to come and in a frozen bias's backward (per head
    group), its mask a view of the values; a forward with a backward to come reverses them
    into tensors of its own, so that the backward's peak does not hold the buffer. Without
    a mask the forward returns the kernel's own output."""
    from posenc import ALiBi

    workspace.release_workspace()
    forward, backward = common._flash_cpu, common._flash_cpu_backward
    seen: list[tuple[str, bool, tuple[int, ...]]] = []
    outputs = []

    def spy_forward(q, k, v, *a, attn_mask, **kw):
        seen.append(("fwd", _in_kept_buffer(k) and _in_kept_buffer(v), attn_mask.stride()[-2:]))
        outputs.append(forward(q, k, v, *a, attn_mask=attn_mask, **kw))
        return outputs[-1]

    def spy_backward(grad, q, k, v, *a, attn_mask, **kw):
        seen.append(("bwd", _in_kept_buffer(k) and _in_kept_buffer(v), attn_mask.stride()[-2:]))
        return backward(grad, q, k, v, *a, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(common, "_flash_cpu", spy_forward)
    monkeypatch.setattr(common, "_flash_cpu_backward", spy_backward)
    monkeypatch.setattr(common, "_head_groups", lambda b, h: [slice(0, 2), slice(2, 3)])
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(20)[None]
    scheme = ALiBi(3).double()
    results = {}
    for backend in ("math", "lean"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(backend, scheme, *leaves, pos, pos, Mask(20, 20))
        if backend == "lean":
            assert workspace.kept_elements() == 0  # the forward kept nothing for the backward
        out.square().sum().backward()
        results[backend] = [out, *(t.grad for t in leaves)]
    assert seen == [("fwd", False, (1, 1))] + [("bwd", True, (1, 1))] * 2
    assert results["lean"][0].data_ptr() == outputs[0][0].data_ptr()
    for got, expected in zip(results["lean"], results["math"], strict=True):
        torch.testing.assert_close(got, expected)
    seen.clear()
    with torch.no_grad():
        got = run("lean", scheme, *(t.requires_grad_() for t in (q, k, v)), pos, pos, Mask(20, 20))
    assert seen == [("fwd", True, (1, 1))]
    torch.testing.assert_close(got, results["math"][0])


@pytest.mark.parametrize(("name", "n", "read"), [("t5", 40, False), ("alibi", 300, True)])
def test_offset_bias_path_reads_q_and_k_for_the_span_only_when_a_head_spreads(
    monkeypatch, name, n, read
):
    """The span (a pass over every query and key) is asked for only when some head's
    values spread over more than ``BIAS_SPAN``: ALiBi at 300 tokens, not a T5 table."""
    from posenc.engine import lean_plans

    spans = []
    span = lean_plans._bias_span
    monkeypatch.setattr(lean_plans, "_bias_span", lambda *a: spans.append(1) or span(*a))
    calls = spy_on(monkeypatch, offset_bias._OffsetFusedAttention)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 8) for _ in range(3))
    pos = torch.arange(n)[None]
    scheme = _offset_scheme(name, 8)
    with torch.no_grad():
        got = run("lean", scheme, q, k, v, pos, pos, Mask(n, n))
        expected = run("math", scheme, q, k, v, pos, pos, Mask(n, n))
    assert calls and bool(spans) == read
    torch.testing.assert_close(got, expected)
