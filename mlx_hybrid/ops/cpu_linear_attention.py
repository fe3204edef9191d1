"""A linear-attention layer's work between its projections on x86-64 CPUs, one MLX primitive
(csrc/linear_attention.cpp, in the CPU kernels' module, see `cpu_extension`):
`reference.linear_attention`'s contract for a float32 x."""

from __future__ import annotations

import mlx.core as mx

from .cpu_extension import extension
from .reference import L2_EPS, Decay, HeadShape, LayerResult, OutputNorm


def linear_attention(
    x, conv_weight, a, b, gate, decay: Decay, norm: OutputNorm, heads: HeadShape, tail=None, state=None, *,
    snapshots=False,
) -> LayerResult:  # fmt: skip
    """Shapes as in `reference.linear_attention`; x and tail float32. Each token's bits are the same
    whatever tokens or rows come with it."""
    B, T, C = x.shape
    Hk, Hv, Dk, Dv = heads
    if tail is None:
        tail = mx.zeros((B, conv_weight.shape[-1] - 1, C), dtype=x.dtype)
    if state is None:
        state = mx.zeros((B, Hv, Dk, Dv), dtype=mx.float32)
    out, new_tail, *rest = extension().linear_attention(
        x, conv_weight, tail, a, b, decay.A, decay.dt_bias, gate, norm.weight, state, Hk, Dk**-0.5, L2_EPS, norm.eps,
        norm.activation == "sigmoid", snapshots,
    )  # fmt: skip
    if not snapshots:
        return LayerResult(out, new_tail, rest[0], None, None)
    tails, *states = rest
    return LayerResult(out, new_tail, states[-1], [tails[:, t] for t in range(T)], states)
