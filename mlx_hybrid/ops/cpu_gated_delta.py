"""The gated delta rule token by token on x86-64 CPUs (csrc/gated_delta.cpp, in the CPU kernels'
module, see `cpu_extension`): `reference.gated_delta_recurrent`'s contract, one MLX primitive a
call where the reference makes about ten ops a token, each a pass over every head's state."""

from __future__ import annotations

import mlx.core as mx

from .cpu_extension import extension


def gated_delta_recurrent(q, k, v, g, beta, state=None, *, snapshots: bool = False):
    """(out [B, T, Hv, Dv] float32, final state, the T states after each token or None); shapes
    as in `reference`. Each token's bits are the same whatever tokens or rows come with it."""
    if state is None:
        B, _, Hv, Dv = v.shape
        state = mx.zeros((B, Hv, q.shape[-1], Dv), dtype=mx.float32)
    out, *states = extension().gated_delta(q, k, v, g, beta, state, snapshots)
    return out, states[-1], (states if snapshots else None)
