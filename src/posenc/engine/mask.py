"""Which keys each query may see, kept factorised (no ``[n_q, n_k]`` tensor until a block
of rows asks for one).

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._memo import eager, memo
from . import tuning


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
        causal: query ``i`` sees keys ``j <= i + n_k - n_q`` (aligned at the end). Over
            at most one query and without a window it hides no key (the one query sees
            every key: a decoding step) and is dropped: such a mask holds False, so that
            the paths take the call as one without it (a causal window keeps it: the
            paths that cut a window in blocks read it).
        q_doc: ``[b, n_q]`` document id of each query (packed sequences), or None.
        k_doc: ``[b, n_k]`` document id of each key; a query sees only its document.
        behind: query ``i`` sees keys ``j > i + n_k - n_q - behind`` (a sliding window,
            aligned at the end as ``causal``), or None. May be <= 0 inside the engine (a
            block of rows cut from a larger call).
        ahead: query ``i`` sees keys ``j < i + n_k - n_q + ahead``, or None (the other
            side of a window without ``causal``).
        allowed: ``[b|1, h|1, n_q|1, n_k|1]`` bool, True = attend (SDPA's convention), or
            None.
        bias: ``[b|1, h|1, n_q|1, n_k|1]`` float added to the scaled scores (finite: its
            ``-inf`` entries are in ``allowed``), or None.
    """

    n_q: int
    n_k: int
    key_padding: Tensor | None = None
    lengths: Tensor | None = None
    causal: bool = False
    q_doc: Tensor | None = None
    k_doc: Tensor | None = None
    behind: int | None = None
    ahead: int | None = None
    allowed: Tensor | None = None
    bias: Tensor | None = None

    def __post_init__(self) -> None:
        if self.causal and self.n_q <= 1 and self.behind is None and self.ahead is None:
            object.__setattr__(self, "causal", False)  # one query at the end sees every key

    @property
    def hides_pairs(self) -> bool:
        """Whether the causal mask hides a pair: ``causal`` over more than one query (one
        query under a causal window keeps the flag, but sees every key the window leaves)."""
        return self.causal and self.n_q > 1

    @property
    def empty(self) -> bool:
        """True when nothing is masked nor added."""
        return not self.causal and self.causal_at_most

    @property
    def causal_at_most(self) -> bool:
        """True when nothing is masked nor added but, perhaps, the causal mask."""
        return (
            self.key_padding is None
            and self.lengths is None
            and self.q_doc is None
            and self.behind is None
            and self.ahead is None
            and self.allowed is None
            and self.bias is None
        )

    @property
    def dense(self) -> bool:
        """True when the caller gave an ``attn_mask`` (a tensor the size of the scores)."""
        return self.allowed is not None or self.bias is not None

    def added(self, rows: slice | None = None) -> Tensor | None:
        """The float ``bias`` for query ``rows``: ``[b|1, h|1, n_rows, n_k]`` (a view), or None."""
        if self.bias is None:
            return None
        start, stop = (0, self.n_q) if rows is None else (rows.start or 0, rows.stop)
        bias = _rows_of(self.bias, rows)  # [b|1, h|1, n_rows|1, n_k|1]
        return bias.expand(*bias.shape[:2], stop - start, self.n_k)

    def keep(self, rows: slice | None = None, device: torch.device | None = None) -> Tensor | None:
        """The boolean mask ``[b|1, h|1, n_rows|1, n_k]`` (True = attend) for query ``rows``
        (heads only with a per-head ``allowed``, one row for key padding alone): a tensor
        of the caller's own.

        Returns None when nothing is masked.
        """
        return self._keep(rows, device, _band)

    def shared_keep(
        self, rows: slice | None = None, device: torch.device | None = None
    ) -> Tensor | None:
        """:meth:`keep` to read only, for the engine: a causal or window band alone (on the
        CPU, at most :data:`_KEPT_BAND` pairs) is a tensor kept between calls and shared by
        every call of its sizes (:func:`_kept_band`: a dozen small kernel calls fewer)."""
        return self._keep(rows, device, _kept_band)

    def filled(
        self, x: Tensor, keep: Tensor, fill: float, *, in_place: bool, finite: bool | None = None
    ) -> Tensor:
        """``x [b|1, h|1, n_q, n_k]`` with the keys ``keep`` hides at ``fill``, as
        ``x.masked_fill(~keep, fill)`` (``masked_fill_`` where ``in_place``) gives it, to
        the bit.

        Where ``keep`` is the causal or window band alone that :meth:`shared_keep` keeps
        (the tensor it returned for every row; at most :data:`_KEPT_BAND_FLOATS` pairs;
        on the CPU, eager, no graph recorded for ``x``, at least
        :data:`~.tuning.FILLED_ELEMENTS` elements of it), ``fill`` is ``-inf`` or the
        dtype's lowest and every element of ``x`` is finite (its sum is: one reduction),
        it is one ``addcmul`` with float forms of the band kept between calls: ``-0.0 + x
        * 1`` where it keeps (``x``, each bit: ``-0.0`` is the sum's identity) and ``fill
        + x * 0`` where it hides (``fill``). The bool form reads its mask one element at
        a time, several times slower on the CPU (docs/performance.md, "Twenty-fifth
        pass"). A sum that is not finite (a NaN or infinite score, or finite ones past the
        dtype's range together) takes ``masked_fill``. ``finite``: that sum's answer where
        the caller has read it (:meth:`finite_sum`), else None."""
        floats = self._band_floats(x, keep, fill)
        if floats is not None and (self.finite_sum(x) if finite is None else finite):
            keep_f, fill_t = floats.unbind(0)  # [1, 1, n_q, n_k] each
            return torch.addcmul(fill_t, x, keep_f, out=x if in_place else None)
        return x.masked_fill_(~keep, fill) if in_place else x.masked_fill(~keep, fill)

    @staticmethod
    def finite_sum(x: Tensor) -> bool:
        """Whether the sum of ``x`` is finite: False where an element is a NaN or an
        infinity, or where finite ones sum past the dtype's range (one reduction, one
        sync)."""
        return math.isfinite(x.sum().item())

    def _band_floats(self, x: Tensor, keep: Tensor, fill: float) -> Tensor | None:
        """``[2, 1, 1, n_q, n_k]`` in ``x``'s dtype, the band as 1 / 0 and as -0.0 / ``fill``
        (kept between calls), where :meth:`filled` may use them; else None."""
        if not (  # (eager first: a traced size compared would be a guard on it)
            eager()
            and self.band_alone
            and x.is_cpu
            and x.is_floating_point()
            and (fill == -math.inf or fill == torch.finfo(x.dtype).min)
            and x.numel() >= tuning.FILLED_ELEMENTS
            and self.n_q * self.n_k <= _KEPT_BAND_FLOATS
            and not (x.requires_grad and torch.is_grad_enabled())
            and keep is self.shared_keep(device=x.device)  # the kept band itself
        ):
            return None
        band = (self.n_k - self.n_q, self.n_q, self.n_k, self.causal, self.behind, self.ahead)
        return _kept_band_floats(band, x.dtype, fill)

    @property
    def band_alone(self) -> bool:
        """True when the mask is a causal or window band and nothing else (no padding,
        lengths, documents, ``attn_mask``)."""
        return (
            (self.causal or self.behind is not None or self.ahead is not None)
            and self.key_padding is None
            and self.lengths is None
            and self.q_doc is None
            and self.allowed is None
            and self.bias is None
        )

    def _keep(
        self, rows: slice | None, device: torch.device | None, kept: Callable[..., Tensor]
    ) -> Tensor | None:
        if self.empty:
            return None
        start, stop = (0, self.n_q) if rows is None else (rows.start or 0, rows.stop)
        keep: Tensor | None = None

        def both(a: Tensor | None, b: Tensor) -> Tensor:
            return b if a is None else a & b

        if self.causal or self.behind is not None or self.ahead is not None:
            device = None if device is None else torch.device(device)  # one key for "cpu"
            on_cpu = device is None or device.type == "cpu"
            band = kept if on_cpu and (stop - start) * self.n_k <= _KEPT_BAND else _band
            keep = band(
                start + self.n_k - self.n_q, stop - start, self.n_k, self.causal, self.behind,
                self.ahead, device,
            )  # fmt: skip
        if self.lengths is not None:
            k_idx = torch.arange(self.n_k, device=self.lengths.device)
            visible = k_idx[None, None, :] < self.lengths[:, start:stop, None]  # [b, n_rows, n_k]
            keep = both(keep, visible[:, None])
        if self.key_padding is not None:
            keep = both(keep, ~self.key_padding[:, None, None, :])  # [b, 1, 1, n_k]
        if self.q_doc is not None and self.k_doc is not None:
            same = self.q_doc[:, start:stop, None] == self.k_doc[:, None, :]  # [b, n_rows, n_k]
            keep = both(keep, same[:, None])
        if self.allowed is not None:
            allowed = _rows_of(self.allowed, rows).to(device)  # [b|1, h|1, n_rows|1, n_k|1]
            keep = allowed if keep is None else keep & allowed
        if keep is not None and keep.shape[-1] != self.n_k:  # an attn_mask broadcast over keys
            keep = keep.expand(*keep.shape[:-1], self.n_k)
        return keep

    def flex_mask_mod(self) -> Callable[..., Tensor]:
        """The same mask as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``."""
        offset = self.n_k - self.n_q
        causal, lengths, padding = self.causal, self.lengths, self.key_padding
        q_doc, k_doc = self.q_doc, self.k_doc
        behind, ahead = self.behind, self.ahead
        allowed = self.allowed
        if allowed is not None:  # a view with every dimension indexable, no copy
            allowed = allowed.expand(allowed.shape[0], allowed.shape[1], self.n_q, self.n_k)

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            keep = kv_idx >= 0
            if causal:
                keep = keep & (kv_idx <= q_idx + offset)
            if behind is not None:
                keep = keep & (kv_idx > q_idx + offset - behind)
            if ahead is not None:
                keep = keep & (kv_idx < q_idx + offset + ahead)
            if allowed is not None:
                keep = (
                    keep
                    & allowed[
                        b if allowed.shape[0] > 1 else 0,
                        h if allowed.shape[1] > 1 else 0,
                        q_idx,
                        kv_idx,
                    ]
                )
            if lengths is not None:
                keep = keep & (kv_idx < lengths[b, q_idx])
            if padding is not None:
                keep = keep & ~padding[b, kv_idx]
            if q_doc is not None and k_doc is not None:
                qb = b if q_doc.shape[0] > 1 else 0  # documents shared by the batch: row 0
                kb = b if k_doc.shape[0] > 1 else 0
                keep = keep & (q_doc[qb, q_idx] == k_doc[kb, kv_idx])
            return keep

        return mask_mod


