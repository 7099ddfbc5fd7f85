"""tools/call_overhead.py: posenc's time around SDPA's kernel, taken apart per call."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import call_overhead  # noqa: E402

from posenc.engine import sdpa  # noqa: E402


def test_alibi_is_taken_apart_around_its_one_kernel():
    kernel = sdpa._kernel
    row = call_overhead.measure("alibi", (1, 2, 8, 8), repeats=3)
    assert sdpa._kernel is kernel  # unwrapped after measuring
    assert row["kernel"] > 0 and math.isclose(row["outside"], row["posenc"] - row["kernel"])
    assert row["without_kernel"] > 0 and row["bound"] > 0 and row["peer"] > 0


def test_the_bound_call_is_the_kernel_posenc_runs():
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    scheme = call_overhead.build_scheme("alibi", 2, 8, 8)
    posenc_call = call_overhead._core(scheme, "auto")
    bound = call_overhead._bound(posenc_call, q, k, v)
    with torch.no_grad():
        torch.testing.assert_close(bound(q, k, v), posenc_call(q, k, v))


def test_a_call_off_the_sdpa_route_has_no_kernel_to_take_apart():
    # the relative embedding's term runs op by op at this size: no SDPA kernel to time
    row = call_overhead.measure("relative", (1, 2, 8, 8), repeats=2)
    assert math.isnan(row["kernel"]) and math.isnan(row["without_kernel"])
    assert "bound" not in row  # the kernel did not run once: nothing to bind
    assert "n/a" in call_overhead.format_rows([row])


def test_a_rotating_scheme_has_no_bound_call():
    row = call_overhead.measure("rotary-interleaved", (1, 2, 8, 8), repeats=2)
    assert "bound" not in row and row["kernel"] > 0
