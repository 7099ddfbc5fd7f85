"""Place 3 families: a content-free bias of an offset (1-D) or of a 2-D offset (a map).

Shape legend: ``B'`` the batch of the positions (1 when shared, else ``b``), ``h`` heads
(``1`` for a bias shared by the heads), ``n_q`` queries, ``n_k`` keys, ``S`` any shape of
offsets, ``W = n_q + n_k - 1`` the offsets of a run of positions, ``R`` rows of a table,
``H x W`` a map.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..indices import (
    gather_rows,
    grid_offset_index,
    is_whole_map,
    offset_run,
    relative_distance,
    run_offsets,
    score_mod_positions,
    select_rows,
    toeplitz,
    whole_map_offset_index,
)
from .common import (
    Primitive,
    check_cells,
    check_heads,
    lengths_positions,
    module_device,
    offset_span,
    table_of,
)

__all__ = ["GridBias", "OffsetBias"]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def _run_values(bias: Primitive, offsets: Tensor, reach: int | None) -> Tensor:
    """``bias`` of a run of offsets ``[W]``: ``[W, h]``, through a table of ``2 reach + 1``
    offsets when that is fewer."""
    if reach is not None and 2 * reach + 1 < offsets.numel():
        table = table_of(bias, -reach, reach, offsets.device)  # [2 reach + 1, h]
        return select_rows(table, offsets.clamp(-reach, reach) + reach)  # [W, h]
    return bias(offsets)


def _select_head(values: Tensor, h: Tensor) -> Tensor:
    """``values[..., h]``: the bias of head ``h`` from the biases of every head.

    A sum over the heads of ``where(head == h, values, 0)``, not an index: FlexAttention's
    compiled CPU kernel (torch 2.13) reads ``values[h]`` of a per-head vector computed in
    the ``score_mod`` wrongly, while it lowers the masked sum exactly (the test of the
    extending guide compiles it). Works for the 0-d indices FlexAttention traces with and
    for broadcast index tensors (its eager reference).
    """
    if values.shape[-1] == 1:
        return values[..., 0]  # shared by the heads
    heads = torch.arange(values.shape[-1], device=values.device)  # [h]
    return torch.where(heads == h.unsqueeze(-1), values, 0.0).sum(-1)


def _own_bias(scheme: OffsetBias, cls: type) -> bool:
    """Whether ``scheme`` computes its bias with a ``bias`` other than ``cls``'s (a
    subclass's, or one set on the instance)."""
    return type(scheme).bias is not cls.bias or "bias" in vars(scheme)


def _run_of(scheme: OffsetBias, q_pos: Tensor, k_pos: Tensor) -> tuple[int, int] | None:
    """``(first offset, count)`` of consecutive positions (:func:`~posenc.indices.offset_run`),
    checked by the scheme's ``check_positions``; None for other positions."""
    first = offset_run(q_pos, k_pos)
    if first is None:
        return None
    scheme.check_positions(q_pos, k_pos)
    return first, q_pos.shape[-1] + k_pos.shape[-1] - 1


#: the longest run of offsets whose buckets or bias is kept between calls (longer ones are
#: built in each call: their attention costs far more, and they would hold memory)
_KEPT_RUN = 4096


