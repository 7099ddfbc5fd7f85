"""Which keys each query may see, kept factorised (no ``[n_q, n_k]`` tensor until a block
of rows asks for one).

Shape legend: ``b`` batch, ``n_q`` queries, ``n_k`` keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Mask:
    """Which keys each query may attend to, kept factorised so that any block of query
    rows can be built without an ``[n_q, n_k]`` tensor for the whole sequence.

    A key is visible to a query when every given condition allows it.

    Attributes:
        n_q: number of queries.
        n_k: number of keys.
        key_padding: ``[b, n_k]`` bool, True = padding (PyTorch's convention), or None.
        lengths: ``[b, n_q]`` int64: key ``j`` is visible to query ``i`` iff
            ``j < lengths[b, i]`` (d2l's ``valid_lens``), or None.
        causal: query ``i`` sees keys ``j <= i + n_k - n_q`` (aligned at the end).
        q_doc: ``[b, n_q]`` document id of each query (packed sequences), or None.
        k_doc: ``[b, n_k]`` document id of each key; a query sees only its document.
    """

    n_q: int
    n_k: int
    key_padding: Tensor | None = None
    lengths: Tensor | None = None
    causal: bool = False
    q_doc: Tensor | None = None
    k_doc: Tensor | None = None

    @property
    def empty(self) -> bool:
        """True when nothing is masked."""
        return (
            self.key_padding is None
            and self.lengths is None
            and not self.causal
            and self.q_doc is None
        )

    def keep(self, rows: slice | None = None, device: torch.device | None = None) -> Tensor | None:
        """The boolean mask ``[b or 1, 1, n_rows, n_k]`` (True = attend) for query ``rows``.

        Returns None when nothing is masked.
        """
        if self.empty:
            return None
        start, stop = (0, self.n_q) if rows is None else (rows.start or 0, rows.stop)
        keep: Tensor | None = None

        def both(a: Tensor | None, b: Tensor) -> Tensor:
            return b if a is None else a & b

        if self.causal:
            q_idx = torch.arange(start, stop, device=device)  # [n_rows]
            k_idx = torch.arange(self.n_k, device=device)  # [n_k]
            keep = (k_idx[None, :] <= q_idx[:, None] + (self.n_k - self.n_q))[None, None]
        if self.lengths is not None:
            k_idx = torch.arange(self.n_k, device=self.lengths.device)
            visible = k_idx[None, None, :] < self.lengths[:, start:stop, None]  # [b, n_rows, n_k]
            keep = both(keep, visible[:, None])
        if self.key_padding is not None:
            keep = both(keep, ~self.key_padding[:, None, None, :])  # [b, 1, 1, n_k]
        if self.q_doc is not None and self.k_doc is not None:
            same = self.q_doc[:, start:stop, None] == self.k_doc[:, None, :]  # [b, n_rows, n_k]
            keep = both(keep, same[:, None])
        return keep

    def flex_mask_mod(self) -> Callable[..., Tensor]:
        """The same mask as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``."""
        offset = self.n_k - self.n_q
        causal, lengths, padding = self.causal, self.lengths, self.key_padding
        q_doc, k_doc = self.q_doc, self.k_doc

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            keep = kv_idx >= 0
            if causal:
                keep = keep & (kv_idx <= q_idx + offset)
            if lengths is not None:
                keep = keep & (kv_idx < lengths[b, q_idx])
            if padding is not None:
                keep = keep & ~padding[b, kv_idx]
            if q_doc is not None and k_doc is not None:
                keep = keep & (q_doc[b, q_idx] == k_doc[b, kv_idx])
            return keep

        return mask_mod
