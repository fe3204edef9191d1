"""Typed errors. Each carries one line a user can act on."""


class MlxHybridError(Exception):
    """Base class of mlx_hybrid's errors."""


class ModelLoadError(MlxHybridError):
    """A model path or file could not be loaded: missing, truncated, unknown or malformed."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint is of an architecture mlx_hybrid does not implement."""


class GenerationError(MlxHybridError, ValueError):
    """Bad generation input: an empty prompt, a bad sampling setting, a context overflow."""


class ContextOverflowError(GenerationError):
    """The prompt does not fit in the model's context."""
