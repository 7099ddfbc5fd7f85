"""Property-based tests (hypothesis): random shapes, masks, positions and schemes.

For every drawn case: the lean engine and ``backend="auto"`` agree with ``backend="math"``;
outputs are finite when inputs are (fully masked rows included); keys that are masked
have no influence (changing them changes nothing). The number of examples is set by
``PROPERTY_EXAMPLES`` (default 40 per property).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posenc import MultiHeadAttention
from schemes import SCHEMES
from tolerances import assert_close, recorded_logits

EXAMPLES = int(os.environ.get("PROPERTY_EXAMPLES", "40"))
HEAD_DIM = 4
GRID = (3, 4)
MAX_N = GRID[0] * GRID[1]


@st.composite
def cases(draw):
    name = draw(st.sampled_from(["none", *SCHEMES]))
    entry = SCHEMES.get(name)
    two_d = entry is not None and entry.two_d
    heads = draw(st.sampled_from([1, 2, 4]))
    b = draw(st.integers(1, 3))
    n = draw(st.integers(1, MAX_N))
    causal = draw(st.booleans())
    padding = draw(
        st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=b, max_size=b)
    )
    use_padding = draw(st.booleans())
    offset = 0 if two_d else draw(st.integers(0, 50))
    absolute = entry is not None and not entry.relative
    if absolute:
        offset = 0  # tables of absolute schemes cover [0, MAX_N)
    seed = draw(st.integers(0, 2**16))
    return dict(
        name=name,
        heads=heads,
        b=b,
        n=n,
        causal=causal,
        padding=torch.tensor(padding) if use_padding else None,
        offset=offset,
        seed=seed,
    )


def build(case, backend):
    torch.manual_seed(case["seed"])
    dim = case["heads"] * HEAD_DIM
    scheme = None
    if case["name"] != "none":
        scheme = SCHEMES[case["name"]].build(case["heads"], HEAD_DIM, MAX_N, GRID)
    torch.manual_seed(case["seed"] + 1)
    return MultiHeadAttention(dim, case["heads"], position=scheme, backend=backend).eval()


def inputs(case):
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["b"], case["n"], case["heads"] * HEAD_DIM, generator=gen)
    positions = torch.arange(case["n"]) + case["offset"]
    return x, dict(causal=case["causal"], key_padding_mask=case["padding"], positions=positions)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_lean_and_auto_agree_with_math(case):
    x, kwargs = inputs(case)
    with recorded_logits() as logits:
        expected = build(case, "math")(x, **kwargs)
    assert torch.isfinite(expected).all()
    for backend in ("lean", "auto"):
        got = build(case, backend)(x, **kwargs)
        assert_close(got, expected, terms=case["n"], logit=max(logits), msg=backend)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_masked_keys_have_no_influence(case):
    x, kwargs = inputs(case)
    if kwargs["key_padding_mask"] is None:
        kwargs["key_padding_mask"] = torch.zeros(case["b"], case["n"], dtype=torch.bool)
        kwargs["key_padding_mask"][:, -1] = True
    model = build(case, "auto")
    with recorded_logits() as logits:
        out = model(x, **kwargs)
    changed = x.clone()
    changed[kwargs["key_padding_mask"]] = 1e3 * torch.randn_like(
        changed[kwargs["key_padding_mask"]]
    )
    out_changed = model(changed, **kwargs)
    real = ~kwargs["key_padding_mask"]  # outputs of real tokens (padded queries change, fine)
    # at most another order of the same roundings (the masked keys weigh exactly 0)
    assert_close(out_changed[real], out[real], terms=case["n"], logit=max(logits))
    assert torch.isfinite(out_changed).all()


@pytest.mark.parametrize("backend", ["math", "sdpa", "lean"])
def test_all_keys_masked_gives_zero_attention(backend):
    model = MultiHeadAttention(8, 2, backend=backend, bias=False)
    x = torch.randn(2, 5, 8)
    out = model(x, key_padding_mask=torch.ones(2, 5, dtype=torch.bool))
    assert out.eq(0).all()
