"""Place 5: relation-aware attention, relative positions in keys and values.

Shaw, Uszkoreit and Vaswani 2018, "Self-Attention with Relative Position
Representations". Each pair (query ``i``, key ``j``) gets two learned vectors of the
clipped offset, ``a^K_ij = keys[clip(j - i, -k, k) + k]`` and ``a^V_ij = values[...]``
(equations 3-4 and 5-6 of the paper)::

    e_ij  = q_i . (k_j + a^K_ij) / sqrt(d)
    z_i   = sum_j alpha_ij (v_j + a^V_ij),       alpha = softmax_j(e)

so the attention adds ``q_i . a^K_ij`` to ``q k^T`` before the scaling (a score term) and
``sum_j alpha_ij a^V_ij`` to ``alpha v`` (a value term).

Two implementations that agree (tests/test_shaw.py):

- literal (:func:`shaw_key_term_literal`, :func:`shaw_value_term_literal`): build
  ``a^K, a^V [n_q, n_k, d]`` as in the paper and contract them; readable, memory
  ``O(n_q n_k d)``. Used by ``backend="math"`` through ``reference_score_term`` /
  ``reference_value_term``.
- lean (:func:`shaw_key_term`, :func:`shaw_value_term`): only ``2k + 1`` distinct vectors
  exist, so ``q @ keys^T`` (``[b, h, n_q, 2k+1]``) gathered by the clipped offset gives the
  key term, and the weights summed per clipped offset (``[b, h, n_q, 2k+1]``) times
  ``values`` give the value term. (The paper's section 3.3 splits the key term out of
  ``q k^T`` too, but still materialises ``a^K [n, n, d]``.) Memory ``O(n_q (n_k + k))``; an
  ``[n_q, n_k, d]`` tensor only for a value term without gradients, where it is no larger
  than the weights (:func:`shaw_value_term`).

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim,
``B'`` the batch of the positions (1 when shared, else ``b``), ``k`` the clipping
distance, ``R = 2k + 1`` table rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _validate as check
from .engine import tuning
from .families import OffsetTerm, check_queries, hook_positions
from .indices import clipped_distance, gather_logits, select_rows

__all__ = [
    "ShawRelativePosition",
    "clipped_rows",
    "shaw_attention",
    "shaw_key_term",
    "shaw_key_term_literal",
    "shaw_value_term",
    "shaw_value_term_literal",
]


def _max_distance(table: Tensor) -> int:
    """``k`` of a ``[2k+1, d]`` table."""
    return (table.shape[-2] - 1) // 2


def clipped_rows(table: Tensor, offsets: Tensor) -> Tensor:
    """Shaw's vector of each offset: ``table[clip(offset, -k, k) + k]``.

    Args:
        table: ``[2k+1, d]``, ``w^K`` or ``w^V``.
        offsets: integer ``[*S]``, ``j - i``.

    Returns:
        ``[*S, d]``.
    """
    k = _max_distance(table)
    return select_rows(table, offsets.clamp(-k, k) + k)


def _check_table(name: str, table: object) -> Tensor:
    check.floating(name, table)
    if table.ndim != 2 or table.shape[0] % 2 == 0:  # type: ignore[union-attr]
        raise ValueError(
            f"{name} must have shape [2k+1, d] (one row per clipped offset -k..k), got shape "
            f"{tuple(table.shape)}"  # type: ignore[union-attr]
        )
    return table  # type: ignore[return-value]


def _check_weights(weights: object, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
    """``weights [b, h, n_q, n_k]`` and the positions of its rows and columns."""
    check.floating("weights", weights)
    if weights.ndim != 4:  # type: ignore[union-attr]
        raise ValueError(
            f"weights must be the attention probabilities [b, h, n_q, n_k], got shape "
            f"{tuple(weights.shape)}"  # type: ignore[union-attr]
        )
    q_pos, k_pos = hook_positions(weights, q_pos, k_pos)  # type: ignore[arg-type]
    if k_pos.shape[-1] != weights.shape[-1]:  # type: ignore[union-attr]
        raise ValueError(
            f"k_pos must have one position per key: weights have n_k={weights.shape[-1]} "  # type: ignore[union-attr]
            f"columns, k_pos has shape {tuple(k_pos.shape)}"
        )
    return q_pos, k_pos


# ----- literal: the paper's a^K_ij and a^V_ij -------------------------------------------------


def _pair_table(table: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``a_ij = table[clip(k_pos_j - q_pos_i, -k, k) + k]``.

    Returns:
        ``[n_q, n_k, d]`` when the positions are shared (``B' = 1``), else ``[b, n_q, n_k, d]``.
    """
    return _pairs_at(table, clipped_distance(q_pos, k_pos, _max_distance(table)))


