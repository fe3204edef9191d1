"""Several rows' caches of one layer: as one pass packs them (`RowCaches`, rows along the token axis of
one input), and as batches that outlive a pass, so that rows that run together again read and write
their states where the last pass left them: a linear layer's recurrent states (`RowStates`), an
attention layer's entries (`KVRows`). Each row stays its own cache (`cache.LayerCache`): rollback,
checkpoints and marks act on one row, and a row that leaves or runs alone takes its state out."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np


class RowStates:
    """One layer's recurrent states of several rows, as one pass over them left them: tails and
    states [n, ...], and with snapshots each token's. A row's rollback is noted (`keep`) and applied
    to all rows at once where the batch is next read whole: one select per kept position, whatever
    the number of rows."""

    def __init__(self, tail, state, tail_snapshots=None, state_snapshots=None):
        self._held = [tail, state]
        self._snapshots = [tail_snapshots, state_snapshots] if state_snapshots is not None else None
        self._kept = [None] * tail.shape[0]  # per row: the snapshot its rollback kept (None: the last)
        self._rolled_back = 0

    def keep(self, row: int, snapshot: int | None):
        """Row `row` keeps the state after snapshot `snapshot` (None: after the last token)."""
        self._kept[row] = snapshot
        self._rolled_back += 1
        if self._rolled_back == len(self._kept):  # every row has: the snapshots can go
            self.whole()
            self._snapshots = None

    def whole(self) -> list[mx.array]:
        """[tails, states] of all rows, each row's rollback applied."""
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

    def tail(self, row: int):
        return self.whole()[0][row : row + 1]

    def state(self, row: int):
        return self.whole()[1][row : row + 1]

    def snapshots(self, row: int, which: int):
        if self._snapshots is None:
            return None
        return [s[row : row + 1] for s in self._snapshots[which]]

    def rows(self, start: int, stop: int) -> list[mx.array]:
        """[tails, states] of rows start .. stop - 1 (views)."""
        return [held[start:stop] for held in self.whole()]


class KVRows:
    """One attention layer's entries of several rows as one batch: buffers [n, H, capacity, D] (a
    quantized cache's codes, scales and biases each), row i's first `offset` entries (its cache's)
    its own, each row written at its own offset. Made where the rows first run together, their
    entries copied in; a pass over the same rows in the same order writes into it as it is, one
    write an array whatever the number of rows. Rollback is each row's offset, as alone."""

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
            if source.batch is not None:  # rows side by side in another batch: one copy
                keys = max(m.offset for m in members[rows])
                parts = [b[source.index : source.index + last - first, :, :keys] for b in source.batch.buffers]
            else:
                keys = source.offset
                parts = list(source.state) if keys else []
            for buffer, part in zip(self.buffers, parts):
                buffer[rows, :, :keys] = part
        for index, member in enumerate(members):
            member.join(self, index)

    @classmethod
    def of(cls, members: list, arrays: list[mx.array]) -> KVRows:
        """These rows' batch, for a pass that writes `arrays`: the one they live in where they are its
        rows in its order, else a new one."""
        batch = members[0].batch
        if (
            batch is None
            or batch.size != len(members)
            or any(m.batch is not batch or m.index != i for i, m in enumerate(members))
        ):
            batch = cls(members, arrays)
        return batch

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


class KVRowsPass:
    """Rows' KVCaches as one pass's attention reads them, one `KVRows` batch (found or made at the
    write), with what a row's KVCache offers: the rows' rotary positions, `update_and_fetch`, and after
    it each row's key count (`key_lengths`)."""

    def __init__(self, members: list):
        self.members = members
        self.key_lengths: tuple[int, ...] | None = None

    def rotary_span(self, count: int) -> tuple[int, ...]:
        return tuple(m.rotary_span(count) for m in self.members)

    def update_and_fetch(self, *entries: mx.array, counts: tuple[int, ...] | None = None):
        """Append each row's entries (entries [n, H, T, D]); the batch's entries as views, each
        row's first `key_lengths` its own. counts: row i's first counts[i] entries only are its own (the
        rest, written after them, are overwritten by its next entries)."""
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


def _rounded(count: int, step: int) -> int:
    return max(1, (count + step - 1) // step) * step


def _runs_of(members: list) -> list[tuple[int, int]]:
    """[first, last) runs of members that lie side by side in one batch (others alone)."""
    runs = []
    for i, member in enumerate(members):
        if (
            runs
            and member.batch is not None
            and member.batch is members[i - 1].batch
            and (member.index == members[i - 1].index + 1)
        ):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


@lru_cache(maxsize=8)
def _write_positions(offsets: tuple[int, ...], tokens: int) -> mx.array:
    """[n, 1, T, 1] int32: where each row's T entries go (a pass's layers share it)."""
    at = np.add.outer(np.asarray(offsets), np.arange(tokens)).astype(np.int32)
    return mx.array(at[:, None, :, None])


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
