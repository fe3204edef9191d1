"""`mlx_hybrid.server`: the OpenAI- and Anthropic-compatible HTTP API on the batch engine (the
command that starts it: `mlx_hybrid.cli.serve`, run as `python -m mlx_hybrid.server`)."""

from .app import create_app
from .outputs import ServedModel

__all__ = ["ServedModel", "create_app"]
