"""mlx-hybrid: hybrid-attention language models on MLX, with MTP speculative decoding."""

# first, before anything imports mlx: on Linux MLX's library must find OpenBLAS already loaded
from .blas import load_optimized_blas as _load_optimized_blas

_load_optimized_blas()

try:
    import mlx.core  # noqa: F401, E402
except ImportError as e:  # on Linux, most often MLX without a backend: its own install leaves the choice
    raise ImportError(
        f"MLX could not be loaded ({e}); on Linux MLX needs a backend: pip install 'mlx-hybrid[cpu]', "
        "or 'mlx-hybrid[cuda]' for an NVIDIA GPU"
    ) from None

from .errors import (  # noqa: E402  (after the BLAS)
    ContextOverflowError,
    GenerationError,
    MlxHybridError,
    ModelLoadError,
    UnsupportedArchitectureError,
)
from .api import GenerationResponse, batch_generate, generate, stream_generate  # noqa: E402
from .drafting import SpeculationSettings  # noqa: E402
from .engine import Engine  # noqa: E402
from .loaders import bundled_drafter_path, bundled_model_path, load  # noqa: E402
from .processors import Grammar  # noqa: E402
from .sampling import SamplingParams  # noqa: E402


__all__ = [
    "ContextOverflowError",
    "Engine",
    "GenerationError",
    "GenerationResponse",
    "Grammar",
    "MlxHybridError",
    "ModelLoadError",
    "SamplingParams",
    "SpeculationSettings",
    "UnsupportedArchitectureError",
    "batch_generate",
    "bundled_drafter_path",
    "bundled_model_path",
    "generate",
    "load",
    "make_cache",
    "stream_generate",
]


def make_cache(model, kv_bits: int | None = None, kv_group_size: int = 64):
    """Fresh per-layer caches for `model(ids, cache=...)`: KV for attention (in kv_bits 4 or 8, groups of
    kv_group_size features, where given), recurrent state for linear layers."""
    return model.make_cache(kv_bits, kv_group_size)


__version__ = "0.1.0"
