"""attention.py's grouped-query heads (``kv_heads``), ``attn_mask`` and sliding ``window``,
against a float64 reference written here one query row at a time, on every backend, for
outputs and gradients; and with a KV cache against the full pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import posenc
from posenc import KVCache, MultiHeadAttention, attention, explain

BACKENDS = ["math", "sdpa", "lean", "auto"]


def reference(q, k, v, *, slopes=None, allowed=None, added=None, causal=False, window=None):
    """Attention by its definition, one query row at a time: query head ``hi`` reads key and
    value head ``hi // (h / h_kv)``; ``slopes`` an ALiBi bias ``-slope_h |j - p_i|`` at the
    default positions (``p_i = i``, moved to the end when causal); ``allowed(bi, hi, i, j)`` bool; ``added(bi, hi, i, j)`` float; a query with
    no visible key gives 0."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    offset = n_k - n_q
    rows = []
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // h_kv)
            for i in range(n_q):
                at = i + offset  # the query's own index among the keys
                seen, scores = [], []
                for j in range(n_k):
                    if causal and j > at:
                        continue
                    if window is not None and (
                        j <= at - window or (not causal and j >= at + window)
                    ):
                        continue
                    if allowed is not None and not allowed(bi, hi, i, j):
                        continue
                    s = q[bi, hi, i] @ k[bi, g, j] / d**0.5
                    if slopes is not None:
                        s = s - slopes[hi] * abs(j - (at if causal else i))
                    if added is not None:
                        s = s + added(bi, hi, i, j)
                    seen.append(j)
                    scores.append(s)
                if not seen:
                    rows.append(torch.zeros_like(v[bi, g, 0]))
                    continue
                weights = torch.stack(scores).softmax(0)
                rows.append((weights[:, None] * v[bi, g, seen]).sum(0))
    return torch.stack(rows).view(b, h, n_q, v.shape[-1])


def inputs(b=2, h=4, h_kv=2, n_q=7, n_k=7, d=8, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(b, h, n_q, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, h_kv, n_k, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, h_kv, n_k, d, dtype=torch.float64, requires_grad=True)
    return q, k, v


def assert_same(got, want, leaves):
    """Outputs and the gradients of ``leaves`` under one random cotangent, float64."""
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    cotangent = torch.randn_like(want)
    g_got = torch.autograd.grad(got, leaves, cotangent, retain_graph=True)
    g_want = torch.autograd.grad(want, leaves, cotangent, retain_graph=True)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ----- grouped-query attention --------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h_kv", [1, 2])
def test_grouped_query_attention_equals_the_definition(backend, h_kv):
    q, k, v = inputs(h_kv=h_kv)
    slopes = posenc.alibi_slopes(4).double()
    got = attention(q, k, v, position=posenc.ALiBi(4), causal=True, backend=backend)
    assert_same(got, reference(q, k, v, slopes=slopes, causal=True), (q, k, v))


@pytest.mark.parametrize("backend", ["sdpa", "lean", "auto"])
@pytest.mark.parametrize("name", ["rotary", "t5", "swin-1d", "relative", "shaw"])
def test_grouped_query_attention_is_attention_with_repeated_key_heads(name, backend):
    """For every kind of scheme (rotation, bias, terms, Shaw's values) GQA equals attention
    with each key/value head repeated for its query heads (HF's repeat_kv)."""
    from schemes import SCHEMES

    if backend == "sdpa" and name == "shaw":
        pytest.skip("sdpa has no value term")
    torch.manual_seed(0)
    scheme = SCHEMES[name].build(4, 8, 12, (3, 4)).double()
    q, k, v = inputs(n_q=12, n_k=12)
    repeated = [t.repeat_interleave(2, dim=1) for t in (k, v)]
    want = attention(q, *repeated, position=scheme, causal=True, backend="math")
    got = attention(q, k, v, position=scheme, causal=True, backend=backend)
    assert_same(got, want, (q, k, v))


def test_multi_head_attention_kv_heads_projects_fewer_keys_and_decodes_with_a_cache():
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 8, kv_heads=2, position=posenc.Rotary(4)).double().eval()
    assert m.k_proj.out_features == m.v_proj.out_features == 2 * 4
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    # the definition: the projections by hand, each key/value head repeated 4 times
    q = m.q_proj(x).view(2, 9, 8, 4).transpose(1, 2)
    k = m.k_proj(x).view(2, 9, 2, 4).transpose(1, 2)
    v = m.v_proj(x).view(2, 9, 2, 4).transpose(1, 2)
    q, k = posenc.Rotary(4)(q, k)
    k, v = (t.repeat_interleave(4, dim=1) for t in (k, v))
    want = m.out_proj(
        F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 9, 32)
    )
    torch.testing.assert_close(m(x, causal=True), want, rtol=1e-10, atol=1e-12)
    cache = KVCache()
    steps = [m(x[:, :5], causal=True, cache=cache)]
    steps += [m(x[:, t : t + 1], causal=True, cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), want, rtol=1e-10, atol=1e-12)
    assert cache.keys.shape == (2, 2, 9, 4)  # the cache holds the kv heads only


