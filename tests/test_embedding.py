"""Place 4 (embedding.py): content-dependent score terms against their definitions.

Every class is compared with a float64 loop over (i, j) written from its definition:
absolute ``q_i . R[k_pos_j]``, relative ``q_i . R[j - i + L - 1]`` and 2-D
``q_i . (height[r_j - r_i + H - 1] + width[c_j - c_i + W - 1])``.
"""

from __future__ import annotations

import pytest
import torch

import posenc
import posenc._query_terms as query_terms
from posenc import MultiHeadAttention, resize_relative_position_table
from posenc.embedding import (
    AbsoluteQueryEmbedding,
    RelativeQueryEmbedding,
    RelativeQueryEmbedding2D,
    absolute_query_term,
    relative_query_logits,
    relative_query_logits_2d,
    relative_query_term,
    relative_query_term_2d,
    relative_rows,
    resize_relative_rows,
)
from posenc.indices import relative_to_absolute

# ----- references: slow, obvious loops over the definitions ---------------------------------


def table_of(table, head):
    """The table head ``head`` uses: shared ``[R, d]`` or per-head ``[h, R, d]``."""
    return table if table.ndim == 2 else table[head]


def ref_absolute(q, weight, k_pos):
    b, h, n_q, _ = q.shape
    k_pos = k_pos.expand(b, -1)
    out = torch.zeros(b, h, n_q, k_pos.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(n_q):
                for j in range(k_pos.shape[-1]):
                    out[bi, hi, i, j] = q[bi, hi, i].double() @ weight[int(k_pos[bi, j])].double()
    return out


def ref_relative(q, weight, q_pos, k_pos, max_len):
    b, h, n_q, _ = q.shape
    q_pos, k_pos = q_pos.expand(b, -1), k_pos.expand(b, -1)
    out = torch.zeros(b, h, n_q, k_pos.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            table = table_of(weight, hi).double()
            for i in range(n_q):
                for j in range(k_pos.shape[-1]):
                    offset = int(k_pos[bi, j]) - int(q_pos[bi, i])
                    out[bi, hi, i, j] = q[bi, hi, i].double() @ table[offset + max_len - 1]
    return out


def ref_2d(q, height, width, size, q_pos, k_pos):
    rows, cols = size
    b, h, n_q, _ = q.shape
    q_pos, k_pos = q_pos.expand(b, -1), k_pos.expand(b, -1)
    out = torch.zeros(b, h, n_q, k_pos.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            hgt, wid = table_of(height, hi).double(), table_of(width, hi).double()
            for i in range(n_q):
                r_i, c_i = divmod(int(q_pos[bi, i]), cols)
                for j in range(k_pos.shape[-1]):
                    r_j, c_j = divmod(int(k_pos[bi, j]), cols)
                    r = hgt[r_j - r_i + rows - 1] + wid[c_j - c_i + cols - 1]
                    out[bi, hi, i, j] = q[bi, hi, i].double() @ r
    return out


def arange(n):
    return torch.arange(n)[None]  # [1, n]


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


# ----- AbsoluteQueryEmbedding --------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 4, 6])
def test_absolute_forward_matches_definition(n):
    torch.manual_seed(0)
    module = AbsoluteQueryEmbedding(6, 4).double()
    q = rand(2, 3, n, 4)
    expected = ref_absolute(q, module.weight, arange(n))
    torch.testing.assert_close(module(q), expected)
    torch.testing.assert_close(module.score_term(q, arange(n), arange(n)), expected)


def test_absolute_score_term_any_key_positions_and_batch_rows():
    torch.manual_seed(1)
    module = AbsoluteQueryEmbedding(10, 4).double()
    q = rand(2, 2, 3, 4)
    q_pos = torch.tensor([[7, 8, 9], [0, 1, 2]])
    k_pos = torch.tensor([[9, 0, 4, 4, 2], [1, 1, 3, 8, 0]])  # [b, n_k], n_k != n_q, any order
    got = module.score_term(q, q_pos, k_pos)
    torch.testing.assert_close(got, ref_absolute(q, module.weight, k_pos))
    # the query position does not enter an absolute key embedding
    torch.testing.assert_close(module.score_term(q, q_pos + 100, k_pos), got)


def test_absolute_key_shift_is_the_score_term_folded_into_the_keys():
    torch.manual_seed(1)
    module = AbsoluteQueryEmbedding(10, 4).double()
    q = rand(2, 2, 3, 4)
    q_pos = torch.tensor([[7, 8, 9], [0, 1, 2]])
    k_pos = torch.tensor([[9, 0, 4, 4, 2], [1, 1, 3, 8, 0]])
    shift = module.key_shift(q, q_pos, k_pos)  # [B', 1, n_k, d]
    assert shift.shape == (2, 1, 5, 4)
    torch.testing.assert_close(q @ shift.transpose(-2, -1), ref_absolute(q, module.weight, k_pos))
    with pytest.raises(ValueError, match=r"k_pos must lie in \[0, 10\), got values from 0 to 10"):
        module.key_shift(q, q_pos, torch.tensor([[0, 10, 2]]))


@pytest.mark.parametrize("backend", ["auto", "sdpa", "lean"])
def test_absolute_fast_paths_fold_the_term_into_the_keys(backend):
    """Not a score term on the fast paths: ``auto`` takes SDPA; equal to math, gradients too."""
    from posenc.engine import Mask, attend, explain_call

    torch.manual_seed(0)
    module = AbsoluteQueryEmbedding(40, 8).double()
    q, k, v = (rand(2, 3, n, 8) for n in (5, 12, 12))
    q_pos, k_pos = arange(5) + 20, torch.stack([arange(12)[0] + 13, arange(12)[0]])
    mask = Mask(5, 12, key_padding=torch.rand(2, 12) < 0.3)
    if backend == "auto":
        args = dict(scheme=module, q_pos=q_pos, k_pos=k_pos, mask=mask)
        assert explain_call(q, k, v, **args).path == "sdpa"
    results = {}
    for name in ("math", backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        module.weight.grad = None
        out, _ = attend(*leaves, scheme=module, q_pos=q_pos, k_pos=k_pos, mask=mask, backend=name)
        out.square().sum().backward()
        results[name] = [out, *(t.grad for t in leaves), module.weight.grad]
    for got, expected in zip(results[backend], results["math"], strict=True):
        torch.testing.assert_close(got, expected)


def test_absolute_is_not_translation_invariant():
    torch.manual_seed(2)
    module = AbsoluteQueryEmbedding(10, 4)
    q = torch.randn(1, 1, 3, 4)
    moved = module.score_term(q, arange(3) + 2, arange(3) + 2)
    assert not torch.allclose(moved, module.score_term(q, arange(3), arange(3)))


def test_absolute_gradcheck():
    torch.manual_seed(3)
    q = rand(1, 2, 3, 4).requires_grad_()
    weight = rand(5, 4).requires_grad_()
    k_pos = torch.tensor([[4, 0, 2]])
    assert torch.autograd.gradcheck(lambda q, w: absolute_query_term(q, w, k_pos), (q, weight))


# ----- RelativeQueryEmbedding ------------------------------------------------------------


@pytest.mark.parametrize("heads", [None, 3])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_relative_forward_matches_definition(heads, n):
    torch.manual_seed(4)
    module = RelativeQueryEmbedding(5, 4, heads=heads).double()
    q = rand(2, 3, n, 4)
    expected = ref_relative(q, module.weight, arange(n), arange(n), 5)
    torch.testing.assert_close(module(q), expected)
    torch.testing.assert_close(module.score_term(q, arange(n), arange(n)), expected)


def test_relative_forward_is_the_skew_of_the_offset_logits(monkeypatch):
    torch.manual_seed(5)
    module = RelativeQueryEmbedding(6, 4)
    q = torch.randn(2, 3, 4, 4)
    seen = []

    def spy(x):
        seen.append(tuple(x.shape))
        return relative_to_absolute(x)

    monkeypatch.setattr(query_terms, "relative_to_absolute", spy)
    got = module(q)
    assert seen == [(2, 3, 4, 7)]  # [b, h, n, 2n-1]: offsets -(n-1)..n-1 only
    rows = module.weight[6 - 4 : 6 + 4 - 1]  # rows of offsets -3..3
    torch.testing.assert_close(got, relative_to_absolute(q @ rows.T))


def test_per_head_tables_really_differ_per_head():
    torch.manual_seed(6)
    module = RelativeQueryEmbedding(4, 2, heads=3)
    assert module.weight.shape == (3, 7, 2)
    q = torch.randn(1, 3, 4, 2)
    before = module(q)
    with torch.no_grad():
        module.weight[1].add_(1.0)  # only head 1's table changes
    after = module(q)
    torch.testing.assert_close(after[:, [0, 2]], before[:, [0, 2]])
    assert not torch.allclose(after[:, 1], before[:, 1])
    # and head h uses exactly table h
    for h in range(3):
        shared = ref_relative(q[:, h : h + 1], module.weight[h], arange(4), arange(4), 4)
        torch.testing.assert_close(after[:, h : h + 1].double(), shared)


@pytest.mark.parametrize("heads", [None, 2])
def test_relative_score_term_any_positions(heads):
    torch.manual_seed(7)
    module = RelativeQueryEmbedding(10, 4, heads=heads).double()
    q = rand(2, 2, 3, 4)
    q_pos = torch.tensor([[5, 2, 9], [100, 103, 101]])
    k_pos = torch.tensor([[3, 4, 9, 11, 2], [104, 100, 98, 101, 107]])  # [b, n_k]
    expected = ref_relative(q, module.weight, q_pos, k_pos, 10)
    torch.testing.assert_close(module.score_term(q, q_pos, k_pos), expected)


@pytest.mark.parametrize("heads", [None, 2])
def test_relative_score_term_is_translation_invariant(heads):
    torch.manual_seed(8)
    module = RelativeQueryEmbedding(6, 4, heads=heads)
    q = torch.randn(2, 2, 6, 4)
    full = module(q)
    for shift in (1, 37, 10_000, -50):
        pos = arange(6) + shift
        torch.testing.assert_close(module.score_term(q, pos, pos), full)


def test_relative_gradcheck():
    torch.manual_seed(9)
    q = rand(1, 2, 3, 2).requires_grad_()
    shared = rand(7, 2).requires_grad_()
    per_head = rand(2, 7, 2).requires_grad_()
    q_pos, k_pos = torch.tensor([[1, 3, 2]]), torch.tensor([[0, 4, 2, 3]])
    for weight in (shared, per_head):
        assert torch.autograd.gradcheck(relative_query_logits, (q, weight))
        assert torch.autograd.gradcheck(
            lambda q, w: relative_query_term(q, w, q_pos, k_pos), (q, weight)
        )


# ----- RelativeQueryEmbedding2D ----------------------------------------------------------


@pytest.mark.parametrize("size", [(3, 5), (4, 2), (3, 3), (1, 4)])
@pytest.mark.parametrize("heads", [None, 2])
def test_2d_forward_matches_definition(size, heads):
    torch.manual_seed(10)
    module = RelativeQueryEmbedding2D(size, 4, heads=heads).double()
    n = size[0] * size[1]
    q = rand(2, 2, n, 4)
    expected = ref_2d(q, module.height, module.width, size, arange(n), arange(n))
    torch.testing.assert_close(module(q), expected)
    torch.testing.assert_close(module.score_term(q, arange(n), arange(n)), expected)


def transposed_height_order(q, height, width, size):
    """The widely copied bug: the height term left in column-major (transposed) order."""
    rows, cols = size
    b, h, n, d = q.shape
    grid = q.reshape(b, h, rows, cols, d)
    width_term = relative_to_absolute(grid @ width.T)  # [b, h, H, W, W]
    height_term = relative_to_absolute(grid.transpose(2, 3) @ height.T)  # [b, h, W, H, H]
    height_term = height_term.reshape(b, h, rows, cols, rows)  # wrong: no transpose back
    return (height_term.unsqueeze(-1) + width_term.unsqueeze(-2)).reshape(b, h, n, n)


def test_2d_reference_catches_transposed_height_order():
    """The brute-force test above can fail: it rejects the transposed-order variant on
    non-square maps (on square ones the bug is not always visible either)."""
    torch.manual_seed(11)
    for size in [(3, 5), (4, 2)]:
        n = size[0] * size[1]
        q, height, width = rand(1, 1, n, 4), rand(2 * size[0] - 1, 4), rand(2 * size[1] - 1, 4)
        expected = ref_2d(q, height, width, size, arange(n), arange(n))
        torch.testing.assert_close(relative_query_logits_2d(q, height, width, size), expected)
        assert not torch.allclose(transposed_height_order(q, height, width, size), expected)


@pytest.mark.parametrize("heads", [None, 3])
def test_2d_score_term_any_token_subsets(heads):
    torch.manual_seed(12)
    size = (3, 5)
    module = RelativeQueryEmbedding2D(size, 4, heads=heads).double()
    q = rand(2, 3, 4, 4)
    q_pos = torch.tensor([[14, 0, 7, 3], [5, 6, 10, 11]])
    k_pos = torch.tensor([[2, 9, 14, 0, 12, 6], [13, 1, 4, 8, 5, 10]])
    expected = ref_2d(q, module.height, module.width, size, q_pos, k_pos)
    torch.testing.assert_close(module.score_term(q, q_pos, k_pos), expected)


def test_2d_per_head_tables_really_differ_per_head():
    torch.manual_seed(13)
    module = RelativeQueryEmbedding2D((2, 3), 2, heads=2)
    assert module.height.shape == (2, 3, 2) and module.width.shape == (2, 5, 2)
    q = torch.randn(1, 2, 6, 2)
    before = module(q)
    with torch.no_grad():
        module.width[0].mul_(-2.0)
    after = module(q)
    torch.testing.assert_close(after[:, 1], before[:, 1])
    assert not torch.allclose(after[:, 0], before[:, 0])


def test_2d_gradcheck():
    torch.manual_seed(14)
    size = (2, 3)
    q = rand(1, 2, 6, 2).requires_grad_()
    height, width = rand(2, 3, 2).requires_grad_(), rand(2, 5, 2).requires_grad_()
    q_pos, k_pos = torch.tensor([[5, 0, 3]]), torch.tensor([[1, 2, 4, 0]])
    assert torch.autograd.gradcheck(
        lambda q, hh, ww: relative_query_logits_2d(q, hh, ww, size), (q, height, width)
    )
    assert torch.autograd.gradcheck(
        lambda q, hh, ww: relative_query_term_2d(q[:, :, :3], hh, ww, size, q_pos, k_pos),
        (q, height, width),
    )


def linear_resample(old_rows, new_rows):
    """Where ``F.interpolate(mode="linear", align_corners=False)`` samples the old rows for
    each new row: ``(k + 0.5) * old / new - 0.5``, clamped to the old rows at the border."""
    where = (torch.arange(float(new_rows)) + 0.5) * old_rows / new_rows - 0.5
    return where.clamp(0, old_rows - 1)


@pytest.mark.parametrize("heads", [None, 2])
def test_2d_resize_interpolates_each_axis_linearly(heads):
    """Each table is resampled over its offsets as a 1-D Swin table is (linear,
    align_corners=False): a table linear in the offset stays linear in the sampled offset."""
    module = RelativeQueryEmbedding2D((3, 4), 2, heads=heads)
    lead = () if heads is None else (heads,)
    slope = torch.tensor([1.0, -2.0]) if heads is None else torch.tensor([[1.0, -2.0], [0.5, 3]])
    slope = slope.reshape(*lead, 1, 2)  # [(h,) 1, d]: one line per head and channel
    with torch.no_grad():
        module.height.copy_(torch.arange(5.0)[:, None] * slope)  # [(h,) 5, 2]
        module.width.copy_(torch.arange(7.0)[:, None] * slope + 1.0)  # [(h,) 7, 2]
    assert module.resize((5, 2)) is module
    assert module.size == (5, 2)
    assert module.height.shape == (*lead, 9, 2) and module.width.shape == (*lead, 3, 2)
    expected_height = linear_resample(5, 9)[:, None] * slope
    expected_width = linear_resample(7, 3)[:, None] * slope + 1.0
    for got, expected in ((module.height, expected_height), (module.width, expected_width)):
        # a convex mix of two rows: a few roundings of values up to max|expected|
        eps = torch.finfo(torch.float32).eps
        atol = 4 * eps * float(expected.abs().max())
        torch.testing.assert_close(got.detach(), expected, atol=atol, rtol=0)
        assert isinstance(got, torch.nn.Parameter) and got.requires_grad
    # offset 0 (the centre row) keeps its value, up to the rounding of where it is sampled
    centre = 2.0 * slope[..., 0, :]
    atol = 4 * torch.finfo(torch.float32).eps * float(centre.abs().max())
    torch.testing.assert_close(module.height[..., 4, :].detach(), centre, atol=atol, rtol=0)
    # the module works at the new size, with the tables it now holds
    q = torch.randn(1, 2, 10, 2)
    torch.testing.assert_close(
        module(q), relative_query_logits_2d(q, module.height, module.width, (5, 2))
    )
    # and its state dict is that of a module built at the new size
    fresh = RelativeQueryEmbedding2D((5, 2), 2, heads=heads)
    fresh.load_state_dict(module.state_dict(), strict=True)
    torch.testing.assert_close(fresh(q), module(q))


def test_2d_resize_same_size_per_head_tables_and_frozen_tables():
    torch.manual_seed(16)
    module = RelativeQueryEmbedding2D((3, 4), 4, heads=3)
    before = (module.height.detach().clone(), module.width.detach().clone())
    module.resize((3, 4))  # same size: the tables as they were
    assert torch.equal(module.height.detach(), before[0])
    assert torch.equal(module.width.detach(), before[1])
    module.resize([6, 2])
    for got, old, rows in ((module.height, before[0], 6), (module.width, before[1], 2)):
        # per head: each head's table resized on its own, as a shared table would be
        for head in range(3):
            assert torch.equal(got[head].detach(), resize_relative_rows(old[head], rows))
        # the same convention as a 1-D Swin table (one column per channel)
        for head in range(3):
            assert torch.equal(
                got[head].detach(),
                resize_relative_position_table(old[head], old.shape[1] // 2 + 1, rows),
            )
    frozen = RelativeQueryEmbedding2D((2, 2), 4)
    frozen.requires_grad_(False)
    frozen.resize((4, 3))
    assert isinstance(frozen.height, torch.nn.Parameter) and not frozen.height.requires_grad
    assert not frozen.width.requires_grad and frozen.width.shape == (5, 4)


def test_2d_resize_errors_name_new_size():
    module = RelativeQueryEmbedding2D((3, 4), 4)
    with pytest.raises(ValueError, match=r"new_size must be a pair \(H, W\), got 4"):
        module.resize(4)
    with pytest.raises(ValueError, match=r"new_size\[1\] must be >= 1, got 0"):
        module.resize((3, 0))
    with pytest.raises(TypeError, match=r"new_size\[0\] must be an int, got 2.5 \(float\)"):
        module.resize((2.5, 3))
    assert module.size == (3, 4) and module.height.shape == (5, 4)  # untouched
    with pytest.raises(
        ValueError, match=r"table must have shape \[2L-1, d\] or \[heads, 2L-1, d\]"
    ):
        resize_relative_rows(torch.zeros(4, 3), 2)
    with pytest.raises(ValueError, match="new_len must be >= 1, got 0"):
        resize_relative_rows(torch.zeros(5, 3), 0)


# ----- all three: hooks, blocks, construction, errors -------------------------------------


def build(name, heads=None):
    if name == "absolute":
        return AbsoluteQueryEmbedding(12, 4)
    if name == "relative":
        return RelativeQueryEmbedding(12, 4, heads=heads)
    return RelativeQueryEmbedding2D((3, 4), 4, heads=heads)


@pytest.mark.parametrize("name", ["absolute", "relative", "2d"])
def test_block_of_queries_equals_rows_of_full_term(name):
    torch.manual_seed(15)
    module = build(name, heads=2 if name != "absolute" else None)
    q = torch.randn(2, 2, 12, 4)
    pos = torch.stack([torch.arange(12), torch.arange(12)])  # [b, n]
    full = module.score_term(q, pos, pos)
    for start, stop in [(0, 5), (5, 12), (11, 12)]:
        block = module.score_term(q[:, :, start:stop], pos[:, start:stop], pos)
        torch.testing.assert_close(block, full[:, :, start:stop])


@pytest.mark.parametrize("name", ["absolute", "relative", "2d"])
def test_positions_per_batch_row_equal_each_row_alone(name):
    torch.manual_seed(16)
    module = build(name)
    q = torch.randn(2, 2, 5, 4)
    pos = torch.stack([torch.arange(5), torch.tensor([7, 1, 3, 11, 0])])  # [b, n]
    both = module.score_term(q, pos, pos)
    for row in range(2):
        alone = module.score_term(q[row : row + 1], pos[row], pos[row])  # [n] positions
        torch.testing.assert_close(both[row : row + 1], alone)


@pytest.mark.parametrize(
    ("name", "heads", "keys"),
    [
        ("absolute", None, {"weight"}),
        ("relative", None, {"weight"}),
        ("relative", 3, {"weight"}),
        ("2d", None, {"height", "width"}),
        ("2d", 3, {"height", "width"}),
    ],
)
def test_meta_construction_to_empty_and_state_dict(name, heads, keys):
    with torch.device("meta"):
        module = build(name, heads)
    assert all(p.is_meta for p in module.parameters())
    module.to_empty(device="cpu")
    torch.manual_seed(17)
    module.reset_parameters()
    torch.manual_seed(17)
    reference = build(name, heads)
    assert set(module.state_dict()) == keys  # exactly the learned tables
    assert not list(module.buffers())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(module.state_dict()[key], value)


def test_initialisation_scale_is_inverse_sqrt_head_dim():
    torch.manual_seed(18)
    for table in (
        AbsoluteQueryEmbedding(2048, 16).weight,
        RelativeQueryEmbedding(1024, 16, heads=2).weight,
        RelativeQueryEmbedding2D((512, 512), 16).height,
    ):
        assert abs(table.std().item() - 0.25) < 0.01
        assert abs(table.mean().item()) < 0.01


@pytest.mark.parametrize("name", ["absolute", "relative", "2d"])
def test_inside_attention_the_term_is_scaled_with_qk(name):
    """MultiHeadAttention computes softmax((q k^T + term) / sqrt(d)) v."""
    torch.manual_seed(19)
    module = build(name, heads=2 if name != "absolute" else None).double()
    attn = MultiHeadAttention(8, 2, position=module, backend="math").double()
    x = rand(2, 12, 8)

    def split(t):
        return t.view(2, 12, 2, 4).transpose(1, 2)  # [b, n, dim] -> [b, h, n, d]

    q, k, v = split(attn.q_proj(x)), split(attn.k_proj(x)), split(attn.v_proj(x))
    pos = arange(12)
    scores = (q @ k.transpose(-2, -1) + module.score_term(q, pos, pos)) / 2.0  # sqrt(4)
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 12, 8)
    torch.testing.assert_close(attn(x), attn.out_proj(out))


# ----- errors ------------------------------------------------------------------------------


def test_longer_sequence_than_max_len_raises():
    q = torch.randn(1, 2, 7, 4)
    with pytest.raises(ValueError, match=r"sequence length 7 exceeds max_len=6.*max_len >= 7"):
        AbsoluteQueryEmbedding(6, 4)(q)
    with pytest.raises(ValueError, match=r"sequence length 7 exceeds max_len=6.*max_len >= 7"):
        RelativeQueryEmbedding(6, 4)(q)


def test_hook_positions_out_of_the_table_raise():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"k_pos must lie in \[0, 6\), got values from 0 to 6"):
        AbsoluteQueryEmbedding(6, 4).score_term(q, arange(3), torch.tensor([[0, 6, 2]]))
    with pytest.raises(ValueError, match=r"k_pos must lie in \[0, 6\).*-1"):
        AbsoluteQueryEmbedding(6, 4).score_term(q, arange(3), torch.tensor([[0, -1, 2]]))
    with pytest.raises(ValueError, match=r"offsets k_pos - q_pos range from -2 to 6.*max_len >= 7"):
        RelativeQueryEmbedding(6, 4).score_term(q, arange(3), torch.tensor([[0, 6, 3]]))
    with pytest.raises(ValueError, match=r"offsets .* from -8 to -4.*max_len >= 9"):
        RelativeQueryEmbedding(6, 4).score_term(q, arange(3) + 6, arange(3))
    with pytest.raises(ValueError, match=r"q_pos must lie in \[0, 12\).*3x4 map"):
        RelativeQueryEmbedding2D((3, 4), 4).score_term(q, arange(3) + 10, arange(3))


def test_far_rows_of_a_batch_do_not_trip_the_offset_check():
    """Offsets are checked per row: two rows far apart are fine."""
    q = torch.randn(2, 2, 3, 4)
    pos = torch.stack([torch.arange(3), torch.arange(3) + 1000])  # [b, n]
    RelativeQueryEmbedding(3, 4).score_term(q, pos, pos)


def test_bad_shapes_heads_and_head_dim_raise():
    with pytest.raises(
        ValueError, match=r"q must have last dimension head_dim=4.*shape \(1, 2, 3, 5\)"
    ):
        RelativeQueryEmbedding(6, 4)(torch.randn(1, 2, 3, 5))
    with pytest.raises(ValueError, match=r"q must have shape \[b, h, n, d\]"):
        AbsoluteQueryEmbedding(6, 4)(torch.randn(3, 4))
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        AbsoluteQueryEmbedding(6, 4)(torch.ones(1, 1, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"q has 3 heads but .* heads=2; build it with heads=3"):
        RelativeQueryEmbedding(6, 4, heads=2)(torch.randn(1, 3, 3, 4))
    with pytest.raises(ValueError, match=r"q has 3 heads but .* heads=2; build it with heads=3"):
        RelativeQueryEmbedding2D((2, 2), 4, heads=2)(torch.randn(1, 3, 4, 4))
    with pytest.raises(ValueError, match=r"3x4 map as 12 row-major tokens, got n=11"):
        RelativeQueryEmbedding2D((3, 4), 4)(torch.randn(1, 1, 11, 4))


def test_hook_position_arguments_are_checked():
    q = torch.randn(2, 2, 3, 4)
    module = RelativeQueryEmbedding(6, 4)
    with pytest.raises(TypeError, match=r"q_pos must be an integer tensor.*q_pos.long\(\)"):
        module.score_term(q, torch.arange(3.0), torch.arange(3))
    with pytest.raises(ValueError, match=r"q_pos must have shape \[3\] or \[1 or 2, 3\]"):
        module.score_term(q, torch.arange(4), torch.arange(3))
    with pytest.raises(ValueError, match=r"k_pos must have shape \[3\] or \[1 or 2, 3\]"):
        module.score_term(q, torch.arange(3), torch.zeros(3, 3, dtype=torch.long))


def test_validate_attention_names_both_values_and_the_fix():
    with pytest.raises(
        ValueError, match=r"head_dim=4 but the attention has head_dim=8.*head_dim=8"
    ):
        AbsoluteQueryEmbedding(6, 4).validate_attention(heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"heads=3 but the attention has heads=2.*heads=2"):
        RelativeQueryEmbedding(6, 4, heads=3).validate_attention(heads=2, head_dim=4)
    RelativeQueryEmbedding(6, 4).validate_attention(heads=5, head_dim=4)  # shared: any heads
    with pytest.raises(ValueError, match=r"heads=3 but the attention has heads=2"):
        MultiHeadAttention(8, 2, position=RelativeQueryEmbedding2D((2, 2), 4, heads=3))
    with pytest.raises(ValueError, match=r"head_dim=4 but the attention has head_dim=2"):
        MultiHeadAttention(8, 4, position=RelativeQueryEmbedding2D((2, 2), 4))


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        AbsoluteQueryEmbedding(0, 4)
    with pytest.raises(TypeError, match="head_dim must be an int"):
        RelativeQueryEmbedding(4, 4.0)
    with pytest.raises(ValueError, match=r"heads must be >= 1, got 0 \(or None"):
        RelativeQueryEmbedding(4, 4, heads=0)
    with pytest.raises(ValueError, match=r"size must be a pair \(H, W\)"):
        RelativeQueryEmbedding2D(4, 4)
    with pytest.raises(ValueError, match=r"size\[1\] must be >= 1"):
        RelativeQueryEmbedding2D((4, 0), 4)


# ----- torch.compile -----------------------------------------------------------------------


@pytest.mark.compile
def test_compile_fullgraph_parity():
    torch.manual_seed(20)
    absolute = AbsoluteQueryEmbedding(12, 4)
    relative = RelativeQueryEmbedding(12, 4, heads=2)
    grid = RelativeQueryEmbedding2D((3, 4), 4, heads=2)

    def terms(q, q_pos, k_pos):
        return (
            absolute.score_term(q, q_pos, k_pos),
            relative.score_term(q, q_pos, k_pos),
            grid.score_term(q, q_pos, k_pos),
            relative(q),
            grid(q),
        )

    q = torch.randn(2, 2, 12, 4)
    pos = torch.stack([torch.arange(12), torch.arange(12).flip(0)])  # [b, n]
    compiled = torch.compile(terms, fullgraph=True)
    for got, expected in zip(compiled(q, pos, pos), terms(q, pos, pos), strict=True):
        torch.testing.assert_close(got, expected)


# ----- the families the classes belong to --------------------------------------------------


def test_relative_classes_are_one_primitive_of_their_family():
    from posenc import GridTerm, OffsetTerm
    from posenc.embedding import relative_rows

    torch.manual_seed(0)
    shared, per_head = RelativeQueryEmbedding(5, 4), RelativeQueryEmbedding(5, 4, heads=3)
    assert isinstance(shared, OffsetTerm) and shared.reach == 4
    offsets = torch.tensor([[-4, 0], [2, 4]])
    assert torch.equal(shared.rows(offsets), shared.weight[offsets + 4])  # [2, 2, d]
    assert torch.equal(per_head.rows(offsets), per_head.weight[:, offsets + 4])  # [h, 2, 2, d]
    # beyond the table: the edge rows (the module's checks raise before that)
    assert torch.equal(relative_rows(shared.weight, torch.tensor([-9, 9])), shared.weight[[0, 8]])
    two = RelativeQueryEmbedding2D((3, 4), 4, heads=2)
    assert isinstance(two, GridTerm)
    assert torch.equal(two.axis_rows(0, torch.tensor([-2, 2])), two.height[:, [0, 4]])
    assert torch.equal(two.axis_rows(1, torch.tensor([-3, 3])), two.width[:, [0, 6]])


@pytest.mark.parametrize("heads", [None, 3])
def test_the_rows_of_a_run_of_offsets_are_a_slice_of_the_table(monkeypatch, heads):
    """Offsets that run_offsets built (a run, known without reading it) inside the table
    take a copy of its rows' slice (no gather), with the values and the weight's gradient
    of the gather, in and out of inference mode; a run past the table's ends, a run
    written into, and the same offsets built elsewhere are gathered, with the same values;
    traced, the offsets are gathered (the graph does not depend on the mark)."""
    from posenc.embedding import relative_rows
    from posenc.indices import run_offsets

    torch.manual_seed(0)
    scheme = RelativeQueryEmbedding(8, 4, heads=heads).double()
    weight = scheme.weight
    q_pos, k_pos = torch.arange(2, 5)[None], torch.arange(6)[None]
    offsets = run_offsets(q_pos, k_pos)  # -4 .. 3
    assert offsets.tolist() == list(range(-4, 4))
    selected = []
    original = query_terms.select_rows
    monkeypatch.setattr(query_terms, "select_rows", lambda *a: selected.append(1) or original(*a))
    rows = relative_rows(weight, offsets)
    assert selected == [] and torch.equal(rows, weight[..., 3:11, :])  # rows -4 + 7 on
    assert rows.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    plain = torch.arange(-4, 4)  # the same offsets, not known as a run
    gathered = relative_rows(weight, plain)
    assert selected == [1] and torch.equal(rows, gathered)
    with torch.inference_mode():
        inside = run_offsets(q_pos, k_pos)
        assert torch.equal(relative_rows(weight, inside), rows) and selected == [1]
    traced = torch.jit.trace(relative_rows, (weight.detach(), offsets), check_trace=False)
    assert selected == [1, 1]  # a gather, recorded for any offsets
    assert torch.equal(traced(weight.detach(), plain - 1), relative_rows(weight, plain - 1))
    compiled = torch.compile(lambda o: relative_rows(weight, o), fullgraph=True, backend="eager")
    assert torch.equal(compiled(offsets), rows)
    grad = torch.randn_like(rows)
    (slice_grad,) = torch.autograd.grad(rows, weight, grad)
    (gather_grad,) = torch.autograd.grad(gathered, weight, grad)
    assert torch.equal(slice_grad, gather_grad)
    far = run_offsets(torch.arange(9, 11)[None], torch.arange(12)[None])  # -10 .. 2
    clamped = relative_rows(weight, far)
    assert torch.equal(clamped, relative_rows(weight, torch.arange(-10, 3)))
    assert torch.equal(clamped[..., :4, :], weight[..., :1, :].expand_as(clamped[..., :4, :]))
    offsets[0] = 3  # written into: gathered again
    assert torch.equal(relative_rows(weight, offsets)[..., 0, :], weight[..., 10, :])


def test_offset_term_of_a_run_equals_the_score_term_by_the_skew():
    from posenc.indices import skew_rows

    torch.manual_seed(0)
    scheme = RelativeQueryEmbedding(16, 8, heads=3).double()
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    q_pos, k_pos = torch.arange(4, 9)[None], torch.arange(11)[None]
    rows = scheme.offset_term(q_pos, k_pos)  # [h, 5 + 11 - 1, d]: offsets -8 .. 6
    assert rows.shape == (3, 15, 8)
    assert torch.equal(rows[:, 0], scheme.weight[:, -8 + 15])
    term = skew_rows(q @ rows.transpose(-2, -1), 11)  # [b, h, 5, 11]
    torch.testing.assert_close(term, scheme.score_term(q, q_pos, k_pos), atol=1e-12, rtol=0)


@pytest.mark.parametrize("heads", [None, 3])
def test_offset_term_of_a_run_reads_the_tables_rows_in_place_without_a_graph(heads):
    """The rows of a run (queries at 4 .. 8, keys at 0 .. 10: offsets -8 .. 6) are the rows
    the family's form gathers from the offsets; where no graph is recorded they are the
    table's rows read in place (a view: no copy per call), in grad mode the family's copy
    (a graph may save it while the table changes). Positions that are not one run give
    None; a run past the table raises as ``check_positions`` does."""
    from posenc.families import OffsetTerm

    torch.manual_seed(0)
    scheme = RelativeQueryEmbedding(10, 4, heads=heads)
    q_pos, k_pos = torch.arange(4, 9)[None], torch.arange(11)[None]
    copied = OffsetTerm.offset_term(scheme, q_pos, k_pos)
    with torch.no_grad():
        rows = scheme.offset_term(q_pos, k_pos)
        assert rows._base is scheme.weight
        assert rows.data_ptr() == scheme.weight[..., 1, :].data_ptr()  # offset -8: row 1
        assert scheme.offset_term(torch.tensor([[0, 2, 1]]), k_pos) is None
        with pytest.raises(ValueError, match=r"range from -13 to 6.*max_len >= 14"):
            scheme.offset_term(torch.arange(4, 14)[None], k_pos)
        with pytest.raises(ValueError, match=r"range from 0 to 12.*max_len >= 13"):
            scheme.offset_term(torch.arange(1)[None], torch.arange(13)[None])
    assert torch.equal(rows, copied)
    in_grad_mode = scheme.offset_term(q_pos, k_pos)
    assert in_grad_mode._base is not scheme.weight and torch.equal(in_grad_mode, copied)


def _rows_doubled(module, offsets):
    return 2 * relative_rows(module.weight, offsets)


def _no_check(module, q_pos, k_pos):
    return None


@pytest.mark.parametrize("override", ["rows", "rows on the instance", "a lenient check"])
@pytest.mark.parametrize("no_grad", [False, True])
def test_a_subclass_rows_or_check_reach_the_fast_paths(override, no_grad):
    """A subclass (or an instance) that replaces ``rows`` gets its own rows on every path
    (not the table's read in place); one whose ``check_positions`` lets offsets past the
    table read its edge rows (as under ``torch.compile``) gets the family's clamped rows:
    ``auto`` (the materialised path at this size) equals ``backend="math"``."""
    overrides = {"rows": _rows_doubled} if override == "rows" else {}
    if override == "a lenient check":
        overrides = {"check_positions": _no_check}
    cls = type("Custom", (RelativeQueryEmbedding,), overrides)
    torch.manual_seed(0)
    scheme = cls(8, 16)
    if override == "rows on the instance":
        scheme.rows = lambda offsets: 2 * relative_rows(scheme.weight, offsets)
    n = 12 if override == "a lenient check" else 8  # offsets past +-7 read the edge rows
    q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))
    with torch.set_grad_enabled(not no_grad):
        out = posenc.attention(q, k, v, position=scheme)
        expected = posenc.attention(q, k, v, position=scheme, backend="math")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_the_table_changed_between_forward_and_backward_as_before():
    """In grad mode the rows are the family's copy, as before: an optimizer step between a
    forward and a second backward through it raises nothing (a view saved by the graph
    would), and the gradient is the one of the table as it was."""
    torch.manual_seed(0)
    scheme = RelativeQueryEmbedding(64, 16)
    q = torch.randn(2, 4, 17, 16, requires_grad=True)
    k, v = torch.randn(2, 4, 17, 16), torch.randn(2, 4, 17, 16)
    out = posenc.attention(q, k, v, position=scheme)
    (before,) = torch.autograd.grad(out.sum(), q, retain_graph=True)
    with torch.no_grad():
        scheme.weight.add_(1.0)
    (after,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(before, after)


def test_a_table_built_in_inference_mode_serves_a_call_with_gradients():
    """A table made under ``torch.inference_mode`` and queries that ask for a gradient: the
    rows the graph saves are a copy, not an inference tensor (which autograd cannot save)."""
    with torch.inference_mode():
        scheme = RelativeQueryEmbedding(32, 16)
    q = torch.randn(2, 4, 17, 16, requires_grad=True)
    k, v = torch.randn(2, 4, 17, 16), torch.randn(2, 4, 17, 16)
    out = posenc.attention(q, k, v, position=scheme)
    (grad,) = torch.autograd.grad(out.sum(), q)
    expected = posenc.attention(q, k, v, position=scheme, backend="math")
    (expected_grad,) = torch.autograd.grad(expected.sum(), q)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_the_2d_map_size_follows_the_tables_and_only_resize_changes_it():
    """Setting a larger ``size`` would read offsets past the tables, clamped to their last
    rows: a silently other attention. The size is read-only; ``resize`` moves it with them."""
    module = RelativeQueryEmbedding2D((4, 4), 8)
    with pytest.raises(AttributeError, match="size"):
        module.size = (8, 4)
    assert module.resize((8, 4)).size == (8, 4)
    assert module.height.shape[0] == 15 and module.width.shape[0] == 7
