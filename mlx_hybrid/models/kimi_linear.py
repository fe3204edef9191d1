"""Kimi Linear: KDA (gated delta rule with a per-channel gate) + MLA without positions.

The MLA layers run in the absorbed form: the cache holds, per token, only the
normalised latent (kv_lora_rank) and the rope-part key, never per-head keys and
values. Kimi uses no positional encoding at all, so the "rope" part is plain.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from ..cache import AttentionCache
from ..parallel import COLUMNS, ROWS, VECTOR, Split, all_sum
from ..row_caches import PassCache, attend_rows
from .layers import (
    F32,
    LINEAR,
    MLP,
    Linear,
    PreNormLayer,
    RMSNorm,
    RoutedExperts,
    causal_attention,
    check_heads,
    check_layer_types,
    projections,
    top_k_indices,
)
from .linear_attention import linear_attention
from .trunk import HybridModel, TrunkArgs


@dataclass
class ModelArgs(TrunkArgs):
    layer_types: list[str]
    # KDA layers
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    # MLA layers
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # feed-forward
    intermediate_size: int
    first_k_dense_replace: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    max_position_embeddings: int = 1048576

    def is_sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace

    def validate(self):
        check_layer_types(self.layer_types, self.num_hidden_layers)


FLOAT32_PARAMS = ("A", "dt_bias", "e_score_correction_bias")


class KimiDeltaAttention(nn.Module):
    """KDA: q/k/v each with a short causal conv, a per-channel forget gate, sigmoid-gated output norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, H, D = args.hidden_size, args.linear_num_heads, args.linear_head_dim
        K = args.linear_conv_kernel_dim
        self.num_heads, self.head_dim, self.eps = H, D, args.rms_norm_eps
        self.q_proj = Linear(E, H * D, bias=False)
        self.k_proj = Linear(E, H * D, bias=False)
        self.v_proj = Linear(E, H * D, bias=False)
        self.q_conv1d_weight = mx.zeros((H * D, K))
        self.k_conv1d_weight = mx.zeros((H * D, K))
        self.v_conv1d_weight = mx.zeros((H * D, K))
        self.f_a_proj = Linear(E, D, bias=False)
        self.f_b_proj = Linear(D, H * D, bias=False)
        self.dt_bias = mx.zeros((H * D,))
        self.A = -mx.ones((H,))  # -exp(A_log), one decay rate per head
        self.b_proj = Linear(E, H, bias=False)
        self.g_a_proj = Linear(E, D, bias=False)
        self.g_b_proj = Linear(D, H * D, bias=False)
        self.o_norm = RMSNorm(D, args.rms_norm_eps)
        self.o_proj = Linear(H * D, E, bias=False)
        self.group = None  # split: o_proj gives a partial sum

    def split_heads(self, group) -> dict[str, Split]:
        """Heads split over the ranks: their q/k/v rows, conv channels, gates and decay; the
        low-rank gate inputs (f_a, g_a) stay whole."""
        check_heads(self.num_heads, group.size(), "KDA heads")
        self.num_heads //= group.size()
        self.group = group
        rows = ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", "g_b_proj")
        convs = ("q_conv1d_weight", "k_conv1d_weight", "v_conv1d_weight")
        return (
            {f"{name}.weight": ROWS for name in rows}
            | {name: ROWS for name in convs}
            | {
                "dt_bias": VECTOR,
                "A": VECTOR,
                "o_proj.weight": COLUMNS,
            }
        )

    def __call__(self, x: mx.array, cache: PassCache | None = None) -> mx.array:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q, k, v, decay_low, gate_low, beta = projections(
            x, self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj, self.b_proj
        )
        # the three depthwise convs are one conv over the concatenated channels
        mixed = mx.concatenate([q, k, v], axis=-1)
        conv_weight = mx.concatenate([self.q_conv1d_weight, self.k_conv1d_weight, self.v_conv1d_weight], axis=0)
        decay_in = self.f_b_proj(decay_low).reshape(B, T, H, D)  # the decay per head and channel
        norm = ops.OutputNorm(self.o_norm.weight, self.eps, "sigmoid")
        out = linear_attention(
            mixed,
            conv_weight,
            decay_in,
            beta,
            self.g_b_proj(gate_low),
            ops.Decay(self.A, self.dt_bias),
            norm,
            cache,
            ops.HeadShape(H, H, D, D),
        )
        return all_sum(self.o_proj(out), self.group)


