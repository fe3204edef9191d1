"""Qwen3.5 (dense and MoE) and Qwen3-Next: gated delta net + gated full attention.

The three families share one graph; they differ in checkpoint layout (handled by
the loaders' tables) and in which layers use experts (`ModelArgs.is_sparse`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from ..cache import AttentionCache
from ..parallel import COLUMNS, ROWS, VECTOR, Split, all_sum, require
from ..row_caches import PassCache, attend_rows
from .layers import (
    F32,
    FULL,
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
    widest_product,
)
from .linear_attention import linear_attention
from .trunk import HybridModel, TrunkArgs
from .vision import VisionArgs, VisionTower

# The hidden state an MTP head reads. The released Qwen3.5 / Qwen3-Next heads were trained
# (Megatron-LM's MTP) on the trunk's output after the final norm, each chained draft on the
# head's own output after `mtp.norm`; a head trained on the states before those norms
# (an early llama.cpp wiring) declares "pre_norm" in its config.
POST_NORM, PRE_NORM = "post_norm", "pre_norm"
MTP_HIDDEN = (POST_NORM, PRE_NORM)


@dataclass
class ModelArgs(TrunkArgs):
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: list[str]
    max_position_embeddings: int = 262144
    intermediate_size: int = 0
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    mtp_num_hidden_layers: int = 0
    # which trunk state the MTP head was trained to read (see `MTPHead`)
    mtp_hidden: str = POST_NORM
    # MRoPE: how many rotary frequencies turn with the (temporal, row, column) positions of
    # image tokens, interleaved; None for a text-only model
    mrope_section: list[int] | None = None
    vision: VisionArgs | None = None  # the vision tower, where the checkpoint has one

    def is_sparse(self, layer: int) -> bool:
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    def validate(self):
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.mtp_hidden not in MTP_HIDDEN:
            raise ValueError(f"mtp_hidden must be one of {', '.join(map(repr, MTP_HIDDEN))}, got {self.mtp_hidden!r}")


# Parameters the loaders keep in float32 whatever the compute dtype.
FLOAT32_PARAMS = ("A", "dt_bias")


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule (Qwen3.5 / Qwen3-Next layout)."""

    def __init__(self, args: ModelArgs, gate_activation: str = "silu"):
        super().__init__()
        self.gate_activation = gate_activation  # of the output norm's gate z: "silu", or "sigmoid"
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.eps = args.rms_norm_eps
        E = args.hidden_size
        key_dim = self.num_k_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = Linear(E, conv_dim, bias=False)
        self.in_proj_z = Linear(E, value_dim, bias=False)
        self.in_proj_b = Linear(E, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(E, self.num_v_heads, bias=False)
        self.conv1d_weight = mx.zeros((conv_dim, args.linear_conv_kernel_dim))
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.A = -mx.ones((self.num_v_heads,))  # -exp(A_log), as GGUF stores it
        self.norm = RMSNorm(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = Linear(value_dim, E, bias=False)
        self.group = None  # split: out_proj gives a partial sum

    def split_heads(self, group) -> dict[str, Split]:
        """Key heads split over the ranks, each with its value heads (value head h reads key head h // R)."""
        check_heads(self.num_k_heads, group.size(), "linear-attention key heads")
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        qkv = Split(-2, (key_dim, key_dim, value_dim))
        self.num_k_heads //= group.size()
        self.num_v_heads //= group.size()
        self.group = group
        return {
            "in_proj_qkv.weight": qkv, "conv1d_weight": qkv, "in_proj_z.weight": ROWS, "in_proj_b.weight": ROWS,
            "in_proj_a.weight": ROWS, "A": VECTOR, "dt_bias": VECTOR, "out_proj.weight": COLUMNS,
        }  # fmt: skip

    def __call__(self, x: mx.array, cache: PassCache | None = None) -> mx.array:
        heads = ops.HeadShape(self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        norm = ops.OutputNorm(self.norm.weight, self.eps, self.gate_activation)
        qkv, z, b, a = projections(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        out = linear_attention(qkv, self.conv1d_weight, a, b, z, ops.Decay(self.A, self.dt_bias), norm, cache, heads)
        return all_sum(self.out_proj(out), self.group)


class GatedAttention(nn.Module):
    """Full attention with per-head q/k RMSNorm, partial RoPE and a sigmoid output gate."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        self.rope_dims = int(self.head_dim * args.partial_rotary_factor)
        self.rope_theta = args.rope_theta
        self.mrope_section = args.mrope_section
        E, H, D, bias = args.hidden_size, self.num_heads, self.head_dim, args.attention_bias
        # per head: [query (D) | gate (D)]
        self.q_proj = Linear(E, 2 * H * D, bias=bias)
        self.k_proj = Linear(E, self.num_kv_heads * D, bias=bias)
        self.v_proj = Linear(E, self.num_kv_heads * D, bias=bias)
        self.o_proj = Linear(H * D, E, bias=bias)
        self.q_norm = RMSNorm(D, args.rms_norm_eps)
        self.k_norm = RMSNorm(D, args.rms_norm_eps)
        self.group = None  # split: o_proj gives a partial sum

    def split_heads(self, group) -> dict[str, Split]:
        """Query heads split over the ranks; KV heads too, or shared by several ranks where
        the ranks outnumber them."""
        size, kv_heads = group.size(), self.num_kv_heads
        check_heads(self.num_heads, size, "attention heads")
        require(
            kv_heads % size == 0 or size % kv_heads == 0,
            f"{kv_heads} KV heads can be neither split over nor shared by {size} ranks",
        )
        require("bias" not in self.o_proj, "attention with an output bias cannot be split")
        kv = Split(-2, units=kv_heads)
        specs = {"q_proj.weight": ROWS, "k_proj.weight": kv, "v_proj.weight": kv, "o_proj.weight": COLUMNS}
        if "bias" in self.q_proj:
            specs |= {
                "q_proj.bias": VECTOR,
                "k_proj.bias": Split(-1, units=kv_heads),
                "v_proj.bias": Split(-1, units=kv_heads),
            }
        self.num_heads //= size
        self.num_kv_heads = max(kv_heads // size, 1)
        self.group = group
        return specs

    def _rope(self, x, position):
        """position: where the first token sits (int; a tuple: each batch row's), or every token's
        3-D position [3, T]."""
        if isinstance(position, (int, tuple)):
            return ops.rope(x, self.rope_dims, self.rope_theta, position)
        if self.mrope_section is None:
            raise ValueError("image positions for a model without MRoPE sections")
        return ops.mrope(x, self.rope_dims, self.rope_theta, position, self.mrope_section)

    def projected(self, x: mx.array):
        """(q, gate, k, v) of x [B, T, E], [B, T, heads, D] each, q and k normed."""
        B, T, _ = x.shape
        q, k, v = projections(x, self.q_proj, self.k_proj, self.v_proj)
        query, gate = mx.split(q.reshape(B, T, self.num_heads, 2 * self.head_dim), 2, axis=-1)
        k = self.k_norm(k.reshape(B, T, self.num_kv_heads, -1))
        return self.q_norm(query), gate, k, v.reshape(B, T, self.num_kv_heads, -1)

    def gated_output(self, out: mx.array, gate: mx.array) -> mx.array:
        B, T = out.shape[:2]
        return all_sum(self.o_proj(ops.sigmoid_gated(out.reshape(B, T, -1), gate.reshape(B, T, -1))), self.group)

    def __call__(self, x: mx.array, cache: PassCache | None = None) -> mx.array:
        q, gate, k, v = self.projected(x)
        return self.gated_output(attend_rows(self._attend, cache, q, k, v), gate)

    def _attend(self, q, k, v, cache: AttentionCache | None):
        """Positioned attention over the cache; q, k, v and the result [B, T, H, D]."""
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        position = cache.rotary_span(q.shape[2]) if cache is not None else 0
        q, k = self._rope(q, position), self._rope(k, position)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return causal_attention(q, k, v, self.scale, cache)


class SparseMoE(RoutedExperts):
    """Softmax router over experts, top-k (renormalised), plus a sigmoid-gated shared expert."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, args.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(args.hidden_size, 1, bias=False)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        probs = mx.softmax(self.gate(x).astype(F32), axis=-1)
        experts = top_k_indices(probs, self.top_k)
        weights = mx.take_along_axis(probs, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return experts, weights

    def shared(self, x: mx.array) -> mx.array:
        return mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(PreNormLayer):
    def __init__(self, args: ModelArgs, layer_type: str, sparse: bool):
        mixer = ("linear_attn", GatedDeltaNet(args)) if layer_type == LINEAR else ("self_attn", GatedAttention(args))
        mlp = SparseMoE(args) if sparse else MLP(args.hidden_size, args.intermediate_size)
        super().__init__(args, layer_type, *mixer, mlp)


class MTPHead(nn.Module):
    """Multi-token prediction block: one full-attention layer fed (h_t, token t+1).

    h_t is the trunk's state at t as `Model.mtp_input` gives it, or, for a chained draft,
    the previous step's `carry`. Post-norm (the released heads): h_t = norm(x_t), the
    tensor the LM head reads, and carry = mtp.norm(u), the tensor the head's logits come
    from. Pre-norm: the states before those norms.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.hidden_size
        self.fc = Linear(2 * E, E, bias=False)
        self.enorm = RMSNorm(E, args.rms_norm_eps)
        self.hnorm = RMSNorm(E, args.rms_norm_eps)
        # a list, so that checkpoint names `mtp.layers.0.*` are the module paths
        self.layers = [DecoderLayer(args, FULL, sparse=args.num_experts > 0)]
        self.norm = RMSNorm(E, args.rms_norm_eps)
        self.chains_normed = args.mtp_hidden == POST_NORM
        self.widest_product = widest_product(args)

    def __call__(self, hidden: mx.array, next_embeddings: mx.array, cache: PassCache | None = None):
        """(y, carry): y = mtp.norm(u), which the LM head projects to predict the token after
        next, and carry, the next chained draft's h."""
        u = self.fc(mx.concatenate([self.enorm(next_embeddings), self.hnorm(hidden)], axis=-1))
        u = self.layers[0](u, cache)
        ops.layer_built(u, self.widest_product)
        y = self.norm(u)
        return y, (y if self.chains_normed else u)


class Model(HybridModel):
    def __init__(self, args: ModelArgs):
        args.validate()
        super().__init__(
            args, [DecoderLayer(args, args.layer_types[i], args.is_sparse(i)) for i in range(args.num_hidden_layers)]
        )
        if args.mtp_num_hidden_layers:
            self.mtp = MTPHead(args)
        if args.vision is not None:
            self.vision = VisionTower(args.vision)

    @property
    def kv_features(self) -> tuple[int, ...]:
        return (self.args.head_dim,)

    def mtp_input(self, hidden: mx.array) -> mx.array:
        return self.norm(hidden) if self.args.mtp_hidden == POST_NORM else hidden
