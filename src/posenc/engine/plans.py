"""What the paths share, and the materialised path: a call as the paths see it, the answer
a path gives (:data:`Plan`), why a per-offset or grid path refuses a call
(:func:`_refusal`), and the materialised path's plan (:mod:`.dispatch` walks the paths in
order; the lean paths' plans are in :mod:`.lean_plans`).

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim;
positions ``[B', n]`` with ``B'`` 1 or ``b``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.autograd import forward_ad

from ..hooks import Hooks
from . import common, tuning
from .few_queries import bias_alone_fits, bias_alone_refusal, few_queries
from .learned import learned_inputs, own_hook, scheme_parameters
from .mask import Mask
from .reference import _forward_in_place, _math, _run_rows
from .sdpa import _sdpa, fused_cpu_runs


@dataclass(frozen=True)
class Call:
    """One attention call as the paths see it (``q, k`` already rotated)."""

    q: Tensor
    k: Tensor
    v: Tensor
    hooks: Hooks
    q_pos: Tensor
    k_pos: Tensor
    mask: Mask
    scale: float
    dropout_p: float
    scheme: Any
    #: ``(leaves, histories)`` of :func:`~.learned.learned_inputs` when already known (a
    #: block of a larger call, a fast path run again inside the create_graph wrapper)
    learned: tuple[list[Tensor], list[Tensor]] | None = None
    #: the hooks whose reads :attr:`params` and :attr:`histories` are, where they are not
    #: :attr:`hooks` (a key shift folded into the keys: the shift reads what it reads)
    read_by: Hooks | None = None

    @functools.cached_property
    def _learned(self) -> tuple[list[Tensor], list[Tensor]]:
        if self.learned is not None:
            return self.learned
        hooks = self.hooks if self.read_by is None else self.read_by
        return learned_inputs(
            self.scheme, hooks, self.q, self.q_pos, self.k_pos, self.scheme_params
        )

    @functools.cached_property
    def scheme_params(self) -> list[Tensor]:
        """The scheme's parameters that require grad (read once per call)."""
        return scheme_parameters(self.scheme)

    @property
    def params(self) -> list[Tensor]:
        """The leaves requiring grad that the hooks read, which the paths built on autograd
        Functions differentiate: the scheme's parameters, and the other tensors that a
        scheme not posenc's own reads (a probe of its hooks, once per call)."""
        return self._learned[0]

    @property
    def histories(self) -> list[Tensor]:
        """The tensors requiring grad with a history of their own that the hooks read (a
        path built on autograd Functions reads them through leaves standing in for them:
        ``dispatch._attend``)."""
        return self._learned[1]

    @functools.cached_property
    def constant_bias(self) -> bool:
        """Whether the bias asks for no gradient itself (:func:`_constant_bias`, read once
        per call: it computes the bias)."""
        return _constant_bias(self)

    @functools.cached_property
    def _bias(self) -> tuple[Tensor, bool]:
        kept = self.kept_bias  # as reference._read_bias reads it
        if kept is not None:
            return kept, True
        return self.hooks.score_bias(self.q_pos, self.k_pos), False

    @functools.cached_property
    def kept_bias(self) -> Tensor | None:
        """The bias the scheme keeps between calls for these positions (its
        ``kept_score_bias``), or None: none kept, or no such hook (read once per call)."""
        kept = self.hooks.kept_score_bias
        return None if kept is None else kept(self.q_pos, self.k_pos)

    @property
    def dense_bias(self) -> Tensor:
        """The scheme's bias for these positions, ``[B', h or 1, n_q, n_k]`` (read once per
        call by the dispatcher: :func:`~.reference._dense_bias`; only with a
        ``score_bias``)."""
        return self._bias[0]

    @property
    def bias_kept(self) -> bool:
        """Whether :attr:`dense_bias` is the tensor the scheme keeps between calls."""
        return self._bias[1]

    @property
    def known_bias(self) -> Tensor | None:
        """:attr:`dense_bias` where the call has read it already, else None."""
        read = self.__dict__.get("_bias")
        return None if read is None else read[0]

    @functools.cached_property
    def op_by_op(self) -> bool:
        """Whether the materialised path runs the call op by op (:func:`_op_by_op`, read
        once per call: the path's plan and the dispatcher's check of its graph ask)."""
        b, h, n_q, _ = self.q.shape
        return _op_by_op(self, b * h * n_q * self.k.shape[2])

    @functools.cached_property
    def threads(self) -> int:
        """The threads torch's CPU kernels run on, read once per call (the path's choice
        and the dispatcher's check of its graph must see the same count)."""
        return _threads()

    @functools.cached_property
    def grad(self) -> bool:
        """Whether the call computes gradients for its inputs or the scheme's parameters:
        grad mode, and one of them requires grad (a tensor only the hooks read is for
        :attr:`params` and :attr:`histories`)."""
        return torch.is_grad_enabled() and any(
            x.requires_grad for x in (self.q, self.k, self.v, *self.scheme_params)
        )


