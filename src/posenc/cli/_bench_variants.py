"""What ``posenc bench`` times: the schemes it builds and the variants it runs on them.

- the schemes: :func:`default_schemes` (bench's default run) and :func:`build_scheme` (an
  entry of :mod:`posenc.registry` built for one length);
- the inputs: ``q``, ``k``, ``v`` (:func:`_inputs`), the key padding of the batch's last
  sequence (:func:`_key_padding`) and the packed documents (:func:`_documents`);
- the variants, each a function of ``(q, k, v)`` (:func:`_variant` picks one by its key):
  ``posenc`` and ``reference`` (posenc's attention core, :func:`_core`), ``floor`` (SDPA
  without positions, :func:`_floor_of`), and the baselines of :data:`BASELINES`,
  ``flex-floor`` (:func:`_flex_floor_of`), ``materialised`` (:func:`_materialised_of`),
  ``peer`` (:func:`_peer_of`, the scheme as other code computes it:
  :mod:`posenc.cli._bench_peers`) and ``copy-floor`` (:func:`_copy_floor_of`, what a
  rotation in eager out-of-place ops pays at least).

How they are timed and measured is :mod:`posenc.cli._bench_measure`; the command and its
report, :mod:`posenc.cli.bench`.

Shape legend: ``b`` batch, ``h`` heads, ``n`` length, ``d`` head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import registry
from .._rotary_buffer import rotated
from ..dense import as_attn_mask
from ..engine import Mask, attend
from ..engine.flex import _block_mask, _compiled_flex
from ..engine.kept import replay_unmasked
from ..hooks import hooks_of
from ..indices import run_positions
from ..registry import Shape
from ._bench_peers import peer_of

# ----- the schemes ------------------------------------------------------------------------


def default_schemes() -> list[str]:
    """The schemes of bench's default run: those of :mod:`posenc.registry` inside attention
    whose ``default_in`` names ``bench``, in the registry's order."""
    return registry.names(inside=True, default_in="bench")


def build_scheme(name: str, heads: int, head_dim: int, n: int) -> Any:
    """The scheme ``name`` of :mod:`posenc.registry` built for length ``n`` (its 2-D grid:
    the squarest with ``n`` cells), with the registry's default sizes (Shaw clipped at 16,
    T5's 32 buckets up to distance 128)."""
    return registry.build(name, Shape(heads, head_dim, n, grid=registry.squarest_grid(n)))


# ----- the inputs ------------------------------------------------------------------------


def _inputs(b: int, h: int, n: int, d: int, dtype: torch.dtype, device: torch.device, grad: bool):
    gen = torch.Generator(device="cpu").manual_seed(0)
    return [
        torch.randn(b, h, n, d, generator=gen, dtype=torch.float32)
        .to(device=device, dtype=dtype)
        .requires_grad_(grad)
        for _ in range(3)
    ]


def _key_padding(b: int, n: int, padding: float, device: torch.device) -> Tensor | None:
    """``[b, n]`` bool, True = padding: the last ``round(padding * n)`` keys of the batch's
    last sequence (a batch with one shorter sequence, padded at the end; at least one key
    left), or None."""
    count = min(round(padding * n), n - 1)
    if count == 0:
        return None
    mask = torch.zeros(b, n, dtype=torch.bool, device=device)
    mask[-1, n - count :] = True
    return mask