def _pairs_at(table: Tensor, rows: Tensor) -> Tensor:
    """``table[rows]`` for the clipped rows ``[B', n_q, n_k]`` of :func:`_pair_table`:
    ``[n_q, n_k, d]`` when ``B' = 1``, else ``[b, n_q, n_k, d]``."""
    pairs = F.embedding(rows, table)  # [B', n_q, n_k, d]
    return pairs[0] if pairs.shape[0] == 1 else pairs  # [n_q, n_k, d] or [b, n_q, n_k, d]


def shaw_key_term_literal(q: Tensor, keys: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``q_i . a^K_ij``, building ``a^K [n_q, n_k, d]`` as the paper writes it (eq. 4).

    Args:
        q: ``[b, h, n_q, d]``.
        keys: ``[2k+1, d]`` the key table ``w^K``.
        q_pos: ``[B', n_q]`` int64 query positions (any integers).
        k_pos: ``[B', n_k]`` int64 key positions.

    Returns:
        ``[b, h, n_q, n_k]`` (unscaled: the attention divides by ``sqrt(d)``).
    """
    a_k = _pair_table(keys, q_pos, k_pos).to(q.dtype)  # [(b,) n_q, n_k, d]
    if a_k.ndim == 3:
        return torch.einsum("bhid,ijd->bhij", q, a_k)
    return torch.einsum("bhid,bijd->bhij", q, a_k)


def shaw_value_term_literal(
    weights: Tensor, values: Tensor, q_pos: Tensor, k_pos: Tensor
) -> Tensor:
    """``sum_j alpha_ij a^V_ij``, building ``a^V [n_q, n_k, d]`` as the paper writes it (eq. 3).

    Args:
        weights: ``[b, h, n_q, n_k]`` attention probabilities ``alpha``.
        values: ``[2k+1, d]`` the value table ``w^V``.
        q_pos: ``[B', n_q]`` int64 query positions.
        k_pos: ``[B', n_k]`` int64 key positions.

    Returns:
        ``[b, h, n_q, d]``.
    """
    return _weighted_pairs(weights, _pair_table(values, q_pos, k_pos))


def _weighted_pairs(weights: Tensor, a_v: Tensor) -> Tensor:
    """``sum_j alpha_ij a^V_ij`` from ``weights [b, h, n_q, n_k]`` and the pairs' vectors
    ``a_v [(b,) n_q, n_k, d]`` (as :func:`_pair_table` gives them): ``[b, h, n_q, d]``."""
    a_v = a_v.to(weights.dtype)
    if a_v.ndim == 3:
        return torch.einsum("bhij,ijd->bhid", weights, a_v)
    return torch.einsum("bhij,bijd->bhid", weights, a_v)


# ----- lean: 2k+1 distinct vectors (a^V [n, n, d] only without a graph) ----------------------


def shaw_key_term(q: Tensor, keys: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``q_i . a^K_ij`` as ``q @ keys^T`` gathered by the clipped offset.

    Equal to :func:`shaw_key_term_literal`; memory ``O(n_q (2k + 1 + n_k))``.

    Args:
        q: ``[b, h, n_q, d]``.
        keys: ``[2k+1, d]``.
        q_pos: ``[B', n_q]`` int64 query positions (any integers).
        k_pos: ``[B', n_k]`` int64 key positions.

    Returns:
        ``[b, h, n_q, n_k]`` (unscaled).
    """
    rows = clipped_distance(q_pos, k_pos, _max_distance(keys))  # [B', n_q, n_k]
    logits = q @ keys.to(q.dtype).transpose(-2, -1)  # [b, h, n_q, d] @ [d, 2k+1]
    return gather_logits(logits, rows)  # [b, h, n_q, n_k]


def shaw_value_term(weights: Tensor, values: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``sum_j alpha_ij a^V_ij`` as (weights summed per clipped offset) ``@ values``.

    ``sum_j alpha_ij values[r_ij] = sum_r (sum_{j: r_ij = r} alpha_ij) values[r]``: the
    weights are added into ``2k + 1`` bins with ``scatter_add_``, then one matmul. Equal to
    :func:`shaw_value_term_literal`; memory ``O(n_q (2k + 1 + n_k))``.

    Where no graph is recorded (no gradient asked for) and the pairs' vectors
    ``a^V [B', n_q, n_k, d]`` are no larger than the weights (``B' d <= b h``) and at most
    :data:`~posenc.engine.tuning.SHAW_PAIR_VALUES` elements, the literal form runs
    instead: one product per query over the batch and heads, with no ``scatter_add_``
    (whose CPU kernel reads the index element by element), and no more memory than the
    weights already take. With a graph the bins stay: the literal form's backward would
    contract the weights' gradient into ``[n_q, n_k, d]`` once more.

    Args:
        weights: ``[b, h, n_q, n_k]``.
        values: ``[2k+1, d]``.
        q_pos: ``[B', n_q]`` int64 query positions.
        k_pos: ``[B', n_k]`` int64 key positions.

    Returns:
        ``[b, h, n_q, d]``.
    """
    b, h, n_q, n_k = weights.shape
    rows = clipped_distance(q_pos, k_pos, _max_distance(values))  # [B', n_q, n_k]
    records = torch.is_grad_enabled() and (weights.requires_grad or values.requires_grad)
    elements = rows.numel() * values.shape[-1]  # a^V's
    if not records and elements <= min(weights.numel(), tuning.SHAW_PAIR_VALUES):
        return _weighted_pairs(weights, _pairs_at(values.to(weights.dtype), rows))
    rows = rows.unsqueeze(1).expand(b, h, n_q, n_k)  # [B', n_q, n_k] -> [b, h, n_q, n_k]
    bins = weights.new_zeros(b, h, n_q, values.shape[-2])  # [b, h, n_q, 2k+1]
    bins = bins.scatter_add_(-1, rows, weights)
    return bins @ values.to(weights.dtype)  # [b, h, n_q, 2k+1] @ [2k+1, d]


def shaw_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keys: Tensor,
    values: Tensor | None,
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    literal: bool = False,
) -> Tensor:
    """Relation-aware self-attention (Shaw et al. 2018, eqs. 3-4), no mask.

    ``softmax((q k^T + q a^K) / sqrt(d)) (v + a^V)``, with the lean terms or, when
    ``literal``, the paper's ``[n_q, n_k, d]`` tensors.

    Args:
        q: ``[b, h, n_q, d]``.
        k: ``[b, h, n_k, d]``.
        v: ``[b, h, n_k, d]``.
        keys: ``[2k+1, d]``.
        values: ``[2k+1, d]``, or None for relative keys only.
        q_pos: ``[B', n_q]`` int64 query positions.
        k_pos: ``[B', n_k]`` int64 key positions.
        literal: use the literal terms instead of the lean ones.

    Returns:
        ``[b, h, n_q, d]``.
    """
    key_term = shaw_key_term_literal if literal else shaw_key_term
    value_term = shaw_value_term_literal if literal else shaw_value_term
    scores = (q @ k.transpose(-2, -1) + key_term(q, keys, q_pos, k_pos)) * q.shape[-1] ** -0.5
    weights = scores.softmax(dim=-1)  # [b, h, n_q, n_k]
    out = weights @ v  # [b, h, n_q, d]
    if values is not None:
        out = out + value_term(weights, values, q_pos, k_pos)
    return out


class ShawRelativePosition(OffsetTerm):
    """Relative position representations in keys and values (Shaw et al. 2018).

    Parameters ``keys`` and ``values`` (``w^K`` and ``w^V`` of the paper), each
    ``[2k+1, head_dim]`` with ``k = max_distance``, row ``clip(j - i, -k, k) + k``, shared by
    all heads as in the paper (section 3.3). Offsets beyond ``k``
    share the edge rows, so any positions work and there is no length limit.

    Initialisation: ``N(0, 1/head_dim)`` (std ``head_dim**-0.5``), like the place-4 tables,
    so ``q . a^K`` starts at the scale of ``q . k``. The paper states no initialiser;
    tensor2tensor creates the table with ``tf.get_variable`` and no initializer of its own,
    so it takes the model-wide default (a unit-scaling / Glorot-style uniform).

    Hooks: ``score_term`` (lean key term) and ``reference_score_term`` (literal) always;
    ``value_term`` and ``reference_value_term`` only when ``values=True``. With
    ``values=False`` they are absent: ``hasattr(scheme, "value_term")`` is False and
    ``getattr(scheme, "value_term", None)`` is None, exactly as for a scheme that never
    defined them. They are properties that raise ``AttributeError`` then; this keeps one
    class, keeps the hook a real method when present, and works under ``torch.compile``.

    Standalone, ``forward(q, k, v)`` is the paper's relation-aware attention (no mask).
    Inside :class:`~posenc.MultiHeadAttention` the key term is scaled by ``1/sqrt(head_dim)``
    together with ``q k^T`` (the attention does that).

    Args:
        head_dim: the per-head width ``d``.
        max_distance: the clipping distance ``k`` >= 1 (the paper finds ``k >= 2`` enough).
        values: also learn ``a^V`` (the full method); False: relative keys only.

    Raises:
        ValueError: ``head_dim`` or ``max_distance`` < 1.
        TypeError: a non-int size or a non-bool ``values``.
    """

    def __init__(self, head_dim: int, max_distance: int, *, values: bool = True) -> None:
        super().__init__()
        self.head_dim = check.positive_int("head_dim", head_dim)
        self.max_distance = check.positive_int(
            "max_distance", max_distance, hint=" (the clipping distance k of Shaw et al.)"
        )
        if not isinstance(values, bool):
            raise TypeError(f"values must be a bool, got {values!r}")
        self.has_values = values
        rows = 2 * max_distance + 1
        self.keys = nn.Parameter(torch.empty(rows, head_dim))
        if values:
            self.values = nn.Parameter(torch.empty(rows, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the tables from ``N(0, 1/head_dim)``."""
        nn.init.normal_(self.keys, std=self.head_dim**-0.5)
        if self.has_values:
            nn.init.normal_(self.values, std=self.head_dim**-0.5)

    # ----- hooks ------------------------------------------------------------------------

    @property
    def reach(self) -> int:  # type: ignore[override]
        """``k``: offsets beyond it share the edge rows."""
        return self.max_distance

    def rows(self, offsets: Tensor) -> Tensor:
        """``a^K`` of each offset, ``w^K[clip(j - i, -k, k) + k]``: the family's primitive
        (:class:`~posenc.families.OffsetTerm` derives the key hook ``score_term``, lean,
        and ``offset_term``).

        Args:
            offsets: integer ``[*S]``.

        Returns:
            ``[*S, head_dim]``.
        """
        return clipped_rows(self.keys, offsets)

    def value_rows(self, offsets: Tensor) -> Tensor:
        """``a^V`` of each offset, ``w^V[clip(j - i, -k, k) + k]`` (``values=True`` only).

        Args:
            offsets: integer ``[*S]``.

        Returns:
            ``[*S, head_dim]``.
        """
        return clipped_rows(self.values, offsets)

    def reference_score_term(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The key hook, literal (``a^K [n_q, n_k, d]``), for ``backend="math"``."""
        q = check_queries(q, self.head_dim)
        q_pos, k_pos = hook_positions(q, q_pos, k_pos)
        return shaw_key_term_literal(q, self.keys, q_pos, k_pos)

    def _value_term(self, weights: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The value hook (lean): ``sum_j alpha_ij a^V_ij``, ``[b, h, n_q, d]``.

        Args:
            weights: ``[b, h, n_q, n_k]`` attention probabilities.
            q_pos: ``[B', n_q]`` query positions.
            k_pos: ``[B', n_k]`` key positions.

        Returns:
            ``[b, h, n_q, d]``, added to ``weights @ v``.
        """
        q_pos, k_pos = _check_weights(weights, q_pos, k_pos)
        return shaw_value_term(weights, self.values, q_pos, k_pos)

    def _reference_value_term(self, weights: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The value hook, literal (``a^V [n_q, n_k, d]``), for ``backend="math"``."""
        q_pos, k_pos = _check_weights(weights, q_pos, k_pos)
        return shaw_value_term_literal(weights, self.values, q_pos, k_pos)

    @property
    def value_term(self) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """The value hook ``value_term(weights, q_pos, k_pos)``; absent when ``values=False``."""
        if not self.has_values:
            raise AttributeError("value_term: built with values=False (relative keys only)")
        return self._value_term

    @property
    def reference_value_term(self) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """The literal value hook; absent when ``values=False``."""
        if not self.has_values:
            raise AttributeError("reference_value_term: built with values=False")
        return self._reference_value_term

    @property
    def offset_value(self) -> Callable[[Tensor, Tensor], Tensor | tuple[Tensor, Tensor] | None]:
        """``offset_value(q_pos, k_pos)``: ``a^V`` per offset as :meth:`offset_term` gives
        ``a^V``'s rows, indexed alike (the value term is ``unskew(weights) @ rows``);
        absent when ``values=False``."""
        if not self.has_values:
            raise AttributeError("offset_value: built with values=False (relative keys only)")
        return self._offset_value

    def _offset_value(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | tuple[Tensor, Tensor] | None:
        """:attr:`offset_value`'s hook: ``a^V``'s rows for a run of positions, or its table and
        an index (:meth:`~posenc.families.OffsetTerm.offset_form`), or None."""
        return self.offset_form(self.value_rows, q_pos, k_pos)

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention whose head dim differs from ``head_dim`` (tables are shared
        by the heads, so any number of heads fits)."""
        if head_dim != self.head_dim:
            raise ValueError(
                f"ShawRelativePosition was built for head_dim={self.head_dim} but the attention "
                f"has head_dim={head_dim} (dim / heads); build ShawRelativePosition({head_dim}, "
                f"{self.max_distance})"
            )

    # ----- standalone -------------------------------------------------------------------

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        q_pos: Tensor | None = None,
        k_pos: Tensor | None = None,
    ) -> Tensor:
        """Relation-aware attention, no mask (lean terms).

        Args:
            q: ``[b, h, n_q, d]``.
            k: ``[b, h, n_k, d]``.
            v: ``[b, h, n_k, d]``.
            q_pos: ``[n_q]`` or ``[b, n_q]`` positions; default ``arange(n_q)``.
            k_pos: ``[n_k]`` or ``[b, n_k]`` positions; default ``arange(n_k)``.

        Returns:
            ``[b, h, n_q, d]``.

        Raises:
            ValueError: shapes that do not fit (each message names the argument).
        """
        q = check_queries(q, self.head_dim)
        k = check_queries(k, self.head_dim, "k")
        v = check_queries(v, self.head_dim, "v")
        if k.shape != v.shape or k.shape[:2] != q.shape[:2]:
            raise ValueError(
                f"k and v must have shape [b, h, n_k, d] matching q's b and h, got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if q_pos is None:
            q_pos = torch.arange(q.shape[-2], device=q.device)
        if k_pos is None:
            k_pos = torch.arange(k.shape[-2], device=k.device)
        q_pos, k_pos = hook_positions(q, q_pos, k_pos)
        hook_positions(k, k_pos, k_pos)  # k_pos must cover n_k
        values = self.values if self.has_values else None
        return shaw_attention(q, k, v, self.keys, values, q_pos, k_pos)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, max_distance={self.max_distance}, values={self.has_values}"
        )
