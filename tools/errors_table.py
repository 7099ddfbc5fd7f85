"""Print the Markdown table of docs/errors.md: each bad input, run for real, with its message.

Run: ``.venv/bin/python tools/errors_table.py > docs/errors-table.md``. tests/test_errors.py
checks that the table in docs/errors.md matches what the code raises today.
"""

from __future__ import annotations

import torch

import posenc
from posenc import KVCache, MultiHeadAttention, Rotary

attn = MultiHeadAttention(8, 2)
x = torch.randn(2, 5, 8)
q16 = torch.randn(2, 3, 7, 16)  # [b, h, n, d]
q8 = torch.randn(1, 2, 16, 8)  # 16 tokens: a 4 x 4 grid without its prefix token


class DecayBias(torch.nn.Module):
    """The attention docstring's example scheme (a learned decay per head)."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.rate = torch.nn.Parameter(torch.full((heads,), 0.1))

    def score_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        distance = (k_pos[:, None, :] - q_pos[:, :, None]).abs()  # [B', n_q, n_k]
        return -self.rate[:, None, None] * distance[:, None]  # [B', h, n_q, n_k]


def _outgrow_swin_1d() -> None:
    model = MultiHeadAttention(8, 2, position=posenc.RelativePositionBias(4, 2))
    cache = KVCache()
    model(torch.randn(1, 4, 8), cache=cache, causal=True)
    model(torch.randn(1, 1, 8), cache=cache, causal=True)


#: (bad input, call that raises)
CASES = [
    ("`dim` not divisible by `heads`", lambda: MultiHeadAttention(10, 4)),
    ("unknown backend", lambda: MultiHeadAttention(8, 2, backend="fast")),
    (
        "a place-1 encoding passed as `position=`",
        lambda: MultiHeadAttention(8, 2, position=posenc.SinusoidalEncoding(8)),
    ),
    ("query of the wrong rank", lambda: attn(torch.randn(5, 8))),
    ("query with the wrong last dimension", lambda: attn(torch.randn(2, 5, 6))),
    ("integer query", lambda: attn(torch.ones(2, 5, 8, dtype=torch.long))),
    ("key and query batch sizes differ", lambda: attn(x, torch.randn(3, 4, 8))),
    ("key and value lengths differ", lambda: attn(x, torch.randn(2, 4, 8), torch.randn(2, 3, 8))),
    ("float `key_padding_mask`", lambda: attn(x, key_padding_mask=torch.zeros(2, 5))),
    (
        "`key_padding_mask` of the wrong shape",
        lambda: attn(x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
    ),
    ("`valid_lens` of the wrong shape", lambda: attn(x, valid_lens=torch.tensor([1, 2, 3]))),
    ("float `valid_lens`", lambda: attn(x, valid_lens=torch.tensor([1.0, 2.0]))),
    ("float positions where integers are needed", lambda: attn(x, positions=torch.arange(5.0))),
    ("positions that do not cover the sequence", lambda: attn(x, positions=torch.arange(4))),
    (
        "positions with another batch size",
        lambda: attn(x, positions=torch.zeros(3, 5, dtype=torch.long)),
    ),
    (
        "`document_ids` of the wrong shape",
        lambda: attn(x, document_ids=torch.zeros(5, dtype=torch.long)),
    ),
    ("cache with cross-attention", lambda: attn(x, torch.randn(2, 4, 8), cache=KVCache())),
    (
        "cache with packed documents",
        lambda: attn(x, cache=KVCache(), document_ids=torch.zeros(2, 5, dtype=torch.long)),
    ),
    ("a `KVCache` capacity that is not a whole number", lambda: KVCache(capacity=1.5)),
    ("`KVCache.crop` past the tokens cached", lambda: KVCache().crop(3)),
    ("odd `dim` for a sinusoidal table", lambda: posenc.sinusoidal(torch.arange(3), 5)),
    ("`dim % 4 != 0` for a 2-D encoding", lambda: posenc.SinusoidalEncoding2D(6)),
    (
        "sequence longer than a learned table",
        lambda: posenc.LearnedEncoding(4, 10)(torch.zeros(1, 11, 4)),
    ),
    (
        "position past a learned table",
        lambda: posenc.LearnedEncoding(4, 10)(torch.zeros(1, 2, 4), torch.tensor([3, 10])),
    ),
    (
        "negative positions for a table",
        lambda: posenc.LearnedEncoding(4, 10)(torch.zeros(1, 2, 4), torch.tensor([-1, 0])),
    ),
    ("`dropout` outside [0, 1)", lambda: posenc.SinusoidalEncoding(8, dropout=1.5)),
    ("skew input that is not `[L, 2L-1]`", lambda: posenc.relative_to_absolute(torch.zeros(3, 4))),
    ("float relative positions for T5 buckets", lambda: posenc.t5_bucket(torch.zeros(3))),
    ("a bad Swin window", lambda: posenc.relative_position_index((2, 0))),
    ("a scheme class instead of an instance", lambda: MultiHeadAttention(8, 2, position=Rotary)),
    ("`causal` that is not a bool", lambda: attn(x, causal="yes")),
    ("negative `valid_lens`", lambda: attn(x, valid_lens=torch.tensor([-1, 3]))),
    ("query of another dtype than the module", lambda: attn(x.double())),
    ("key of another dtype than the query", lambda: attn(x, x.bfloat16())),
    (
        "a scheme built for other heads (its hook's output)",
        lambda: MultiHeadAttention(8, 2, position=DecayBias(4))(x),
    ),
    (
        "a decoding step past a 1-D Swin window (the cache is left as it was)",
        lambda: _outgrow_swin_1d(),
    ),
    (
        "1-D Swin positions too far apart in one sequence",
        lambda: posenc.RelativePositionBias(20, 2).score_bias(
            torch.tensor([[19], [119]]), torch.stack([torch.arange(20), torch.arange(98, 118)])
        ),
    ),
    (
        "score_mod positions of two batch sizes",
        lambda: posenc.ALiBi(2).flex_score_mod(
            torch.zeros(2, 4, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long)
        ),
    ),
    (
        "`resize` to a size that is not a pair",
        lambda: posenc.RelativeQueryEmbedding2D((3, 4), 4).resize(4),
    ),
    (
        "Rotary with `[b, n, h, d]` input and the default layout",
        lambda: Rotary(16)(torch.randn(2, 7, 3, 16), torch.randn(2, 7, 3, 16), torch.arange(7)),
    ),
    ("unknown Rotary layout", lambda: Rotary(16)(q16, q16, layout="BNHD")),
    (
        "Rotary2D tokens past its grid",
        lambda: MultiHeadAttention(16, 2, position=posenc.Rotary2D(8, size=(4, 4)))(
            torch.randn(1, 17, 16)
        ),
    ),
    (
        "Rotary2D called with another token count",
        lambda: posenc.Rotary2D(8, size=(4, 4), prefix_tokens=1)(q8, q8),
    ),
    ("negative `prefix_tokens`", lambda: posenc.Rotary2D(8, prefix_tokens=-1)),
    (
        "`attn_mask` in nn.MultiheadAttention's `[b * h, n, n]` layout",
        lambda: attn(x, attn_mask=torch.zeros(4, 5, 5)),
    ),
    ("integer `attn_mask`", lambda: attn(x, attn_mask=torch.ones(5, 5, dtype=torch.long))),
    ("`window` of 0", lambda: attn(x, window=0)),
    ("`kv_heads` that does not divide `heads`", lambda: MultiHeadAttention(8, 4, kv_heads=3)),
    (
        "a content-dependent scheme as an `attn_mask`",
        lambda: posenc.as_attn_mask(posenc.Rotary(8), 4),
    ),
    (
        "a token sequence into a 2-D encoding",
        lambda: posenc.SinusoidalEncoding2D(32)(torch.zeros(2, 36, 32)),
    ),
]


def table(cases=CASES) -> str:
    rows = ["| bad input | exception | message |", "|---|---|---|"]
    for what, call in cases:
        try:
            call()
        except (ValueError, TypeError) as err:
            message = str(err).replace("|", "\\|")
            rows.append(f"| {what} | `{type(err).__name__}` | {message} |")
        else:
            raise AssertionError(f"{what}: no error raised")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
