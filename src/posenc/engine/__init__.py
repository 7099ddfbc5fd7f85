"""The attention engine: every path (reference, SDPA, FlexAttention, the lean engine and its
fused CPU paths), behind one signature, and the dispatcher that picks one.

Every path computes, for queries ``q`` and keys ``k`` already rotated by the scheme,

    s = (q k^T + score_term) * scale + score_bias        (masked keys removed)
    s = s + contextual_term(s)                            (CoPE: read from s itself)
    w = softmax(s)                                        (a query with no key: w = 0)
    out = dropout(w) v + value_term(dropout(w))

and returns ``out [b, h, n_q, d]``. One module per path; :mod:`.dispatch` walks them in
order (:data:`~posenc.engine.dispatch.PATHS`; the lean paths' plans are in
:mod:`.lean_plans`, the materialised path's in :mod:`.plans`), each answering "I can run
this" or "no, because ...". A new fast path is one module and one entry there. A call
without mask, dropout or weights whose path is one SDPA call (on ``q, k, v``, or with the
scheme's bias alone as its float mask; with gradients, only where the dispatcher runs it
with no wrapper) replays the route kept for its signature (:mod:`.kept`): a path placed
before the materialised one must read nothing that signature does not hold. Under
``torch.compile`` a call too large to write out runs this eager engine as one opaque
operator (:mod:`.compiled`). The engine sees a scheme's hooks (:mod:`posenc.hooks`), never
its class.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim;
positions ``q_pos [B', n_q]``, ``k_pos [B', n_k]`` with ``B'`` 1 (shared) or ``b``.
"""

from .dispatch import BACKENDS, PATHS, Explanation, attend, explain_call
from .mask import Mask
from .workspace import release_workspace

__all__ = [
    "BACKENDS",
    "PATHS",
    "Explanation",
    "Mask",
    "attend",
    "explain_call",
    "release_workspace",
]
