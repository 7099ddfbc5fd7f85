"""posenc: positional encodings for self-attention.

See DESIGN.md: every scheme enters attention at one of five places (the input; q and k
rotated; content-free score bias; content-dependent score term; keys and values).
"""

from ._version import __version__
from .absolute import (
    LearnedEncoding,
    SinusoidalEncoding,
    SinusoidalEncoding2D,
    sinusoidal,
    sinusoidal_2d,
    sinusoidal_shift,
)
from .attention import MultiHeadAttention
from .bias import (
    ALiBi,
    RelativePositionBias,
    T5RelativeBias,
    alibi_slopes,
    load_relative_position_bias,
    resize_relative_position_table,
)
from .cache import KVCache
from .embedding import AbsoluteQueryEmbedding, RelativeQueryEmbedding, RelativeQueryEmbedding2D
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
    NTKScaling,
    Rotary,
    Rotary2D,
    RotaryScaling,
    YaRNScaling,
)
from .shaw import ShawRelativePosition

__all__ = [
    "ALiBi",
    "AbsoluteQueryEmbedding",
    "DynamicNTKScaling",
    "KVCache",
    "LearnedEncoding",
    "LinearScaling",
    "MultiHeadAttention",
    "NTKScaling",
    "RelativePositionBias",
    "RelativeQueryEmbedding",
    "RelativeQueryEmbedding2D",
    "Rotary",
    "Rotary2D",
    "RotaryScaling",
    "ShawRelativePosition",
    "SinusoidalEncoding",
    "SinusoidalEncoding2D",
    "T5RelativeBias",
    "YaRNScaling",
    "__version__",
    "alibi_slopes",
    "load_relative_position_bias",
    "positions_from_documents",
    "positions_from_padding",
    "relative_position_index",
    "relative_to_absolute",
    "resize_relative_position_table",
    "sinusoidal",
    "sinusoidal_2d",
    "sinusoidal_shift",
    "t5_bucket",
]
