"""mlx-hybrid: hybrid-attention language models on MLX, with MTP speculative decoding."""

from .errors import ContextOverflowError, GenerationError, MlxHybridError, ModelLoadError, UnsupportedArchitectureError
from .generation import GenerationResponse, generate, stream_generate
from .loaders import bundled_model_path, load


__all__ = [
    "ContextOverflowError",
    "GenerationError",
    "GenerationResponse",
    "MlxHybridError",
    "ModelLoadError",
    "UnsupportedArchitectureError",
    "bundled_model_path",
    "generate",
    "load",
    "make_cache",
    "stream_generate",
]


def make_cache(model):
    """Fresh per-layer caches for `model(ids, cache=...)`: KV for attention, recurrent state for linear layers."""
    return model.make_cache()


__version__ = "0.1.0"