class OffsetBias(nn.Module):
    """A content-free bias of the offset alone: ``B[h, i, j] = bias(k_pos_j - q_pos_i)[h]``.

    The family of ALiBi (Press et al. 2022), T5's buckets (Raffel et al. 2020), a 1-D Swin
    table (Liu et al. 2021), Kerple (Chi et al. 2022) and most relative biases since. A
    subclass writes :meth:`bias`; this base derives:

    - :meth:`offset_bias`: one value per offset of a run of positions, which the lean
      engine spreads over the scores itself (the per-offset bias path: no ``[n_q, n_k]``
      bias is ever written);
    - :meth:`score_bias`: the dense bias for any positions;
    - :meth:`flex_score_mod`: the bias as a FlexAttention ``score_mod``;
    - :meth:`forward`: the dense bias ``[h, q_len, k_len]`` standalone;
    - ``validate_attention``: the number of heads against ``self.heads``, if set.
    """

    #: offsets beyond ``+-reach`` share the bias of ``+-reach`` (None: no such bound)
    reach: int | None = None
    #: False: a dense bias computes the primitive on every pair rather than once per
    #: distinct offset read per pair (for a primitive as cheap as that read: ALiBi's)
    tabulate: bool = True

    def bias(self, offsets: Tensor) -> Tensor:
        """The primitive: the bias of each offset.

        Args:
            offsets: integer ``[*S]``, key position minus query position.

        Returns:
            ``[*S, h]`` (or ``[*S, 1]`` shared by the heads), float.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must define bias(offsets) -> [*offsets.shape, heads], "
            f"the bias of each offset key minus query"
        )

    def check_positions(self, q_pos: Tensor, k_pos: Tensor) -> None:
        """Raise ``ValueError`` for positions the scheme has no bias for (default: none).

        Args:
            q_pos: ``[B', n_q]`` query positions.
            k_pos: ``[B', n_k]`` key positions.
        """

    def forward(self, q_len: int, k_len: int, offset: int = 0) -> Tensor:
        """The dense bias ``[h, q_len, k_len]``; queries at ``offset + arange(q_len)``.

        Raises:
            TypeError: a length or offset that is not an int.
            ValueError: a negative one.
        """
        q_pos, k_pos = lengths_positions(q_len, k_len, offset, module_device(self))
        return self.score_bias(q_pos, k_pos)[0]

    def offset_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """The bias per offset when the positions are one consecutive run.

        Args:
            q_pos: ``[B', n_q]`` query positions.
            k_pos: ``[B', n_k]`` key positions.

        Returns:
            ``[h, n_q + n_k - 1]`` with column ``m`` the bias of offset
            ``k_pos[0, 0] - q_pos[0, -1] + m`` (see :func:`~posenc.indices.offset_run`), so
            that ``score_bias == toeplitz(offset_bias)``; None for other positions.

        Raises:
            ValueError: positions :meth:`check_positions` rejects.
        """
        offsets = run_offsets(q_pos, k_pos)
        if offsets is None:
            return None
        self.check_positions(q_pos, k_pos)
        return _run_values(self.bias, offsets, self.reach).t().contiguous()  # [h, W]

    def score_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The bias for ``q_pos [B', n_q]`` and ``k_pos [B', n_k]``: ``[B', h, n_q, n_k]``.

        Consecutive positions: :meth:`offset_bias` spread along the diagonals. Others: the
        primitive on each distinct offset the positions meet, read per pair, where there
        are fewer offsets than pairs (and ``tabulate``); else on every pair.

        Raises:
            ValueError: positions :meth:`check_positions` rejects.
        """
        values = self.offset_bias(q_pos, k_pos)
        if values is not None:
            # consecutive positions: one bias per offset, spread along the diagonals
            return toeplitz(values, q_pos.shape[-1], k_pos.shape[-1]).unsqueeze(0)
        self.check_positions(q_pos, k_pos)
        offsets = relative_distance(q_pos, k_pos)  # [B', n_q, n_k]
        span = offset_span(q_pos, k_pos, self.reach) if self.tabulate else None
        # (sizes are not compared under torch.compile, where that would specialise them)
        fewer = torch.compiler.is_compiling() or (
            span is not None and span[1] - span[0] + 1 < offsets.numel()
        )
        if span is None or not fewer:
            return self.bias(offsets).permute(0, 3, 1, 2)  # [B', n_q, n_k, h] -> [B', h, ..]
        low, high = span
        table = table_of(self.bias, low, high, offsets.device)  # [R, h]
        return gather_rows(table, offsets.clamp(low, high) - low)  # [B', h, n_q, n_k]

    def flex_score_mod(self, q_pos: Tensor, k_pos: Tensor) -> ScoreMod:
        """``score + bias(k - q)[h]`` as a FlexAttention ``score_mod``.

        The primitive is tabulated on the offsets the positions meet where they are known
        (:func:`~posenc.families.offset_span`) and fewer than the pairs, and read per pair;
        otherwise it is computed per pair.

        Args:
            q_pos: ``[n_q]``, ``[1, n_q]`` (shared by the batch) or ``[b, n_q]`` positions,
                or None (the token indices).
            k_pos: ``[n_k]``, ``[1, n_k]`` or ``[b, n_k]`` positions, or None, likewise.

        Returns:
            ``score_mod(score, b, h, q_idx, kv_idx)`` for any batch size when the positions
            are shared (or None).

        Raises:
            ValueError: positions not ``[n]`` or ``[B', n]``, batch sizes that differ, or
                positions :meth:`check_positions` rejects.
            TypeError: positions that are not integers.
        """
        q_pos, k_pos, read_q, read_k = score_mod_positions(q_pos, k_pos)
        if q_pos is None or k_pos is None:  # token indices: only a reach bounds the offsets
            span = None if self.reach is None else (-self.reach, self.reach)
            pairs, device = math.inf, module_device(self)
        else:
            self.check_positions(q_pos, k_pos)
            span = offset_span(q_pos, k_pos, self.reach)
            pairs = max(q_pos.shape[0], k_pos.shape[0]) * q_pos.shape[-1] * k_pos.shape[-1]
            device = q_pos.device
        if span is not None and (self.reach is not None or span[1] - span[0] < pairs):
            low, high = span
            table = table_of(self.bias, low, high, device)  # [R, h]
            column = table[:, 0] if table.shape[-1] == 1 else None  # shared by the heads

            def table_mod(
                score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
            ) -> Tensor:
                row = (read_k(b, kv_idx) - read_q(b, q_idx)).clamp(low, high) - low
                return score + (table[row, h] if column is None else column[row])

            return table_mod
        bias = self.bias

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + _select_head(bias(read_k(b, kv_idx) - read_q(b, q_idx)), h)

        return score_mod

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention with another number of heads than ``self.heads`` (if set)."""
        check_heads(self, heads)


class GridBias(nn.Module):
    """A content-free bias of the 2-D offset between two tokens of an ``H x W`` map.

    ``B[h, i, j] = bias(r_j - r_i, c_j - c_i)[h]`` for token indices ``p = r * W + c``
    (row-major): the family of Swin's 2-D table (Liu et al. 2021). A subclass sets
    ``size = (H, W)`` and writes :meth:`bias`; this base derives :meth:`grid_bias` (the
    ``[h, 2H-1, 2W-1]`` grid of every offset, which the lean engine spreads over the
    scores itself for a whole map in order), :meth:`score_bias` and
    :meth:`flex_score_mod`.
    """

    #: ``(H, W)``, the map the token indices number
    size: tuple[int, int]

    def bias(self, rows: Tensor, cols: Tensor) -> Tensor:
        """The primitive: the bias of each 2-D offset.

        Args:
            rows: integer ``[*S]`` row offsets ``r_j - r_i`` in ``[-(H-1), H-1]``.
            cols: integer ``[*S]`` column offsets ``c_j - c_i`` in ``[-(W-1), W-1]``.

        Returns:
            ``[*S, h]`` (or ``[*S, 1]``), float.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must define bias(rows, cols) -> [*rows.shape, heads], the "
            f"bias of each 2-D offset key minus query"
        )

    def check_positions(self, q_pos: Tensor, k_pos: Tensor) -> None:
        """Raise ``ValueError`` unless the positions are token indices of the map."""
        check_cells(self.size, q_pos, k_pos)

    def grid_table(self, device: torch.device | None = None) -> Tensor:
        """The bias of every offset: ``[2H-1, 2W-1, h]``, entry ``[dr + H - 1, dc + W - 1]``."""
        height, width = self.size
        rows = torch.arange(1 - height, height, device=device)  # [2H-1]
        cols = torch.arange(1 - width, width, device=device)  # [2W-1]
        shape = (2 * height - 1, 2 * width - 1)
        return self.bias(rows[:, None].expand(shape), cols[None, :].expand(shape))

    def grid_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """The bias per 2-D offset when queries and keys are the whole map in order
        (``0 .. H*W-1``, shared by the batch): global attention over a map.

        Returns:
            ``[h, 2H-1, 2W-1]``, entry ``[h, dr + H - 1, dc + W - 1]`` the bias of a key
            ``dr`` rows and ``dc`` columns from its query, so that
            ``score_bias[0, h, i, j] = grid[h, r_j - r_i + H - 1, c_j - c_i + W - 1]``;
            None for other positions.
        """
        if not is_whole_map(q_pos, k_pos, math.prod(self.size)):
            return None
        return self.grid_table(q_pos.device).permute(2, 0, 1)  # [h, 2H-1, 2W-1]

    def score_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The bias for token indices ``q_pos [B', n_q]`` and ``k_pos [B', n_k]``.

        Returns:
            ``[B', h, n_q, n_k]``.

        Raises:
            ValueError: positions :meth:`check_positions` rejects.
        """
        self.check_positions(q_pos, k_pos)
        table = self.grid_table(q_pos.device).flatten(0, 1)  # [2H-1, 2W-1, h] -> [R, h]
        if is_whole_map(q_pos, k_pos, math.prod(self.size)):
            # every token of the map in order: the pairs' rows are a constant of its size
            return gather_rows(table, whole_map_offset_index(*self.size, q_pos.device))
        return gather_rows(table, grid_offset_index(q_pos, k_pos, self.size))

    def flex_score_mod(self, q_pos: Tensor, k_pos: Tensor) -> ScoreMod:
        """``score + bias(dr, dc)[h]`` as a FlexAttention ``score_mod``.

        Args:
            q_pos: ``[n_q]``, ``[1, n_q]`` (shared by the batch) or ``[b, n_q]`` token indices,
                or None (the indices of the tokens: the whole map in order).
            k_pos: ``[n_k]``, ``[1, n_k]`` or ``[b, n_k]``, likewise.

        Returns:
            ``score_mod(score, b, h, q_idx, kv_idx)``.

        Raises:
            ValueError: positions :meth:`check_positions` rejects, positions not ``[n]`` or
                ``[B', n]``, or batch sizes that differ.
            TypeError: positions that are not integers.
        """
        q_pos, k_pos, read_q, read_k = score_mod_positions(q_pos, k_pos)
        if q_pos is not None and k_pos is not None:
            self.check_positions(q_pos, k_pos)
        device = module_device(self) if q_pos is None else q_pos.device
        table = self.grid_table(device).flatten(0, 1)  # [R, h]
        column = table[:, 0] if table.shape[-1] == 1 else None
        height, width = self.size

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            qp, kp = read_q(b, q_idx), read_k(b, kv_idx)
            dr, dc = kp // width - qp // width, kp % width - qp % width
            row = (dr + height - 1) * (2 * width - 1) + (dc + width - 1)
            return score + (table[row, h] if column is None else column[row])

        return score_mod

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention with another number of heads than ``self.heads`` (if set)."""
        check_heads(self, heads)