#: a path's answer: a function that runs the call, or why it cannot
Plan = Callable[[], Tensor] | str


@dataclass(frozen=True)
class Path:
    """A way to run attention: ``plan(call)`` is a function that runs it, or the reason it
    cannot."""

    name: str
    plan: Callable[[Call], Plan]


#: why a path cannot run a contextual term (:class:`~posenc.hooks.ContextualTerm`)
_CONTEXTUAL = (
    "a contextual term (CoPE: each query's term is read from its whole row of masked "
    "logits, which this path never writes out)"
)


def _causal_only(call: Call) -> bool:
    """A causal mask alone (aligned at the end, ``n_q <= n_k``) or none: the per-offset
    paths take it as hidden offsets."""
    n_q, n_k = call.q.shape[2], call.k.shape[2]
    mask = call.mask
    return mask.causal_at_most and (not mask.causal or n_q <= n_k)


def _refusal(
    call: Call, extra: str, what: str, beside: str, *, causal_ok: bool, value_ok: bool = False
) -> str | None:
    """Why a per-offset or grid path cannot take the call before its hook is asked: the
    scheme lacks the ``extra`` hook (``what`` it is), adds the ``beside`` hook too, the fused
    CPU kernels do not run, a mask other than a causal one (``causal_ok``) or any, or a
    value term (unless ``value_ok``)."""
    hooks = call.hooks
    if hooks.contextual_term is not None:
        return _CONTEXTUAL
    if getattr(hooks, extra) is None:
        return f"the scheme has no {extra} ({what})"
    if getattr(hooks, beside) is not None:
        other = "bias" if beside == "score_bias" else "term"
        return f"the scheme adds a {other} beside its {'term' if other == 'bias' else 'bias'}"
    if not common._fused_cpu_available(call.q, call.v, replace(hooks, value_term=None)):
        return "the fused CPU kernels do not run here (device, dtype, values of another head dim)"
    if causal_ok and not _causal_only(call):
        return "a mask other than causal"
    if not causal_ok and not call.mask.empty:
        return "a mask"
    if not value_ok and hooks.value_term is not None:
        return "a value term"
    return None


def _mib(elements: int, dtype: torch.dtype) -> str:
    """``elements`` values of ``dtype`` in MiB, for a reason."""
    return f"{elements * dtype.itemsize / 2**20:.1f} MiB"


def _ops_forward(call: Call, scores: int) -> bool:
    """Whether a call that SDPA's fused kernel could run (no gradient for the bias or term)
    runs op by op instead: on CPU with :data:`tuning.OPS_FORWARD_THREADS` threads or more,
    no mask but a causal one, and at most so many scores: for a call in one buffer (no
    gradient asked for: :func:`_in_place`) :data:`tuning.OPS_IN_PLACE_SCORES`, a bias
    alone :data:`tuning.OPS_IN_PLACE_BIAS_SCORES`; for a constant bias with gradients for
    ``q, k, v`` and values of the queries' head dim (SDPA's fused kernel)
    :data:`tuning.OPS_GRAD_BIAS_SCORES`; otherwise (other value channels, where SDPA runs
    its math kernel; a ``torch.func`` transform, a forward-mode AD level)
    :data:`tuning.OPS_FORWARD_SCORES`; with gradients, a bias alone only where the weights
    its graph keeps do not outweigh what SDPA's route keeps
    (:func:`_weights_outweigh_sdpa`). The two bias limits are 0: SDPA with the bias as its
    float mask, the route of the code posenc replaces, whose time no CPU's GEMMs can
    worsen."""
    in_place = _in_place(call)
    bias_alone = call.hooks.score_term is None
    if in_place:
        limit = tuning.OPS_IN_PLACE_BIAS_SCORES if bias_alone else tuning.OPS_IN_PLACE_SCORES
    elif call.grad and bias_alone and call.v.shape[-1] == call.q.shape[-1]:
        limit = tuning.OPS_GRAD_BIAS_SCORES  # SDPA's fused kernel takes it (d_v = d)
    else:
        limit = tuning.OPS_FORWARD_SCORES
    return (
        scores <= limit
        and call.q.device.type == "cpu"
        and call.mask.causal_at_most
        and call.threads >= tuning.OPS_FORWARD_THREADS
        and not (not in_place and call.grad and bias_alone and _weights_outweigh_sdpa(call))
    )


