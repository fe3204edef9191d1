"""The work of a linear-attention layer shared by GDN and KDA, as a recurrent mixer's step
(`row_caches.recurrent`): its state is the conv tail and the delta-rule state."""

from __future__ import annotations

import mlx.core as mx

from .. import ops
from ..row_caches import RecurrentStep, recurrent


def linear_attention(
    mixed_qkv, conv_weight, a, b, gate, decay: ops.Decay, norm: ops.OutputNorm, cache, heads: ops.HeadShape
) -> mx.array:
    """The work of a GDN or KDA layer between its projections (`ops.linear_attention`: causal
    conv + SiLU over q|k|v, L2-normalised q and k, the rule's gates from a and b, the gated delta
    rule, the gated output norm), reading and updating the layer's recurrent cache.

    Returns [B, T, value_heads * value_dim] in mixed_qkv's dtype.
    """

    def step(mixed_qkv, a, b, gate, state, record):
        tail, rule_state = state if state is not None else (None, None)
        layer = ops.linear_attention(
            mixed_qkv, conv_weight, a, b, gate, decay, norm, heads, tail, rule_state, snapshots=record
        )
        snapshots = (layer.tail_snapshots, layer.state_snapshots) if layer.state_snapshots is not None else None
        return RecurrentStep(layer.out, (layer.tail, layer.state), snapshots)

    return recurrent(step, cache, mixed_qkv, a, b, gate)