class LatentAttention(nn.Module):
    """MLA, absorbed: queries are mapped into the latent space, so one shared latent 'head'
    of kv_lora_rank + rope dims serves as keys (and its latent part as values)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, H = args.hidden_size, args.num_attention_heads
        self.num_heads = H
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.latent_dim = args.kv_lora_rank
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        self.q_proj = Linear(E, H * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = Linear(E, self.latent_dim + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, args.rms_norm_eps)
        # per head: latent -> key (no-position part), and latent -> value (as GGUF attn_k_b / attn_v_b)
        self.k_b_proj = mx.zeros((H, self.latent_dim, self.nope_dim))
        self.v_b_proj = mx.zeros((H, args.v_head_dim, self.latent_dim))
        self.o_proj = Linear(H * args.v_head_dim, E, bias=False)
        self.group = None  # split: o_proj gives a partial sum

    def split_heads(self, group) -> dict[str, Split]:
        """Heads split over the ranks; the latent (and its cache) is shared by all heads, so
        every rank keeps it whole."""
        check_heads(self.num_heads, group.size(), "MLA heads")
        self.num_heads //= group.size()
        self.group = group
        heads = Split(-3)
        return {"q_proj.weight": ROWS, "k_b_proj": heads, "v_b_proj": heads, "o_proj.weight": COLUMNS}

    def __call__(self, x: mx.array, cache: PassCache | None = None) -> mx.array:
        B, T, _ = x.shape
        q, compressed = projections(x, self.q_proj, self.kv_a_proj_with_mqa)
        q = q.reshape(B, T, self.num_heads, -1).transpose(0, 2, 1, 3)
        q_nope, q_rope = mx.split(q, [self.nope_dim], axis=-1)
        queries = mx.concatenate([q_nope @ self.k_b_proj.swapaxes(-1, -2), q_rope], axis=-1)
        latent, k_rope = mx.split(compressed, [self.latent_dim], axis=-1)
        keys = mx.concatenate([self.kv_a_layernorm(latent), k_rope], axis=-1)  # [B, T, L + R]
        out = attend_rows(self._attend, cache, queries.transpose(0, 2, 1, 3), keys)  # [B, T, H, L]
        out = out.transpose(0, 2, 1, 3) @ self.v_b_proj.swapaxes(-1, -2)  # [B, H, T, v_head_dim]
        return all_sum(self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1)), self.group)

    def _attend(self, queries, keys, cache: AttentionCache | None):
        """Queries [B, T, H, L + R] over the latent cache; the result [B, T, H, L]."""
        queries, keys = queries.transpose(0, 2, 1, 3), keys[:, None]  # [B, 1, T, L + R]
        if cache is not None:
            (keys,) = cache.update_and_fetch(keys)
        values = ops.leading_features(keys, self.latent_dim)
        return causal_attention(queries, keys, values, self.scale, cache)


class SigmoidMoE(RoutedExperts):
    """Sigmoid router with a selection-only bias, renormalised top-k, scaled, plus shared experts."""

    shared_name = "shared_experts"

    def __init__(self, args: ModelArgs):
        super().__init__(args, args.moe_intermediate_size * args.num_shared_experts)
        self.scaling = args.routed_scaling_factor
        self.e_score_correction_bias = mx.zeros((args.num_experts,))

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        scores = mx.sigmoid(self.gate(x.astype(F32)))
        experts = top_k_indices(scores + self.e_score_correction_bias, self.top_k)
        weights = mx.take_along_axis(scores, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return experts, weights * self.scaling


class DecoderLayer(PreNormLayer):
    def __init__(self, args: ModelArgs, layer_type: str, sparse: bool):
        mixer = KimiDeltaAttention(args) if layer_type == LINEAR else LatentAttention(args)
        mlp = SigmoidMoE(args) if sparse else MLP(args.hidden_size, args.intermediate_size)
        super().__init__(args, layer_type, "self_attn", mixer, mlp)


class Model(HybridModel):
    def __init__(self, args: ModelArgs):
        args.validate()
        super().__init__(
            args, [DecoderLayer(args, args.layer_types[i], args.is_sparse(i)) for i in range(args.num_hidden_layers)]
        )

    @property
    def kv_features(self) -> tuple[int, ...]:
        # the latent and rope key; the values are its leading latent features
        return (self.args.kv_lora_rank + self.args.qk_rope_head_dim, self.args.kv_lora_rank)