def _weights_outweigh_sdpa(call: Call) -> bool:
    """Whether the ``[b, h, n_q, n_k]`` weights that the op-by-op graph keeps for its
    backward are more than :data:`tuning.OPS_GRAD_WEIGHTS_RATIO` times what SDPA's fused
    route keeps beside ``q, k, v``: its output ``[b, h, n_q, d_v]``, and the float mask
    where the call builds one (a bias the scheme does not keep between calls, or in
    another dtype, or with the causal mask folded into it; the op-by-op route takes no
    other mask). Never with a ``d_v`` other than ``d``: SDPA runs its math kernel then,
    which keeps the weights too."""
    b, h, n_q, d = call.q.shape
    n_k, d_v = call.k.shape[2], call.v.shape[3]
    if d_v != d:
        return False
    bias = call.dense_bias
    built = 0
    if not (call.bias_kept and bias.dtype == call.q.dtype and not call.mask.causal):
        built = bias.shape[0] * bias.shape[1] * n_q * n_k  # [B', h or 1, n_q, n_k]
    return b * h * n_q * n_k > tuning.OPS_GRAD_WEIGHTS_RATIO * (b * h * n_q * d_v + built)


def _in_place(call: Call) -> bool:
    """Whether the op-by-op kernel runs in one buffer (:func:`~.reference._forward_in_place`):
    no gradient asked for (grad mode off, or nothing the call differentiates requires grad:
    a tensor that only the hooks read is checked there) and no forward-mode AD level open
    (nothing records a graph or a tangent: its ``out=`` ops have no derivative), eager (no
    ``torch.compile``, no ``torch.func`` transform), and keys and values of the queries'
    batch and heads."""
    lead = call.q.shape[:2]
    return (
        not call.grad
        and forward_ad._current_level < 0
        and not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
        and call.k.shape[:2] == lead
        and call.v.shape[:2] == lead
    )


def _threads() -> int:
    """The threads torch's CPU kernels run on."""
    return torch.get_num_threads()


def _constant_bias(call: Call) -> bool:
    """Whether the call adds a bias that asks for no gradient itself: no score term, no
    parameter of the scheme that requires grad, and the bias computed for these positions
    does not require grad (a user's hook, or a posenc scheme's overridden method, may read
    a tensor that does; SDPA's route would not differentiate it)."""
    hooks = call.hooks
    if hooks.score_term is not None or hooks.score_bias is None:
        return False
    if call.scheme_params:
        return False
    return not call.dense_bias.requires_grad


def _op_by_op(call: Call, scores: int) -> bool:
    """Whether the materialised path runs the formula op by op rather than SDPA with the
    bias and term as a float ``attn_mask``: for a value term (SDPA cannot add it);
    otherwise where :func:`_ops_forward` says the separate kernels are faster (a score
    term without gradients; a constant bias with gradients for ``q, k, v`` alone and values
    of another head dim; a bias alone only where a limit is raised);
    inside a forward-mode AD level (SDPA's CPU kernels and the route's autograd Functions
    have no forward derivative); and with gradients unless the bias is constant (:func:`_constant_bias`: a learned
    table or a term of the queries would make SDPA fall back to its math kernel for a mask
    that requires grad) and no ``torch.func`` transform runs (the route through SDPA takes
    an autograd Function without ``setup_context``). Above that SDPA's fused kernel runs,
    and its backward keeps no ``[b, h, n_q, n_k]`` weights."""
    if call.hooks.value_term is not None or _ops_forward(call, scores):
        return True
    if forward_ad._current_level >= 0:  # SDPA's route has no forward derivative here
        return True
    if not call.grad:
        return False
    return torch._C._are_functorch_transforms_active() or not call.constant_bias


