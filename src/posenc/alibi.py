"""ALiBi, attention with linear biases (Press et al. 2022): ``B[h, i, j] = -slope_h * |j - i|``.

The paper's slopes (:func:`alibi_slopes`) and, for a consecutive run of positions, the bias
of each offset and the dense bias are constants of the head count and the run: kept
between calls (:mod:`posenc._memo`). :mod:`posenc.bias` re-exports both names.

Shape legend: ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``W = n_q + n_k - 1`` offsets.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import _validate as check
from ._memo import _plain, memo
from .diagonals import toeplitz
from .families import OffsetBias
from .families.biases import _KEPT_RUN, _own_bias, _run_of

__all__ = ["ALiBi", "alibi_slopes"]


def alibi_slopes(heads: int, *, device: torch.device | str | None = None) -> Tensor:
    """ALiBi's head slopes (Press et al. 2022, section 3).

    For ``n`` heads, a power of two, the slopes are the geometric sequence that starts at
    ``2**(-8/n)`` with that ratio (8 heads: 1/2, 1/4, ..., 1/256). Otherwise the paper takes
    the slopes of the closest lower power of two ``m``, then every other slope of ``2m``
    heads until there are ``n``.

    Args:
        heads: number of heads.
        device: where to build the result.

    Returns:
        ``[heads]`` float32 (computed in float64).
    """
    check.positive_int("heads", heads)

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    lower = 1 << (heads.bit_length() - 1)  # the largest power of two <= heads
    slopes = geometric(lower)
    if lower != heads:
        slopes += geometric(2 * lower)[0::2][: heads - lower]
    return torch.tensor(slopes, dtype=torch.float64, device=device).float()


@memo(maxsize=64)
def _paper_slopes(heads: int, device: torch.device) -> Tensor:
    """:func:`alibi_slopes` kept per head count and device (shared: read, never written)."""
    return alibi_slopes(heads, device=device)


@memo(maxsize=16)
def _paper_run_bias(heads: int, first: int, count: int, device: torch.device) -> Tensor:
    """ALiBi's bias with the paper's slopes for the offsets ``first .. first + count - 1``:
    ``[heads, count]`` float32, kept per run (shared: read, never written)."""
    offsets = torch.arange(first, first + count, device=device)  # [count]
    return -_paper_slopes(heads, device)[:, None] * offsets.abs().float()  # [heads, count]


#: the most elements ``h * n_q * n_k`` of a dense bias kept between calls (16 MiB: 16 heads
#: at 512 tokens, where the engine runs SDPA's fused kernel with it up to
#: ``tuning.KEPT_BIAS_PAIRS`` pairs per head)
_KEPT_DENSE = 1 << 22


@memo(maxsize=4)
def _paper_dense_bias(heads: int, first: int, n_q: int, n_k: int, device: torch.device) -> Tensor:
    """ALiBi's dense bias with the paper's slopes for ``n_q`` consecutive queries and ``n_k``
    consecutive keys whose first offset is ``first`` (see :func:`~posenc.indices.offset_run`):
    ``[1, heads, n_q, n_k]`` float32, kept (shared: read, never written)."""
    run = _paper_run_bias.__wrapped__(heads, first, n_q + n_k - 1, device)  # [heads, W], not kept
    return toeplitz(run, n_q, n_k).unsqueeze(0)  # [1, heads, n_q, n_k]


@memo(maxsize=8)
def _paper_row(heads: int, below: int, above: int, device: torch.device) -> Tensor:
    """ALiBi's bias with the paper's slopes for every offset ``-below .. above``: ``[heads,
    below + above + 1]`` float32, kept (shared: read, never written); one query's bias
    over any run of keys whose offsets lie there is a slice of it (a decoding step)."""
    return _paper_run_bias.__wrapped__(heads, -below, below + above + 1, device)


@memo(maxsize=4)
def _paper_end_block(heads: int, n_q: int, width: int, device: torch.device) -> Tensor:
    """ALiBi's dense bias with the paper's slopes for ``n_q`` consecutive queries at the end
    of ``width`` consecutive keys (the last query at the last key's position): ``[1, heads,
    n_q, width]`` float32, kept (shared: read, never written; a tensor of its own, no
    view). The bias of ``n_q`` queries at the end of any ``n_k <= width`` keys, whose
    offsets are the same from the end, is its last ``n_k`` columns (a chunk of tokens
    over a growing cache)."""
    block = _paper_dense_bias.__wrapped__(heads, 1 - width, n_q, width, device)
    return block.clone()  # [1, heads, n_q, width] (not a view: its columns' views name it)


def _power_of_two_at_least(x: int) -> int:
    """The smallest power of two ``>= x`` for ``x >= 1``; 0 for ``x <= 0``."""
    return 0 if x <= 0 else 1 << (x - 1).bit_length()


class ALiBi(OffsetBias):
    """Attention with linear biases: ``B[h, i, j] = -slope_h * |j - i|``.

    Press et al. 2022. Below the diagonal this is the paper's causal bias
    ``-slope * (i - j)``; above it the penalty is symmetric, which is the usual encoder
    form. By default no parameters nor buffers: the slopes come from ``heads`` in float32
    (kept per head count outside the module), so ``module.to(torch.bfloat16)`` cannot
    round them (a bf16 bias at distance 1,000 would lose the difference between
    neighbouring keys).

    ``learned=True`` makes the slopes a parameter per head, trained with the model and
    initialised to the paper's (:func:`alibi_slopes`). It is the log-slope,
    ``log_slopes`` (``slope_h = exp(log_slopes[h])``): positive by construction, with no
    clamp whose flat side would stop the gradient, and a step moves each slope by the same
    factor, which suits slopes that span two decades (1/2 to 1/256 for 8 heads); a
    softplus would scale the gradient of a slope ``s`` by about ``s`` near zero, starving
    the small slopes. The bias is computed in at least float32 from the parameter's value,
    but ``module.to(torch.bfloat16)`` does round a learned parameter.

    Args:
        heads: number of heads.
        learned: train the slopes (a parameter ``log_slopes`` ``[heads]``).
    """

    tabulate = False  # a product per pair costs no more than reading a table

    def __init__(self, heads: int, *, learned: bool = False) -> None:
        super().__init__()
        self.heads = check.positive_int("heads", heads)
        self.learned = bool(learned)
        if self.learned:
            self.log_slopes = nn.Parameter(torch.empty(self.heads))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Set learned slopes back to the paper's (nothing to do when not learned)."""
        if self.learned:
            with torch.no_grad():
                slopes = alibi_slopes(self.heads, device=self.log_slopes.device)
                self.log_slopes.copy_(slopes.double().log())

    def _has_paper_slopes(self) -> bool:
        """Whether the slopes are the paper's: not learned, :meth:`slopes` not overridden
        (by a subclass, or set on the instance)."""
        return not self.learned and type(self).slopes is ALiBi.slopes and "slopes" not in vars(self)

    def slopes(self, device: torch.device | None = None) -> Tensor:
        """``[heads]`` slopes: float32 (learned: ``exp(log_slopes)`` in at least float32,
        with its gradient)."""
        if self.learned:
            log = self.log_slopes
            log = log.to(device=device, dtype=torch.promote_types(log.dtype, torch.float32))
            return log.exp()
        return alibi_slopes(self.heads, device=device)

    def offset_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """The bias per offset of a consecutive run of positions (see
        :meth:`~posenc.families.OffsetBias.offset_bias`): ``[h, n_q + n_k - 1]``, or None.

        With the paper's slopes it is a constant of the head count and the run (its first
        offset and length): kept between calls (:func:`_paper_run_bias`; each call returns
        a copy). Learned slopes, or a :meth:`slopes` or :meth:`bias` of a subclass's or set
        on the instance, take the family's form.
        """
        if not self._has_paper_slopes() or _own_bias(self, ALiBi):
            return super().offset_bias(q_pos, k_pos)
        run = _run_of(self, q_pos, k_pos)
        if run is None:
            return None
        first, count = run
        if count > _KEPT_RUN:
            return _paper_run_bias.__wrapped__(self.heads, first, count, q_pos.device)
        return _paper_run_bias(self.heads, first, count, q_pos.device).clone()  # the caller's

    def kept_score_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """:meth:`score_bias` kept between calls, for the engine to read (see
        :class:`~posenc.hooks.KeptScoreBias`): with the paper's slopes, for consecutive
        positions on the CPU and at most 2^22 elements ``h * n_q * n_k``, ``[1, h, n_q,
        n_k]`` shared by every ALiBi of ``h`` heads in the process (never write into it; the
        last four kept, at most 64 MiB in all; one query's, a decoding step's, a view of a
        row kept for its offsets rounded to powers of two, the last eight kept, at most 16
        MiB each: :func:`_paper_row`; fewer queries than keys at the end of them, a chunk
        of tokens over a cache, the last columns of a block kept per chunk size and key
        count rounded up to a power of two, the last four kept, at most 16 MiB each:
        :func:`_paper_end_block`);
        None otherwise (learned slopes, a :meth:`slopes`, :meth:`bias`,
        :meth:`offset_bias` or ``score_bias`` of a subclass's, a mixin's or set on the
        instance, other positions, a larger bias).

        Raises:
            ValueError: positions :meth:`check_positions` rejects.
        """
        if not self._has_paper_slopes() or _own_bias(self, ALiBi):
            return None
        own = vars(self)
        if type(self).offset_bias is not ALiBi.offset_bias or "offset_bias" in own:
            return None
        if type(self).score_bias is not OffsetBias.score_bias or "score_bias" in own:
            return None  # a score_bias of a subclass's, a mixin's or the instance's
        n_q, n_k = q_pos.shape[-1], k_pos.shape[-1]
        if self.heads * n_q * n_k > _KEPT_DENSE:
            return None
        run = _run_of(self, q_pos, k_pos)
        if run is None:
            return None
        first = run[0]
        if n_q == 1 and _plain():  # a slice of a row kept per power of two of the offsets
            below = _power_of_two_at_least(-first)  # (decoding: offsets -p .. 0)
            above = _power_of_two_at_least(first + n_k - 1)
            if self.heads * (below + above + 1) <= _KEPT_DENSE:
                row = _paper_row(self.heads, below, above, q_pos.device)  # [h, below+above+1]
                return row[None, :, None, first + below : first + below + n_k]  # [1, h, 1, n_k]
        elif n_q < n_k and first == 1 - n_k and _plain():  # a chunk at the end of its keys
            width = _power_of_two_at_least(n_k)  # the last columns of a block kept per power
            if self.heads * n_q * width <= _KEPT_DENSE:
                block = _paper_end_block(self.heads, n_q, width, q_pos.device)
                return block[..., width - n_k :]  # [1, h, n_q, n_k]
        return _paper_dense_bias(self.heads, first, n_q, n_k, q_pos.device)

    def bias(self, offsets: Tensor) -> Tensor:
        """``-slope_h * |offset|`` for each offset ``j - i``, float32 (or the learned
        slopes' dtype where wider).

        Args:
            offsets: integer ``[*S]``.

        Returns:
            ``[*S, heads]``.
        """
        # the paper's slopes are a constant of the head count: kept, not rebuilt per call
        slopes = (
            _paper_slopes(self.heads, offsets.device)
            if self._has_paper_slopes()
            else self.slopes(offsets.device)
        )
        slopes = slopes.view(-1, *[1] * offsets.ndim)  # [h, 1, ...]
        # each head's biases contiguous in memory (as the dense [B', h, n_q, n_k] bias
        # wants them), heads last in the family's layout: [h, *S] -> [*S, h] (a view)
        return (-slopes * offsets.abs().to(slopes.dtype)).movedim(0, -1)

    def extra_repr(self) -> str:
        return f"heads={self.heads}" + (", learned=True" if self.learned else "")
