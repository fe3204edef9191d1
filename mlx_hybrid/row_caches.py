"""The rows of a pass: several sequences' caches of one layer, and how the mixers run them together.

A pass packs its rows along the token axis of one input [1, N, ...], without padding, and a layer sees
their caches as `RowCaches`. Rows of the same length whose states can share a batch run as one batch
(`in_batches`), so that a step's launches do not grow with its rows. The batch outlives the pass: when
the same rows run together again, they read and write their states where the last pass left them
(`RowStates` for a recurrent layer, `KVRows` for an attention layer). Whether rows are the same rows in
the same order, or else which runs of neighbours to gather, is decided in one place (`_runs_of`).

Each row keeps its own cache (`cache.LayerCache`); a batch hands each row's cache a handle on its row
(`StateRow`, `EntriesRow`), which the cache holds as its `store`. Rollback, checkpoints and marks act on
one row through it; a row that leaves, or runs alone, takes its state out of the batch. A recurrent
mixer declares only its step (`recurrent`); batching, snapshots, rollback and checkpoints come with it.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import accumulate
from typing import Callable, NamedTuple

import mlx.core as mx
import numpy as np

from .cache import AttentionCache, KVCache, LayerCache, RecurrentCache


class RowCaches:
    """One layer's caches of several sequences packed along the token axis of one input
    [1, N, ...]: row r owns the next `lengths[r]` positions. The mixers run each row's
    attention or recurrence on its own cache; everything per token runs on all N at once."""

    def __init__(self, caches: list, lengths: list[int]):
        self.caches = caches
        self.lengths = lengths


# What a layer takes for a pass, and hands on unopened to `recurrent`, `attend_rows` or `part_of`: one
# sequence's cache, or packed rows' caches (None: no cache).
PassCache = LayerCache | RowCaches


def part_of(cache: PassCache | None, part: Callable[[LayerCache], LayerCache]) -> PassCache | None:
    """A part of a composite layer cache (`part(row_cache)`: a PLE layer's mixer's), of one sequence or of
    packed rows, as the module the part belongs to takes it."""
    if isinstance(cache, RowCaches):
        return RowCaches([part(row_cache) for row_cache in cache.caches], cache.lengths)
    return part(cache) if cache is not None else None


def row_caches(caches: list, lengths: list[int]):
    """One layer's cache argument for rows packed along the token axis (one row: its own cache)."""
    return caches[0] if len(caches) == 1 else RowCaches(caches, lengths)


def packed(row_layer_caches: list[list], lengths: list[int]) -> list:
    """A model's per-layer cache argument for rows packed along the token axis."""
    if len(row_layer_caches) == 1:
        return row_layer_caches[0]
    return [RowCaches([caches[i] for caches in row_layer_caches], lengths) for i in range(len(row_layer_caches[0]))]


class RecurrentStep(NamedTuple):
    """What a recurrent mixer's step returns: its output, its state after the call's tokens (the arrays
    it declares, each [B, ...]), and with snapshots each state array's value after every token (per
    array, a list of T arrays; None where the step was not asked for them)."""

    out: mx.array
    state: tuple
    snapshots: tuple | None = None


def recurrent(step: Callable[..., RecurrentStep], cache, *inputs: mx.array) -> mx.array:
    """A recurrent mixer's output over one sequence's `cache.RecurrentCache` (or None), or over packed
    rows (`RowCaches`) of them. step(*inputs, state, record) -> `RecurrentStep` runs the mixer on
    inputs [B, T, ...] from state (the tuple of arrays [B, ...] it returned before; None: a fresh
    sequence), keeping snapshots where record is true. Every op of a step must be per row, so that a
    row computes in a batch what it computes alone."""

    def one_sequence(*args):
        *inputs, cache = args
        record = cache is not None and cache.record_snapshots
        result = step(*inputs, cache.state if cache is not None else None, record)
        if cache is not None:
            cache.update(result.state, result.snapshots)
        return result.out

    if not isinstance(cache, RowCaches):
        return one_sequence(*inputs, cache)

    def batch_key(n: int, row_cache: RecurrentCache):
        return row_cache.record_snapshots if row_cache.holds_state else None

    def run_batch(*args):
        *inputs, members = args
        result = step(*inputs, _states_of(members), members[0].record_snapshots)
        states = RowStates(result.state, result.snapshots)
        for i, member in enumerate(members):
            member.store = StateRow(states, i)
        return result.out

    return in_batches(cache, inputs, batch_key, run_batch, one_sequence)


