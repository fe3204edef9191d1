"""Random-weight models at real shapes, built in memory (no checkpoint needed)."""

from __future__ import annotations

import mlx.core as mx

from mlx_hybrid.models.random_weights import initialise
from mlx_hybrid.models.qwen3_5 import FULL, LINEAR, Model, ModelArgs


# What Qwen3.5's released sizes share: the tokenizer, the attention heads' shape and rotary
# embedding, the gated-delta layers' key heads and widths, an MTP layer.
QWEN3_5_FAMILY = dict(
    vocab_size=248320,
    num_key_value_heads=2,
    head_dim=256,
    rms_norm_eps=1e-6,
    rope_theta=10_000_000.0,
    partial_rotary_factor=0.25,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    mtp_num_hidden_layers=1,
)


def qwen3_5_0_8b() -> ModelArgs:
    """Qwen3.5-0.8B's text model (hidden 1024, 24 layers, every 4th full attention)."""
    return ModelArgs(
        **QWEN3_5_FAMILY,
        model_type="qwen3_5",
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=8,
        linear_num_value_heads=16,
        layer_types=[FULL if (i + 1) % 4 == 0 else LINEAR for i in range(24)],
        intermediate_size=3584,
        tie_word_embeddings=True,
    )


def qwen3_5_35b_a3b_scaled() -> ModelArgs:
    """Qwen3.5-35B-A3B's widths (hidden 2048, experts of 512, top-8, 32 value heads) with
    4 layers instead of 40 and 32 experts instead of 256, to fit a small machine."""
    return ModelArgs(
        **QWEN3_5_FAMILY,
        model_type="qwen3_5_moe",
        hidden_size=2048,
        num_hidden_layers=4,
        num_attention_heads=16,
        linear_num_value_heads=32,
        layer_types=[FULL if (i + 1) % 4 == 0 else LINEAR for i in range(4)],
        num_experts=32,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
    )


SHAPES = {"qwen3.5-0.8b": qwen3_5_0_8b, "qwen3.5-35b-a3b-scaled": qwen3_5_35b_a3b_scaled}


def random_model(args: ModelArgs, dtype=mx.float32, seed: int = 0) -> Model:
    return initialise(Model(args), seed, dtype)
