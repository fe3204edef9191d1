"""Random initialisation of the Qwen hybrid models, for training from scratch and for
benchmarks at real shapes (no checkpoint needed)."""

from __future__ import annotations

import math

import mlx.core as mx
from mlx.utils import tree_flatten

from .qwen3_5 import FLOAT32_PARAMS

RESIDUAL_OUTPUTS = ("o_proj", "out_proj", "down_proj")


def initialise(model, seed: int = 0, dtype=mx.float32):
    """GPT-style: N(0, 0.02), outputs into the residual stream scaled by 1/sqrt(2 x layers);
    norms 1; decay as freshly initialised HF checkpoints have it (A in [-16, -1], dt_bias 1)."""
    mx.random.seed(seed)
    depth_scale = 1 / math.sqrt(2 * model.args.num_hidden_layers)
    weights = []
    for name, p in tree_flatten(model.parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A":
            p = -mx.random.uniform(1.0, 16.0, p.shape)
        elif leaf == "dt_bias" or "norm" in name:
            p = mx.ones(p.shape)
        elif leaf == "conv1d_weight":
            p = mx.random.uniform(-0.5, 0.5, p.shape)
        else:
            std = 0.02 * (depth_scale if any(k in name for k in RESIDUAL_OUTPUTS) else 1.0)
            p = std * mx.random.normal(p.shape)
        weights.append((name, p.astype(mx.float32 if leaf in FLOAT32_PARAMS else dtype)))
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model
