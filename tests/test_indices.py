"""indices.py helpers not covered by the scheme tests: gather_rows, offset runs, positions."""

from __future__ import annotations

import pytest
import torch

from posenc.indices import gather_rows, grid_offset_index, select_rows


@pytest.mark.parametrize("batch", [1, 3])
def test_gather_rows_equals_indexing_with_gradients(batch):
    torch.manual_seed(0)
    table = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)  # [rows, h]
    index = torch.randint(0, 7, (batch, 5, 6))
    out = gather_rows(table, index)
    assert out.shape == (batch, 4, 5, 6)
    for b in range(batch):
        for h in range(4):
            for i in range(5):
                for j in range(6):
                    assert out[b, h, i, j] == table[index[b, i, j], h]
    weight = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * weight).sum(), table)
    expected = torch.zeros(7, 4, dtype=torch.float64)
    for b in range(batch):
        for i in range(5):
            for j in range(6):
                expected[index[b, i, j]] += weight[b, :, i, j]
    torch.testing.assert_close(grad, expected)
    torch.autograd.gradcheck(lambda t: gather_rows(t, index), (table,))


@pytest.mark.parametrize("heads", [None, 3])
@pytest.mark.parametrize("shape", [(), (5,), (4, 6)])
def test_select_rows_reads_each_row_of_the_index_with_gradients(heads, shape):
    """``table[..., index, :]`` element by element, for a shared and a per-head table and
    an index of 0, 1 and 2 dims; the gradient sums the weights of each row's readers."""
    torch.manual_seed(0)
    lead = () if heads is None else (heads,)
    table = torch.randn(*lead, 7, 4, dtype=torch.float64, requires_grad=True)  # [(h,) R, d]
    index = torch.randint(0, 7, shape)
    out = select_rows(table, index)
    assert out.shape == (*lead, *shape, 4)
    flat_out = out.reshape(*lead, -1, 4)
    for s, row in enumerate(index.flatten().tolist()):
        assert torch.equal(flat_out[..., s, :], table[..., row, :])
    weight = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * weight).sum(), table)
    expected = torch.zeros_like(table)
    flat_weight = weight.reshape(*lead, -1, 4)
    for s, row in enumerate(index.flatten().tolist()):
        expected[..., row, :] += flat_weight[..., s, :]
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


# ----- the Toeplitz fast path for consecutive positions -----------------------------------


def test_offset_run_detects_consecutive_positions_only():
    from posenc.indices import offset_run

    assert offset_run(torch.arange(4, 7)[None], torch.arange(0, 5)[None]) == 0 - 6
    assert offset_run(torch.tensor([[0, 2, 3]]), torch.arange(3)[None]) is None  # a gap
    assert offset_run(torch.arange(3).expand(2, 3), torch.arange(3).expand(2, 3)) is None
    assert offset_run(torch.arange(3.0)[None], torch.arange(3.0)[None]) is None
    # ends n - 1 apart but out of order; a run read through a strided view; one tensor twice
    assert offset_run(torch.tensor([[0, 2, 1, 3]]), torch.arange(4)[None]) is None
    assert offset_run(torch.arange(4)[None], torch.tensor([[3, 1, 2, 4]])) is None
    assert offset_run(torch.arange(10)[None, ::2], torch.arange(3)[None]) is None  # step 2
    strided = torch.arange(4).repeat_interleave(2)[::2][None]  # [[0, 1, 2, 3]], stride 2
    assert not strided.is_contiguous() and offset_run(strided, strided) == 0 - 3
    run = torch.arange(5, 9)[None]
    assert offset_run(run, run) == 5 - 8
    assert offset_run(torch.tensor([[7]]), torch.tensor([[3]])) == 3 - 7


def test_run_positions_are_known_as_a_run_until_written_into(monkeypatch):
    """Positions built by run_positions skip the read of offset_run (the NumPy view is not
    taken) and give the same answer; an in-place write moves the version counter, and the
    positions are read again. Inference tensors have no counter: always read (in inference
    mode the runs are built outside it)."""
    import posenc.indices as indices
    from posenc.indices import offset_run, run_positions

    reads = []
    host_row = indices.host_row
    monkeypatch.setattr(indices, "host_row", lambda pos: reads.append(1) or host_row(pos))
    q_pos, k_pos = run_positions(4, 3), run_positions(0, 5)
    assert torch.equal(q_pos, torch.arange(4, 7)[None]) and q_pos.shape == (1, 3)
    assert offset_run(q_pos, k_pos) == 0 - 6 and reads == []
    k_pos[0, 2] = 9  # no longer a run: read, and refused
    assert offset_run(q_pos, k_pos) is None and reads == [1]
    with torch.no_grad():
        q_pos.add_(1)  # a run again, starting at 5: read, and its new first offset
    k_pos[0, 2] = 2
    assert offset_run(q_pos, k_pos) == 0 - 7
    assert offset_run(q_pos[:, 1:], run_positions(0, 5)) == 0 - 7  # a view: read
    with torch.inference_mode():
        built = run_positions(2, 4)  # built outside inference mode: marked all the same
        reads.clear()
        assert not built.is_inference() and offset_run(built, built) == 2 - 5 and reads == []
        inference = torch.arange(2, 6)[None]
        inference._posenc_run = (0, 2)  # an inference tensor has no counter: always read
        assert offset_run(inference, inference) == 2 - 5 and reads == [1]


