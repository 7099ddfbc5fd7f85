"""A key/value cache for decoding one token (or a few) at a time.

Shape legend: ``b`` batch, ``h_kv`` the key/value heads the cache holds (``h`` where they
are the heads), ``n`` cached length, ``d`` head dim (``d_v`` the values'), ``m`` new
tokens, ``c`` the buffer's capacity (``c >= n``).

:class:`KVCache` belongs to one attention layer. ``MultiHeadAttention.forward(x,
cache=cache)`` reads what the cache holds, appends the new keys and values, and gives the
new queries the positions that follow the cached ones, so that a prompt prefilled at once
and then extended token by token gives the same outputs as one causal pass over the whole
sequence. Keys are stored after the scheme's rotation (RoPE's keys are rotated once, at
the position they were written at), with their positions, so relative schemes (T5, ALiBi,
Swin 1-D, relative embeddings, Shaw) see the right distances.

Without gradients (``torch.no_grad`` or ``torch.inference_mode``), keys and values are
written in place into a buffer with spare capacity (:meth:`KVCache.append`, and the steps
of ``MultiHeadAttention``): a step copies its new tokens, not the whole cache, which a
``torch.cat`` per step would copy again each time.
"""

from __future__ import annotations

import copy
import operator
import weakref

import torch
from torch import Tensor

from . import _validate as check
from ._memo import eager
from .indices import _known_run, run_positions

__all__ = ["KVCache"]

#: the spare tokens a buffer gets past what it holds when it is made or grows: a quarter of
#: them, at least this many (each step then copies its own tokens, and a growth copies
#: the cache once per quarter of its length)
_SPARE_TOKENS = 64


