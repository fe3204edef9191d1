"""Per-layer caches: a KV cache for attention layers, recurrent state for linear ones.

Attention caches roll back by trimming. Recurrent state cannot be trimmed, so a
verify pass runs with `record_snapshots` on and each linear layer keeps its
state after every token; `rollback` then selects one.
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys and values [B, H, T, D] of one attention layer, grown in steps."""

    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, T, Dk = keys.shape
        needed = self.offset + T
        if self.keys is None or needed > self.keys.shape[2]:
            capacity = ((needed + self.step - 1) // self.step) * self.step
            new_keys = mx.zeros((B, H, capacity, Dk), keys.dtype)
            new_values = mx.zeros((B, H, capacity, values.shape[-1]), values.dtype)
            if self.keys is not None:
                new_keys[..., : self.offset, :] = self.keys[..., : self.offset, :]
                new_values[..., : self.offset, :] = self.values[..., : self.offset, :]
            self.keys, self.values = new_keys, new_values
        self.keys[..., self.offset : needed, :] = keys
        self.values[..., self.offset : needed, :] = values
        self.offset = needed
        return self.keys[..., :needed, :], self.values[..., :needed, :]

    def trim(self, n: int) -> int:
        """Forget the last n tokens."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self):
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


class RecurrentCache:
    """State of one linear-attention layer: conv tail [B, K-1, C] and S [B, H, Dk, Dv]."""

    def __init__(self):
        self.conv_tail = None
        self.state = None
        self.record_snapshots = False
        self.conv_snapshots = None  # [B, T, K-1, C] after each token of the last call
        self.state_snapshots = None  # [B, T, H, Dk, Dv]

    def update(self, conv_tail, state, conv_snapshots=None, state_snapshots=None):
        self.conv_tail = conv_tail
        self.state = state
        self.conv_snapshots = conv_snapshots
        self.state_snapshots = state_snapshots

    def rollback(self, keep: int, recorded: int):
        """Keep the first `keep` (>= 1) of the `recorded` tokens of the last call."""
        if keep < recorded:
            self.conv_tail = self.conv_snapshots[:, keep - 1]
            self.state = self.state_snapshots[:, keep - 1]
        self.conv_snapshots = self.state_snapshots = None
