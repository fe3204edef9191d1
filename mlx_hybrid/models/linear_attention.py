"""Linear attention over packed rows: several sequences packed along the token axis, each on
its own cache (`cache.RowCaches`), and the layer's work shared by GDN and KDA."""

from __future__ import annotations

from itertools import accumulate

import mlx.core as mx

from .. import ops
from ..cache import RecurrentCache, RowCaches


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
    (each row's state is its own slice, and every op is per row, so each row computes what
    it computes alone); the others one by one. Batching saves the per-op overhead of
    B small calls, which at decode dominates the recurrence's work."""
    pieces = _row_pieces(cache, arrays)
    groups: dict[tuple, list[int]] = {}
    for row, (n, row_cache) in enumerate(zip(cache.lengths, cache.caches)):
        key = (n, row_cache.record_snapshots) if row_cache.state is not None else ("alone", row)
        groups.setdefault(key, []).append(row)
    outs = [None] * len(cache.caches)
    for rows in groups.values():
        if len(rows) == 1:
            (row,) = rows
            outs[row] = one_sequence(*(p[row] for p in pieces), cache.caches[row])
            continue
        members = [cache.caches[row] for row in rows]
        batch = RecurrentCache()
        batch.record_snapshots = members[0].record_snapshots
        batch.update(mx.concatenate([c.conv_tail for c in members]), mx.concatenate([c.state for c in members]))
        out = one_sequence(*(mx.concatenate([p[row] for row in rows]) for p in pieces), batch)
        for i, (row, member) in enumerate(zip(rows, members)):
            outs[row] = out[i : i + 1]
            member.update(
                batch.conv_tail[i : i + 1],
                batch.state[i : i + 1],
                [s[i : i + 1] for s in batch.conv_snapshots] if batch.conv_snapshots else None,
                [s[i : i + 1] for s in batch.state_snapshots] if batch.state_snapshots else None,
            )
    return mx.concatenate(outs, axis=1)
