"""A small pre-norm transformer built from posenc's own modules.

Token embedding, an optional input encoding (place 1), ``layers`` blocks of
``x + MultiHeadAttention(LayerNorm(x))`` and ``x + MLP(LayerNorm(x))`` (pre-norm, as in
GPT-2), a final ``LayerNorm`` and a linear read-out per token. The positional scheme of
places 2-5 is passed in as an object, as to :class:`~posenc.MultiHeadAttention`.

It is what ``posenc compare`` trains, and is small enough to train on a laptop CPU in
seconds; use it from Python too::

    model = TinyTransformer(vocab=16, position=lambda: ALiBi(4))
    logits = model(tokens)                       # [b, n] -> [b, n, vocab]

Shape legend: ``b`` batch, ``n`` tokens, ``dim`` model width, ``H x W`` a token grid
(row-major, ``n = H * W``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import _validate as check
from ..absolute import SinusoidalEncoding2D
from ..attention import MultiHeadAttention

__all__ = ["TinyTransformer", "TransformerBlock"]


class TransformerBlock(nn.Module):
    """One pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Args:
        dim: model width.
        heads: attention heads.
        position: the positional scheme of this block's attention, or None.
        mlp_ratio: hidden width of the MLP as a multiple of ``dim``.
        dropout: dropout on the attention weights and after the MLP.
        backend: the attention backend (see :class:`~posenc.MultiHeadAttention`).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        position: Any = None,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(
            dim, heads, position=position, dropout=dropout, backend=backend
        )
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim),
            nn.GELU(),
            nn.Linear(mlp_ratio * dim, dim),
            nn.Dropout(dropout),
        )

    def forward(
        self,
        x: Tensor,
        *,
        causal: bool = False,
        positions: Tensor | None = None,
        need_weights: bool = False,
        **attn: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x [b, n, dim] -> [b, n, dim]``; ``attn`` goes to the attention (masks, cache).

        With ``need_weights`` also returns the attention weights ``[b, h, n, n]``.
        """
        out = self.attn(
            self.norm1(x), causal=causal, positions=positions, need_weights=need_weights, **attn
        )
        out, weights = out if need_weights else (out, None)
        x = x + out
        x = x + self.mlp(self.norm2(x))
        return (x, weights) if need_weights else x


class TinyTransformer(nn.Module):
    """A small transformer over tokens with one positional scheme.

    Args:
        vocab: number of token ids.
        dim: model width.
        layers: number of blocks.
        heads: attention heads; must divide ``dim``.
        encoding: an input encoding (place 1) added to the token embeddings, e.g.
            :class:`~posenc.SinusoidalEncoding`, :class:`~posenc.LearnedEncoding` or
            :class:`~posenc.SinusoidalEncoding2D` (then ``forward`` needs ``size``), or None.
        position: the scheme inside attention (places 2-5): either one object shared by
            every block (as T5 shares its bias), or a zero-argument callable that builds
            one per block (each block then learns its own table), or None.
        num_outputs: read-out classes per token (default ``vocab``).
        dropout: attention and MLP dropout.
        backend: the attention backend.

    Raises:
        ValueError: non-positive sizes, or ``dim % heads != 0``.
        TypeError: ``encoding`` is not an ``nn.Module``.
    """

    def __init__(
        self,
        vocab: int,
        *,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
        encoding: nn.Module | None = None,
        position: Any = None,
        num_outputs: int | None = None,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        check.positive_int("vocab", vocab)
        check.positive_int("dim", dim)
        check.positive_int("layers", layers)
        if encoding is not None and not isinstance(encoding, nn.Module):
            raise TypeError(
                f"encoding must be an input encoding module (e.g. SinusoidalEncoding(dim)), "
                f"got {type(encoding).__name__}"
            )
        self.dim = dim
        self.embed = nn.Embedding(vocab, dim)
        self.encoding = encoding
        per_block = callable(position) and not isinstance(position, nn.Module)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                dim,
                heads,
                position=position() if per_block else position,
                dropout=dropout,
                backend=backend,
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_outputs or vocab)

    def forward(
        self,
        tokens: Tensor,
        *,
        causal: bool = False,
        positions: Tensor | None = None,
        size: tuple[int, int] | None = None,
        **attn: Any,
    ) -> Tensor:
        """Logits for every token.

        Args:
            tokens: ``[b, n]`` token ids.
            causal: causal attention (a language model).
            positions: ``[n]`` or ``[b, n]`` integer positions, given to the input
                encoding and to every attention (default ``arange(n)``).
            size: ``(H, W)`` when the tokens are a grid (row-major); needed by a 2-D input
                encoding.
            **attn: more arguments for every attention (``key_padding_mask``,
                ``valid_lens``, ``document_ids``).

        Returns:
            ``[b, n, num_outputs]`` logits.

        Raises:
            ValueError: a 2-D input encoding without a ``size`` that matches ``n``.
        """
        return self.head(self.norm(self._blocks(tokens, causal, positions, size, False, attn)[0]))

    @torch.no_grad()
    def attention_maps(
        self,
        tokens: Tensor,
        *,
        causal: bool = False,
        positions: Tensor | None = None,
        size: tuple[int, int] | None = None,
        **attn: Any,
    ) -> list[Tensor]:
        """The attention weights of every block, ``[b, h, n, n]`` each (for plots).

        Takes the arguments of :meth:`forward`.
        """
        return self._blocks(tokens, causal, positions, size, True, attn)[1]

    def _blocks(
        self,
        tokens: Tensor,
        causal: bool,
        positions: Tensor | None,
        size: tuple[int, int] | None,
        need_weights: bool,
        attn: dict[str, Any],
    ) -> tuple[Tensor, list[Tensor]]:
        """Embed, encode, run the blocks: ``(x [b, n, dim], weights per block)``."""
        x = self.embed(tokens)  # [b, n, dim]
        if isinstance(self.encoding, SinusoidalEncoding2D):
            b, n, _ = x.shape
            if size is None or size[0] * size[1] != n:
                raise ValueError(
                    f"a 2-D input encoding needs size=(H, W) with H * W = n = {n}, got size={size}"
                )
            x = self.encoding(x.view(b, size[0], size[1], self.dim)).view(b, n, self.dim)
            # [b, n, dim] -> [b, H, W, dim] -> [b, n, dim]
        elif self.encoding is not None:
            x = self.encoding(x, positions)
        maps = []
        for block in self.blocks:
            out = block(x, causal=causal, positions=positions, need_weights=need_weights, **attn)
            x, weights = out if need_weights else (out, None)
            if weights is not None:
                maps.append(weights)
        return x, maps
