"""tools/call_overhead.py: posenc's time around SDPA's kernel, taken apart per call."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import call_overhead  # noqa: E402

from posenc.engine import plans, sdpa  # noqa: E402


def test_alibi_is_taken_apart_around_its_one_kernel():
    kernel = sdpa._kernel
    row = call_overhead.measure("alibi", (1, 2, 8, 8), repeats=3)
    assert sdpa._kernel is kernel  # unwrapped after measuring
    assert 0 < row["kernel"] < row["posenc"] and 0 < row["outside"] < row["posenc"]
    assert row["without_kernel"] > 0 and row["bound"] > 0 and row["peer"] > 0


def test_the_kernel_is_unwrapped_when_a_call_raises(monkeypatch):
    kernel = sdpa._kernel

    def failing(scheme, backend):
        def run(q, k, v):
            raise RuntimeError("boom")

        return run

    monkeypatch.setattr(call_overhead, "_core", failing)
    with pytest.raises(RuntimeError, match="boom"):
        call_overhead.measure("alibi", (1, 2, 8, 8), repeats=1)
    assert sdpa._kernel is kernel


def test_each_replacement_of_the_kernel_is_undone_when_a_call_raises():
    kernel = sdpa._kernel
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))

    def failing(q, k, v):
        assert sdpa._kernel is not kernel  # replaced while the call runs
        raise RuntimeError("boom")

    for run in (
        lambda: call_overhead._bound(failing, q, k, v),
        lambda: call_overhead._without_kernel(failing, q, k, v, 1),
    ):
        with pytest.raises(RuntimeError, match="boom"):
            run()
        assert sdpa._kernel is kernel


def test_the_bound_call_is_the_kernel_posenc_runs():
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    scheme = call_overhead.build_scheme("alibi", 2, 8, 8)
    posenc_call = call_overhead._core(scheme, "auto")
    bound = call_overhead._bound(posenc_call, q, k, v)
    with torch.no_grad():
        torch.testing.assert_close(bound(q, k, v), posenc_call(q, k, v))


def test_a_bias_built_in_each_call_has_no_bound_call():
    # the Swin table is gathered in every call: a kept mask would skip that work
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    scheme = call_overhead.build_scheme("swin-1d", 2, 8, 8)
    assert call_overhead._bound(call_overhead._core(scheme, "auto"), q, k, v) is None


def test_a_call_off_the_sdpa_route_has_no_kernel_to_take_apart(monkeypatch):
    # the relative embedding's term runs op by op at this size with two threads or more
    # (OPS_FORWARD_THREADS): no SDPA kernel to time
    monkeypatch.setattr(plans, "_threads", lambda: 2)
    row = call_overhead.measure("relative", (1, 2, 8, 8), repeats=2)
    assert math.isnan(row["kernel"]) and math.isnan(row["without_kernel"])
    assert "bound" not in row
    assert "n/a" in call_overhead.format_rows([row])


def test_a_scheme_without_a_peer_prints_na():
    row = call_overhead.measure("relative-2d", (1, 2, 16, 8), repeats=1)
    assert "peer" not in row
    assert call_overhead.format_rows([row]).count("n/a") >= 3


def test_a_rotating_scheme_has_no_bound_call():
    row = call_overhead.measure("rotary-interleaved", (1, 2, 8, 8), repeats=2)
    assert "bound" not in row and 0 < row["kernel"] < row["posenc"]
