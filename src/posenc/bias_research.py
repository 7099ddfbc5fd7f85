"""Place 3, length-generalisation research biases: content-free, ``s_ij += B[h, i, j]``.

- :class:`KerpleBias`: a learned conditionally positive definite kernel of the distance,
  logarithmic ``-r1 * log(1 + r2 * |j - i|)`` or power ``-r1 * |j - i| ** r2`` (Chi et al.
  2022, "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation").
- :class:`SandwichBias`: the inner product of two sinusoidal position embeddings, a
  function of their distance alone, shifted to zero at distance 0 and compressed per head
  (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via the Lens of Receptive
  Field Analysis"); no parameters.
- :class:`FIREBias`: a learned MLP of the log distance divided by the log of the query's
  position (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long
  Context Transformers"); the maths in :func:`fire_inputs` and :func:`fire_mlp`.

The learned-slope variant of ALiBi is ``ALiBi(heads, learned=True)`` in :mod:`posenc.alibi`.
KERPLE and Sandwich are :class:`~posenc.families.OffsetBias` subclasses: each writes the bias
of an offset, and the family derives every hook (the per-offset fast path, the dense bias,
the FlexAttention ``score_mod``) from it. FIRE's bias depends on the query's position too,
not on the offset alone, so it writes the hooks itself (``score_bias``, ``flex_score_mod``).

Shape legend: ``S`` any shape of offsets, ``h`` heads, ``k`` hidden units of FIRE's MLP,
``B'`` the batch of the positions (1 when shared, else ``b``), ``n_q`` queries, ``n_k`` keys,
``f`` Sandwich's frequencies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _validate as check
from .absolute import angle_dtype
from .families import OffsetBias
from .families.common import check_heads, lengths_positions, module_device
from .indices import score_mod_positions

__all__ = ["FIREBias", "KerpleBias", "SandwichBias", "fire_inputs", "fire_mlp", "sandwich_bias"]

#: KERPLE's kernels, and the upper bound of ``r2`` of each (None: unbounded)
_KINDS: dict[str, float | None] = {"log": None, "power": 2.0}


def _clamp(value: Tensor, low: float, high: float | None) -> Tensor:
    """``value`` clamped into ``[low, high]`` in the forward, the identity in the backward:
    the reference code's projection (it clamps the parameter in place before each use and
    lets the optimizer step from there), without writing to the parameter in the forward."""
    return value + (value.clamp(low, high) - value).detach()


class KerpleBias(OffsetBias):
    """KERPLE's learned kernel of the distance, per head (Chi et al. 2022, NeurIPS).

    The paper shifts a conditionally positive definite kernel of ``|m - n|`` into the
    scores (the shift that makes it positive definite is a constant, which the softmax
    absorbs) and proposes two of them (arXiv 2205.09921, the power and the logarithmic
    variants of the KERPLE construction; its experiments favour the logarithmic one):

    - ``kind="log"``: ``B[h, i, j] = -r1_h * log(1 + r2_h * |j - i|)``, ``r1, r2 > 0``;
    - ``kind="power"``: ``B[h, i, j] = -r1_h * |j - i| ** r2_h``, ``r1 > 0``, ``0 < r2 <= 2``
      (``r2 = 1`` is ALiBi with a learned slope).

    The parameters ``r1`` and ``r2`` ``[heads]`` are kept in range as the reference code
    (github.com/chijames/KERPLE) does: each use clamps them to ``[eps, inf)`` (``r2`` of
    the power kernel to ``[eps, 2]``), ``eps = 0.01`` there; here the clamp is applied to the
    value used, with the gradient passed through unchanged (the reference clamps the
    stored parameter in place, outside autograd, so its gradient is the unclamped one too),
    and :meth:`project_` writes the clamped values back, if wanted after an optimizer step.
    Initialisation as the reference: uniform on ``(0, 2)`` for the log kernel's ``r1`` and
    the power kernel's exponent ``r2``, on ``(0, 1)`` for the other, then clamped.

    Computed in float32 (float64 for float64 parameters).

    Args:
        heads: number of heads.
        kind: ``"log"`` or ``"power"``.
        eps: the lower bound of ``r1`` and ``r2``.

    Raises:
        ValueError: another kind, a bad head count, or ``eps`` not > 0.
    """

    def __init__(self, heads: int, *, kind: str = "log", eps: float = 1e-2) -> None:
        super().__init__()
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, _KINDS))}, got {kind!r}")
        self.heads = check.positive_int("heads", heads)
        self.kind = kind
        self.eps = check.positive_float("eps", eps)
        upper = _KINDS[kind]
        if upper is not None and self.eps > upper:
            raise ValueError(f"eps must be <= {upper} (r2's upper bound), got {eps}")
        self.r1 = nn.Parameter(torch.empty(self.heads))
        self.r2 = nn.Parameter(torch.empty(self.heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw ``r1`` and ``r2`` as the reference code does (see the class), then clamp."""
        with torch.no_grad():
            log = self.kind == "log"
            self.r1.uniform_(0.0, 2.0 if log else 1.0)
            self.r2.uniform_(0.0, 1.0 if log else 2.0)
        self.project_()

    @torch.no_grad()
    def project_(self) -> KerpleBias:
        """Clamp the stored ``r1`` and ``r2`` into their ranges, in place.

        Returns:
            ``self``.
        """
        self.r1.clamp_(min=self.eps)
        self.r2.clamp_(self.eps, _KINDS[self.kind])
        return self

    def parameters_used(self) -> tuple[Tensor, Tensor]:
        """``(r1, r2)`` ``[heads]`` as the bias uses them: clamped into their ranges."""
        r1 = _clamp(self.r1, self.eps, None)
        r2 = _clamp(self.r2, self.eps, _KINDS[self.kind])
        return r1, r2

    def bias(self, offsets: Tensor) -> Tensor:
        """The kernel of ``|offset|`` for each offset ``j - i``.

        Args:
            offsets: integer ``[*S]``.

        Returns:
            ``[*S, heads]``, float32 (float64 for float64 parameters).
        """
        r1, r2 = self.parameters_used()
        dtype = torch.promote_types(r1.dtype, torch.float32)
        r1, r2 = r1.to(dtype), r2.to(dtype)
        distance = offsets.abs().to(dtype).unsqueeze(-1)  # [*S, 1]
        if self.kind == "log":
            return -r1 * torch.log1p(r2 * distance)  # [*S, h]
        return -r1 * distance.pow(r2)  # [*S, h]; 0 ** r2 = 0, with a zero gradient

    def extra_repr(self) -> str:
        return f"heads={self.heads}, kind={self.kind!r}, eps={self.eps}"