def test_position_extremes_per_row():
    from posenc.indices import position_extremes

    assert position_extremes(torch.tensor([[5, 2, 9]])) == (2, 9)  # one CPU row: ints
    low, high = position_extremes(torch.tensor([[5, 2, 9], [1, 1, 0]]))
    assert low.tolist() == [2, 0] and high.tolist() == [9, 1]


@pytest.mark.parametrize("name", ["alibi", "t5", "swin", "relative"])
def test_consecutive_positions_fast_path_equals_the_general_path(name):
    """A block of consecutive positions (fast path) gives what the general gather gives."""
    from posenc.bias import ALiBi, RelativePositionBias, T5RelativeBias
    from posenc.embedding import RelativeQueryEmbedding

    torch.manual_seed(0)
    q_pos, k_pos = torch.arange(5, 11)[None], torch.arange(0, 13)[None]
    # the same positions with a batch of 2 rows: offset_run declines, the gather runs
    q_two, k_two = q_pos.expand(2, -1), k_pos.expand(2, -1)
    if name == "relative":
        module = RelativeQueryEmbedding(16, 8).double()
        q = torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True)
        fast = module.score_term(q, q_pos, k_pos)
        slow = module.score_term(q, q_two, k_two)
        wrt = [q, module.weight]
    else:
        module = {"alibi": ALiBi(4), "t5": T5RelativeBias(4), "swin": RelativePositionBias(16, 4)}
        module = module[name].double()
        fast = module.score_bias(q_pos, k_pos).expand(2, -1, -1, -1)
        slow = module.score_bias(q_two, k_two)
        wrt = [p for p in module.parameters()]
    torch.testing.assert_close(fast.double(), slow.double())
    if wrt:
        grad = torch.randn_like(slow)
        fast_grads = torch.autograd.grad(fast, wrt, grad)
        slow_grads = torch.autograd.grad(slow, wrt, grad)
        for a, b in zip(fast_grads, slow_grads, strict=True):
            torch.testing.assert_close(a, b)


def test_run_offsets_and_whole_map():
    from posenc.indices import is_whole_map, run_offsets

    q_pos, k_pos = torch.arange(5, 8)[None], torch.arange(2, 6)[None]
    # offsets k - q from 2 - 7 = -5 to 5 - 5 = 0, each once, in order
    assert run_offsets(q_pos, k_pos).tolist() == [-5, -4, -3, -2, -1, 0]
    assert run_offsets(torch.tensor([[0, 2]]), k_pos) is None  # not consecutive
    assert run_offsets(q_pos.expand(2, -1), k_pos.expand(2, -1)) is None  # batch of 2
    pos = torch.arange(6)[None]
    assert is_whole_map(pos, pos, 6)
    assert not is_whole_map(pos + 1, pos, 6)  # shifted
    assert not is_whole_map(pos[:, :5], pos, 6)  # not all of the map
    assert not is_whole_map(pos.flip(-1), pos, 6)  # not in order
    assert is_whole_map(pos, pos.clone(), 6)  # two tensors of the same positions
    assert not is_whole_map(pos, pos + 1, 6)  # keys shifted
    assert not is_whole_map(pos - 1, pos - 1, 6)  # both shifted alike: offsets still fit
    assert not is_whole_map(pos.expand(2, -1), pos.expand(2, -1), 6)  # a batch of 2


def test_the_whole_maps_offset_index_is_kept_for_small_maps_and_equals_the_general_one():
    from posenc.indices import _KEPT_CELLS, whole_map_offset_index

    for height, width, kept in ((3, 4, True), (1, _KEPT_CELLS, True), (3, _KEPT_CELLS, False)):
        tokens = torch.arange(height * width)[None]
        index = whole_map_offset_index(height, width, tokens.device)
        expected = grid_offset_index(tokens, tokens, (height, width))
        torch.testing.assert_close(index, expected, atol=0, rtol=0)
        assert (whole_map_offset_index(height, width, tokens.device) is index) is kept