def materialised_size(call: Call, pairs: bool = True) -> str | None:
    """Why the call is too large for the materialised path whatever it computes (but a bias
    the scheme keeps, through SDPA's fused kernel: :func:`_kept_bias_fused`; and, in
    :func:`_plan_materialised`, a call of few queries: :func:`~.few_queries.few_queries`,
    :func:`~.few_queries.bias_alone_fits`): more than
    :data:`tuning.MATERIALISED_SCORES` scores (the memory budget) or, with ``pairs``,
    :data:`tuning.MATERIALISED_PAIRS` query-key pairs per head; None if it is not (shapes
    alone: read while compiling too, where the reason names no size, so that Dynamo does
    not specialise the graph on the shapes it would print)."""
    b, h, n_q, _ = call.q.shape
    n_k = call.k.shape[2]
    scores = b * h * n_q * n_k
    over_budget = scores > tuning.MATERIALISED_SCORES
    too_many = pairs and n_q * n_k > tuning.MATERIALISED_PAIRS
    if torch.compiler.is_compiling():
        if over_budget or too_many:
            return "above MATERIALISED_SCORES scores or MATERIALISED_PAIRS pairs per head"
        return None
    if over_budget:
        return (
            f"the [b, h, n_q, n_k] scores would be {_mib(scores, call.q.dtype)}, above the "
            f"budget {_mib(tuning.MATERIALISED_SCORES, call.q.dtype)} (MATERIALISED_SCORES)"
        )
    if too_many:
        return (
            f"{n_q} x {n_k} query-key pairs per head, above MATERIALISED_PAIRS = "
            f"{tuning.MATERIALISED_PAIRS}, from which the lean paths are faster at any batch"
        )
    return None


def _offset_term_path(call: Call) -> bool:
    """Whether the offset-term path, which the term's crossovers were measured against, may
    take the call by what a kept route's key holds: the scheme's hooks (an ``offset_term``,
    no bias beside it), the fused CPU kernels, no mask but a causal one; no hook is asked
    and the positions are not read (at positions that are no run the path declines the
    call in its own plan, and the crossover chosen here holds all the same)."""
    why = _refusal(
        call, "offset_term", "a query term per offset j - i", "score_bias", causal_ok=True,
        value_ok=True,
    )  # fmt: skip
    return why is None


def _clipped_term(call: Call) -> bool:
    """Whether the call's score term is a clipped table whose rows most offsets share
    (Shaw's keys beyond their reach): its ``offset_term`` gives a table and the row of each
    offset (:func:`~.reference._run_rows`), and the rows the offsets meet are at most half
    of them, in a call the offset-term path would take (:func:`_offset_term_path`, which
    the caller has asked). The materialised path multiplies ``q`` by those rows alone and
    gathers each pair's logit, a product narrower than the scores, where the lean path
    works per strip of offsets; in self-attention with gradients, or without them where
    the forward runs in one buffer, its crossover lies higher. The answer reads the
    positions' values (the offsets met), which a kept route's key does not hold: a call it
    decides is not kept."""
    rows = _run_rows(call.hooks, call.q, call.q_pos, call.k_pos)
    if rows is None or rows[1] is None:
        return False
    index = rows[1]  # [n_q + n_k - 1], from 0 (the table cut to the rows met, then padded)
    return 2 * (int(index.max()) + 1) <= index.shape[0]