def _band(
    first: int,
    rows: int,
    n_k: int,
    causal: bool,
    behind: int | None,
    ahead: int | None,
    device: torch.device | str | None,
) -> Tensor:
    """The causal or window band ``[1, 1, rows, n_k]`` bool (True = attend) of ``rows``
    queries whose first is aligned with key ``first`` (query ``i`` of the block sees key
    ``j`` when ``j <= first + i`` if ``causal``, ``j > first + i - behind``,
    ``j < first + i + ahead``)."""
    q_idx = torch.arange(first, first + rows, device=device)[:, None]  # [rows, 1]
    k_idx = torch.arange(n_k, device=device)[None, :]  # [1, n_k]
    band = torch.ones((), dtype=torch.bool, device=device)
    if causal:
        band = band & (k_idx <= q_idx)
    if behind is not None:
        band = band & (k_idx > q_idx - behind)
    if ahead is not None:
        band = band & (k_idx < q_idx + ahead)
    return band.expand(rows, n_k)[None, None]  # [1, 1, rows, n_k]


#: elements at most of a band kept between calls (256 KiB of bool; a dozen small kernel
#: calls saved per call, where a small attention costs a few dozen microseconds)
_KEPT_BAND = 1 << 18

#: :func:`_band` kept between calls, on the CPU (plain eager tensors:
#: :func:`posenc._memo.memo`; a device of None is the default one, on the CPU unless a
#: function mode sets another, which the memo does not keep)
_kept_band = memo(maxsize=16)(_band)