def test_score_mod_positions_read_shared_and_per_sequence_positions_for_any_batch():
    from posenc.indices import score_mod_positions

    b = torch.arange(3)[:, None, None, None]  # FlexAttention's batch index, broadcast
    idx = torch.arange(4)[None, None, :, None]
    shared = torch.tensor([5, 7, 9, 11])
    per_row = torch.stack([shared, shared + 100, shared + 200])  # [3, 4]
    q_pos, k_pos, read_q, read_k = score_mod_positions(shared, per_row)
    assert q_pos.shape == (1, 4) and k_pos.shape == (3, 4)
    # shared: every sequence reads the one row (broadcast over b); per sequence: its own row
    assert torch.equal(read_q(b, idx).expand(3, 1, 4, 1), shared[idx].expand(3, 1, 4, 1))
    assert torch.equal(read_k(b, idx), per_row[b, idx])
    _, _, read_q, _ = score_mod_positions(shared[None], shared[None])
    assert torch.equal(read_q(b, idx).expand(3, 1, 4, 1), shared[idx].expand(3, 1, 4, 1))
    with pytest.raises(ValueError, match="q_pos has batch size 2 but k_pos has batch size 3"):
        score_mod_positions(per_row[:2], per_row)
    with pytest.raises(ValueError, match=r"k_pos must have shape \[n\], \[1, n\]"):
        score_mod_positions(shared, per_row[None])
    with pytest.raises(TypeError, match=r"q_pos must be an integer tensor.*q_pos.long\(\)"):
        score_mod_positions(shared.float(), shared)


def test_gather_logits_reads_each_pairs_row():
    from posenc.indices import gather_logits

    logits = torch.randn(2, 3, 4, 7)  # [b, h, n_q, R]
    index = torch.randint(0, 7, (1, 4, 5))  # [B' = 1, n_q, n_k]
    got = gather_logits(logits, index)
    assert got.shape == (2, 3, 4, 5)
    for i in range(4):
        for j in range(5):
            assert torch.equal(got[:, :, i, j], logits[:, :, i, index[0, i, j]])
    per_row = torch.randint(0, 7, (2, 4, 5))  # [B' = b, n_q, n_k]
    got = gather_logits(logits, per_row)
    assert torch.equal(got[1, 2, 3], logits[1, 2, 3, per_row[1, 3]])


def test_grid_offset_index_is_key_minus_query_and_swins_index_reversed():
    from posenc.indices import grid_offset_index, relative_position_index

    height, width = 3, 4
    tokens = torch.arange(height * width)
    index = grid_offset_index(tokens, tokens, (height, width))  # [N, N]
    for i in range(12):
        for j in range(12):
            dr, dc = j // width - i // width, j % width - i % width
            assert int(index[i, j]) == (dr + height - 1) * (2 * width - 1) + dc + width - 1
    # Swin's rows are query minus key: the same grid read backwards
    rows = (2 * height - 1) * (2 * width - 1)
    assert torch.equal(index, rows - 1 - relative_position_index((height, width)))
    batch = grid_offset_index(tokens[None, :5].expand(2, -1), tokens[None].expand(2, -1), (3, 4))
    assert batch.shape == (2, 5, 12) and torch.equal(batch[1], index[:5])


def test_gather_rows_without_a_gradient_records_no_graph_and_equals_the_graphs_values():
    torch.manual_seed(0)
    table = torch.randn(7, 4, requires_grad=True)  # [rows, h]
    index = torch.randint(0, 7, (2, 5, 6))
    with_graph = gather_rows(table, index)
    with torch.no_grad():
        without = gather_rows(table, index)
    constant = gather_rows(table.detach(), index)  # grad mode, a table that asks for none
    assert with_graph.grad_fn is not None
    assert without.grad_fn is None and constant.grad_fn is None
    expected = table.detach()[index].permute(0, 3, 1, 2)  # [B', n_q, n_k, h] -> [B', h, ..]
    assert torch.equal(without, expected) and torch.equal(constant, expected)
    assert torch.equal(with_graph.detach(), expected)


def test_value_range_reads_the_smallest_and_largest_position():
    from posenc.indices import run_positions, value_range

    run = run_positions(3, 5)  # known as a run: not read
    assert value_range(run) == (3, 7)
    run.mul_(2)  # written into: read again
    assert value_range(run) == (6, 14)
    row = torch.tensor([[4, -2, 9, 0]])
    assert value_range(row) == (-2, 9)
    rows = torch.tensor([[4, 1], [7, -5]])  # per sequence: over every row
    assert value_range(rows) == (-5, 7)
    assert value_range(torch.tensor([5, 2, 8])) == (2, 8)  # one dimension
    assert all(type(x) is int for x in value_range(rows))