def _plan_materialised(call: Call) -> Plan:
    """The bias, term and value term written out over the ``[b, h, n_q, n_k]`` scores, where
    they are few enough that the lean paths' fixed costs (blocks in Python, many small
    kernel calls, buffers) outweigh what they save. Two kernels:

    - a value term, or a call whose bias or term asks for a gradient itself: the formula
      in plain autograd ops (scores, softmax, the weights times the values, plus the value
      term from the weights), with the scheme's fast hooks (:func:`~.reference._math`,
      ``reference=False``). On CPU it runs faster than SDPA with a float ``attn_mask`` that
      requires grad and holds what that holds; with posenc's hooks its graph is
      differentiable twice by itself (``dispatch._exact_twice`` says when no wrapper is
      needed);
    - otherwise (no gradients, or a constant bias with gradients for ``q, k, v`` alone), on
      CPU with :data:`tuning.OPS_FORWARD_THREADS` threads or more and no mask but a causal
      one, the same ops: at most :data:`tuning.OPS_IN_PLACE_SCORES` scores with no
      gradient asked for, in one buffer (:func:`~.reference._forward_in_place`; a bias
      alone at most :data:`tuning.OPS_IN_PLACE_BIAS_SCORES`), a constant bias with
      gradients (and values of the queries' head dim) at most
      :data:`tuning.OPS_GRAD_BIAS_SCORES` (and only where the weights
      the graph keeps are at most :data:`tuning.OPS_GRAD_WEIGHTS_RATIO` times what SDPA's
      route keeps: its output, and a float mask it builds), at most
      :data:`tuning.OPS_FORWARD_SCORES` otherwise (:func:`_ops_forward`; the two bias
      limits are 0);
    - otherwise SDPA with the bias and term as its float ``attn_mask``: one fused call,
      whose backward keeps no ``[b, h, n_q, n_k]`` weights (:func:`_op_by_op`).

    At most :data:`tuning.MATERIALISED_SCORES` scores (the memory budget) and
    :data:`tuning.MATERIALISED_PAIRS` query-key pairs per head; below the measured
    crossovers: :data:`tuning.MATERIALISED_VALUE_SCORES` scores for a value term
    (:data:`tuning.MATERIALISED_CAUSAL_VALUE_SCORES` under a causal mask;
    :data:`tuning.MATERIALISED_CAUSAL_SELF_VALUE_SCORES` in self-attention where the
    offset-term path may take the call, with gradients over at most
    :data:`tuning.MATERIALISED_CAUSAL_GRAD_VALUE_PAIRS` pairs per head),
    :data:`tuning.MATERIALISED_TERM_SCORES` for a score term
    (:data:`tuning.MATERIALISED_CAUSAL_TERM_SCORES` under a causal mask, whose hidden pairs
    the lean paths skip; with gradients in self-attention on the offset-term path,
    :func:`_offset_term_path`, :data:`tuning.MATERIALISED_CAUSAL_GRAD_TERM_SCORES`), past
    it :data:`tuning.MATERIALISED_CLIPPED_TERM_SCORES` for a clipped term in
    self-attention (:func:`_clipped_term`; under a causal mask at most
    :data:`tuning.MATERIALISED_CAUSAL_CLIPPED_TERM_PAIRS` pairs per head and
    :data:`tuning.MATERIALISED_CAUSAL_CLIPPED_TERM_SCORES` scores with gradients,
    :data:`tuning.MATERIALISED_CAUSAL_CLIPPED_TERM_FORWARD_SCORES` without, where the
    forward runs in one buffer),
    :data:`tuning.MATERIALISED_BIAS_SCORES` for a bias in a call that asks for gradients;
    for a bias without, the budget alone, and under a causal mask
    :data:`tuning.MATERIALISED_CAUSAL_PAIRS` pairs per head (the lean forward skips the
    hidden pairs and is cheap; a causal mask over one query hides nothing: without a window
    :class:`~.mask.Mask` drops it, and under one these limits do not read it). A bias
    without gradients asked of fewer queries than keys, too few for the lean paths
    (:func:`~.few_queries.few_queries`), stays past the pairs' limits, within the budget;
    past the scores' budget, where SDPA's fused kernel writes the bias alone and that is
    within it or within the call's keys and values
    (:func:`~.few_queries.bias_alone_fits`). Past all of these, a bias the scheme keeps
    between calls, through SDPA's fused kernel (:func:`_kept_bias_fused`).
    """
    hooks = call.hooks
    if hooks.contextual_term is not None:
        return _CONTEXTUAL
    if hooks.score_bias is None and hooks.score_term is None and hooks.value_term is None:
        return "no bias or term to write out"
    dtype = call.q.dtype
    if dtype not in (torch.float32, torch.float64):
        return (
            f"{dtype}: SDPA would add the bias rounded to {dtype}; the lean engine adds it "
            "in float32"
        )
    few = few_queries(call)
    too_large = materialised_size(call, pairs=not few)
    kept = too_large is not None and _kept_bias_fused(call)  # (only past a bound)
    # few queries past the scores' budget: within it, or within the call's keys and values,
    # where SDPA's fused kernel writes the bias alone
    bias_alone = few and too_large is not None and not kept and bias_alone_fits(call)
    if too_large is not None and not (kept or bias_alone):
        if few and not torch.compiler.is_compiling():
            return too_large + bias_alone_refusal(call)
        return too_large
    b, h, n_q, _ = call.q.shape
    n_k = call.k.shape[2]
    scores = b * h * n_q * n_k
    grad = call.grad
    value = hooks.value_term is not None
    term = value or hooks.score_term is not None
    clipped = False
    causal = call.mask.hides_pairs  # (not one query under a causal window: it hides none)
    if value:
        name = "MATERIALISED_CAUSAL_VALUE_SCORES" if causal else "MATERIALISED_VALUE_SCORES"
        if (
            causal
            and scores > min(tuning.MATERIALISED_CAUSAL_VALUE_SCORES,
                             tuning.MATERIALISED_CAUSAL_SELF_VALUE_SCORES)
            and n_q == n_k  # (self-attention on the offset-term path: what was measured)
            and (not grad or n_q * n_k <= tuning.MATERIALISED_CAUSAL_GRAD_VALUE_PAIRS)
            and _offset_term_path(call)
        ):  # fmt: skip
            name = "MATERIALISED_CAUSAL_SELF_VALUE_SCORES"
    elif term:
        # self-attention on the offset-term path: what was measured (few queries: not measured);
        # asked only past the lowest limit, under which every limit takes the call
        lowest = min(
            tuning.MATERIALISED_TERM_SCORES, tuning.MATERIALISED_CAUSAL_TERM_SCORES,
            tuning.MATERIALISED_CAUSAL_GRAD_TERM_SCORES,
        )  # fmt: skip
        measured = n_q == n_k and scores > lowest and _offset_term_path(call)
        if not causal:
            name = "MATERIALISED_TERM_SCORES"
        elif grad and measured:
            name = "MATERIALISED_CAUSAL_GRAD_TERM_SCORES"
        else:
            name = "MATERIALISED_CAUSAL_TERM_SCORES"
        clipped = (
            measured
            # (without gradients, as measured: the forward in one buffer)
            and (grad or (call.op_by_op and _in_place(call)))
            and scores > getattr(tuning, name)
            and (not causal or n_q * n_k <= tuning.MATERIALISED_CAUSAL_CLIPPED_TERM_PAIRS)
            and _clipped_term(call)
        )
        if clipped:
            name = (
                "MATERIALISED_CLIPPED_TERM_SCORES" if not causal
                else "MATERIALISED_CAUSAL_CLIPPED_TERM_SCORES" if grad
                else "MATERIALISED_CAUSAL_CLIPPED_TERM_FORWARD_SCORES"
            )  # fmt: skip
    else:
        name = "MATERIALISED_BIAS_SCORES" if grad else "MATERIALISED_SCORES"
    crossover = getattr(tuning, name)
    if scores > crossover and not (kept or bias_alone):
        kept = _kept_bias_fused(call)  # (past the crossover alone)
        if not kept:
            kind = "value term" if value else "clipped score term" if clipped else "score term"
            what = (
                ("a causal " if causal else "a ") + kind if term
                else "a bias with gradients"
            )  # fmt: skip
            return (
                f"{scores} scores [b, h, n_q, n_k], above the crossover {crossover} ({name}) "
                f"from which the lean paths run {what} faster"
            )
    if not (term or grad) and causal and n_q * n_k > tuning.MATERIALISED_CAUSAL_PAIRS and not few:
        return (
            f"a causal bias without gradients over {n_q} x {n_k} pairs per head, above "
            f"MATERIALISED_CAUSAL_PAIRS = {tuning.MATERIALISED_CAUSAL_PAIRS}: the lean paths "
            "skip the hidden pairs, which SDPA with a float mask computes"
        )
    if call.op_by_op:
        if _in_place(call):
            in_place = lambda: _forward_in_place(  # noqa: E731
                call.q, call.k, call.v, hooks, call.q_pos, call.k_pos, call.mask, call.scale,
                call.dropout_p, bias=call.known_bias,
            )  # fmt: skip
            # kept in no-grad mode (the choice then reads what the key holds; in grad mode
            # it reads which of the hooks' tensors ask for a gradient)
            # (nor where the clipped term's crossover chose it: the positions' values)
            if torch.is_grad_enabled() or clipped:
                return in_place
            return routed(in_place, _IN_PLACE_ROUTE)
        ops = lambda: _math(  # noqa: E731
            call.q, call.k, call.v, hooks, call.q_pos, call.k_pos, call.mask, call.scale,
            call.dropout_p, reference=False, bias=call.known_bias,
        )[0]  # fmt: skip
        # kept, but not where the clipped term's crossover chose it (the positions' values)
        return ops if clipped else routed(ops, _MATH_ROUTE)
    run = lambda: _sdpa(  # noqa: E731
        call.q, call.k, call.v, hooks, call.q_pos, call.k_pos, call.mask, call.scale,
        call.dropout_p, bias=None if hooks.score_bias is None else call.dense_bias,
        kept_bias=hooks.score_bias is not None and _own_kept_bias(call),
    )  # fmt: skip
    if hooks.score_term is not None or hooks.score_bias is None or bias_alone:
        return run  # (bias_alone: what it read, the kernel SDPA takes, is not in the key)
    if kept:
        return routed(run, _KEPT_FUSED_ROUTE)
    return routed(run, _BIAS_ROUTE if hooks.kept_score_bias is None else _KEPT_BIAS_ROUTE)


