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
from .cache import KVCache
from .indices import (
    positions_from_documents,
    positions_from_padding,
    relative_position_index,
    relative_to_absolute,
    t5_bucket,
)

__all__ = [
    "KVCache",
    "LearnedEncoding",
    "MultiHeadAttention",
    "SinusoidalEncoding",
    "SinusoidalEncoding2D",
    "__version__",
    "positions_from_documents",
    "positions_from_padding",
    "relative_position_index",
    "relative_to_absolute",
    "sinusoidal",
    "sinusoidal_2d",
    "sinusoidal_shift",
    "t5_bucket",
]
