"""The engine's tuning constants, one line each.

What each was measured at, and with which command, is the "tuning constants" table of
docs/performance.md. Code reads them as ``tuning.NAME`` at call time, so that a test or
an experiment can change one by assigning it (``tuning.NAME = value``, or pytest's
``monkeypatch.setattr``, ``mock.patch.object``): each assignment or deletion sets
:data:`state`, the constants' names and values in one tuple, and :data:`key`, its
number, which the kept routes' key holds (:mod:`.kept`). A write into the module's dict
itself (``vars(tuning)[NAME] = ...``, ``mock.patch.dict(tuning.__dict__, ...)``) bypasses
it: call :func:`posenc.engine.kept.clear` after one, or a kept route may be replayed for
a constant since changed (a path exact either way, but maybe not the one the constant
now chooses).
"""

from __future__ import annotations

import sys
import threading
import types

#: a probability ``exp(x - lse)`` below ``exp(-EXP_FLOOR)`` is exactly 0 (no denormals)
EXP_FLOOR = 80.0
#: least span below its row's best bias at which a far bias is raised (see ``_bias_span``)
BIAS_SPAN = 60.0
#: scores ``[b, h, rows, n_k]`` per block of the general lean engine
LEAN_BLOCK_ELEMENTS = 1 << 22
#: scores ``[b, g, rows, n_k]`` per block of a written-out backward (1-D paths)
WRITTEN_BLOCK_ELEMENTS = 1 << 19
#: query rows per kernel call on the per-offset bias path under a causal mask
CAUSAL_ROWS = 256
#: scores per block of the 2-D term's written-out backward
GRID_TERM_WRITTEN_ELEMENTS = 1 << 21
#: query-key pairs per head from which a clipped table's far pairs take the fused kernels
FAR_PAIRS = 1 << 21
#: query rows per fused-kernel call on the grid paths (whole map rows, at least one)
GRID_KERNEL_ROWS = 256
#: query-key pairs per head from which a 2-D bias over a whole map takes its grid path
GRID_BIAS_PAIRS = 1 << 18
#: elements of one 2-D bias buffer or 2-D term block (below glibc's 32 MiB mmap threshold)
GRID_BUFFER_ELEMENTS = 1 << 22
#: query-key pairs of the masked call per call, at least, for a mask to run in blocks
MASK_BLOCK_PAIRS = 1 << 15
#: query rows per call, at least, of a causal sliding window run in blocks
WINDOW_BLOCK_ROWS = 128
#: scores [b, h, n_q, n_k] at most that the materialised path writes out (memory budget;
#: a few queries' bias alone through SDPA's fused kernel: it or the call's keys and values,
#: engine/few_queries.py; under torch.compile, past it or MATERIALISED_PAIRS a call runs the lean engine as one
#: operator: engine/compiled.py)
MATERIALISED_SCORES = 1 << 23
#: query-key pairs per head at most on the materialised path (past it the lean paths win)
MATERIALISED_PAIRS = 1 << 16
#: queries per sequence of the batch (32 x b) below which a bias without gradients, with
#: no mask but the causal one, over more keys than queries (cross-attention, a few tokens
#: decoded at once, a prompt read in chunks) stays on the materialised path past
#: MATERIALISED_PAIRS and MATERIALISED_CAUSAL_PAIRS (fewer than MATERIALISED_QUERIES in
#: all), within the budget and past it where SDPA's fused kernel writes the bias alone,
#: within the budget or the call's keys and values (engine/few_queries.py). The lean paths pass over every key and value once or more per
#: call (the per-offset path reverses them), which few queries do not pay for, while the
#: bias is written once for the whole batch; a causal mask over fewer queries than keys
#: hides few pairs. materialised / lean forward, h=8 d=64, ALiBi, T5's decoder and Swin
#: 1-D over 1024 keys, with and without the causal mask (4096 keys in brackets), 32
#: queries: b=1 1.11-1.41 (0.74-1.10), b=2 0.93-1.13, b=4 0.78-1.01, b=8 0.77-0.88
#: (0.32-0.39); 64 queries: b=2 0.92-1.11, b=4 0.87-1.13, b=8 0.78-0.91 (0.47-0.57); 128
#: queries: b=4 0.98-1.20, b=8 0.91-0.99 (0.60-0.78); 256 queries: b=8 0.97-1.08
#: (0.93-1.11)
MATERIALISED_QUERIES_PER_SEQUENCE = 32
#: the queries from which MATERIALISED_QUERIES_PER_SEQUENCE keeps none materialised
MATERIALISED_QUERIES = 256
#: query-key pairs per head at most for which a bias the scheme keeps between calls
#: (ALiBi's) runs SDPA's fused kernel with it as the float mask, past MATERIALISED_SCORES,
#: MATERIALISED_PAIRS and MATERIALISED_BIAS_SCORES: that kernel writes no scores and the
#: kept bias costs the call no memory (no mask but the bias, the bias in the queries'
#: dtype, inputs SDPA's fused kernel takes); the crossover against the per-offset bias
#: path, measured at b=2-16 h=8 d=64
KEPT_BIAS_PAIRS = 1 << 18
#: scores at most on the materialised path for a bias with gradients (the crossover)
MATERIALISED_BIAS_SCORES = 3 << 21
#: scores at most on the materialised path for a score term (the crossover)
MATERIALISED_TERM_SCORES = 3 << 19
#: scores at most on the materialised path for a score term under a causal mask
MATERIALISED_CAUSAL_TERM_SCORES = 1 << 18
#: the same in self-attention with gradients, where the offset-term path may take the
#: call (its hooks, the mask's kind, the fused CPU kernels: plans._offset_term_path)
MATERIALISED_CAUSAL_GRAD_TERM_SCORES = 3 << 19
#: scores at most on the materialised path for a clipped score term (most offsets share a
#: row of its table: Shaw's keys beyond their reach) in self-attention (the crossover)
MATERIALISED_CLIPPED_TERM_SCORES = 3 << 21
#: the same under a causal mask, in a call with gradients
MATERIALISED_CAUSAL_CLIPPED_TERM_SCORES = 3 << 20
#: the same under a causal mask without gradients (the forward in one buffer)
MATERIALISED_CAUSAL_CLIPPED_TERM_FORWARD_SCORES = 3 << 19
#: query-key pairs per head at most for which a causal call takes these two crossovers
#: (n = 128; at n = 256 runs disagree on which path wins: docs/performance.md)
MATERIALISED_CAUSAL_CLIPPED_TERM_PAIRS = 1 << 14
#: scores at most on the materialised path for a value term (the crossover)
MATERIALISED_VALUE_SCORES = 3 << 21
#: scores at most on the materialised path for a value term under a causal mask
MATERIALISED_CAUSAL_VALUE_SCORES = 1 << 21
#: the same in self-attention, where the offset-term path may take the call (its hooks
#: and the mask's kind: plans._offset_term_path)
MATERIALISED_CAUSAL_SELF_VALUE_SCORES = 3 << 21
#: query-key pairs per head at most for which a causal call with gradients takes that
#: limit (n = 256 lost at 3 x 2^21)
MATERIALISED_CAUSAL_GRAD_VALUE_PAIRS = 1 << 14
#: pairs per head at most on the materialised path for a causal bias without gradients
MATERIALISED_CAUSAL_PAIRS = 1 << 12
#: scores at most for which the materialised path runs op by op a call that SDPA could
#: run and that neither OPS_IN_PLACE_* nor OPS_GRAD_BIAS_SCORES governs: a constant bias
#: with gradients and values of another head dim (SDPA's math kernel), a call under a
#: torch.func transform; measured when it governed every call that SDPA's fused kernel
#: could run: below it the separate kernels beat SDPA's fused kernel with a float mask on
#: CPU with two threads or more (on one thread the fused kernel was as fast or faster at
#: every shape measured, b=2 n=64 and Swin's windows: never op by op)
OPS_FORWARD_SCORES = 3 << 19
#: the same for a constant bias with gradients for q, k, v (no score term; ALiBi's, a
#: frozen table's) and values of the queries' head dim (another d_v stays under
#: OPS_FORWARD_SCORES): 0, SDPA's fused route at every size, the peer's own kernel; op by
#: op took 0.78-0.80x its time at b=2 n=64 on the twelfth pass's CPU and 1.07-1.31x there
#: on the seventeenth's (1.17-1.59x at n = 16, default and AVX2 kernels), so its gain
#: depends on the machine (docs/performance.md, "Seventeenth pass")
OPS_GRAD_BIAS_SCORES = 0
#: with gradients for q, k, v, a constant bias runs op by op (under OPS_GRAD_BIAS_SCORES)
#: only where the [b, h, n_q, n_k] weights its graph keeps are at most this many times
#: what SDPA's fused route keeps beside q, k, v: its output [b, h, n_q, d_v], and the
#: float mask where the call builds one (a bias not kept between calls, or cast, or with
#: the causal mask folded in; never with d_v other than d, where SDPA runs its math
#: kernel). For ALiBi's kept bias in self-attention that is n <= d_v; beyond
#: it, fwd+bwd time / peak memory against the peer, op by op -> SDPA's route (b=2 h=8
#: d=64): n=96 1.08-1.09 / 1.22 -> 1.17-1.22 / 1.00, n=128 1.03-1.10 / 1.47 ->
#: 1.14-1.16 / 1.00, n=256 1.03 / 2.39 -> 1.06-1.08 / 1.00; Swin's windows (n=49 d=32)
#: 0.83-0.85 / 1.26 -> 1.04-1.07 / 1.00 (docs/performance.md, "Twelfth pass")
OPS_GRAD_WEIGHTS_RATIO = 1
#: scores at most for which the materialised path runs op by op, in one buffer, a call
#: with a score term that asks for no gradient and that SDPA's fused kernel could run (no
#: mask but a causal one, two threads or more): at BERT-size the in-place forward takes
#: 0.76-0.94x SDPA's time on one CPU, 1.00x (causal 0.96-1.04x) for a term on another
#: (docs/performance.md)
OPS_IN_PLACE_SCORES = 3 << 21
#: the same for a bias alone (no score term): 0, SDPA with the bias as its float mask at
#: every size, the route of the code it replaces, for a call the buffer would take (eager,
#: no forward-mode AD or torch.func: those stay op by op under OPS_FORWARD_SCORES); the
#: in-place forward took 0.77-0.94x SDPA's time on one CPU and 1.05-1.36x on another
#: (docs/performance.md): its gain depends on the machine's GEMMs, SDPA's route never
#: loses to that code
OPS_IN_PLACE_BIAS_SCORES = 0
#: values that a thread keeps, per device and dtype, for the in-place forward's scores
#: (and its weights where its softmax is not in place), for the queries and keys a call
#: without gradients rotates and for the keys and values the per-offset bias path reverses,
#: between calls (engine/workspace.py: 2^23 is 32 MiB in float32, above
#: OPS_IN_PLACE_SCORES; a larger call borrows a fresh one)
WORKSPACE_ELEMENTS = 1 << 23
#: keys per row, a multiple of which the in-place forward's softmax writes into its input
#: (AVX-512 holds 16 float32: a shorter last vector of a row, stored, stalls the next
#: row's first load; softmax in place / into another buffer, 2^20 float32, AVX-512: rows
#: of 48, 64, 96, 128, 256 keys 0.93-0.99, of 49, 56, 60, 100, 120, 196, 200 keys
#: 1.14-1.43; AVX2: 0.96-1.01 for all)
SOFTMAX_IN_PLACE_COLUMNS = 16
#: a product of the queries with a table of rows (one per offset: 2n - 1 of them) is
#: computed over the table padded with zero rows to a multiple of this many where that
#: adds at most an eighth to its rows (diagonals.padded_count; the lean offset-term strips
#: widened by the table's next rows), the extra columns not read: CPU GEMMs run slow edge
#: kernels for an odd count of output columns (q @ table^T alone, padded / not:
#: 0.44-0.77 for 63, 97, 127, 255, 511, 1023 rows and 0.51 for 13, default and AVX2; 33
#: rows to 40 0.96-1.05, and Shaw's attention 1.02-1.09: not padded)
GEMM_COLUMNS = 8
#: elements at most of the pairs' value vectors ``a^V [B', n_q, n_k, d]`` that Shaw's value
#: term builds where no graph is recorded and they are no larger than the weights (one
#: product per query in place of ``scatter_add_``); past it the table leaves the caches
#: and the bins are faster again (16 MiB in float32)
SHAW_PAIR_VALUES = 1 << 22
#: threads at least for which a call runs op by op under OPS_FORWARD_SCORES,
#: OPS_IN_PLACE_SCORES or OPS_IN_PLACE_BIAS_SCORES
OPS_FORWARD_THREADS = 2
#: elements of the queries at least for a rotation without gradients in an attention call
#: to write the rotated queries and keys into the thread's kept buffer (engine/workspace.py:
#: no new tensors; below it a new tensor costs less than lending the buffer)
ROTATION_BUFFER_ELEMENTS = 1 << 18
#: elements at least of the scores (or bias) that a kept causal or window band fills in one
#: addcmul with its float forms (engine/mask.py, Mask.filled) rather than masked_fill;
#: below it the sum that checks them and the Python around it cost more
FILLED_ELEMENTS = 1 << 15
#: routes a scheme keeps at most (engine/kept.py: the dispatcher's choice per call
#: signature, replayed without the walk); one more empties the scheme's routes first; 0
#: keeps none
KEPT_ROUTES = 16
#: queries at most of a call without gradients over more keys, and fewer than the least
#: key count of its band [2^(m-1), 2^m) (a decoding step, a speculative decoder's drafts
#: checked at once), whose kept route is keyed by its key count's power of two, not the
#: count (engine/kept.py): the steps of a growing cache
#: replay the route of the first step of each band. Its scores [b, h, n_q, n_k] are then
#: at most a quarter of the keys' [b, h, n_k, d] at d = 64, where a band replays a
#: materialised route past a limit
KEPT_BAND_QUERIES = 16