def _own_kept_bias(call: Call) -> bool:
    """Whether the call's bias is the one a scheme of posenc's keeps between calls (its own
    ``kept_score_bias``, as the replay's route reads it: :func:`~.kept._run`), whose
    causal-masked form :func:`~.sdpa._causal_masked` may keep too."""
    return call.bias_kept and own_hook(call.scheme, "kept_score_bias")


def _kept_bias_fused(call: Call) -> bool:
    """Whether the materialised path runs the call, whatever its size, as SDPA's fused kernel
    with the bias the scheme keeps between calls (ALiBi's: ``kept_score_bias``) as its
    float mask: a bias alone that asks for no gradient, kept in the queries' dtype, no
    mask, at most :data:`tuning.KEPT_BIAS_PAIRS` query-key pairs per head, eager, where
    SDPA takes its fused CPU kernel (:func:`~.sdpa.fused_cpu_runs`: its backward keeps no
    ``[b, h, n_q, n_k]`` weights), and not op by op (:func:`_op_by_op`). That kernel writes
    no scores and the kept bias costs the call no memory, so the scores' budget does not
    apply; past that many pairs the per-offset bias path is as fast (the crossover). The
    route kept for it reads ``kept_score_bias`` alone (:data:`_KEPT_FUSED_ROUTE`)."""
    hooks = call.hooks
    if hooks.kept_score_bias is None or hooks.score_term is not None:
        return False
    if hooks.value_term is not None or not call.mask.empty or call.dropout_p:
        return False
    q, k = call.q, call.k
    if q.shape[2] * k.shape[2] > tuning.KEPT_BIAS_PAIRS or torch.compiler.is_compiling():
        return False
    if not fused_cpu_runs(q, k, call.v):
        return False
    kept = call.kept_bias
    if kept is None or kept.dtype != q.dtype or kept.requires_grad or call.scheme_params:
        return False
    return not call.op_by_op


