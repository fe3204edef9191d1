"""Per-layer caches: a KV cache for attention layers, recurrent state for linear ones.

Attention caches roll back by trimming. Recurrent state cannot be trimmed, so a
verify pass runs with `record_snapshots` on and each linear layer keeps its
state after every token; `rollback` then selects one.

Several sequences run in one pass packed along the token axis, never padded: each
keeps its own caches, and a layer sees them as `RowCaches` (see `packed`).
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Per-token entries [B, H, T, D] of one attention layer, grown in steps.

    Usually keys and values; an absorbed MLA layer caches a single array (the
    normalised latent and the rope key), whose first part serves as the values.
    """

    step = 256

    def __init__(self):
        self.arrays = None
        self.offset = 0

    def update_and_fetch(self, *entries: mx.array):
        T = entries[0].shape[2]
        needed = self.offset + T
        if self.arrays is None or needed > self.arrays[0].shape[2]:
            capacity = ((needed + self.step - 1) // self.step) * self.step
            grown = [mx.zeros((*e.shape[:2], capacity, e.shape[3]), e.dtype) for e in entries]
            if self.arrays is not None:
                for new, old in zip(grown, self.arrays):
                    new[..., : self.offset, :] = old[..., : self.offset, :]
            self.arrays = grown
        for array, entry in zip(self.arrays, entries):
            array[..., self.offset : needed, :] = entry
        self.offset = needed
        return tuple(array[..., :needed, :] for array in self.arrays)

    def trim(self, n: int) -> int:
        """Forget the last n tokens."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self):
        return tuple(array[..., : self.offset, :] for array in self.arrays)

    def checkpoint(self) -> tuple:
        """The entries so far, compact: a view would keep the whole grown buffer, and make
        the next update copy it."""
        return tuple(mx.contiguous(entry) for entry in self.state) if self.arrays is not None else ()

    def restore(self, entries: tuple):
        self.arrays = list(entries) or None
        self.offset = entries[0].shape[2] if entries else 0


class RecurrentCache:
    """State of one linear-attention layer: conv tail [B, K-1, C] and S [B, H, Dk, Dv]."""

    def __init__(self):
        self.conv_tail = None
        self.state = None
        self.record_snapshots = False
        self.conv_snapshots = None  # after each token of the last call: T arrays [B, K-1, C]
        self.state_snapshots = None  # T arrays [B, H, Dk, Dv]

    def update(self, conv_tail, state, conv_snapshots=None, state_snapshots=None):
        self.conv_tail = conv_tail
        self.state = state
        self.conv_snapshots = conv_snapshots
        self.state_snapshots = state_snapshots

    def checkpoint(self) -> tuple:
        # states are replaced, never written in place, so references are enough
        return (self.conv_tail, self.state) if self.state is not None else ()

    def restore(self, entries: tuple):
        self.conv_tail, self.state = entries if entries else (None, None)

    def rollback(self, keep: int, recorded: int):
        """Keep the first `keep` (>= 1) of the `recorded` tokens of the last call."""
        if keep < recorded:
            self.conv_tail = self.conv_snapshots[keep - 1]
            self.state = self.state_snapshots[keep - 1]
        self.conv_snapshots = self.state_snapshots = None


class RowCaches:
    """One layer's caches of several sequences packed along the token axis of one input
    [1, N, ...]: row r owns the next `lengths[r]` positions. The mixers run each row's
    attention or recurrence on its own cache; everything per token runs on all N at once."""

    def __init__(self, caches: list, lengths: list[int]):
        self.caches = caches
        self.lengths = lengths


def row_caches(caches: list, lengths: list[int]):
    """One layer's cache argument for rows packed along the token axis (one row: its own cache)."""
    return caches[0] if len(caches) == 1 else RowCaches(caches, lengths)


def packed(row_layer_caches: list[list], lengths: list[int]) -> list:
    """A model's per-layer cache argument for rows packed along the token axis."""
    if len(row_layer_caches) == 1:
        return row_layer_caches[0]
    return [RowCaches([caches[i] for caches in row_layer_caches], lengths) for i in range(len(row_layer_caches[0]))]