#: query-key pairs at most of a band kept in float form (:func:`_kept_band_floats`: 512 KiB
#: in float32, 1 MiB in float64)
_KEPT_BAND_FLOATS = 1 << 16


@memo(maxsize=8)
def _kept_band_floats(band: tuple[Any, ...], dtype: torch.dtype, fill: float) -> Tensor:
    """``[2, 1, 1, rows, n_k]`` on the CPU in ``dtype``: the band of :func:`_band` (``band``
    its arguments but the device: ``first, rows, n_k, causal, behind, ahead``) as 1 where
    it keeps and 0 where it hides, then as ``-0.0`` where it keeps and ``fill`` where it
    hides (for :meth:`Mask.filled`)."""
    keep = _band(*band, None)  # [1, 1, rows, n_k]
    ones = keep.to(dtype)
    fills = torch.full(keep.shape, -0.0, dtype=dtype).masked_fill_(~keep, fill)
    return torch.stack((ones, fills))  # [2, 1, 1, rows, n_k]


def _rows_of(x: Tensor, rows: slice | None) -> Tensor:
    """``x[:, :, rows]`` of a ``[., ., n_q|1, .]`` tensor (a broadcast 1 is kept)."""
    return x if rows is None or x.shape[2] == 1 else x[:, :, rows]