#: the routes of the materialised path's SDPA call with a bias alone (:mod:`.kept`): the
#: bias hooks read in turn, as :func:`~.reference._read_bias` reads them
_BIAS_ROUTE = ("score_bias",)
_KEPT_BIAS_ROUTE = ("kept_score_bias", "score_bias")
#: the route of :func:`_kept_bias_fused`'s call: the kept bias alone (a call for which the
#: scheme keeps none, or whose inputs SDPA's fused kernel does not take, goes back to the
#: dispatcher, which weighs the scores' budget)
_KEPT_FUSED_ROUTE = ("kept_score_bias",)


#: the route of the materialised path's forward in one buffer, without gradients
#: (:func:`~.reference._forward_in_place`): the scheme's hooks as the path calls them, no
#: SDPA call
_IN_PLACE_ROUTE = ("op by op, in place",)


#: the route of the materialised path's formula op by op with the fast hooks
#: (:func:`~.reference._math`): a learned table's or a value term's call with gradients
_MATH_ROUTE = ("op by op",)


def routed(run: Callable[[], Tensor], route: tuple[str, ...]) -> Callable[[], Tensor]:
    """``run``, marked with the route :mod:`.kept` may replay for calls of its signature:
    SDPA's kernel on ``q, k, v`` with the bias of the hooks named (``()``: none),
    :data:`_IN_PLACE_ROUTE` or :data:`_MATH_ROUTE`."""
    run.route = route  # type: ignore[attr-defined]
    return run
