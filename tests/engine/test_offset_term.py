"""The per-offset query-term path (engine/offset_term.py): 1-D relative embeddings and Shaw."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    ClippedPerHead,
    CyclicTerm,
    assert_lean_matches_math,
    assert_results_close,
    block_rows,
    lean_and_math,
    run,
    spy_on,
)
from torch import nn

from posenc.engine import Mask, attend, common, offset_term, tuning
from tolerances import logit_size


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize(
    ("q_range", "k_range", "std", "offset_path"),
    [
        ((0, 37), (0, 37), 0.5, True),  # self-attention
        ((24, 37), (0, 37), 0.5, True),  # decoding: the last queries against a cache
        ((0, 37), (0, 37), 40.0, True),  # a term spanning > BIAS_SPAN (never clamped)
        ((0, 37), (3, 40), 0.5, True),  # keys shifted from the queries
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_offset_term_path_equals_math(
    head_groups, monkeypatch, per_head, q_range, k_range, std, offset_path, dtype, causal
):
    """Relative embedding, consecutive positions, no mask or a causal one: outputs and
    every gradient."""
    from posenc import RelativeQueryEmbedding

    calls = spy_on(monkeypatch, offset_term._OffsetTermAttention)
    b, h, d = 2, 3, 8
    n_q, n_k = q_range[1] - q_range[0], k_range[1] - k_range[0]
    block_rows(monkeypatch, 7)
    torch.manual_seed(1)
    scheme = RelativeQueryEmbedding(45, d, heads=h if per_head else None).to(dtype)
    nn.init.normal_(scheme.weight, std=std)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for n in (n_q, n_k, n_k))
    q_pos, k_pos = torch.arange(*q_range)[None], torch.arange(*k_range)[None]
    mask = Mask(n_q, n_k, causal=causal)
    grads = lean_and_math(scheme, q, k, v, q_pos, k_pos, mask)
    assert bool(calls) == offset_path
    # std 40: logits' terms in the hundreds, and float32 rounding of the scores with them
    assert_results_close(grads, dtype, logit_size(q, k, scheme, q_pos, k_pos), n_k)


@pytest.mark.parametrize("columns", [1, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_offset_term_path_with_the_rows_padded_or_not_equals_math(monkeypatch, columns, causal):
    """The strips' products over the table's rows after theirs up to a multiple of
    GEMM_COLUMNS (1: none; 8: 67 offsets to 72, a view where the table has the rows, the
    strip's rows padded where it ends first; the skew must read the first columns alone):
    outputs and every gradient."""
    from posenc import RelativeQueryEmbedding

    monkeypatch.setattr(tuning, "GEMM_COLUMNS", columns)
    calls = spy_on(monkeypatch, offset_term._OffsetTermAttention)
    b, h, d, n = 2, 3, 8, 61
    block_rows(monkeypatch, 7)
    torch.manual_seed(1)
    scheme = RelativeQueryEmbedding(64, d).double()
    nn.init.normal_(scheme.weight, std=0.5)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(n, n, causal=causal))
    assert calls
    assert_results_close(grads, torch.float64, logit_size(q, k, scheme, pos, pos), n)


def test_strip_rows_widen_to_a_multiple_of_gemm_columns():
    """A strip's rows with the table's next ones up to a multiple of GEMM_COLUMNS (where
    that adds an eighth at most), a view; where the table ends first, the rows padded with
    zero rows in each product (no copy kept)."""
    table = torch.randn(3, 80, 16, dtype=torch.float64)  # [h, R, d]
    x = torch.randn(2, 1, 5, 16, dtype=torch.float64)
    rows = offset_term._Rows(table, None, slice(2, 62))  # W = 60 offsets
    assert rows.rows.shape[-2] == 60 and rows.wide.shape[-2] == 64  # rows 2 .. 65
    assert rows.wide.data_ptr() == table[:, 2].data_ptr()  # a view: no copy
    got = rows.logits(x, slice(1, 2))  # [2, 1, 5, 64]
    torch.testing.assert_close(got[..., :60], x @ table[1:2, 2:62].mT, atol=1e-12, rtol=0)
    assert offset_term._Rows(table, None, slice(2, 11)).wide.shape[-2] == 9  # 7 more: no
    near_end = offset_term._Rows(table, None, slice(33, 80))  # rows 33 .. 80: past the 80
    assert near_end.wide is None
    got = near_end.logits(x, slice(1, 2))
    assert got.shape[-1] == 48 and not got[..., 47:].any()  # a zero row's column
    torch.testing.assert_close(got[..., :47], x @ table[1:2, 33:80].mT, atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_shaw_strip_products_cover_the_band_alone(monkeypatch, causal):
    """With far parts, a strip block's term and its gradient are products with the band's
    ``2k - 1`` rows of each table (one per offset: nothing spread or gathered), made once
    per distinct offset range, not with the ``rows + 2k - 2`` columns of its logits."""
    from posenc import ShawRelativePosition

    made = []
    init = offset_term._Rows.__init__

    def spy(self, table, index, cols):
        init(self, table, index, cols)
        made.append((cols.stop - cols.start, self.runs, self.rows.shape[-2]))

    monkeypatch.setattr(offset_term._Rows, "__init__", spy)
    monkeypatch.setattr(tuning, "FAR_PAIRS", 0)
    block_rows(monkeypatch, 16)
    clip, n = 3, 80
    scheme = ShawRelativePosition(8, clip)
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for _ in range(3))
    pos = torch.arange(n)[None]
    mask = Mask(n, n, causal=causal)
    out, _ = attend(q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask, backend="lean")
    out.sum().backward()
    assert made and all(runs is None for _, runs, _ in made)
    assert all(width == rows <= 2 * clip - 1 for width, _, rows in made)
    # keys and values, forward and backward: the inner blocks share theirs
    assert len(made) <= 2 * 2 * 3


@pytest.mark.parametrize("values", [True, False])
@pytest.mark.parametrize(
    ("q_range", "k_range"),
    [
        ((0, 37), (0, 37)),  # blocks with far keys on both sides and a strip
        ((24, 37), (0, 37)),
        ((0, 30), (5, 40)),
        ((400, 410), (0, 30)),  # every key far before every query: no strip
        ((0, 10), (300, 330)),  # every key far after
        ((27, 38), (0, 30)),  # late queries meet no key in their band: rows without a strip
        ((0, 11), (8, 38)),  # early queries likewise
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("far", [True, False])
def test_shaw_offset_path_equals_math(
    head_groups, monkeypatch, values, q_range, k_range, dtype, causal, far
):
    """Shaw's keys and values, consecutive positions, no mask or a causal one: against the
    literal form, with its far pairs on the fused kernels (as from FAR_PAIRS pairs) and
    without (the strip over every key, as below)."""
    from posenc import ShawRelativePosition

    calls = spy_on(monkeypatch, offset_term._OffsetTermAttention)
    monkeypatch.setattr(tuning, "FAR_PAIRS", 0 if far else 1 << 40)
    far_calls = []
    far_forward = offset_term._FarPart.forward
    monkeypatch.setattr(
        offset_term._FarPart,
        "forward",
        lambda self, *a: far_calls.append(1) or far_forward(self, *a),
    )
    b, h, d = 2, 3, 8
    n_q, n_k = q_range[1] - q_range[0], k_range[1] - k_range[0]
    block_rows(monkeypatch, 7)
    torch.manual_seed(1)
    scheme = ShawRelativePosition(d, 4, values=values).to(dtype)
    for table in scheme.parameters():
        nn.init.normal_(table, std=1.0)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for n in (n_q, n_k, n_k))
    q_pos, k_pos = torch.arange(*q_range)[None], torch.arange(*k_range)[None]
    grads = lean_and_math(scheme, q, k, v, q_pos, k_pos, Mask(n_q, n_k, causal=causal))
    assert calls
    assert bool(far_calls) == far
    assert_results_close(grads, dtype, logit_size(q, k, scheme, q_pos, k_pos), n_k)


@pytest.mark.parametrize("causal", [False, True])
def test_offset_term_far_parts_with_a_table_per_head(head_groups, monkeypatch, causal):
    monkeypatch.setattr(tuning, "FAR_PAIRS", 0)
    block_rows(monkeypatch, 4)
    calls = spy_on(monkeypatch, offset_term._OffsetTermAttention)
    torch.manual_seed(0)
    scheme = ClippedPerHead(3, 8).double()
    assert_lean_matches_math(scheme, 2, 3, 21, 8, Mask(21, 21, causal=causal))
    assert calls


def test_shaw_far_part_whose_share_underflows(monkeypatch):
    """float32: a far part whose weight in a row is below exp(-EXP_FLOOR) gets that row's
    logsumexp at +inf in its kernel backward (exactly 0, no denormal exp over its keys);
    outputs and gradients still those of the literal form."""
    from posenc import ShawRelativePosition

    block_rows(monkeypatch, 8)
    monkeypatch.setattr(tuning, "FAR_PAIRS", 0)
    seen_lse = []
    backward = common._flash_cpu_backward

    def spy(*args, **kwargs):
        seen_lse.append(args[5])  # (grad_out, q, k, v, out, lse, ...)
        return backward(*args, **kwargs)

    monkeypatch.setattr(common, "_flash_cpu_backward", spy)
    torch.manual_seed(0)
    scheme = ShawRelativePosition(8, 2)
    with torch.no_grad():
        scheme.keys.zero_()
        scheme.keys[0, 0] = -60.0  # the lead (offsets <= -2): term about -106 for q[0] = 5
    q, k, v = (torch.randn(2, 2, 24, 8) for _ in range(3))
    q[..., 0] = 5.0
    pos = torch.arange(24)[None]
    grads = lean_and_math(scheme, q, k, v, pos, pos, Mask(24, 24))
    assert any(bool(torch.isinf(lse).any()) for lse in seen_lse)
    assert_results_close(grads, torch.float32, logit_size(q, k, scheme, pos, pos), 24)


def test_far_parts_only_on_long_sequences():
    """Below FAR_PAIRS query-key pairs a clipped table keeps the strip over every key."""
    for n in (64, 1024, 2048):
        index = (torch.arange(2 * n - 1) - (n - 1)).clamp(-16, 16) + 16
        parts, low, high = offset_term._far_parts(torch.zeros(33, 4), None, index, n, n, False)
        assert len(parts) == (2 if n * n >= tuning.FAR_PAIRS else 0)
        assert (low is None) == (high is None) == (not parts)


def test_strip_rows():
    assert offset_term._strip_rows(512, None, 20) == 512  # no far parts: as given
    assert offset_term._strip_rows(512, -15, 15) == 64  # Shaw, k = 16: a band of 31 offsets
    assert offset_term._strip_rows(512, -127, 127) == 255
    assert offset_term._strip_rows(32, -15, 15) == 32


@pytest.mark.parametrize(("n_q", "n_k"), [(9, 9), (4, 11), (11, 4), (1, 6)])
@pytest.mark.parametrize("delta", [-12, -3, 0, 1, 2, 5, 20])
def test_lead_pieces_cover_the_pairs_once(n_q, n_k, delta):
    """The kernel calls of a far part cover exactly the pairs j <= i + delta - 1, once."""
    covered = torch.zeros(n_q, n_k, dtype=torch.long)
    for rows, keys, causal in offset_term._lead_pieces(n_q, n_k, delta):
        i = torch.arange(rows.start, rows.stop)[:, None]
        j = torch.arange(keys.start, keys.stop)[None, :]
        seen = (j - keys.start <= i - rows.start) if causal else torch.ones_like(i * j, dtype=bool)
        covered[rows, keys] += seen.long()  # the kernel's causal mask is top-left
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    assert torch.equal(covered, (j <= i + delta - 1).long())


@pytest.mark.parametrize(("n_q", "n_k"), [(30, 30), (10, 30), (30, 12)])
@pytest.mark.parametrize("causal", [False, True])
def test_far_parts_and_strips_split_the_pairs(monkeypatch, n_q, n_k, causal):
    """Shaw, k = 4: every visible pair is in exactly one of the lead part (first row), the
    tail part (last row) and its block's strip, whose hidden logit columns are the pairs
    of the other parts or hidden by the causal mask."""
    monkeypatch.setattr(tuning, "FAR_PAIRS", 0)
    table = torch.zeros(9, 2)
    width = n_q + n_k - 1
    offsets = torch.arange(width) - (n_q - 1)
    index = offsets.clamp(-4, 4) + 4
    parts, low, high = offset_term._far_parts(table, None, index, n_q, n_k, causal)
    assert len(parts) == (1 if causal else 2)
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    visible = (j <= i + n_k - n_q) if causal else torch.ones(n_q, n_k, dtype=torch.bool)
    count = torch.zeros(n_q, n_k, dtype=torch.long)
    for part in parts:
        seq_i, seq_j = (n_q - 1 - i, n_k - 1 - j) if part.flip else (i, j)
        mine = seq_j <= seq_i + part.delta - 1
        assert (index[j - i + n_q - 1][mine] == part.row).all()  # one table row
        count += mine.long()
    for blk in (slice(s, min(s + 7, n_q)) for s in range(0, n_q, 7)):
        keys, cols, left, right = offset_term._strip(blk, n_q, n_k, low, high)
        rows = blk.stop - blk.start
        for r in range(rows):
            for c in range(keys.start, keys.stop):
                col = c - keys.start - r + rows - 1  # the logit column of (r, c) in the skew
                assert index[cols][col] == index[c - (blk.start + r) + n_q - 1]
                shown = col >= left and (right is None or col < right)
                count[blk.start + r, c] += int(shown)
    assert torch.equal(count, visible.long())


def test_offset_term_with_any_index_equals_math(monkeypatch):
    block_rows(monkeypatch, 5)
    torch.manual_seed(0)
    scheme = CyclicTerm(8).double()
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for n in (13, 19, 19))
    q_pos, k_pos = torch.arange(6, 19)[None], torch.arange(19)[None]
    results = {}
    for backend in ("math", "lean"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        scheme.table.grad = None
        out = run(backend, scheme, *leaves, q_pos, k_pos, Mask(13, 19))
        out.square().sum().backward()
        results[backend] = [out, *(t.grad for t in leaves), scheme.table.grad]
    for got, expected in zip(results["lean"], results["math"], strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("std", [0.5, 40.0])  # 40: a term spanning > BIAS_SPAN (never clamped)
def test_offset_term_future_keys_have_exactly_no_influence(monkeypatch, std):
    from posenc import RelativeQueryEmbedding

    block_rows(monkeypatch, 4)
    torch.manual_seed(0)
    scheme = RelativeQueryEmbedding(12, 4)
    nn.init.normal_(scheme.weight, std=std)
    q, k, v = (torch.randn(1, 2, 12, 4) for _ in range(3))
    pos = torch.arange(12)[None]
    mask = Mask(12, 12, causal=True)
    out = run("lean", scheme, q, k, v, pos, pos, mask)
    v2 = v.clone()
    v2[:, :, 11] = 1e30  # only the last query may see the last key
    torch.testing.assert_close(
        run("lean", scheme, q, k, v2, pos, pos, mask)[:, :, :11], out[:, :, :11], rtol=0, atol=0
    )


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("kind", ["cyclic", "direction"])
def test_offset_term_any_index_any_size(monkeypatch, n, kind):
    """An index that is no clipped run, decreasing ones included, at several sizes."""
    block_rows(monkeypatch, 3)
    torch.manual_seed(0)
    scheme = CyclicTerm(8).double()
    if kind == "direction":  # row 1 for offsets <= 0, row 0 after: [1, .., 1, 0, .., 0]
        scheme.score_term = lambda q, q_pos, k_pos: torch.einsum(
            "bhid,bijd->bhij",
            q,
            scheme.table[(k_pos[:, None, :] <= q_pos[:, :, None]).long()].expand(
                q.shape[0], -1, -1, -1
            ),
        )
        first = lambda q_pos, k_pos: int(k_pos[0, 0] - q_pos[0, -1])  # noqa: E731
        scheme.offset_term = lambda q_pos, k_pos: (
            scheme.table,
            (torch.arange(q_pos.shape[-1] + k_pos.shape[-1] - 1) + first(q_pos, k_pos) <= 0).long(),
        )
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)[None]
    results = {}
    for backend in ("math", "lean"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        scheme.table.grad = None
        out = run(backend, scheme, *leaves, pos, pos, Mask(n, n))
        out.square().sum().backward()
        results[backend] = [out, *(t.grad for t in leaves), scheme.table.grad]
    for got, expected in zip(results["lean"], results["math"], strict=True):
        torch.testing.assert_close(got, expected)


def test_offset_term_rejects_offsets_beyond_the_table():
    from posenc import RelativeQueryEmbedding

    with pytest.raises(
        ValueError, match=r"offsets k_pos - q_pos range from -9 to 9.*max_len >= 10"
    ):
        RelativeQueryEmbedding(6, 4).offset_term(torch.arange(10)[None], torch.arange(10)[None])
    assert (
        RelativeQueryEmbedding(6, 4).offset_term(torch.tensor([[0, 2]]), torch.arange(3)[None])
        is None
    )
