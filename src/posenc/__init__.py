"""posenc: positional encodings for self-attention.

Every scheme enters attention at one of five places, and lives in the module of its place:
the input (``absolute.py``); q and k rotated (``rotary.py``); a content-free score bias
(``bias.py``, and the length-generalisation research biases in ``bias_research.py``); a
content-dependent score term (``embedding.py``, and CoPE's contextual positions in
``embedding_research.py``); keys and values (``shaw.py``). README.md
has the table and the usage; docs/ has the rest.
"""

from ._version import __version__
from .absolute import (
    LearnedEncoding,
    SinusoidalEncoding,
    SinusoidalEncoding2D,
    resample_position_embeddings,
    sinusoidal,
    sinusoidal_2d,
    sinusoidal_shift,
)
from .attention import MultiHeadAttention, attention, explain
from .bias import (
    ALiBi,
    RelativePositionBias,
    T5RelativeBias,
    alibi_slopes,
    load_relative_position_bias,
    resize_relative_position_table,
)
from .bias_continuous import ContinuousPositionBias
from .bias_research import FIREBias, KerpleBias, SandwichBias
from .cache import KVCache
from .dense import as_attn_mask
from .embedding import AbsoluteQueryEmbedding, RelativeQueryEmbedding, RelativeQueryEmbedding2D
from .embedding_research import CoPE
from .families import GridBias, GridTerm, OffsetBias, OffsetTerm
from .indices import (
    positions_from_documents,
    positions_from_padding,
    relative_position_index,
    relative_to_absolute,
    t5_bucket,
)
from .rotary import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    NTKScaling,
    Rotary,
    Rotary2D,
    RotaryScaling,
    YaRNScaling,
)
from .rotary_nd import RotaryMixed, RotaryND
from .rotary_research import XPos
from .shaw import ShawRelativePosition

__all__ = [
    "ALiBi",
    "AbsoluteQueryEmbedding",
    "CoPE",
    "ContinuousPositionBias",
    "DynamicNTKScaling",
    "FIREBias",
    "GridBias",
    "GridTerm",
    "KVCache",
    "KerpleBias",
    "LearnedEncoding",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPEScaling",
    "MultiHeadAttention",
    "NTKScaling",
    "OffsetBias",
    "OffsetTerm",
    "RelativePositionBias",
    "RelativeQueryEmbedding",
    "RelativeQueryEmbedding2D",
    "Rotary",
    "Rotary2D",
    "RotaryMixed",
    "RotaryND",
    "RotaryScaling",
    "SandwichBias",
    "ShawRelativePosition",
    "SinusoidalEncoding",
    "SinusoidalEncoding2D",
    "T5RelativeBias",
    "XPos",
    "YaRNScaling",
    "__version__",
    "alibi_slopes",
    "as_attn_mask",
    "attention",
    "explain",
    "load_relative_position_bias",
    "positions_from_documents",
    "positions_from_padding",
    "relative_position_index",
    "relative_to_absolute",
    "resample_position_embeddings",
    "resize_relative_position_table",
    "sinusoidal",
    "sinusoidal_2d",
    "sinusoidal_shift",
    "t5_bucket",
]
