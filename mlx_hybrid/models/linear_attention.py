"""The work of a linear-attention layer shared by GDN and KDA, over one sequence's recurrent cache or
over packed rows (`cache.RowCaches`), rows of one length as one batch (`packed_rows.in_batches`)."""

from __future__ import annotations

import mlx.core as mx

from .. import ops
from ..cache import RecurrentCache, RowCaches, RowStates
from .packed_rows import in_batches


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

    if not isinstance(cache, RowCaches):
        return one_sequence(mixed_qkv, a, b, gate, cache)
    return recurrent_rows(cache, (mixed_qkv, a, b, gate), one_sequence)


def recurrent_rows(cache: RowCaches, arrays, one_sequence) -> mx.array:
    """A recurrent layer's output for packed rows: `one_sequence(*inputs, recurrent_cache)` on each
    row's inputs, rows of one length whose states exist as one batch: the states the last pass over
    the same rows left (`RowStates`), read as they are; so a decode step of rows that stay together
    gathers and splits nothing, however many rows it has."""

    def batch_key(n: int, row_cache):
        return row_cache.record_snapshots if row_cache.state is not None else None

    def run_batch(*inputs):
        *inputs, members = inputs
        batch = RecurrentCache()
        batch.record_snapshots = members[0].record_snapshots
        batch.update(*_states_of(members))
        out = one_sequence(*inputs, batch)
        states = RowStates(batch.conv_tail, batch.state, batch.conv_snapshots, batch.state_snapshots)
        for i, member in enumerate(members):
            member.join(states, i)
        return out

    return in_batches(cache, arrays, batch_key, run_batch, one_sequence)


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
    return [part[0] if len(parts) == 1 else mx.concatenate(list(part), axis=0) for part in zip(*parts)]