# ----- attn_mask ----------------------------------------------------------------------------


def _masks(b, h, n_q, n_k):
    """(name, attn_mask, allowed(bi, hi, i, j), added(bi, hi, i, j)) of several shapes."""
    torch.manual_seed(3)
    keep = torch.rand(b, 1, n_q, n_k) > 0.3
    keep[0, 0, 2] = False  # a query that sees no key
    per_head = torch.randn(1, h, 1, n_k, dtype=torch.float64)
    dense = torch.randn(n_q, n_k, dtype=torch.float64)
    dense[1, 3] = float("-inf")
    dense[4] = float("-inf")  # a query whose keys are all -inf: 0, not NaN
    return [
        ("bool", keep, lambda bi, hi, i, j: bool(keep[bi, 0, i, j]), None),
        ("float-per-head", per_head, None, lambda bi, hi, i, j: per_head[0, hi, 0, j]),
        (
            "float-with-inf",
            dense,
            lambda bi, hi, i, j: dense[i, j] != float("-inf"),
            lambda bi, hi, i, j: dense[i, j],
        ),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", [0, 1, 2], ids=["bool", "float-per-head", "float-with-inf"])
def test_attn_mask_equals_the_definition(backend, which):
    q, k, v = inputs(n_q=6, n_k=9)
    _, mask, allowed, added = _masks(2, 4, 6, 9)[which]
    slopes = posenc.alibi_slopes(4).double()
    for causal in (False, True):
        got = attention(
            q, k, v, position=posenc.ALiBi(4), attn_mask=mask, causal=causal, backend=backend
        )
        want = reference(q, k, v, slopes=slopes, allowed=allowed, added=added, causal=causal)
        assert not got.isnan().any()
        assert_same(got, want, (q, k, v))


def test_attn_mask_on_every_scheme_equals_math():
    from schemes import SCHEMES

    mask = torch.randn(2, 1, 12, 12, dtype=torch.float64)
    mask[torch.rand(2, 1, 12, 12) < 0.2] = float("-inf")
    for name, entry in sorted(SCHEMES.items()):
        torch.manual_seed(0)
        scheme = entry.build(4, 8, 12, (3, 4)).double()
        # grouped keys, except for a rotation per head (RoPE-Mixed): a key head shared by
        # query heads of different rotations has no one rotation, and the scheme refuses it
        per_head_rotation = hasattr(scheme, "rotate") and getattr(scheme, "heads", None)
        q, k, v = inputs(n_q=12, n_k=12, h_kv=4 if per_head_rotation else 2)
        want = attention(q, k, v, position=scheme, attn_mask=mask, backend="math")
        for backend in ("auto", "lean"):
            got = attention(q, k, v, position=scheme, attn_mask=mask, backend=backend)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


def test_a_float_attn_mask_that_requires_grad_gets_its_gradient():
    q, k, v = inputs()
    mask = torch.randn(1, 4, 7, 7, dtype=torch.float64, requires_grad=True)
    grads = {}
    for backend in ("math", "auto", "lean", "sdpa"):
        out = attention(q, k, v, attn_mask=mask, position=posenc.ALiBi(4), backend=backend)
        grads[backend] = torch.autograd.grad(out.sin().sum(), mask)[0]
        assert explain(q, k, v, attn_mask=mask, backend=backend).path == "math"
    for backend in ("auto", "lean", "sdpa"):
        torch.testing.assert_close(grads[backend], grads["math"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_huge_finite_mask_values_are_softmaxed_as_defined(backend, dtype):
    """transformers marks padded queries with ``finfo.min`` on every key: a row of equal huge
    finite values is a uniform softmax by definition, the mean of the values. Each kernel's
    log-sum-exp rounded ``max + log n`` back to ``max`` there (the lean engine summed the
    values; the fused and SDPA backwards were ``n_k`` times too large), and a float64 row of
    -1e300 became -inf in float32 (NaN on the math path)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    for row, mask_dtype in (
        (-1e9, dtype),
        (torch.finfo(dtype).min, dtype),
        (-1e300, torch.float64),
    ):
        mask = torch.zeros(6, 6, dtype=mask_dtype)
        mask[1] = row
        mask[3, 2:] = row  # a row where only some keys are pushed away
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, position=posenc.ALiBi(2), attn_mask=mask, backend=backend)
        slopes = posenc.alibi_slopes(2).double()
        kept = [t.detach().double().requires_grad_() for t in leaves]
        want = reference(
            *kept, slopes=slopes,
            allowed=lambda bi, hi, i, j: not (i == 3 and j >= 2),
        )  # fmt: skip
        tol = dict(rtol=0, atol=1e-5 if dtype == torch.float32 else 5e-2)
        torch.testing.assert_close(out.double(), want, **tol)
        grads = torch.autograd.grad(out.float().sum(), leaves)
        wanted = torch.autograd.grad(want.sum(), kept)
        for got, expected in zip(grads, wanted, strict=True):
            scale = 1 + float(expected.abs().max())
            torch.testing.assert_close(got.double(), expected, rtol=0, atol=tol["atol"] * scale)


def test_attn_mask_counts_the_cached_keys():
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, kv_heads=2, position=posenc.T5RelativeBias(4)).double().eval()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    mask = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    want = m(x, causal=True, attn_mask=mask)
    cache = KVCache()
    steps = [m(x[:, :5], causal=True, cache=cache, attn_mask=mask[:, :, :5, :5])]
    for t in range(5, 8):
        steps.append(
            m(x[:, t : t + 1], causal=True, cache=cache, attn_mask=mask[:, :, t : t + 1, : t + 1])
        )
    torch.testing.assert_close(torch.cat(steps, 1), want, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"attn_mask must broadcast to .* \[2, 4, 1, 9\]"):
        m(x[:, :1], causal=True, cache=cache, attn_mask=mask[:, :, :1, :8])
    assert len(cache) == 8  # the failed step left the cache as it was


# ----- sliding window -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_window_equals_the_definition(backend, causal):
    q, k, v = inputs(n_q=9, n_k=11)
    slopes = posenc.alibi_slopes(4).double()
    padding = torch.zeros(2, 11, dtype=torch.bool)
    padding[1, -3:] = True
    for window in (1, 3, 20):
        got = attention(
            q, k, v, position=posenc.ALiBi(4), causal=causal, window=window,
            key_padding_mask=padding, backend=backend,
        )  # fmt: skip
        want = reference(
            q, k, v, slopes=slopes, causal=causal, window=window,
            allowed=lambda bi, hi, i, j: not bool(padding[bi, j]),
        )  # fmt: skip
        assert_same(got, want, (q, k, v))


@pytest.mark.parametrize("name", ["none", "alibi", "t5", "relative"])
def test_a_causal_window_runs_in_blocks_that_skip_the_keys_outside_it(name):
    """Long enough for the blocks (n = 600): the fast paths call the lean engine on each
    block of rows with its window's keys alone, and equal the math path with padding and
    documents too."""
    from schemes import SCHEMES

    torch.manual_seed(0)
    scheme = None if name == "none" else SCHEMES[name].build(2, 8, 600, (20, 30)).double()
    q, k, v = inputs(b=2, h=2, h_kv=1, n_q=600, n_k=600)
    docs = torch.tensor([[0] * 350 + [1] * 250, [0] * 600])
    padding = torch.zeros(2, 600, dtype=torch.bool)
    padding[1, 500:] = True
    for extra in ({}, {"document_ids": docs}, {"key_padding_mask": padding}):
        kwargs = dict(position=scheme, causal=True, window=100, **extra)
        assert explain(q, k, v, backend="lean", **kwargs).path == "mask-blocks"
        want = attention(q, k, v, backend="math", **kwargs)
        for backend in ("lean", "sdpa"):
            assert_same(attention(q, k, v, backend=backend, **kwargs), want, (q, k, v))


def test_window_with_a_cache_equals_the_full_pass():
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, kv_heads=1, position=posenc.ALiBi(4)).double().eval()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    want = m(x, causal=True, window=3)
    cache = KVCache()
    steps = [m(x[:, :4], causal=True, window=3, cache=cache)]
    steps += [m(x[:, t : t + 1], causal=True, window=3, cache=cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), want, rtol=1e-10, atol=1e-12)


@pytest.mark.compile
def test_flex_takes_the_window_and_attn_mask():
    pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    keep = torch.rand(1, 2, 16, 16) > 0.2
    added = torch.randn(16, 16)
    with torch.no_grad():
        for kwargs in ({"window": 4, "attn_mask": keep}, {"causal": True, "attn_mask": added}):
            got = attention(q, k, v, position=posenc.ALiBi(2), backend="flex", **kwargs)
            want = attention(q, k, v, position=posenc.ALiBi(2), backend="math", **kwargs)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # a mask per head, over whole 128 x 128 blocks: head 0's blocks are all full, so a
        # block mask classified from head 0 alone skipped head 1's masking
        q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
        per_head = torch.ones(1, 2, 128, 128, dtype=torch.bool)
        per_head[0, 1] = torch.ones(128, 128, dtype=torch.bool).tril()
        got = attention(q, k, v, attn_mask=per_head, backend="flex")
        want = attention(q, k, v, attn_mask=per_head, backend="math")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----- errors -------------------------------------------------------------------------------


def test_errors_name_the_argument_and_the_fix():
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    with pytest.raises(TypeError, match="attn_mask must be a bool tensor .* or a float one"):
        attention(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"attn_mask must broadcast .* attn_mask.view\(2, 4, 5, 5\)"
    ):
        attention(q, k, v, attn_mask=torch.zeros(8, 5, 5))
    with pytest.raises(ValueError, match="attn_mask must broadcast"):
        attention(q, k, v, attn_mask=torch.zeros(5))
    with pytest.raises(ValueError, match=r"attn_mask has NaN or \+inf"):
        attention(q, k, v, attn_mask=torch.full((5, 5), float("nan")))
    with pytest.raises(ValueError, match="window must be >= 1"):
        attention(q, k, v, window=0)
    with pytest.raises(TypeError, match="window must be an int"):
        attention(q, k, v, window=2.0)
    with pytest.raises(ValueError, match="k and v their heads, which must divide q's"):
        attention(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="k and v their heads"):
        attention(q, k[:, :2], v)
    with pytest.raises(
        ValueError, match=r"kv_heads must divide heads=8 .* pick one of \[1, 2, 4, 8\]"
    ):
        MultiHeadAttention(32, 8, kv_heads=3)
    with pytest.raises(TypeError, match="kv_heads must be an int"):
        MultiHeadAttention(32, 8, kv_heads=2.0)
