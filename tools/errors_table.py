"""Print the Markdown table of docs/errors.md: each bad input, run for real, with its message.

Run: ``.venv/bin/python tools/errors_table.py > docs/errors-table.md``. tests/test_errors.py
checks that the table in docs/errors.md matches what the code raises today.
"""

from __future__ import annotations

import torch

import posenc
from posenc import KVCache, MultiHeadAttention

attn = MultiHeadAttention(8, 2)
x = torch.randn(2, 5, 8)

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
