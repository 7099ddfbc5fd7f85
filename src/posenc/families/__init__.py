"""Scheme families: a relative scheme written as one primitive, every hook derived from it.

Most schemes of places 3-5 are a function of where a key lies relative to its query.
Such a scheme subclasses the base of its family and writes one method, the primitive;
the base derives every hook of :class:`~posenc.MultiHeadAttention` from it, the forms the
fast paths of ``backend="auto"`` read included (docs/extending.md has a complete example):

- :class:`OffsetBias`: ``bias(offsets [*S]) -> [*S, h | 1]``, the bias of an offset;
  derives ``offset_bias`` (the per-offset bias path), ``score_bias``,
  ``flex_score_mod`` and ``forward``;
- :class:`GridBias`: ``bias(rows [*S], cols [*S]) -> [*S, h | 1]``, the bias of a 2-D
  offset; derives ``grid_bias`` (the grid bias path), ``score_bias`` and
  ``flex_score_mod``;
- :class:`OffsetTerm`: ``rows(offsets [*S]) -> [(h,) *S, d]``, the embedding of an
  offset; derives ``offset_term`` (the offset term path) and ``score_term``;
- :class:`GridTerm`: ``axis_rows(axis, offsets [*S]) -> [(h,) *S, d]``, the embedding of
  a row (axis 0) or column (axis 1) offset; derives ``grid_term`` (the grid term path) and
  ``score_term``.

An offset is key minus query, ``j - i`` (Shaw et al. 2018, Raffel et al. 2020); on a
row-major ``H x W`` map it is ``(r_j - r_i, c_j - c_i)``. A bias is content-free (place
3, added after the ``1/sqrt(d)`` scaling), one value per head in the last dimension
(``1`` for a bias shared by the heads), the layout of a ``[rows, heads]`` table. A term
is ``q_i . r`` (places 4 and 5, scaled with ``q k^T``) with ``r`` the row the primitive gives,
``[*S, d]`` shared by the heads or ``[h, *S, d]`` per head, the layout of a
``[(h,) rows, d]`` table.

A subclass may also set:

- ``reach``: offsets beyond ``+-reach`` share the value at ``+-reach`` (T5's
  ``max_distance``, Shaw's clipping distance, the rows of a table): the base then
  tabulates the primitive on ``2 * reach + 1`` offsets at most, however long the sequence;
- ``check_positions(q_pos, k_pos)``: raise ``ValueError`` for positions the scheme has
  no value for (a table too short); every derived hook calls it first;
- ``tabulate = False`` (biases): a dense bias computes the primitive on every pair, not
  once per distinct offset read per pair, for a primitive as cheap as that read (ALiBi).

The primitive takes integer offsets of any shape and must be differentiable in the
scheme's parameters and free of Python branches on tensor values: FlexAttention calls it
on single offsets under ``vmap``. It is computed once per distinct offset where that is
cheaper (a table over the offsets the positions meet, read per pair).

A subclass must not override a derived hook alone: the engine then drops the fast forms
it inherits (a steeper ``score_bias`` does not run on the parent's ``offset_bias``).

Shape legend: ``b`` batch, ``h`` heads (``1`` when shared), ``n_q`` queries, ``n_k`` keys,
``d`` head dim, ``B'`` the batch of the positions (1 when shared, else ``b``), ``S`` any
shape of offsets, ``W = n_q + n_k - 1`` the offsets of a run of positions, ``R`` rows of
a table, ``H x W`` a map (2-D families).
"""

from .biases import GridBias, OffsetBias
from .common import (
    check_queries,
    hook_positions,
    lengths_positions,
    map_size,
    offset_span,
)
from .terms import (
    GridTerm,
    OffsetTerm,
    offset_term_literal,
    offset_term_logits,
    relative_query_term_2d,
    table_logits,
)

__all__ = [
    "GridBias",
    "GridTerm",
    "OffsetBias",
    "OffsetTerm",
    "check_queries",
    "hook_positions",
    "lengths_positions",
    "map_size",
    "offset_span",
    "offset_term_literal",
    "offset_term_logits",
    "relative_query_term_2d",
    "table_logits",
]