def attend_rows(attend, cache, *arrays: mx.array, reads_key_positions: bool = False) -> mx.array:
    """Run an attention layer's `attend(*arrays, cache) -> [B, T, ...]` over one KVCache or over packed
    rows (`RowCaches`).

    Rows of the same length whose keys sit at plain rotary positions run as one batch (`KVRows`): one
    rotary embedding, one write and one attention for all of them. Other rows run alone.
    reads_key_positions: the layer also reads where its cached keys sit (an indexer that rotates blocks
    of them), so a row joins a batch only if every key sits at its own index (no image positions)."""
    if not isinstance(cache, RowCaches):
        return attend(*arrays, cache)

    def batch_key(n: int, row_cache):
        batched = isinstance(row_cache, KVCache) and row_cache.holds_entries
        batched = batched and not (reads_key_positions and row_cache.positions is not None)
        return row_cache.form if batched and isinstance(row_cache.rotary_span(n), int) else None

    return in_batches(cache, arrays, batch_key, lambda *inputs: attend(*inputs[:-1], KVRowsPass(inputs[-1])), attend)


def in_batches(cache: RowCaches, arrays, batch_key, run_batch, run_alone) -> mx.array:
    """The mixer's output [1, N, ...] for packed rows.

    Rows of the same length with equal `batch_key(length, row_cache)` run as one batch:
    `run_batch(*inputs, caches)` on inputs [m, length, ...]. Where the rows lie side by side in the
    packed arrays their inputs are a reshape, else a gather. A row whose key is None runs alone:
    `run_alone(*inputs, row_cache)` on its slice [1, length, ...]."""
    starts = [0, *accumulate(cache.lengths)]
    groups: dict[tuple, list[int]] = {}
    for row, (n, row_cache) in enumerate(zip(cache.lengths, cache.caches)):
        key = batch_key(n, row_cache)
        groups.setdefault(("alone", row) if key is None else (n, key), []).append(row)
    pieces = []  # (first position, output [1, m, ...]) in any order
    for rows in groups.values():
        n = cache.lengths[rows[0]]
        if len(rows) == 1:
            row = rows[0]
            inputs = [x[:, starts[row] : starts[row + 1]] for x in arrays]
            pieces.append((starts[row], run_alone(*inputs, cache.caches[row])))
            continue
        runs = [(rows[first], rows[last - 1] + 1) for first, last in _runs(rows, lambda a, b: b == a + 1)]
        inputs = [
            _joined([x[:, starts[a] : starts[b]].reshape(b - a, n, *x.shape[2:]) for a, b in runs]) for x in arrays
        ]
        out = run_batch(*inputs, [cache.caches[row] for row in rows])
        done = 0
        for a, b in runs:
            pieces.append((starts[a], out[done : done + b - a].reshape(1, (b - a) * n, *out.shape[2:])))
            done += b - a
    pieces.sort(key=lambda piece: piece[0])
    return _joined([out for _, out in pieces], axis=1)


class RowStates:
    """One layer's recurrent states of several rows, as one pass over them left them: the state's
    arrays [n, ...], and with snapshots each token's. A row's rollback is noted (`keep`) and applied
    to all rows at once where the batch is next read whole: one select per kept position, whatever
    the number of rows."""

    def __init__(self, state: tuple, snapshots: tuple | None = None):
        self._held = list(state)
        self._snapshots = snapshots
        self._kept = [None] * state[0].shape[0]  # per row: the snapshot its rollback kept (None: the last)
        self._rolled_back = 0

    def keep(self, row: int, snapshot: int | None):
        """Row `row` keeps the state after snapshot `snapshot` (None: after the last token)."""
        self._kept[row] = snapshot
        self._rolled_back += 1
        if self._rolled_back == len(self._kept):  # every row has: the snapshots can go
            self.whole()
            self._snapshots = None

    def whole(self) -> list[mx.array]:
        """The state's arrays for all rows, each row's rollback applied."""
        if self._snapshots is not None and any(k is not None for k in self._kept):
            kept, selected = set(self._kept), []
            for held, snapshots in zip(self._held, self._snapshots):
                if len(kept) == 1:  # every row keeps the same token's state: that snapshot, as it is
                    held = snapshots[self._kept[0]]
                else:
                    for index in sorted(k for k in kept if k is not None):
                        rows = mx.array([k == index for k in self._kept]).reshape(-1, *[1] * (held.ndim - 1))
                        held = mx.where(rows, snapshots[index], held)
                selected.append(held)
            self._held, self._kept = selected, [None] * len(self._kept)
        return self._held

    def row(self, row: int) -> tuple:
        return tuple(held[row : row + 1] for held in self.whole())

    def rows(self, start: int, stop: int) -> list[mx.array]:
        """The state's arrays of rows start .. stop - 1 (views)."""
        return [held[start:stop] for held in self.whole()]


