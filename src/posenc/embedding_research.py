"""Place 4, research: positions that the content sets, ``s_ij += q_i . e[p_ij]``.

- :class:`CoPE`: contextual position encoding (Golovneva et al. 2024, "Contextual Position
  Encoding: Learning to Count What's Important", arXiv 2405.18719). A query's gates
  ``sigmoid(z_ij)`` on its own logits decide which keys count; the position of key ``j`` is
  the number of keys counted from ``j`` to the query, a fraction, at which a learned table
  is read by linear interpolation.

The positions depend on ``q`` and ``k`` through the masked logits, which no position-only
hook receives: CoPE enters attention through the ``contextual_term`` hook
(:class:`~posenc.hooks.ContextualTerm`), on the math path (``backend="auto"``, ``"math"``,
``"lean"``) or SDPA's float mask (``backend="sdpa"``), never a per-offset or FlexAttention
path. The maths are the pure functions :func:`contextual_positions` and
:func:`interpolated_term`; :class:`CoPE` holds the table and calls them.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim,
``P`` the table's positions (``max_position``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import _validate as check

__all__ = ["CoPE", "contextual_positions", "interpolated_term"]


def contextual_positions(logits: Tensor, max_position: int) -> Tensor:
    """CoPE's positions: ``p_ij = min(sum_{t >= j} sigmoid(z_it), max_position - 1)``.

    Golovneva et al. 2024, section 3: the gate ``g_ij = sigmoid(q_i . k_j)`` (here of the
    scaled logit, as the paper's code computes it) says whether key ``j`` counts for query
    ``i``, and ``p_ij = sum_{t=j}^{i} g_it``. The sum runs over every key from ``j`` to the end
    of the row (the paper's ``gates.flip(-1).cumsum(-1).flip(-1)``): a masked key
    (``z = -inf``) has gate 0, so under a causal mask it runs from ``j`` to ``i``, and under
    another mask from ``j`` to the last key that the query sees. Clamped to the table's last
    position ``max_position - 1``.

    Args:
        logits: ``[..., n_q, n_k]`` the scaled logits ``z``, masked keys at ``-inf``.
        max_position: ``P``, the positions of the table (``p <= P - 1``).

    Returns:
        ``[..., n_q, n_k]`` fractional positions in ``[0, P - 1]``, float32 (float64 for
        float64 logits).
    """
    wide = torch.promote_types(logits.dtype, torch.float32)
    gates = torch.sigmoid(logits.to(wide))  # [..., n_q, n_k]: 0 at a masked key
    counts = gates.flip(-1).cumsum(dim=-1).flip(-1)  # sum over t = j .. n_k - 1
    return counts.clamp(max=max_position - 1)


def interpolated_term(q: Tensor, positions: Tensor, weight: Tensor) -> Tensor:
    """``q_i . e[p_ij]`` with the table read at a fractional position by linear interpolation.

    Golovneva et al. 2024, section 3: ``e[p] = (p - floor p) e[ceil p] + (1 - p + floor p)
    e[floor p]``, computed as the paper's code does, from the logits of each query against
    every column of the table, ``q_i . e[k]`` for integer ``k`` (``[.., n_q, P]``, not
    ``[.., n_q, n_k, d]``), read at ``floor p`` and ``ceil p``. The gradient reaches ``q``,
    the table, and ``p`` through the weight ``p - floor p`` (the indices have none).

    Args:
        q: ``[b, h, n_q, d]`` queries.
        positions: ``[b, h, n_q, n_k]`` positions in ``[0, P - 1]``
            (:func:`contextual_positions`).
        weight: ``[d, P]``, column ``k`` the embedding ``e[k]``.

    Returns:
        ``[b, h, n_q, n_k]``, float32 (float64 for float64 inputs).
    """
    wide = torch.promote_types(torch.promote_types(q.dtype, weight.dtype), positions.dtype)
    wide = torch.promote_types(wide, torch.float32)
    at_columns = q.to(wide) @ weight.to(wide)  # [b, h, n_q, P]: q_i . e[k]
    share = (positions - positions.floor()).to(wide)  # [b, h, n_q, n_k]: the weight of e[ceil p]
    # a NaN position (the gate of a NaN logit) reads column 0, and its NaN share makes the
    # term NaN (an index made of NaN would be out of range)
    index = positions.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    low = at_columns.gather(-1, index.floor().long())  # [b, h, n_q, n_k]
    high = at_columns.gather(-1, index.ceil().long())
    return high * share + low * (1 - share)


class CoPE(nn.Module):
    """Contextual position encoding (Golovneva et al. 2024, arXiv 2405.18719).

    Each query counts the keys that matter to it: the gate of key ``t`` is
    ``g_it = sigmoid(z_it)`` of the scaled, masked logit ``z_it = q_i . k_t / sqrt(d)``, the
    position of key ``j`` is ``p_ij = sum_{t >= j} g_it`` (to the query under a causal mask;
    under another mask to the last key the query sees: a masked key has gate 0), clamped to
    ``max_position - 1``, and the logit gains ``q_i . e[p_ij]``, the table ``e`` read at
    ``floor p`` and ``ceil p`` and interpolated linearly (:func:`contextual_positions`,
    :func:`interpolated_term`). The attention is ``softmax(z + q . e[p]) v``: the term is added
    to the scaled logits and not scaled itself, as in the paper's listing (its PyTorch code,
    ``attn_logits += self.cope(query, attn_logits)`` after the division by ``sqrt(d)``); the
    authors' repository (facebookresearch/RAM, ``projects/cope``) by default divides the term
    by ``sqrt(d)`` with ``q k^T`` instead (its ``--cope-nodiv`` flag gives the listing's form).

    The table ``weight [d, P]`` (the paper's ``pos_emb [1, d, P]`` without the leading 1) is
    shared by the heads, as in the paper's code, which runs the heads as a batch through one
    table per layer; each head counts with its own gates. It starts at zeros, as the paper's
    code initialises it (the term is then 0 until training moves the table). The positions
    reach ``P - 1``: ``max_position = n + 1`` covers every count of ``n`` keys (the paper's
    code takes the block size + 1); a smaller table clamps the far counts (the paper's
    experiments use small ones).

    The positions are counted from the logits alone: the token positions of the attention
    (``positions=``) are not read, so a shift of them changes nothing. It runs on the math
    path (``backend="auto"``, ``"math"``, ``"lean"``) or as SDPA's float mask
    (``backend="sdpa"``), with ``[b, h, n_q, n_k]`` memory, and decodes with a
    :class:`~posenc.KVCache` (a query's row holds every key it sees); not on FlexAttention
    (``backend="flex"``) nor as a dense ``attn_mask`` (:func:`posenc.as_attn_mask`).

    Computed in float32 (float64 for float64 inputs), cast to the logits' dtype.

    Args:
        heads: the attention's heads (checked when the attention is built; the table is
            shared by them).
        head_dim: ``d``, the head dim of the queries.
        max_position: ``P``, the positions of the table.

    Raises:
        TypeError: a non-int argument.
        ValueError: an argument < 1.
    """

    def __init__(self, heads: int, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.heads = check.positive_int("heads", heads)
        self.head_dim = check.positive_int("head_dim", head_dim)
        self.max_position = check.positive_int("max_position", max_position)
        self.weight = nn.Parameter(torch.empty(self.head_dim, self.max_position))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zeros, as the paper's code initialises ``pos_emb``."""
        nn.init.zeros_(self.weight)

    def forward(self, q: Tensor, logits: Tensor) -> Tensor:
        """The paper's ``cope(query, attn_logits)``: the term to add to the logits.

        Args:
            q: ``[b, h, n_q, d]`` queries.
            logits: ``[b, h, n_q, n_k]`` the scaled logits, masked keys at ``-inf``.

        Returns:
            ``[b, h, n_q, n_k]`` ``q_i . e[p_ij]``, in the logits' dtype.

        Raises:
            ValueError: ``q`` of another head dim, or logits whose leading dimensions
                differ from ``q``'s.
        """
        if q.ndim != 4 or q.shape[-1] != self.head_dim:
            raise ValueError(
                f"q must have shape [batch, heads, n_q, head_dim={self.head_dim}], got shape "
                f"{tuple(q.shape)}; build CoPE with the attention's head_dim"
            )
        if logits.shape[:-1] != q.shape[:-1]:
            raise ValueError(
                f"logits must have shape [batch, heads, n_q, n_k] with q's {tuple(q.shape[:-1])}"
                f" first, got shape {tuple(logits.shape)}: the scaled q k^T of these queries"
            )
        positions = contextual_positions(logits, self.max_position)  # [b, h, n_q, n_k]
        return interpolated_term(q, positions, self.weight).to(logits.dtype)

    def contextual_term(self, logits: Tensor, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The ``contextual_term`` hook (:class:`~posenc.hooks.ContextualTerm`): the term of
        :meth:`forward`; the token positions are not read. ``[b, h, n_q, n_k]``."""
        return self(q, logits)

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention of other heads or another head dim.

        Raises:
            ValueError: naming what differs and the fix.
        """
        for name, built, got in (
            ("heads", self.heads, heads),
            ("head_dim", self.head_dim, head_dim),
        ):
            if built != got:
                raise ValueError(
                    f"CoPE was built for {name}={built} but the attention has {name}={got}; "
                    f"build it with {name}={got}"
                )

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, max_position={self.max_position}"
