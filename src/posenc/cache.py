"""A key/value cache for decoding one token (or a few) at a time.

Shape legend: ``b`` batch, ``h`` heads, ``n`` cached length, ``d`` head dim.

:class:`KVCache` belongs to one attention layer. ``MultiHeadAttention.forward(x,
cache=cache)`` reads what the cache holds, appends the new keys and values, and gives the
new queries the positions that follow the cached ones, so that a prompt prefilled at once
and then extended token by token gives the same outputs as one causal pass over the whole
sequence. Keys are stored after the scheme's rotation (RoPE's keys are rotated once, at
the position they were written at), with their positions, so relative schemes (T5, ALiBi,
Swin 1-D, relative embeddings, Shaw) see the right distances.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .indices import _known_run, run_positions

__all__ = ["KVCache"]


class KVCache:
    """The keys, values, positions and padding of the tokens seen so far, for one layer.

    Attributes:
        keys: ``[b, h, n, d]`` (rotated when the scheme rotates), or None when empty.
        values: ``[b, h, n, d]``, or None.
        positions: ``[b or 1, n]`` int64 positions of the cached keys, or None.
        key_padding: ``[b, n]`` bool (True = padding), or None when nothing was padded.
    """

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.positions: Tensor | None = None
        self.key_padding: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def next_position(self) -> Tensor | int:
        """The position after the last cached one: ``[b or 1, 1]`` (0 when empty)."""
        if self.positions is None:
            return 0
        return self.positions[:, -1:] + 1

    def _following(self, m: int, device: torch.device) -> Tensor:
        """The positions of ``m`` new tokens after the cached ones, ``[b or 1, m]`` int64:
        where the cache holds one run of positions marked as such (the default positions
        of every step so far: :func:`~posenc.indices.run_positions`), a marked run too,
        which the schemes read without reading its values; else
        :attr:`next_position` ``+ arange(m)``."""
        run = None if self.positions is None else _run_of_one_row(self.positions)
        if run is not None:
            return run_positions(run[1] + 1, m, device)  # [1, m]
        return self.next_position + torch.arange(m, device=device)  # [b or 1, m]

    def reset(self) -> None:
        """Forget everything (start a new sequence)."""
        self.keys = self.values = self.positions = self.key_padding = None

    def append(
        self, keys: Tensor, values: Tensor, positions: Tensor, key_padding: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Append new entries and return everything cached, new entries last.

        The same as :meth:`extended` followed by :meth:`store`.

        Args:
            keys: ``[b, h, m, d]`` new keys (already rotated).
            values: ``[b, h, m, d]``.
            positions: ``[b or 1, m]`` positions of the new keys.
            key_padding: ``[b, m]`` bool for the new keys, or None (no padding).

        Returns:
            ``(keys, values, positions, key_padding)`` over all ``n + m`` cached tokens.

        Raises:
            ValueError: a batch size, head count or head dim that differs from the cache.
        """
        entries = self.extended(keys, values, positions, key_padding)
        self.store(*entries)
        return entries

    def extended(
        self, keys: Tensor, values: Tensor, positions: Tensor, key_padding: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """What the cache would hold with new entries appended; the cache is left as it is.

        ``MultiHeadAttention`` attends over this and calls :meth:`store` only once the step
        has succeeded, so that a step that raises leaves the cache untouched.

        Args and Returns: as :meth:`append`.

        Raises:
            ValueError: a batch size, head count or head dim that differs from the cache.
        """
        if self.keys is None:
            return keys, values, positions, key_padding
        if keys.shape[0] != self.keys.shape[0] or (keys.shape[1], keys.shape[3]) != (
            self.keys.shape[1],
            self.keys.shape[3],
        ):
            raise ValueError(
                f"the cache holds keys of shape [b, h, n, d] = {tuple(self.keys.shape)} "
                f"but new keys have shape {tuple(keys.shape)}; use one KVCache per layer "
                f"and sequence batch, or call cache.reset()"
            )
        n_old, b = self.keys.shape[2], keys.shape[0]
        all_keys = torch.cat((self.keys, keys), dim=2)  # [b, h, n + m, d]
        all_values = torch.cat((self.values, values), dim=2)  # type: ignore[arg-type]
        old_positions = self.positions
        if old_positions.shape[0] != positions.shape[0]:  # type: ignore[union-attr]
            old_positions = old_positions.expand(b, -1)  # type: ignore[union-attr]
            positions = positions.expand(b, -1)
        old_run = _run_of_one_row(old_positions)  # type: ignore[arg-type]
        new_run = _run_of_one_row(positions)
        if old_run is not None and new_run is not None and new_run[0] == old_run[1] + 1:
            # one run still: built marked, as cat would give it
            all_positions = run_positions(old_run[0], n_old + positions.shape[1], positions.device)
        else:
            all_positions = torch.cat((old_positions, positions), dim=1)  # type: ignore[arg-type]
        padding = None  # [b, n + m]
        if key_padding is not None or self.key_padding is not None:
            old = self.key_padding
            if old is None:
                old = torch.zeros(b, n_old, dtype=torch.bool, device=keys.device)
            new = key_padding
            if new is None:
                new = torch.zeros(b, keys.shape[2], dtype=torch.bool, device=keys.device)
            padding = torch.cat((old, new), dim=1)
        return all_keys, all_values, all_positions, padding

    def store(
        self, keys: Tensor, values: Tensor, positions: Tensor, key_padding: Tensor | None
    ) -> None:
        """Hold exactly these entries (what :meth:`extended` returned)."""
        self.keys, self.values, self.positions = keys, values, positions
        self.key_padding = key_padding

    def __repr__(self) -> str:
        shape = None if self.keys is None else tuple(self.keys.shape)
        return f"KVCache(length={len(self)}, keys={shape})"


def _run_of_one_row(positions: Tensor) -> tuple[int, int] | None:
    """``(first, last)`` of ``[1, n]`` positions marked as one run and unchanged since
    (:func:`~posenc.indices.run_positions`), else None."""
    return _known_run(positions) if positions.ndim == 2 and positions.shape[0] == 1 else None