class KVCache:
    """The keys, values, positions and padding of the tokens seen so far, for one layer.

    **A buffer written in place.** From the first step after the prefill on, where no
    gradient is recorded (grad mode off: ``torch.no_grad()``, ``torch.inference_mode()``;
    ``model.eval()`` and frozen parameters are not enough), the keys and values live in a
    buffer of ``c`` tokens that the cache owns, ``[b, h_kv, c, d]`` each (``h_kv`` the
    key/value heads), and :attr:`keys` and :attr:`values` are views of its first ``n``
    tokens (strided: ``.reshape`` them, not ``.view``). Each step writes its tokens after
    them, in place, where ``torch.cat`` would copy the whole cache again. The buffer is
    made for the tokens it must hold then plus a quarter (at least 64 more), or for
    ``capacity`` tokens where that is enough, and is made anew the same way when it is
    full (one copy of the cache per quarter of its length; the old and the new buffer
    both live during that copy). It takes ``2 * b * h_kv * c * d`` elements per layer, up
    to a quarter (or 64 tokens) more than the cache holds; a view of it kept alive keeps
    the whole buffer alive. The cache also remembers how many of the buffer's first tokens
    a masked step found finite, while nothing writes into the buffer through its version
    counters, so that later masked steps check only their new tokens for NaN and
    infinities.

    **What it never changes.** A write never changes a tensor the cache handed out: its
    :attr:`keys` or :attr:`values` read (even for their ``.shape``: ``len(cache)`` reads
    nothing), what :meth:`append` returned, the tensors of a ``copy.copy`` of the cache.
    The buffer is written only past the tokens those reach, and the cache gives it up
    where its length goes back below them (:meth:`crop`), where it forgets everything
    (:meth:`reset`, ``crop(0)``) and where :attr:`keys` or :attr:`values` are assigned:
    the next write then copies the cache into a new buffer. Writes go through the
    buffer's ``.data``, whose version counter is its own, so that what autograd saved of
    a tensor handed out stays valid (the tokens it reaches are never written).

    **Where the cache concatenates instead** (``torch.cat``, and holds no buffer):

    - grad mode on;
    - under ``torch.compile``, ``torch.jit.trace``, a ``torch.func`` transform, a
      forward-mode AD level, a dispatch or function mode (including ``with
      torch.device(...)``);
    - tensor subclasses;
    - new keys of another dtype or device than the cached ones.

    Args:
        capacity: the tokens per sequence a buffer is made for (the prompt and the tokens
            to generate), where that is at least what it must hold then; otherwise, and
            for a buffer made later (the cache outgrew it, or gave it up), the default
            sizing. None (the default): what the buffer must hold plus a quarter.

    Attributes:
        keys: ``[b, h_kv, n, d]`` (rotated when the scheme rotates), or None when empty.
        values: ``[b, h_kv, n, d_v]``, or None.
        positions: ``[b or 1, n]`` int64 positions of the cached keys, or None.
        key_padding: ``[b, n]`` bool (True = padding), or None when nothing was padded.
        capacity: the ``capacity`` given.

    Raises:
        TypeError: ``capacity`` is not an int.
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None:
            check.positive_int("capacity", capacity, hint="; pass None to size the buffer by need")
        self.capacity = capacity
        self._keys: Tensor | None = None
        self._values: Tensor | None = None
        self.positions: Tensor | None = None
        self.key_padding: Tensor | None = None
        self._buffer: tuple[Tensor, Tensor] | None = None  # [b, h, c, d] each, or None
        self._exposed = 0  # the buffer's tokens that tensors handed out may reach
        # what the last in-place write handed out, for store to adopt: (keys, values, buffer)
        self._written: tuple[Tensor, Tensor, tuple[Tensor, Tensor]] | None = None
        # the buffer's first tokens known finite: (the keys buffer, count, the versions of
        # the keys and values buffers then); the step's count, for store to adopt
        self._finite: tuple[weakref.ref, int, int, int] | None = None
        self._checked = 0

    @property
    def keys(self) -> Tensor | None:
        """``[b, h_kv, n, d]`` cached keys, or None. Reading them hands their tokens out;
        assigning them gives the buffer up."""
        self._expose()
        return self._keys

    @keys.setter
    def keys(self, value: Tensor | None) -> None:
        self._keys = value
        self._buffer = self._written = None

    @property
    def values(self) -> Tensor | None:
        """``[b, h_kv, n, d_v]`` cached values, or None. Reading them hands their tokens
        out; assigning them gives the buffer up."""
        self._expose()
        return self._values

    @values.setter
    def values(self, value: Tensor | None) -> None:
        self._values = value
        self._buffer = self._written = None

    def _expose(self) -> None:
        """Record that the tokens held are handed out: the buffer is never written below
        them again (:meth:`crop` shorter gives it up)."""
        self._exposed = max(self._exposed, len(self))

    def __len__(self) -> int:
        return 0 if self._keys is None else self._keys.shape[2]

    def __copy__(self) -> KVCache:
        """A fork (a second beam, say): the copy shares the tensors the cache holds but
        has no buffer (its first write copies the cache into one); the original keeps
        its buffer, with its tokens now handed out (a later shorter :meth:`crop` gives it
        up). The first write of either cannot reach the other's tokens."""
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        other._buffer = other._written = None
        self._expose()  # the copy's tokens are the buffer's
        return other

    def __deepcopy__(self, memo: dict) -> KVCache:
        """A cache with copies of every tensor (the buffer copied whole, spare tokens
        included, with the views of it)."""
        other = type(self).__new__(type(self))
        memo[id(self)] = other
        other.__dict__.update(copy.deepcopy(self.__dict__, memo))
        other._written = None
        return other

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
        """Forget everything (start a new sequence) and let the buffer go."""
        self._keys = self._values = self.positions = self.key_padding = None
        self._buffer = self._written = None
        self._exposed = 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens and forget the rest (the draft tokens a
        speculative decoder rejected), for every sequence of the batch.

        The buffer is kept where no tensor the cache handed out reaches past ``length``
        (:attr:`keys`, :attr:`values` once read, what :meth:`append` returned, a
        ``copy.copy`` of the cache): the next steps write over the tokens forgotten, in
        place. Otherwise it is given up, so that those tensors keep their values, and the
        next step copies the tokens kept into a new buffer. ``crop(0)`` is :meth:`reset`.

        Args:
            length: how many tokens to keep, ``0 <= length <= len(cache)``.

        Raises:
            TypeError: ``length`` is not an integer.
            ValueError: ``length`` is negative or more than the cache holds.
        """
        try:
            if isinstance(length, bool):
                raise TypeError
            length = operator.index(length)
        except TypeError:
            raise TypeError(
                f"length must be an int, got {length!r} ({type(length).__name__})"
            ) from None
        if not 0 <= length <= len(self):
            raise ValueError(
                f"length must be in [0, {len(self)}] (the tokens cached), got {length}; "
                f"cache.reset() forgets them all"
            )
        if length == 0:
            self.reset()
            return
        run = _run_of_one_row(self.positions)  # type: ignore[arg-type]
        self._keys = self._keys[:, :, :length]  # type: ignore[index]  # [b, h, length, d]
        self._values = self._values[:, :, :length]  # type: ignore[index]
        if run is not None:  # a marked run stays one (a slice would not carry the mark)
            self.positions = run_positions(run[0], length, self.positions.device)  # type: ignore[union-attr]
        else:
            self.positions = self.positions[:, :length]  # type: ignore[index]  # [b or 1, length]
        if self.key_padding is not None:
            self.key_padding = self.key_padding[:, :length]  # [b, length]
        self._written = None
        if self._finite is not None:  # the tokens past it are written again (through .data)
            ref, count, *versions = self._finite
            self._finite = (ref, min(count, length), *versions)
        if length < self._exposed:
            self._buffer = None

    def append(
        self, keys: Tensor, values: Tensor, positions: Tensor, key_padding: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Append new entries and return everything cached, new entries last.

        Where no gradient is recorded the new keys and values are written into the
        cache's buffer, and the keys and values returned are views of it, handed out as
        :attr:`keys` is (a later :meth:`crop` below them gives the buffer up): the values
        :meth:`extended` and then :meth:`store` would hold. Into an empty cache, the
        tensors given are held and returned as they are.

        Args:
            keys: ``[b, h, m, d]`` new keys (already rotated).
            values: ``[b, h, m, d]``.
            positions: ``[b or 1, m]`` positions of the new keys.
            key_padding: ``[b, m]`` bool for the new keys, or None (no padding).

        Returns:
            ``(keys, values, positions, key_padding)`` over all ``n + m`` cached tokens.

        Raises:
            ValueError: a batch size, head count or head dim that differs from the cache,
                or values whose batch, heads or length differ from the new keys'.
        """
        entries = self._extend(keys, values, positions, key_padding, in_place=True)
        self.store(*entries)
        self._expose()
        return entries

    def extended(
        self, keys: Tensor, values: Tensor, positions: Tensor, key_padding: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """What the cache would hold with new entries appended, in new tensors (for an
        empty cache, the tensors given); the cache is left as it is. Storing them
        (:meth:`store`) gives the cache's buffer up (the next write in place copies the
        cache into a new one); :meth:`append` writes into it.

        Args and Returns: as :meth:`append`.

        Raises:
            ValueError: a batch size, head count or head dim that differs from the cache,
                or values whose batch, heads or length differ from the new keys'.
        """
        return self._extend(keys, values, positions, key_padding, in_place=False)

    def _step(
        self, keys: Tensor, values: Tensor, positions: Tensor, key_padding: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """:meth:`extended` for ``MultiHeadAttention``'s step, written into the buffer where
        it can be: the cache holds what it held until :meth:`store` takes the result (a
        step that raises leaves it as it was; the next step writes over the tokens the
        failed one wrote past the cache's length)."""
        return self._extend(keys, values, positions, key_padding, in_place=True)

    def _discard(self) -> None:
        """Forget what the last step wrote (a step that failed): a buffer it made goes."""
        self._written, self._checked = None, 0

    def _extend(
        self,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        key_padding: Tensor | None,
        *,
        in_place: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        self._written = None
        self._checked = 0
        old_keys, old_values = self._keys, self._values
        if old_keys is None or old_values is None:
            return keys, values, positions, key_padding
        if keys.shape[0] != old_keys.shape[0] or (keys.shape[1], keys.shape[3]) != (
            old_keys.shape[1],
            old_keys.shape[3],
        ):
            raise ValueError(
                f"the cache holds keys of shape [b, h, n, d] = {tuple(old_keys.shape)} "
                f"but new keys have shape {tuple(keys.shape)}; use one KVCache per layer "
                f"and sequence batch, or call cache.reset()"
            )
        if values.shape[:3] != keys.shape[:3] or values.shape[3] != old_values.shape[3]:
            raise ValueError(
                f"the cache holds values of shape [b, h, n, d_v] = {tuple(old_values.shape)} "
                f"but new values have shape {tuple(values.shape)} for new keys of shape "
                f"{tuple(keys.shape)}; give values of the keys' batch, heads and length"
            )
        n_old, b = old_keys.shape[2], keys.shape[0]
        if in_place and self._writable(keys, values):
            all_keys, all_values = self._write(keys, values, n_old)  # [b, h, n + m, d] each
        else:
            all_keys = torch.cat((old_keys, keys), dim=2)  # [b, h, n + m, d]
            all_values = torch.cat((old_values, values), dim=2)
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

    def _writable(self, keys: Tensor, values: Tensor) -> bool:
        """Whether new keys and values may be written into a buffer: no gradient recorded
        (grad mode off), eager, plain tensors (no subclass, which a buffer would drop) of the
        dtypes and devices of the cached ones."""
        old_keys, old_values = self._keys, self._values
        return (
            not torch.is_grad_enabled()
            and eager()
            and type(keys) is type(values) is type(old_keys) is type(old_values) is Tensor
            and keys.dtype == old_keys.dtype == values.dtype == old_values.dtype  # type: ignore[union-attr]
            and keys.device == old_keys.device == values.device == old_values.device  # type: ignore[union-attr]
        )

    def _write(self, keys: Tensor, values: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """The ``n`` cached tokens and the new ones, as views of the buffer, the new ones
        written into it after the cached ones (a new buffer first, the cached tokens copied
        in, where the cache has none or it is full): ``[b, h, n + m, d]`` each. The buffer
        is the cache's once :meth:`store` takes the views."""
        need = n + keys.shape[2]
        buffer = self._buffer
        if (
            buffer is None
            or buffer[0].shape[2] < need
            or (buffer[0].is_inference() and not torch.is_inference_mode_enabled())
        ):  # none, full, or one a deep copy made in inference mode, written outside it
            capacity = need + max(need // 4, _SPARE_TOKENS)
            if self.capacity is not None and self.capacity >= need:
                capacity = self.capacity  # asked for, and enough
            buffer = tuple(_buffer_for(t, capacity) for t in (self._keys, self._values))  # type: ignore[arg-type]
            buffer[0][:, :, :n].copy_(self._keys)  # type: ignore[arg-type]
            buffer[1][:, :, :n].copy_(self._values)  # type: ignore[arg-type]
        # through .data: a version counter of its own, so that the views handed out (which
        # share the buffer's) keep theirs, and what autograd saved of them stays valid (the
        # tokens they reach are never written)
        buffer[0].data[:, :, n:need].copy_(keys)
        buffer[1].data[:, :, n:need].copy_(values)
        written = (buffer[0][:, :, :need], buffer[1][:, :, :need])  # [b, h, n + m, d] each
        self._written = (*written, buffer)  # type: ignore[assignment]
        return written

    def store(
        self, keys: Tensor, values: Tensor, positions: Tensor, key_padding: Tensor | None
    ) -> None:
        """Hold exactly these entries: what :meth:`extended` returned (new tensors: the
        cache then holds no buffer), or what ``MultiHeadAttention``'s step wrote into a
        buffer, which becomes the cache's."""
        written = self._written
        buffer = None
        if written is not None and keys is written[0] and values is written[1]:
            buffer = written[2]
        self._keys, self._values, self.positions = keys, values, positions
        self.key_padding = key_padding
        if buffer is None or buffer is not self._buffer:  # new: nothing of it handed out
            self._exposed = 0
        if buffer is not None and self._checked and not buffer[0].is_inference():
            # the step found its keys all finite (an inference tensor has no version counter)
            versions = (buffer[0]._version, buffer[1]._version)
            self._finite = (weakref.ref(buffer[0]), self._checked, *versions)
        self._buffer, self._written, self._checked = buffer, None, 0

    def _finite_keys(self, keys: Tensor, values: Tensor) -> int:
        """How many of the first tokens of ``keys`` and ``values``, what this step's
        :meth:`_step` wrote into the buffer, a step before found finite (:meth:`_found_finite`):
        those of the cache's buffer up to its length, where nothing has written into the
        buffer since (its version counters, which the cache's own writes through ``.data``
        do not move, and a write through :attr:`keys` or :attr:`values` does); 0 for keys
        and values that are not the buffer's (the step made a new one, or wrote none). A
        write that bypasses the version counters (``.data``, a NumPy view) is not seen."""
        written, kept = self._written, self._finite
        if written is None or kept is None or keys is not written[0] or values is not written[1]:
            return 0
        buffer = written[2]
        if buffer is not self._buffer or kept[0]() is not buffer[0] or buffer[0].is_inference():
            return 0
        if (buffer[0]._version, buffer[1]._version) != kept[2:]:
            return 0
        return min(kept[1], len(self))  # (a failed step's tokens past it: written again)

    def _found_finite(self, count: int) -> None:
        """Record that this step's first ``count`` keys and values are finite, for the steps
        after it once :meth:`store` holds them (:meth:`_finite_keys`)."""
        self._checked = count

    def __repr__(self) -> str:
        shape = None if self._keys is None else tuple(self._keys.shape)
        return f"KVCache(length={len(self)}, keys={shape})"


def _buffer_for(cached: Tensor, capacity: int) -> Tensor:
    """An empty ``[b, h, capacity, d]`` buffer in the dtype and device of ``cached``, made
    outside inference mode (an inference tensor cannot be written into outside it)."""
    b, h, _, d = cached.shape
    with torch.inference_mode(False):  # (made once per buffer: no need to test the mode)
        return torch.empty(b, h, capacity, d, dtype=cached.dtype, device=cached.device)


def _run_of_one_row(positions: Tensor) -> tuple[int, int] | None:
    """``(first, last)`` of ``[1, n]`` positions marked as one run and unchanged since
    (:func:`~posenc.indices.run_positions`), else None."""
    return _known_run(positions) if positions.ndim == 2 and positions.shape[0] == 1 else None
