"""The checks and defaults of :func:`posenc.attention`'s arguments: the scheme passed as
``position=``, the shapes and dtypes of ``q, k, v``, the masks, the default positions.

Shape legend: ``b`` batch, ``h`` heads, ``n_q`` queries, ``n_k`` keys, ``d`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _validate as check
from .engine import BACKENDS
from .hooks import HOOK_NAMES, attribute
from .indices import positions_from_documents, run_positions


def check_scheme(position: Any) -> None:
    """Raise unless ``position`` is None or a scheme object that defines an attention hook.

    Raises:
        TypeError: a class instead of an instance, or an object with no hook (e.g. a
            place-1 input encoding).
    """
    if isinstance(position, type):
        raise TypeError(
            f"position={position.__name__} is a class, not a scheme object; pass an "
            f"instance, e.g. position={position.__name__}(...) with the arguments its "
            f"constructor takes"
        )
    if position is not None and not any(callable(attribute(position, name)) for name in HOOK_NAMES):
        raise TypeError(
            f"position={type(position).__name__} defines none of the attention hooks "
            f"{HOOK_NAMES}; an input encoding (place 1, e.g. SinusoidalEncoding) is "
            f"added to the input before attention, not passed as position="
        )


def default_query_positions(n_q: int, n_k: int, causal: bool, device: torch.device) -> Tensor:
    """``arange(n_q)``, shifted by ``n_k - n_q`` when causal with fewer queries (decoding):
    ``[1, n_q]``."""
    start = n_k - n_q if causal and n_q < n_k else 0
    return run_positions(start, n_q, device)  # [1, n_q]


def prepare(
    q: Any,
    k: Any,
    v: Any,
    *,
    position: Any,
    positions: Tensor | None,
    key_positions: Tensor | None,
    causal: object,
    key_padding_mask: Tensor | None,
    valid_lens: Tensor | None,
    document_ids: Tensor | None,
    scale: float | None,
    dropout_p: float,
    backend: object,
    attn_mask: Tensor | None,
    window: object,
) -> dict[str, Any]:
    """The checks and defaults of :func:`posenc.attention`: the keyword arguments of its
    core (``posenc.attention._core``)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check.floating(name, x)
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have shape [batch, heads, seq, head_dim], got shape "
                f"{tuple(x.shape)}; from [batch, seq, heads, head_dim] use {name}.transpose(1, 2)"
            )
        if x.dtype != q.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but q has {q.dtype}; they must match: convert "
                f"with {name}.to({q.dtype})"
            )
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    grouped = h % k.shape[1] == 0 if k.shape[1] else h == 0  # no key heads: no query heads
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or not grouped:
        raise ValueError(
            f"q, k and v must share the batch, and k and v their heads, which must divide q's "
            f"(grouped-query attention: q [b, h, n_q, d], k and v [b, h_kv, n_k, d] with h a "
            f"multiple of h_kv), got shapes {tuple(q.shape)}, {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    if k.shape[3] != d:
        raise ValueError(f"k must have head_dim {d} as q, got shape {tuple(k.shape)}")
    if v.shape[2] != n_k:
        raise ValueError(f"k and v must have the same length, got {n_k} and {v.shape[2]}")
    check_scheme(position)
    validate = attribute(position, "validate_attention")
    if callable(validate):
        validate(heads=h, head_dim=d)
    causal = check.causal_flag(causal)
    dropout_p = check.probability("dropout_p", dropout_p)
    if scale is not None:
        scale = check.positive_float("scale", scale)
    documents = None
    if document_ids is not None:
        if n_q != n_k:
            raise ValueError(
                f"document_ids is for self-attention over packed sequences (n_q == n_k), got "
                f"n_q={n_q}, n_k={n_k}"
            )
        documents = check.document_ids(document_ids, b, n_q)
        if positions is None:
            positions = positions_from_documents(documents)
    device = q.device
    if positions is None:
        q_pos = default_query_positions(n_q, n_k, causal, device)
    else:
        q_pos = check.positions(positions, n=n_q, batch=b, device=device)
    if key_positions is not None:
        k_pos = check.positions(key_positions, n=n_k, batch=b, name="key_positions", device=device)
    elif positions is not None and n_q == n_k:
        k_pos = q_pos  # self-attention: the keys are the queries' tokens
    elif positions is not None:
        raise ValueError(
            f"positions covers the {n_q} queries but there are {n_k} keys: pass "
            f"key_positions [{n_k}] or [{b}, {n_k}] too"
        )
    elif n_q == n_k:  # the default query positions, arange(n_k): one tensor for both
        k_pos = q_pos
    else:
        k_pos = run_positions(0, n_k, device)  # [1, n_k]
    return dict(
        position=position,
        q_pos=q_pos,
        k_pos=k_pos,
        key_padding=check.key_padding_mask(key_padding_mask, b, n_k),
        lengths=check.valid_lens(valid_lens, b, n_q),
        causal=causal,
        documents=documents,
        cache=None,
        backend=check.backend(backend, BACKENDS),
        dropout_p=dropout_p,
        scale=scale,
        attn_mask=attn_mask,
        window=check.window(window),
    )


def plain_number(value: object) -> float:
    """``value`` where it is a Python float or int (not a bool), else NaN (which compares
    false: the full call then checks it)."""
    return value if value.__class__ is float or value.__class__ is int else float("nan")  # type: ignore[return-value]
