"""Linear attention over packed rows: several sequences packed along the token axis, each on
its own cache (`cache.RowCaches`), and the layer's work shared by GDN and KDA."""

from __future__ import annotations

from itertools import accumulate

import mlx.core as mx

from .. import ops
from ..cache import RecurrentCache, RowCaches, RowStates


def _row_pieces(cache: RowCaches, arrays) -> list[list[mx.array]]:
    """Each packed array split into its rows' parts along the token axis."""
    bounds = list(accumulate(cache.lengths))[:-1]
    return [mx.split(array, bounds, axis=1) for array in arrays]


def for_each_row(fn, cache, *arrays: mx.array) -> mx.array:
    """fn(*arrays, cache) -> [B, T, ...], run per sequence when several come packed along
    the token axis (axis 1) with `RowCaches`, so that no row sees another's tokens."""
    if not isinstance(cache, RowCaches):
        return fn(*arrays, cache)
    pieces = _row_pieces(cache, arrays)
    outs = [fn(*(p[row] for p in pieces), row_cache) for row, row_cache in enumerate(cache.caches)]
    return mx.concatenate(outs, axis=1)


def linear_attention(
    mixed_qkv, conv_weight, a, b, gate, decay: ops.Decay, norm: ops.OutputNorm, cache, heads: ops.HeadShape
) -> mx.array:
    """The work of a GDN or KDA layer between its projections (`ops.linear_attention`: causal
    conv + SiLU over q|k|v, L2-normalised q and k, the rule's gates from a and b, the gated delta
    rule, the gated output norm), reading and updating the layer's recurrent cache.

    Returns [B, T, value_heads * value_dim] in mixed_qkv's dtype.
    """

    def one_sequence(mixed_qkv, a, b, gate, cache):
        record = cache is not None and cache.record_snapshots
        tail, state = (cache.conv_tail, cache.state) if cache is not None else (None, None)
        layer = ops.linear_attention(
            mixed_qkv, conv_weight, a, b, gate, decay, norm, heads, tail, state, snapshots=record
        )
        if cache is not None:
            cache.update(layer.tail, layer.state, layer.tail_snapshots, layer.state_snapshots)
        return layer.out

    if isinstance(cache, RowCaches):
        return _rows_in_groups(one_sequence, cache, mixed_qkv, a, b, gate)
    return one_sequence(mixed_qkv, a, b, gate, cache)


def _rows_in_groups(one_sequence, cache: RowCaches, *arrays: mx.array) -> mx.array:
    """Recurrent layers of packed rows: rows of one length whose states exist run as one batch
    (each row's state is its own slice, and every op is per row, so each row computes what it
    computes alone); the others one by one. A batch's inputs are the packed array's rows, reshaped
    where they lie side by side; its states are those the last pass over the same rows left
    (`RowStates`), read as they are. So a decode step of rows that stay together gathers and splits
    nothing, however many rows it has."""
    starts = [0, *accumulate(cache.lengths)]
    groups: dict[tuple, list[int]] = {}
    for row, (n, row_cache) in enumerate(zip(cache.lengths, cache.caches)):
        key = (n, row_cache.record_snapshots) if row_cache.state is not None else ("alone", row)
        groups.setdefault(key, []).append(row)
    pieces = []  # (first position, output [1, m, ...]) in any order
    for rows in groups.values():
        n = cache.lengths[rows[0]]
        if len(rows) == 1:
            row = rows[0]
            inputs = [x[:, starts[row] : starts[row + 1]] for x in arrays]
            pieces.append((starts[row], one_sequence(*inputs, cache.caches[row])))
            continue
        runs = _runs(rows)
        inputs = [
            _joined([x[:, starts[a] : starts[b]].reshape(b - a, n, *x.shape[2:]) for a, b in runs]) for x in arrays
        ]
        members = [cache.caches[row] for row in rows]
        batch = RecurrentCache()
        batch.record_snapshots = members[0].record_snapshots
        batch.update(*_states_of(members))
        out = one_sequence(*inputs, batch)
        states = RowStates(batch.conv_tail, batch.state, batch.conv_snapshots, batch.state_snapshots)
        for i, member in enumerate(members):
            member.join(states, i)
        done = 0
        for a, b in runs:
            pieces.append((starts[a], out[done : done + b - a].reshape(1, (b - a) * n, *out.shape[2:])))
            done += b - a
    pieces.sort(key=lambda piece: piece[0])
    return _joined([out for _, out in pieces], axis=1)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted rows as runs of neighbours: [start, stop) each."""
    runs = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


def _states_of(members: list[RecurrentCache]) -> list[mx.array]:
    """[tails, states] of these rows' caches as one batch: a batch the last pass left, read as it is
    where the same rows come in its order; else its runs of rows and single rows joined."""
    parts, at = [], 0
    while at < len(members):
        batch, first = members[at].batch, members[at].index
        end = at + 1
        if batch is not None:
            while end < len(members) and members[end].batch is batch and members[end].index == first + end - at:
                end += 1
            parts.append(batch.rows(first, first + end - at))
        else:
            parts.append([members[at].conv_tail, members[at].state])
        at = end
    return [_joined([part[i] for part in parts]) for i in range(2)]


def _joined(arrays: list[mx.array], axis: int = 0) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=axis)
