"""Scheduling: one sequence or many, continuous joining, speculation per row, prefix checkpoints."""

from .prefix_store import Checkpoint, PrefixStore, load_checkpoint, save_checkpoint
from .replicated import ReplicatedEngine
from .scheduler import Engine
from .sequence import Event, Sequence, TokenLogprob

__all__ = [
    "Checkpoint",
    "Engine",
    "Event",
    "PrefixStore",
    "ReplicatedEngine",
    "Sequence",
    "TokenLogprob",
    "load_checkpoint",
    "save_checkpoint",
]
