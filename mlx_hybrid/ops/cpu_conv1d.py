"""Causal depthwise conv1d + SiLU on x86-64 CPUs (csrc/conv1d_silu.cpp, in the CPU kernels' module,
see `cpu_extension`): `reference.causal_conv1d_silu`'s contract for float32 inputs, one MLX
primitive a call."""

from __future__ import annotations

import mlx.core as mx

from .cpu_extension import extension


def causal_conv1d_silu(x, weight, tail=None, *, snapshots: bool = False):
    """(y [B, T, C], the tail after the last token [B, K-1, C], the T tails after each token or
    None); x and tail float32. Each token's bits are the same whatever tokens or rows come with it."""
    B, T, C = x.shape
    if tail is None:
        tail = mx.zeros((B, weight.shape[-1] - 1, C), dtype=x.dtype)
    y, new_tail, *tails = extension().conv1d_silu(x, weight, tail, snapshots)
    return y, new_tail, ([tails[0][:, t] for t in range(T)] if snapshots else None)