def sandwich_bias(offsets: Tensor, heads: int, dim: int, base: float = 10000.0) -> Tensor:
    """Sandwich's bias of each offset: ``(sum_f cos(r w_f) - dim / 2) / (8 h / H)``.

    ``p_m . p_n = sum_{f=1}^{dim/2} cos((m - n) w_f)``, ``w_f = base ** (-2 f / dim)``, is
    the inner product of two sinusoidal position embeddings of dimension ``dim``; it is
    ``dim / 2`` at distance 0, so subtracting ``dim / 2`` makes the bias 0 there and
    negative elsewhere, decaying like a logarithm of the distance. Head ``h`` (1 to ``H``)
    divides it by ``8 h / H``, as ALiBi's slopes ``2 ** (-8 h / H)`` make each head look
    further than the one before. Angles in float64 (a float32 angle past distance 10^4
    would be off by 10^-3 rad; float32 on MPS, which has no float64), the sum likewise,
    the result float32.

    Args:
        offsets: integer ``[*S]``, key position minus query position (the sign does not
            matter: the bias is even).
        heads: ``H``.
        dim: ``dim``, even.
        base: the sinusoid's base.

    Returns:
        ``[*S, heads]`` float32.

    Raises:
        TypeError / ValueError: a bad head count, ``dim`` not an even positive int,
            ``base`` not a finite number > 0, or offsets that are not integers.
    """
    check.positive_int("heads", heads)
    check.even_int("dim", dim, why="a sinusoid pairs a sine with a cosine")
    check.positive_float("base", base)
    if offsets.is_floating_point() or offsets.dtype == torch.bool:
        raise TypeError(f"offsets must be an integer tensor, got {offsets.dtype}")
    wide = angle_dtype(offsets.device)  # float64 (float32 where the device has no float64)
    index = torch.arange(1, dim // 2 + 1, dtype=wide, device=offsets.device)  # [f]
    frequencies = base ** (-2.0 * index / dim)  # [f]
    angles = offsets.to(wide).unsqueeze(-1) * frequencies  # [*S, f]
    inner = angles.cos().sum(-1, keepdim=True) - dim / 2  # [*S, 1]
    head = torch.arange(1, heads + 1, dtype=wide, device=offsets.device)  # [H]
    return (inner / (8.0 * head / heads)).to(torch.float32)  # [*S, H]


class SandwichBias(OffsetBias):
    """Sandwich: the sinusoids' inner product as a relative bias (Chi et al. 2023, ACL).

    Chi, Fan, Rudnicky and Ramadge 2023, "Dissecting Transformer Length Extrapolation via
    the Lens of Receptive Field Analysis" (arXiv 2212.10356): with no parameters,

        ``B[h, i, j] = (p_i . p_j - dim / 2) / (8 h / H)``,
        ``p_i . p_j = sum_{f=1}^{dim/2} cos((i - j) / base ** (2 f / dim))``

    (:func:`sandwich_bias`). The bias is 0 at distance 0 and falls off about like
    ``log |i - j|`` at first, as KERPLE's and T5's learned biases do; once the distance
    passes the slowest wavelength's scale it oscillates around ``-dim / 2`` instead of
    falling further, which bounds the penalty (unlike ALiBi's) and is where the paper locates
    its use of lengths past training. ``dim`` sets the depth and the reach of the decay:
    the paper uses a sinusoid dimension of its own, which need not be the head's.

    Which head is compressed by what, and the frequency index running from 1 (not 0), are
    those of the one public implementation, NVIDIA NeMo's
    ``SandwichRelativePositionEmbedding`` (head ``h`` of ``H`` divided by ``8 h / H``, the
    ``8 / H`` step of ALiBi's slopes): the paper's own text of the per-head compression was
    not available to check against, and secondary descriptions of it disagree (dividing or
    multiplying by ``8 h / H``).

    Args:
        heads: number of heads.
        dim: the sinusoid's dimension, even (NeMo passes the head dimension).
        base: the sinusoid's base.

    Raises:
        TypeError / ValueError: a bad head count, ``dim`` not an even positive int, or
            ``base`` not > 0.
    """

    def __init__(self, heads: int, dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        self.heads = check.positive_int("heads", heads)
        self.dim = check.even_int("dim", dim, why="a sinusoid pairs a sine with a cosine")
        self.base = check.positive_float("base", base)

    def bias(self, offsets: Tensor) -> Tensor:
        """Sandwich's bias of each offset ``j - i``.

        Args:
            offsets: integer ``[*S]``.

        Returns:
            ``[*S, heads]`` float32.
        """
        return sandwich_bias(offsets, self.heads, self.dim, self.base)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, dim={self.dim}, base={self.base}"


def fire_inputs(
    distance: Tensor, query: Tensor, c: Tensor, threshold: Tensor, eps: float
) -> Tensor:
    """FIRE's progressive interpolation: ``psi(i - j) / psi(max(L, i))``, ``psi(x) = log(c x + 1)``.

    Li et al. 2023: ``b(i, j) = f_theta(psi(i - j) / psi(max{L, i}))`` with
    ``psi(x) = log(c x + 1)``, computed as FIRE's PyTorch module does (see
    :class:`FIREBias`): ``log(|c * x| + 1)`` for both, ``eps`` added to the denominator,
    ``L = threshold``. The result is in ``[0, 1]`` for a key at or before its query
    (``0 <= j <= i``) and ``c > 0``.

    Args:
        distance: ``[*S]`` query minus key position ``i - j`` (any sign; FIRE's order).
        query: ``[*S]`` (or broadcastable) the query position ``i``.
        c: 0-d, the log transform's scale.
        threshold: 0-d, ``L``: queries before it are normalised as if at ``L``.
        eps: added to the denominator.

    Returns:
        ``[*S]`` in the dtype of ``c``.
    """
    numerator = torch.log1p((c * distance.to(c.dtype)).abs())  # [*S]
    normaliser = torch.maximum(query.to(c.dtype), threshold)  # [*S], max(L, i)
    return numerator / (torch.log1p((c * normaliser).abs()) + eps)


def fire_mlp(x: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor, bias2: Tensor) -> Tensor:
    """FIRE's ``f_theta``: ``W2 relu(w1 x + b1) + b2``, one value per head for each input.

    Args:
        x: ``[*S]`` the interpolated distances (:func:`fire_inputs`).
        weight1: ``[k, 1]``; bias1: ``[k]``: the hidden layer.
        weight2: ``[h, k]``; bias2: ``[h]``: the output layer.

    Returns:
        ``[*S, h]``.
    """
    hidden = F.relu(F.linear(x.unsqueeze(-1), weight1, bias1))  # [*S, 1] -> [*S, k]
    return F.linear(hidden, weight2, bias2)  # [*S, h]


ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class FIREBias(nn.Module):
    """FIRE: a learned function of the interpolated distance, per head (Li et al. 2023).

    Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context
    Transformers" (ICLR 2024, arXiv 2310.04418):

        ``B[h, i, j] = f_theta(psi(i - j) / psi(max{L, i}))[h]``,  ``psi(x) = log(c x + 1)``

    for query position ``i`` and key position ``j``: the log transform spreads the nearby
    distances, the division by the (log of the) query's position maps every distance a
    query sees into ``[0, 1]`` however long the sequence (progressive interpolation), and
    the threshold ``L`` keeps short contexts from being stretched over the whole interval.
    The bias depends on ``i`` itself once ``i > L``: FIRE is not translation invariant
    then, and is no :class:`~posenc.families.OffsetBias`.

    The details are those of the paper's PyTorch ``FIRE`` module, as later work reproduces
    it with credit to the paper (e.g. github.com/mcleish7/arithmetic,
    ``cramming/architectures/embeddings.py``, and the DAPE code):

    - ``f_theta`` is ``Linear(1, hidden) -> ReLU -> Linear(hidden, heads)`` (``mlp.0``,
      ``mlp.2``; ``hidden = 32``), PyTorch's default initialisation;
    - ``c`` is a learned scalar, initially 0.1, used as ``log(|c x| + 1)``;
    - ``L = |L_multiplier * init_L|``: a learned multiplier ``L_multiplier`` (initially 1)
      of the fixed ``init_L`` (512);
    - ``eps = 1e-6`` is added to the denominator.

    That module keeps ``init_L`` as a frozen parameter; here it is a constructor argument,
    so the state dict holds the learned tensors only (``mlp.*``, ``c``, ``L_multiplier``).
    The absolute value makes the bias of a key ``m`` positions after its query equal to
    that of a key ``m`` before it (bidirectional attention); the paper's models are causal.

    Computed in float32 (float64 for float64 parameters). ``score_bias`` evaluates the MLP
    once per (query, key) pair: past ``L`` every pair of a query has its own input
    (``psi(max{L, i})`` changes with ``i``), so a table over distinct inputs saves nothing
    there; before ``L`` the input is a function of the offset alone, but telling those
    queries apart reads the learned ``L`` (a device sync, a graph break under
    ``torch.compile``). The lean engine calls the hook a block of queries at a time, which
    bounds the ``[B', rows, n_k, hidden]`` intermediate. The normaliser is per query.

    Args:
        heads: number of heads.
        hidden: hidden units of ``f_theta``.
        init_c: the initial ``c``.
        init_L: ``L`` for ``L_multiplier = 1``.
        eps: added to the denominator.

    Raises:
        TypeError: a count that is not an int, a constant that is not a number.
        ValueError: a count < 1, a constant not finite and > 0.
    """

    def __init__(
        self,
        heads: int,
        *,
        hidden: int = 32,
        init_c: float = 0.1,
        init_L: float = 512.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.heads = check.positive_int("heads", heads)
        self.hidden = check.positive_int("hidden", hidden)
        self.init_c = check.positive_float("init_c", init_c)
        self.init_L = check.positive_float("init_L", init_L)
        self.eps = check.positive_float("eps", eps)
        self.mlp = nn.Sequential(
            nn.Linear(1, self.hidden), nn.ReLU(), nn.Linear(self.hidden, heads)
        )
        self.c = nn.Parameter(torch.empty(()))
        self.L_multiplier = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``c = init_c``, ``L_multiplier = 1``, the MLP's layers re-drawn (PyTorch default)."""
        with torch.no_grad():
            self.c.fill_(self.init_c)
            self.L_multiplier.fill_(1.0)
        self.mlp[0].reset_parameters()
        self.mlp[2].reset_parameters()

    def _tensors(self) -> tuple[Tensor, ...]:
        """``(c, L, w1, b1, w2, b2)`` in the dtype of the computation (float32 at least)."""
        first, last = self.mlp[0], self.mlp[2]
        dtype = torch.promote_types(self.c.dtype, torch.float32)
        threshold = (self.L_multiplier.to(dtype) * self.init_L).abs()  # L
        tensors = (first.weight, first.bias, last.weight, last.bias)
        return (self.c.to(dtype), threshold, *(t.to(dtype) for t in tensors))

    def score_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The bias for ``q_pos [B', n_q]`` and ``k_pos [B', n_k]``: ``[B', h, n_q, n_k]``."""
        c, threshold, *weights = self._tensors()
        distance = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)  # [B', n_q, n_k], i - j
        x = fire_inputs(distance, q_pos.unsqueeze(-1), c, threshold, self.eps)  # [B', n_q, n_k]
        return fire_mlp(x, *weights).permute(0, 3, 1, 2)  # [B', n_q, n_k, h] -> [B', h, ..]

    def forward(self, q_len: int, k_len: int, offset: int = 0) -> Tensor:
        """The dense bias ``[h, q_len, k_len]``; queries at ``offset + arange(q_len)``.

        Raises:
            TypeError: a length or offset that is not an int.
            ValueError: a negative one.
        """
        q_pos, k_pos = lengths_positions(q_len, k_len, offset, module_device(self))
        return self.score_bias(q_pos, k_pos)[0]

    def flex_score_mod(self, q_pos: Tensor | None, k_pos: Tensor | None) -> ScoreMod:
        """``score + B[h, i, j]`` as a FlexAttention ``score_mod``, the MLP per pair.

        The hidden layer is unrolled (``hidden`` multiply-adds per pair and head), as a
        ``score_mod`` holds no reduction.

        Args:
            q_pos: ``[n_q]``, ``[1, n_q]`` (shared by the batch) or ``[b, n_q]`` positions,
                or None (the token indices).
            k_pos: ``[n_k]``, ``[1, n_k]`` or ``[b, n_k]``, likewise.

        Returns:
            ``score_mod(score, b, h, q_idx, kv_idx)``.

        Raises:
            ValueError: positions not ``[n]`` or ``[B', n]``, or batch sizes that differ.
            TypeError: positions that are not integers.
        """
        _, _, read_q, read_k = score_mod_positions(q_pos, k_pos)
        c, threshold, weight1, bias1, weight2, bias2 = self._tensors()
        w1, eps = weight1[:, 0], self.eps  # [k, 1] -> [k]

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            i, j = read_q(b, q_idx), read_k(b, kv_idx)
            x = fire_inputs(i - j, i, c, threshold, eps)
            # head h's output, one hidden unit at a time: a score_mod must stay pointwise
            # (inductor lowers no reduction inside it), and reads one head, never all
            out = bias2[h]
            for unit in range(self.hidden):
                out = out + torch.relu(x * w1[unit] + bias1[unit]) * weight2[h, unit]
            return score + out

        return score_mod

    def validate_attention(self, heads: int, head_dim: int) -> None:
        """Reject an attention with another number of heads than ``heads``."""
        check_heads(self, heads)

    def extra_repr(self) -> str:
        return (
            f"heads={self.heads}, hidden={self.hidden}, init_c={self.init_c}, "
            f"init_L={self.init_L}, eps={self.eps}"
        )
