"""Blocks shared by the model files."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import ops

F32 = mx.float32


class RMSNorm(nn.Module):
    """RMSNorm with a plain weight (loaders turn zero-centred weights w into 1 + w)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, self.weight, self.eps)


def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (as FLA and transformers)."""
    x = x.astype(F32)
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def gated_rms_norm(x: mx.array, weight: mx.array, gate: mx.array, eps: float) -> mx.array:
    """RMSNorm(x) * weight * gate, in float32 (the output norm of linear attention)."""
    x = x.astype(F32)
    return mx.fast.rms_norm(x, weight.astype(F32), eps) * gate.astype(F32)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class SwitchGLU(nn.Module):
    """SwiGLU experts stacked as [E, out, in] tensors, applied to the selected ones."""

    def __init__(self, dims: int, hidden: int, num_experts: int):
        super().__init__()
        self.gate_proj = mx.zeros((num_experts, hidden, dims))
        self.up_proj = mx.zeros((num_experts, hidden, dims))
        self.down_proj = mx.zeros((num_experts, dims, hidden))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [..., D], indices [..., k] -> [..., k, D]."""
        x = mx.expand_dims(x, (-2, -3))
        gate = ops.gather_matmul(x, self.gate_proj.swapaxes(-1, -2), indices)
        up = ops.gather_matmul(x, self.up_proj.swapaxes(-1, -2), indices)
        out = ops.gather_matmul(nn.silu(gate) * up, self.down_proj.swapaxes(-1, -2), indices)
        return out.squeeze(-2)


def top_k_indices(scores: mx.array, k: int) -> mx.array:
    """Indices of the k largest scores along the last axis."""
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


def causal_mask_for(num_tokens: int):
    """Mask argument for attention over a cache: causal when several tokens come at once."""
    return "causal" if num_tokens > 1 else None