class BatchRow(NamedTuple):
    """A row's place in a batch of rows' states (`RowStates`, `KVRows`): the handle a batch gives the
    row's cache, to hold as its `store` in place of arrays of its own."""

    batch: RowStates | KVRows
    index: int


class StateRow(BatchRow):
    """A row's recurrent state in a `RowStates`: as `cache.HeldState` gives a state held alone."""

    @property
    def state(self) -> tuple:
        return self.batch.row(self.index)

    def kept(self, keep: int, recorded: int) -> StateRow:
        self.batch.keep(self.index, keep - 1 if keep < recorded else None)
        return self

    def checkpoint(self) -> tuple:
        return tuple(mx.contiguous(array) for array in self.state)  # else it would hold every row's state


class EntriesRow(BatchRow):
    """A row's attention entries in a `KVRows`: as `cache.OwnEntries` gives entries held alone."""

    def entries(self, offset: int) -> tuple:
        return tuple(buffer[self.index : self.index + 1, :, :offset] for buffer in self.batch.buffers)

    def alone(self, offset: int) -> list:
        """Buffers of the row's own, its entries copied out of the batch, for it to write on alone."""
        return [mx.contiguous(entry) for entry in self.entries(offset)]


def batch_of(cache: LayerCache):
    """The batch (`RowStates`, `KVRows`) that holds a row's cache's state, or None where it holds its own."""
    return cache.store.batch if isinstance(cache.store, BatchRow) else None


def _states_of(members: list[RecurrentCache]) -> list[mx.array]:
    """These rows' states as one batch: a batch the last pass left, read as it is where the same rows
    come in its order; else its runs of rows and single rows joined."""
    parts = []
    for first, last in _runs_of(members):
        source = members[first].store
        parts.append(source.batch.rows(source.index, source.index + last - first) if last - first > 1 else source.state)
    return [part[0] if len(parts) == 1 else mx.concatenate(list(part), axis=0) for part in zip(*parts)]


class KVRows:
    """One attention layer's entries for several rows, as one batch.

    The buffers are [n, H, capacity, D] (for a quantized cache: its codes, scales and biases). Row i
    owns the first `offset` entries of its row, where `offset` is its cache's, and each row is written
    at its own offset. The batch is made when the rows first run together, with their entries copied
    in. A later pass over the same rows in the same order writes into it as it is: one write per array,
    whatever the number of rows. A row rolls back by its own offset, as it does alone."""

    step = 256

    def __init__(self, members: list, arrays: list[mx.array]):
        """members: the rows' KVCaches (alone or in another batch, or still empty); arrays: the entries a
        pass writes next (their heads, widths and dtypes where no member holds any)."""
        held = max(m.offset for m in members)
        like = next((m.state for m in members if m.holds_entries), arrays)
        self.size, capacity = len(members), _rounded(held, self.step)
        self.buffers = [mx.zeros((self.size, a.shape[1], capacity, a.shape[3]), a.dtype) for a in like]
        for first, last in _runs_of(members):
            source, rows = members[first], slice(first, last)
            batch = batch_of(source)
            if batch is not None:  # rows side by side in another batch: one copy
                keys, at = max(m.offset for m in members[rows]), source.store.index
                parts = [b[at : at + last - first, :, :keys] for b in batch.buffers]
            else:
                keys = source.offset
                parts = list(source.state) if keys else []
            for buffer, part in zip(self.buffers, parts):
                buffer[rows, :, :keys] = part
        for index, member in enumerate(members):
            member.store = EntriesRow(self, index)

    @classmethod
    def of(cls, members: list, arrays: list[mx.array]) -> KVRows:
        """These rows' batch, for a pass that writes `arrays`: the one they live in where they are its
        rows in its order, else a new one."""
        batch = batch_of(members[0])
        whole = batch is not None and batch.size == len(members) and members[0].store.index == 0
        return batch if whole and _runs_of(members) == [(0, len(members))] else cls(members, arrays)

    def write(self, arrays: list[mx.array], offsets: tuple[int, ...]):
        """Each row's T new entries [n, H, T, D] at its own offset."""
        needed = max(offsets) + arrays[0].shape[2]
        if needed > self.buffers[0].shape[2]:
            capacity = _rounded(needed, self.step)
            grown = [mx.zeros((*b.shape[:2], capacity, b.shape[3]), b.dtype) for b in self.buffers]
            for new, old in zip(grown, self.buffers):
                new[:, :, : old.shape[2]] = old
            self.buffers = grown
        at = _write_positions(offsets, arrays[0].shape[2])
        self.buffers = [mx.put_along_axis(b, at, a, axis=2) for b, a in zip(self.buffers, arrays)]