class _Constants(types.ModuleType):
    """This module: each assignment or deletion of an attribute sets :data:`state` anew."""

    # ModuleType's own methods, not super(): a reload replaces this class, ``__class__``
    # included, in the middle of an assignment. One assignment at a time: two threads'
    # assignments must not leave the state one of them computed before the other's.
    def __setattr__(self, name: str, value: object) -> None:
        with _ASSIGNING:
            types.ModuleType.__setattr__(self, name, value)
            _set_state(self)

    def __delattr__(self, name: str) -> None:
        with _ASSIGNING:
            types.ModuleType.__delattr__(self, name)
            _set_state(self)


def _set_state(module: types.ModuleType) -> None:
    """:data:`state` and :data:`key` anew, from the module's constants as they are now."""
    now = _state(vars(module))
    types.ModuleType.__setattr__(module, "state", now)
    types.ModuleType.__setattr__(module, "key", _numbered.setdefault(now, len(_numbered)))


_ASSIGNING = threading.RLock()


def _state(names: dict[str, object]) -> tuple[tuple[str, object], ...]:
    """Every constant (a public name in capitals) and its value, in their order in the
    module; a value that cannot be hashed stands as a token of its own, equal to no other."""
    state = []
    for name, value in names.items():
        if name.isupper() and not name.startswith("_"):
            try:
                hash(value)
            except TypeError:
                value = object()
            state.append((name, value))
    return tuple(state)


#: every constant's name and value as they are now (kept up to date by each assignment): a
#: key that holds it matches while the constants have these values
state = _state(vars())
#: each state met, numbered in the order met (kept across a reload of this module, so that
#: a number never stands for two states)
_numbered: dict[tuple[tuple[str, object], ...], int] = globals().get("_numbered", {})
#: the number of :data:`state` in :data:`_numbered`: equal states, equal numbers; what a key
#: holds in its place (an int hashes at no cost, the tuple of every constant does not)
key = _numbered.setdefault(state, len(_numbered))
sys.modules[__name__].__class__ = _Constants
