"""Per-layer caches of one sequence behind one interface (`LayerCache`): a KV cache for an attention
layer (also absorbed MLA's latent cache and the MTP head's; quantized with --kv-bits), and the
recurrent state of a linear-attention layer.

An attention cache rolls back by trimming. A recurrent state cannot be trimmed, so a verify pass runs
with `record_snapshots` on: each recurrent layer keeps its state after every token, and `rollback`
selects one. Speculation, drafting, the engine's rows and prefix checkpoints use only this interface,
through the functions at the end of this module, which act on a model's list of layer caches.

Several sequences can run in one pass, packed along the token axis: each keeps its own caches, and
`row_caches` runs them together, its batches handing each row's cache a handle on its row (the
cache's `store`).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import ops
from .errors import GenerationError


class LayerCache:
    """What every layer cache does.

    record_snapshots: while it is on, a call keeps the state after each of its tokens.
    rollback(keep, recorded): keep the first `keep` of the `recorded` tokens that the last call added.
    mark() / rewind(mark): remember where the cache is, and go back there later, forgetting the tokens
        added since (a draft model uses this: it reads one token per call).
    checkpoint() / restore(entries): the state as a tuple of arrays, and back from it.
    arrays: the arrays the cache holds now; nbytes: their size.
    step_nbytes: the size of one recorded token's snapshot (0 for a cache that rolls back by trimming).
    form: how the cache holds its state, where there is a choice ("" if there is one way). Checkpoint
        fingerprints include it.
    store: where a cache that holds arrays keeps them: its own, or a batch's handle on its row
        (`row_caches.batch_of` tells which batch).
    """

    record_snapshots = False
    form = ""
    store = None

    def rollback(self, keep: int, recorded: int):
        raise NotImplementedError

    def mark(self):
        raise NotImplementedError

    def rewind(self, mark):
        raise NotImplementedError

    def checkpoint(self) -> tuple:
        raise NotImplementedError

    def restore(self, entries: tuple):
        raise NotImplementedError

    @property
    def arrays(self) -> list[mx.array]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    @property
    def step_nbytes(self) -> int:
        return 0


class RotaryPositions:
    """Where a sequence's tokens sit for rotary embeddings when that is not their index (a
    prompt with images): token i < P of the prompt at table[:, i] (temporal, row, column),
    every later token at i + shift on all three axes. `index_shift` reads the table that
    many tokens on (the MTP head's pair t sits where token t + 1 does). Like llama.cpp's
    memory, the attention caches of a sequence carry its positions (`KVCache.positions`).
    """

    def __init__(self, table: np.ndarray, index_shift: int = 0):
        self.table = table  # [3, P]
        self.shift = int(table.max()) + 1 - table.shape[1] if table.size else 0
        self.index_shift = index_shift

    def shifted(self, tokens: int) -> RotaryPositions:
        return RotaryPositions(self.table, self.index_shift + tokens)

    def span(self, start: int, count: int) -> int | np.ndarray:
        """The positions of tokens start .. start + count - 1: p where they are p, p + 1, ... on
        every axis (plain rotary embedding from p), else their table [3, count]."""
        first, length = start + self.index_shift, self.table.shape[1]
        if first >= length:
            return first + self.shift
        index = np.arange(first, first + count)
        positions = np.where(index < length, self.table[:, np.minimum(index, length - 1)], index + self.shift)
        if (positions == positions[0]).all() and (np.diff(positions[0]) == 1).all():
            return int(positions[0, 0])
        return positions


class AttentionCache:
    """What an attention layer's attention reads and writes: one sequence's `KVCache`, or the rows of a
    pass that run as one batch (`row_caches.KVRowsPass`). An attention takes either (or None: no cache).

    rotary_span(count): the rotary positions of the next `count` tokens (`RotaryPositions.span`; for a
        batch, a tuple of each row's).
    update_and_fetch(*entries): append the call's entries [B, H, T, D]; all of them so far, as views.
    key_lengths: each batch row's count of the keys fetched (its first ones); None where every row holds
        all of them.
    key_positions(count): where the first `count` keys sit (`RotaryPositions.span`), for a layer that
        reads its cached keys' positions (an indexer rotating blocks of them).
    """

    key_lengths = None

    def rotary_span(self, count: int):
        raise NotImplementedError

    def update_and_fetch(self, *entries: mx.array) -> tuple:
        raise NotImplementedError

    def key_positions(self, count: int) -> int | np.ndarray:
        raise NotImplementedError


class OwnEntries(NamedTuple):
    """Entries a KVCache holds alone: buffers [B, H, capacity, D] of its own, grown in steps; the first
    `offset` entries (the cache's) are in use."""

    buffers: list

    def entries(self, offset: int) -> tuple:
        return tuple(buffer[..., :offset, :] for buffer in self.buffers)

    def alone(self, offset: int) -> list:
        """The buffers the cache writes its next entries into: these."""
        return self.buffers


class KVCache(LayerCache, AttentionCache):
    """The per-token entries [B, H, T, D] of one attention layer.

    The entries are usually keys and values. An absorbed MLA layer caches a single array (the
    normalised latent and the rope key), whose first part serves as the values.
    Its first `offset` entries are in its `store`: buffers of its own (`OwnEntries`), or, after a pass
    over several rows together, the handle on its row that the pass's batch gave it
    (`row_caches.KVRows`). Either gives the entries (`entries(offset)`) and the buffers to write the
    next ones into (`alone(offset)`: a row of a batch copies its entries out first).
    """

    step = 256

    def __init__(self):
        self.store = None  # OwnEntries, a batch's handle on this row, or None before any entry
        self.offset = 0
        self.positions: RotaryPositions | None = None  # None: token i at position i

    def rotary_span(self, count: int) -> int | np.ndarray:
        """The rotary positions of the next `count` tokens (see `RotaryPositions.span`)."""
        return self.offset if self.positions is None else self.positions.span(self.offset, count)

    def key_positions(self, count: int) -> int | np.ndarray:
        return 0 if self.positions is None else self.positions.span(0, count)

    def update_and_fetch(self, *entries: mx.array):
        return self.fetched(self._append(self.held(entries)))

    def held(self, entries) -> list[mx.array]:
        """The arrays the cache keeps for a call's entries."""
        return list(entries)

    def fetched(self, views) -> tuple:
        """The entries as attention reads them, from the kept arrays' views."""
        return tuple(views)

    def _append(self, arrays) -> tuple:
        T = arrays[0].shape[2]
        needed = self.offset + T
        buffers = self.store.alone(self.offset) if self.store is not None else None
        if buffers is None or needed > buffers[0].shape[2]:
            capacity = ((needed + self.step - 1) // self.step) * self.step
            grown = [mx.zeros((*a.shape[:2], capacity, a.shape[3]), a.dtype) for a in arrays]
            if buffers is not None:
                for new, old in zip(grown, buffers):
                    new[..., : self.offset, :] = old[..., : self.offset, :]
            buffers = grown
        for buffer, array in zip(buffers, arrays):
            buffer[..., self.offset : needed, :] = array
        self.store, self.offset = OwnEntries(buffers), needed
        return tuple(buffer[..., :needed, :] for buffer in buffers)

    def trim(self, n: int) -> int:
        """Forget the last n tokens."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    def rollback(self, keep: int, recorded: int):
        self.trim(recorded - keep)

    def mark(self) -> int:
        return self.offset

    def rewind(self, mark: int):
        self.trim(self.offset - mark)

    @property
    def holds_entries(self) -> bool:
        return self.store is not None

    @property
    def state(self):
        return self.store.entries(self.offset)

    @property
    def arrays(self) -> list[mx.array]:
        return list(self.state) if self.holds_entries else []

    def checkpoint(self) -> tuple:
        """The entries so far, compact: a view would keep the whole grown buffer, and make
        the next update copy it."""
        return tuple(mx.contiguous(entry) for entry in self.state) if self.holds_entries else ()

    def restore(self, entries: tuple):
        self.store = OwnEntries(list(entries)) if entries else None
        self.offset = entries[0].shape[2] if entries else 0


class WindowKVCache(KVCache):
    """The KVCache of a sliding-window attention layer whose queries all come after the entries it
    holds (a DFlash drafter's: its block follows its context): an entry `window` or more places
    before the next token is never seen again. Once it holds twice the window, `trim` drops all but
    the last window - 1 (a copy of the window, that often), so it never holds more than 2 x window.
    Its rotary positions, and its checkpoints, count the entries dropped."""

    def __init__(self, window: int):
        super().__init__()
        self.window, self.dropped = window, 0

    def rotary_span(self, count: int) -> int:
        return self.dropped + self.offset

    def key_positions(self, count: int) -> int:
        return self.dropped

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.offset >= 2 * self.window:
            kept = self.window - 1
            entries = KVCache.checkpoint(self)
            self.dropped += self.offset - kept
            KVCache.restore(self, tuple(mx.contiguous(entry[..., entry.shape[2] - kept :, :]) for entry in entries))
        return n

    def checkpoint(self) -> tuple:
        return (*KVCache.checkpoint(self), mx.array(self.dropped))

    def restore(self, entries: tuple):
        KVCache.restore(self, entries[:-1])
        self.dropped = int(entries[-1].item())


class QuantizedKVCache(KVCache):
    """A KVCache that holds each token's entries in `bits` bits (--kv-bits): its features in groups
    of `group_size`, a scale and bias each (mx.quantize's affine groups, as mlx-lm's quantized cache
    and llama.cpp's q8_0 / q4_0 caches hold them). A token's codes depend on its entries alone, so
    verify passes, rows and checkpoints keep their exactness; what it changes is the attention's
    inputs, by the groups' rounding. `update_and_fetch` gives `ops.QuantizedEntries`."""

    def __init__(self, bits: int, group_size: int):
        super().__init__()
        self.bits, self.group_size = bits, group_size
        self.form = f"KV in {bits} bits, groups of {group_size}"

    def held(self, entries) -> list[mx.array]:
        return [a for entry in entries for a in ops.quantize_entries(entry, self.bits, self.group_size).arrays]

    def fetched(self, views) -> tuple:
        return tuple(
            ops.QuantizedEntries(*views[i : i + 3], self.bits, self.group_size) for i in range(0, len(views), 3)
        )


def check_kv_quantization(bits: int, group_size: int, features: tuple[int, ...]):
    """Refuse a quantized KV cache's settings that do not fit a model whose attention layers cache
    entries of these widths (each a multiple of the group)."""
    if bits not in ops.KV_BITS:
        raise GenerationError(f"kv_bits must be one of {', '.join(map(str, ops.KV_BITS))}, got {bits}")
    if group_size not in ops.KV_GROUP_SIZES:
        sizes = ", ".join(map(str, ops.KV_GROUP_SIZES))
        raise GenerationError(f"kv_group_size must be one of {sizes}, got {group_size}")
    fitting = [size for size in ops.KV_GROUP_SIZES if not any(width % size for width in features)]
    if group_size not in fitting:
        widths = " and ".join(map(str, features))
        instead = f"use {' or '.join(map(str, fitting))}" if fitting else "this model takes no quantized KV cache"
        raise GenerationError(
            f"kv_group_size {group_size} does not divide this model's attention entries ({widths} features): {instead}"
        )


class HeldState(NamedTuple):
    """A recurrent state a cache holds alone: its arrays, and while they are kept the last call's
    snapshots (per array, its value after each token)."""

    state: tuple
    snapshots: tuple | None = None

    def kept(self, keep: int, recorded: int) -> HeldState:
        """The state after the first `keep` (>= 1) of the `recorded` tokens of the last call."""
        return HeldState(tuple(s[keep - 1] for s in self.snapshots) if keep < recorded else self.state)

    def checkpoint(self) -> tuple:
        return self.state  # references: states are replaced, never written in place


class RecurrentCache(LayerCache):
    """A recurrent layer's state for one sequence: the arrays [B, ...] that its mixer's step returns
    (for a linear-attention layer, the conv tail and the delta-rule state; `row_caches.recurrent` runs
    the step). With record_snapshots on, it also keeps each array's value after every token of the
    last call, for rollback.

    The state is in its `store`: its own (`HeldState`), or, after a pass over several rows together,
    the handle on its row that the pass's batch gave it (`row_caches.RowStates`). Either gives the
    state, the state a rollback keeps (`kept`) and a checkpoint of it."""

    def __init__(self):
        self.store = None  # HeldState, a batch's handle on this row, or None before any token
        self.record_snapshots = False

    def update(self, state: tuple | None, snapshots: tuple | None = None):
        self.store = None if state is None else HeldState(state, snapshots)

    @property
    def holds_state(self) -> bool:
        return self.store is not None

    @property
    def state(self) -> tuple | None:
        return self.store.state if self.store is not None else None

    def checkpoint(self) -> tuple:
        return self.store.checkpoint() if self.store is not None else ()

    def restore(self, entries: tuple):
        self.update(tuple(entries) or None)

    def rollback(self, keep: int, recorded: int):
        """Keep the first `keep` (>= 1) of the `recorded` tokens of the last call."""
        if self.store is not None:
            self.store = self.store.kept(keep, recorded)

    def mark(self) -> tuple:
        return self.state or ()  # references: states are replaced, never written in place

    def rewind(self, mark: tuple):
        self.restore(mark)

    @property
    def arrays(self) -> list[mx.array]:
        """The state. Not the last call's snapshots: those a rollback does not read may never be
        computed (`ops.reference.BuiltOnRead`)."""
        return list(self.state or ())

    @property
    def step_nbytes(self) -> int:
        return sum(array.nbytes for array in self.state or ())


def rollback(cache: list[LayerCache], keep: int, recorded: int):
    """Keep the first `keep` of the `recorded` tokens the last call added to each layer."""
    for layer_cache in cache:
        layer_cache.rollback(keep, recorded)


def record_snapshots(cache: list[LayerCache], on: bool):
    for layer_cache in cache:
        layer_cache.record_snapshots = on


def marks(cache: list[LayerCache]) -> list:
    return [layer_cache.mark() for layer_cache in cache]


def rewind(cache: list[LayerCache], marks_: list):
    for layer_cache, mark in zip(cache, marks_):
        layer_cache.rewind(mark)


def set_positions(cache: list[LayerCache], positions: RotaryPositions | None):
    """Give a sequence's attention caches its rotary positions (None: token index)."""
    for layer_cache in cache:
        if isinstance(layer_cache, KVCache):
            layer_cache.positions = positions
