"""`mlx_hybrid.server`: an OpenAI-compatible HTTP server on the batch engine."""

from .app import ServedModel, create_app
from .main import entry, main

__all__ = ["ServedModel", "create_app", "entry", "main"]
