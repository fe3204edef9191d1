"""Sigmoid and SiLU through 2^x, in float32.

MLX's x86 CPU backend computes exp and sigmoid one value at a time, several times slower
than its power(2, y). With y = -x log2(e) rounded once to float32 the result is as
accurate as mx.sigmoid's (relative error below 4e-6 over [-100, 100], checked in
tests/test_ops.py): y's rounding error grows with |x|, and both functions saturate before
it matters. A Qwen3.5-0.8B decode step computes about 250k of these values where our CPU
primitives do not. A GPU runs them in fused kernels either way.
"""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx

F32 = mx.float32
_MINUS_LOG2_E = -math.log2(math.e)


def _sigmoid_f32(x):
    return 1.0 / (1.0 + mx.power(2.0, x.astype(F32) * _MINUS_LOG2_E))


@partial(mx.compile, shapeless=True)
def sigmoid(x: mx.array) -> mx.array:
    """1 / (1 + exp(-x)), in x's dtype."""
    return _sigmoid_f32(x).astype(x.dtype)


@partial(mx.compile, shapeless=True)
def silu(x: mx.array) -> mx.array:
    """x sigmoid(x), in x's dtype."""
    return (x.astype(F32) * _sigmoid_f32(x)).astype(x.dtype)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, in up's dtype: the SwiGLU feed-forward's hidden layer."""
    return (gate.astype(F32) * _sigmoid_f32(gate) * up.astype(F32)).astype(up.dtype)


@partial(mx.compile, shapeless=True)
def sigmoid_gated(x: mx.array, gate: mx.array) -> mx.array:
    """x * sigmoid(gate), in x's dtype: an attention output's gate."""
    return (x.astype(F32) * _sigmoid_f32(gate)).astype(x.dtype)


# Where a GPU computes, MLX's own sigmoid (no slow exp there): under mx.compile each of these is
# one fused kernel, where the 2^x forms above, a graph deeper than MLX fuses, make three
# (swiglu) or two (sigmoid_gated) launches (benchmarks/step_graph.py --gpu-path).
@partial(mx.compile, shapeless=True)
def swiglu_gpu(gate: mx.array, up: mx.array) -> mx.array:
    """`swiglu` with mx.sigmoid."""
    gate = gate.astype(F32)
    return (gate * mx.sigmoid(gate) * up.astype(F32)).astype(up.dtype)


@partial(mx.compile, shapeless=True)
def sigmoid_gated_gpu(x: mx.array, gate: mx.array) -> mx.array:
    """`sigmoid_gated` with mx.sigmoid."""
    return (x.astype(F32) * mx.sigmoid(gate.astype(F32))).astype(x.dtype)
