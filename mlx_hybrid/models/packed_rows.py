"""Rows packed along the token axis of one input [1, N, ...] (`cache.RowCaches`: several sequences in one
pass, never padded): the mixers run rows of one length whose caches can share a batch as one batch
(`in_batches`), so that a step's launches do not grow with its rows."""

from __future__ import annotations

from itertools import accumulate

import mlx.core as mx

from ..cache import KVCache, RowCaches
from ..row_caches import KVRowsPass


def in_batches(cache: RowCaches, arrays, batch_key, run_batch, run_alone) -> mx.array:
    """The mixer's output [1, N, ...] for packed rows. Rows of one length whose `batch_key(length,
    row_cache)` is equal (None: the row runs alone) run as one batch: `run_batch(*inputs, caches)`
    on inputs [m, length, ...], the packed arrays' rows reshaped where they lie side by side; each
    other row `run_alone(*inputs, row_cache)` on its slice [1, length, ...]. Every op of a mixer is
    per row, so each row computes what it computes alone."""
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
        runs = _runs(rows)
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


def attend_rows(attend, cache, *arrays: mx.array, reads_key_positions: bool = False) -> mx.array:
    """attend(*arrays, cache) -> [B, T, ...] of an attention layer, over its KVCache, or over packed
    rows (`RowCaches`): rows of one length whose caches hold entries at plain rotary positions as one
    batch (`row_caches.KVRows`: one rotary embedding, one write and one attention for all of them),
    the others alone. reads_key_positions: the layer reads where its cached keys sit too (an indexer
    rotating blocks of them), so a row batches only where every key sits at its index (no image
    positions)."""
    if not isinstance(cache, RowCaches):
        return attend(*arrays, cache)

    def batch_key(n: int, row_cache):
        batched = isinstance(row_cache, KVCache) and row_cache.holds_entries
        batched = batched and not (reads_key_positions and row_cache.positions is not None)
        return row_cache.form if batched and isinstance(row_cache.rotary_span(n), int) else None

    return in_batches(cache, arrays, batch_key, lambda *inputs: attend(*inputs[:-1], KVRowsPass(inputs[-1])), attend)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted rows as runs of neighbours: [start, stop) each."""
    runs = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


def _joined(arrays: list[mx.array], axis: int = 0) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=axis)