def _documents(n: int, documents: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """``(document id [1, n], position in its document [1, n])`` of ``documents`` packed
    documents of (nearly) equal length, or None for one."""
    if documents <= 1:
        return None
    doc = torch.arange(n, device=device) * documents // n  # [n]
    starts = torch.searchsorted(doc, doc, right=False)  # each token's document start
    return doc[None], (torch.arange(n, device=device) - starts)[None]


# ----- the variants ----------------------------------------------------------------------


def _masked(
    q: Tensor, causal: bool, padding: float, documents: int, window: int | None
) -> tuple[Mask, Tensor]:
    """The mask of a bench case for ``q [b, h, n, d]`` (causal or not, the key padding of
    :func:`_key_padding`, the packed documents of :func:`_documents`, a sliding ``window``)
    and the positions ``[1, n]`` (restarting in each document)."""
    b, n = q.shape[0], q.shape[2]
    pos = run_positions(0, n, q.device)  # [1, n], as posenc.attention's default
    packed = _documents(n, documents, q.device)
    doc = None
    if packed is not None:
        doc, pos = packed
    mask = Mask(
        n,
        n,
        causal=causal,
        key_padding=_key_padding(b, n, padding, q.device),
        q_doc=doc,
        k_doc=doc,
        behind=window,
        ahead=None if causal else window,
    )
    return mask, pos


def _core(
    scheme: Any,
    backend: str,
    causal: bool = False,
    padding: float = 0.0,
    documents: int = 1,
    window: int | None = None,
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """posenc's attention core as a module runs it, without the checks of its inputs: the
    scheme's rotation, then :func:`attend` (causal or not, with the key padding of
    :func:`_key_padding`, over the packed documents of :func:`_documents`, positions
    restarting in each, in a sliding ``window``); with none of them, the route kept for
    ``q, k, v`` alone first (:func:`~posenc.engine.kept.replay_unmasked`, with its checks
    of the tensors, without the scheme's ``validate_attention``)."""
    alone = not causal and not padding and documents == 1 and window is None

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if alone:
            out = replay_unmasked(q, k, v, scheme, backend, None, validate=False, rotation=rotated)
            if out is not None:
                return out
        mask, pos = _masked(q, causal, padding, documents, window)
        q, k, lent = rotated(scheme, q, k, pos, pos, True)  # as posenc.attention rotates
        try:
            out, _ = attend(
                q, k, v, scheme=scheme, q_pos=pos, k_pos=pos, mask=mask, backend=backend
            )
        finally:
            if lent is not None:
                lent.__exit__(None, None, None)
        return out

    return run


def _floor(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def _causal_floor(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _floor_of(
    causal: bool = False, padding: float = 0.0, documents: int = 1, window: int | None = None
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The floor: SDPA without positions, with its own causal flag under a causal mask; with
    key padding, packed documents or a window, its boolean mask (``[b, 1, 1, n]``, or
    ``[b, 1, n, n]`` with the causal mask, the documents or the window folded in: SDPA
    takes one mask)."""
    if padding == 0 and documents <= 1 and window is None:
        return _causal_floor if causal else _floor

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keep = _keep(q.shape[0], q.shape[2], causal, padding, documents, window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    return run


def _keep(
    b: int,
    n: int,
    causal: bool,
    padding: float,
    documents: int,
    window: int | None,
    device: torch.device,
) -> Tensor:
    """The floor's boolean mask, True = attend: ``[b, 1, 1, n]`` (key padding alone) or
    ``[b, 1, n, n]``."""
    pad = _key_padding(b, n, padding, device)
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool, device=device)
    if pad is not None:
        keep = ~pad[:, None, None, :]  # [b, 1, 1, n]
    if causal:
        keep = keep & torch.ones(n, n, dtype=torch.bool, device=device).tril()
    packed = _documents(n, documents, device)
    if packed is not None:
        doc = packed[0][0]  # [n]
        keep = keep & (doc[:, None] == doc[None, :])  # [b, 1, n, n]
    if window is not None:
        i = torch.arange(n, device=device)
        keep = keep & ((i[:, None] - i[None, :]).abs() < window)  # [b, 1, n, n]
    return keep


def _flex_floor_of(
    causal: bool = False, padding: float = 0.0, documents: int = 1, window: int | None = None
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The FlexAttention floor: compiled FlexAttention with no ``score_mod`` and the floor's
    mask as a ``BlockMask`` (none without a mask), both as posenc's flex path has them (the
    same compiled function; a mask of the shape alone, causal or a window, built once per
    shape, one with padding or documents in each call)."""

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        mask, _ = _masked(q, causal, padding, documents, window)
        block_mask = None if mask.empty else _block_mask(mask, q.shape[0], None, q.device)
        return _compiled_flex(q.device.type)(q, k, v, block_mask=block_mask)

    return run


class _Copied(torch.autograd.Function):
    """A copy of ``x`` whose backward copies the gradient, with no arithmetic: the passes
    that a rotation written as an out-of-place autograd Function per tensor makes at
    least (it writes a rotated ``q`` and ``k`` for the kernel to read and, with
    gradients, the rotations of their gradients), at its cost per Function."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.clone()


def _copy_floor_problem(scheme: Any) -> str | None:
    """Why the copy floor is no yardstick for ``scheme`` (no rotation), or None."""
    if hooks_of(scheme).rotate is None:
        return "no rotation: the copy floor is a yardstick for rotating q and k"
    return None


def _copy_floor_of(
    causal: bool = False, padding: float = 0.0, documents: int = 1, window: int | None = None
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The copy floor: the floor (:func:`_floor_of`, its mask too) on copies of ``q`` and
    ``k``, their gradients copied in the backward (:class:`_Copied`), so one out-of-place
    pass over each in each direction, through a Python autograd Function per tensor. A
    rotation of that form (posenc's) is no faster; one in place, fused into the
    projection or the layout copy before attention, or in one native op for both tensors
    can be."""
    floor = _floor_of(causal, padding, documents, window)

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return floor(_Copied.apply(q), _Copied.apply(k), v)

    return run


def _materialised_problem(scheme: Any) -> str | None:
    """Why no dense ``attn_mask`` can carry ``scheme`` (a content-dependent term), or None."""
    hooks = hooks_of(scheme)
    terms = [
        t for t in ("score_term", "value_term", "contextual_term") if getattr(hooks, t) is not None
    ]
    if terms:
        return (
            f"a content-dependent term ({', '.join(terms)}): no attn_mask can carry it, "
            "there is no materialised bias to compare with"
        )
    return None


def _materialised_of(
    scheme: Any,
    causal: bool = False,
    padding: float = 0.0,
    documents: int = 1,
    window: int | None = None,
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """What Hugging Face-style code does: SDPA with the scheme's dense bias
    (:func:`posenc.as_attn_mask`, ``[1, h, n, n]``; built in each call, its gradient
    reaching a learned table) and the floor's mask folded in as ``-inf``
    (``[b|1, h, n, n]``); a rotary scheme rotates ``q`` and ``k`` and calls the floor.
    Positions restart in each packed document, as in :func:`_core`."""
    hooks = hooks_of(scheme)
    floor = _floor_of(causal, padding, documents, window)

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, n = q.shape[0], q.shape[2]
        pos = torch.arange(n, device=q.device)[None]
        packed = _documents(n, documents, q.device)
        if packed is not None:
            pos = packed[1]
        if hooks.rotate is not None:
            q, k = hooks.rotate(q, k, pos, pos)
        if hooks.score_bias is None:
            return floor(q, k, v)
        bias = as_attn_mask(scheme, n, positions=pos, dtype=q.dtype, device=q.device)
        if causal or padding or documents > 1 or window is not None:
            keep = _keep(b, n, causal, padding, documents, window, q.device)
            bias = bias.masked_fill(~keep, float("-inf"))  # [b|1, h, n, n]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    return run


def _peer_of(
    scheme: Any,
    causal: bool = False,
    padding: float = 0.0,
    documents: int = 1,
    window: int | None = None,
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The scheme as other code computes it (:func:`posenc.cli._bench_peers.peer_of`), with
    the floor's boolean mask (:func:`_keep`) where the case has one. Positions are
    ``0 .. n-1``: packed documents have no peer (``peer_problem`` says so)."""
    masked = causal or padding > 0 or documents > 1 or window is not None

    def keep(q: Tensor) -> Tensor | None:
        if not masked:
            return None
        return _keep(q.shape[0], q.shape[2], causal, padding, documents, window, q.device)

    return peer_of(scheme, keep)


#: ``--baselines`` values and the variants they add
BASELINES = {
    "flex": "flex-floor",
    "materialised": "materialised",
    "peer": "peer",
    "copies": "copy-floor",
}


def compiled(fn: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    """``fn`` under :func:`torch.compile` with static shapes (``dynamic=False``: each
    case's sizes are fixed, as in a model compiled for them), graph breaks allowed (as a
    user compiles a model)."""
    return torch.compile(fn, dynamic=False)


def _variant(
    key: str,
    scheme: Any,
    backend: str,
    causal: bool = False,
    padding: float = 0.0,
    documents: int = 1,
    window: int | None = None,
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The function that runs variant ``key`` (``floor``, ``posenc``, ``reference``,
    ``flex-floor``, ``materialised``, ``peer``, ``copy-floor``)."""
    masks = (causal, padding, documents, window)
    if key == "floor":
        return _floor_of(*masks)
    if key == "flex-floor":
        return _flex_floor_of(*masks)
    if key == "materialised":
        return _materialised_of(scheme, *masks)
    if key == "peer":
        return _peer_of(scheme, *masks)
    if key == "copy-floor":
        return _copy_floor_of(*masks)
    return _core(scheme, "math" if key == "reference" else backend, *masks)
