"""The SDPA path: :func:`torch.nn.functional.scaled_dot_product_attention` with the score
term and the bias folded into its ``attn_mask``; a contextual term (CoPE) too, read from
the logits that this path computes once more for it.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import Tensor

from ..hooks import Hooks
from .blocks import _by_blocks, _mask_blocks
from .mask import Mask
from .reference import _contextual_extra, _fold_scores


def _sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    hooks: Hooks,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Mask,
    scale: float,
    dropout_p: float,
    *,
    blocks: bool = True,
) -> Tensor:
    """SDPA with the hooks' terms and the mask in its ``attn_mask`` (``blocks``: a mask that
    runs in blocks, :func:`_mask_blocks`, does; False for a block itself)."""
    if hooks.value_term is not None:
        raise ValueError(
            "backend='sdpa' cannot add a value term (Shaw's a^V needs the attention weights); "
            "use backend='auto' or 'math'"
        )
    if hooks.contextual_term is not None:  # the logits once more, and the term read from them
        extra = _contextual_extra(hooks, q, k, q_pos, k_pos, mask, scale)
    else:
        extra = _fold_scores(hooks, q, q_pos, k_pos, scale, reference=False, mask=mask)
    if extra is None and dropout_p == 0 and blocks:
        pieces = _mask_blocks(mask, q, cut=False)
        if pieces is not None:  # padding at the ends, documents, a window: no [n_q, n_k] mask
            block = functools.partial(_sdpa, blocks=False)
            return _by_blocks(q, k, v, hooks, q_pos, k_pos, scale, pieces, block)
    keep = mask.keep(device=q.device)
    has_key: Tensor | None = None
    is_causal = False
    if (
        keep is not None
        and extra is None
        and mask.causal
        and mask.n_q == mask.n_k
        and mask.causal_at_most
    ):
        keep, is_causal = None, True  # SDPA's own causal flag: its fastest path
    if keep is not None and not (mask.causal_at_most and mask.n_q <= mask.n_k):
        # a causal mask aligned at the end leaves every query key 0 when n_q <= n_k
        has_key = keep.any(dim=-1, keepdim=True)  # [b|1, 1, n_q, 1]
        keep = keep | ~has_key  # rows with no key attend to all keys, and are zeroed below
    if extra is None:
        attn_mask = keep
    else:
        attn_mask = extra.to(q.dtype)
        if keep is not None:
            attn_mask = attn_mask.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
    if has_key is not None:
        out = out * has_key
    return out
