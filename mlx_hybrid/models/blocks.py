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


def delta_rule_attention(mixed_qkv, conv_weight, g, beta, cache, key_heads: int, value_heads: int, key_dim: int, value_dim: int):
    """The shared core of GDN and KDA layers: causal conv + SiLU over q|k|v, L2-normalised
    q and k, then the gated delta rule; reads and updates the layer's recurrent cache.

    Returns the rule's output [B, T, value_heads, value_dim] in float32.
    """
    B, T, _ = mixed_qkv.shape
    record = cache is not None and cache.record_snapshots
    conv = ops.conv1d_update(mixed_qkv, conv_weight, cache.conv_tail if cache else None, snapshots=record)
    q, k, v = mx.split(conv.out, [key_heads * key_dim, 2 * key_heads * key_dim], axis=-1)
    q = l2_normalize(q.reshape(B, T, key_heads, key_dim)) * key_dim**-0.5
    k = l2_normalize(k.reshape(B, T, key_heads, key_dim))
    v = v.reshape(B, T, value_heads, value_dim)
    rule = ops.gated_delta_update(q, k, v, g, beta, cache.state if cache else None, snapshots=record)
    if cache is not None:
        cache.update(conv.tail, rule.state, conv.snapshots, rule.snapshots)
    return rule.out


class HybridModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; subclasses build the layers.

    Each layer has a `layer_type` ("linear_attention" or "full_attention") and is
    called as layer(h, cache).
    """

    def __init__(self, args, layers):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def has_mtp(self) -> bool:
        return "mtp" in self

    def make_cache(self):
        from ..cache import KVCache, RecurrentCache

        return [RecurrentCache() if layer.layer_type == "linear_attention" else KVCache() for layer in self.layers]

    def hidden_states(self, ids: mx.array, cache=None) -> mx.array:
        """The trunk's hidden state before the final norm, [B, T, E]."""
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return h

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        return self.project(self.norm(h))

    def project(self, x: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.embed_tokens.as_linear(x)
        return self.lm_head(x)

    def __call__(self, ids: mx.array, cache=None) -> mx.array:
        return self.logits_from_hidden(self.hidden_states(ids, cache))
