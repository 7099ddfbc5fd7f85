"""posenc.engine.workspace: the buffer the in-place forward keeps between calls, one per
thread, device, dtype and inference mode."""

from __future__ import annotations

import threading

import pytest
import torch

from posenc.engine import Mask, reference, tuning, workspace
from posenc.engine.reference import _forward_in_place, _math
from posenc.engine.workspace import borrowed, kept_elements, release_workspace
from posenc.hooks import Hooks


@pytest.fixture(autouse=True)
def _fresh():
    release_workspace()
    yield
    release_workspace()


def _pointers(monkeypatch) -> list[int]:
    """The address of the scores buffer of each in-place forward from now on."""
    seen = []
    original = reference._softmax_out

    def spy(scores, dim, half, *, out):
        seen.append(scores.data_ptr())
        return original(scores, dim, half, out=out)

    monkeypatch.setattr(reference, "_softmax_out", spy)
    return seen


def _call(b: int, n: int, hooks: Hooks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-place forward and the formula op by op on the same random inputs."""
    q, k, v = (torch.randn(b, 2, n, 4) for _ in range(3))
    pos = torch.arange(n)[None]
    hooks = hooks or Hooks(score_bias=lambda q_pos, k_pos: torch.randn(1, 2, n, n))
    torch.manual_seed(1)
    with torch.no_grad():
        out = _forward_in_place(q, k, v, hooks, pos, pos, Mask(n, n), 0.5, 0.0)
    torch.manual_seed(1)
    expected = _math(q, k, v, hooks, pos, pos, Mask(n, n), 0.5, 0.0, reference=False)[0]
    return out, expected


def test_calls_reuse_the_kept_buffer_and_a_larger_one_replaces_it(monkeypatch):
    seen = _pointers(monkeypatch)
    for b in (2, 2, 1, 3):
        out, expected = _call(b, 16)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert seen[0] == seen[1] == seen[2]  # the same buffer, for a smaller call too
    assert kept_elements() == 3 * 2 * 16 * 16  # the larger call's buffer, and that alone


def test_the_output_does_not_alias_the_buffer():
    first, _ = _call(2, 16)
    kept = first.clone()
    _call(2, 16)  # the next call writes the buffer again
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


def test_rows_whose_softmax_is_not_in_place_take_the_buffer_twice(monkeypatch):
    """7 keys a row: the weights go into the second half of one kept buffer."""
    seen = _pointers(monkeypatch)
    for _ in range(2):
        out, expected = _call(2, 7)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert seen[0] == seen[1]
    assert kept_elements() == 2 * (2 * 2 * 7 * 7)


def test_a_call_above_the_cap_borrows_a_fresh_buffer(monkeypatch):
    monkeypatch.setattr(tuning, "WORKSPACE_ELEMENTS", 2 * 2 * 16 * 16 - 1)
    out, expected = _call(2, 16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert kept_elements() == 0


def test_a_value_term_that_runs_attention_gets_a_buffer_of_its_own():
    """The buffer is lent while the outer call reads its weights: the inner call must not
    write into it."""
    n = 16
    inner_q = torch.randn(2, 2, n, 4)

    def value_term(weights, q_pos, k_pos):
        before = weights.clone()
        with torch.no_grad():
            inner = _forward_in_place(
                inner_q, inner_q, inner_q, Hooks(), q_pos, k_pos, Mask(n, n), 0.5, 0.0
            )
        torch.testing.assert_close(weights, before, rtol=0, atol=0)
        return inner * 0 + weights.sum(-1, keepdim=True)  # [b, h, n_q, 1] -> [b, h, n_q, d_v]

    bias = torch.randn(1, 2, n, n)
    hooks = Hooks(score_bias=lambda q_pos, k_pos: bias, value_term=value_term)
    out, expected = _call(2, n, hooks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_inference_mode_and_other_dtypes_keep_buffers_of_their_own():
    """A buffer made in inference mode cannot be written outside it: each mode its own."""
    q = torch.randn(1, 2, 16, 4)
    pos = torch.arange(16)[None]
    hooks = Hooks(score_bias=lambda q_pos, k_pos: torch.zeros(1, 2, 16, 16))
    with torch.inference_mode():
        inside = _forward_in_place(q, q, q, hooks, pos, pos, Mask(16, 16), 0.5, 0.0)
    with torch.no_grad():
        outside = _forward_in_place(q, q, q, hooks, pos, pos, Mask(16, 16), 0.5, 0.0)
        wide = _forward_in_place(
            q.double(), q.double(), q.double(), hooks, pos, pos, Mask(16, 16), 0.5, 0.0
        )
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    torch.testing.assert_close(wide.float(), outside, rtol=1e-5, atol=1e-6)
    assert len(workspace._kept.buffers) == 3


def test_each_thread_keeps_its_own():
    _call(2, 16)
    other: list[int] = []
    thread = threading.Thread(target=lambda: (_call(2, 16), other.append(kept_elements())))
    thread.start()
    thread.join()
    assert other == [2 * 2 * 16 * 16]
    assert kept_elements() == 2 * 2 * 16 * 16  # this thread's, untouched


def test_release_hands_the_buffers_back():
    _call(2, 16)
    assert kept_elements() > 0
    release_workspace()
    assert kept_elements() == 0


def test_borrowed_lends_once_at_a_time():
    cpu = torch.device("cpu")
    with borrowed(8, torch.float32, cpu) as first, borrowed(8, torch.float32, cpu) as second:
        assert first.data_ptr() != second.data_ptr()
    with borrowed(8, torch.float32, cpu) as again:
        assert again.data_ptr() == first.data_ptr()


def test_a_value_term_reading_a_tensor_that_requires_grad_keeps_its_own_weights():
    """In grad mode with nothing the plan differentiates, a value term may read a tensor
    that requires grad: its graph saves the weights, which the next call must not write."""
    from posenc.engine import attend

    table = torch.randn(16, 4, requires_grad=True)
    hooks = {
        "score_bias": lambda q_pos, k_pos: torch.zeros(1, 2, q_pos.shape[-1], k_pos.shape[-1]),
        "value_term": lambda weights, q_pos, k_pos: weights @ table,  # [b, h, n_q, 4]
    }
    scheme = type("ValueTable", (), {k: staticmethod(f) for k, f in hooks.items()})()
    q = torch.randn(2, 2, 16, 4)
    pos = torch.arange(16)[None]
    outs = [attend(q * s, q, q, scheme=scheme, q_pos=pos, k_pos=pos, mask=Mask(16, 16))[0]
            for s in (1.0, 2.0)]  # fmt: skip
    (grad,) = torch.autograd.grad(outs[0].sum(), table)
    expected = _math(q, q, q, Hooks(**hooks), pos, pos, Mask(16, 16), 0.5, 0.0)[0]
    (expected_grad,) = torch.autograd.grad(expected.sum(), table)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)


def test_buffers_off_the_cpu_are_not_kept():
    """A CUDA buffer kept across calls could still be read by another stream's kernels."""
    with borrowed(8, torch.float32, torch.device("meta")) as flat:
        assert flat.device.type == "meta"
    assert kept_elements() == 0