class KVRowsPass(AttentionCache):
    """Several rows' KVCaches as one attention call reads them (`cache.AttentionCache`), over one
    `KVRows` batch, found or made at the write. After the write, `key_lengths` holds each row's count
    of keys."""

    def __init__(self, members: list):
        self.members = members
        self.key_lengths: tuple[int, ...] | None = None

    def rotary_span(self, count: int) -> tuple[int, ...]:
        return tuple(m.rotary_span(count) for m in self.members)

    def key_positions(self, count: int) -> int:
        """Where every row's first key sits: rows that read it run together only where it is the same
        plain position for all (`attend_rows`' reads_key_positions)."""
        first, *others = (m.key_positions(count) for m in self.members)
        if not isinstance(first, int) or any(not isinstance(p, int) or p != first for p in others):
            raise ValueError("rows whose keys sit apart (or at image positions) read their key positions alone")
        return first

    def update_and_fetch(self, *entries: mx.array, counts: tuple[int, ...] | None = None):
        """Row i's first `key_lengths[i]` entries are its own. counts: only the first counts[i] of row i's
        new entries are kept; the rest are written after them and overwritten by its next entries."""
        first = self.members[0]
        arrays = first.held(entries)
        offsets = tuple(m.offset for m in self.members)
        tokens = arrays[0].shape[2]
        batch = KVRows.of(self.members, arrays)
        batch.write(arrays, offsets)
        counts = counts or (tokens,) * len(offsets)
        for member, count in zip(self.members, counts):
            member.offset += count
        self.key_lengths = tuple(offset + count for offset, count in zip(offsets, counts))
        needed = max(self.key_lengths)
        return first.fetched([buffer[:, :, :needed] for buffer in batch.buffers])

    def trim(self, n: int):
        """Each row forgets its last n entries."""
        for member in self.members:
            member.trim(n)


def _runs(items: list, follows) -> list[tuple[int, int]]:
    """[first, last) runs of items in which each follows the one before (`follows(before, item)`)."""
    runs = []
    for i, item in enumerate(items):
        if runs and follows(items[i - 1], item):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _runs_of(members: list) -> list[tuple[int, int]]:
    """[first, last) runs of row caches that lie side by side in one batch (others alone)."""

    def follows(a, b) -> bool:
        batch = batch_of(b)
        return batch is not None and batch is batch_of(a) and b.store.index == a.store.index + 1

    return _runs(members, follows)


def _rounded(count: int, step: int) -> int:
    return max(1, (count + step - 1) // step) * step


@lru_cache(maxsize=8)
def _write_positions(offsets: tuple[int, ...], tokens: int) -> mx.array:
    """[n, 1, T, 1] int32: where each row's T entries go (a pass's layers share it)."""
    at = np.add.outer(np.asarray(offsets), np.arange(tokens)).astype(np.int32)
    return mx.array(at[:, None, :, None])


def _joined(arrays: list[mx.array], axis: int = 0) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=axis)
