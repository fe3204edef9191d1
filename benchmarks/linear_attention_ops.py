"""The linear-attention layers' ops as this machine runs them, against the pure-MLX forms
measured in the same run, run by hand:

    python benchmarks/linear_attention_ops.py            # Qwen3.5-0.8B's shapes, its 18 layers
    python benchmarks/linear_attention_ops.py --tokens 1 4 64

For each token count: the causal conv1d + SiLU, the gated delta rule (token by token, as a
decode step or a verify pass runs it; past ops.CHUNKED_MIN_TOKENS the pure-MLX side is the
chunked form, as a prompt runs it, and on a GPU both sides are), the norms (q's and k's L2
normalization, the RMSNorm of the output) and the whole layer between its projections as the
models call it (ops.linear_attention: on the CPU one fused kernel), over one call per layer,
every layer's inputs its own, all evaluated. Verify-pass sizes (2 to 8 tokens) keep what a
rollback needs, and MLX's allocator keeps their buffers for reuse, as speculative decoding has it.
Prints milliseconds for all layers, medians of --repeats, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx_hybrid  # noqa: F401  (first: on Linux it loads OpenBLAS before MLX's library)

import mlx.core as mx  # noqa: I001

from mlx_hybrid import ops
from mlx_hybrid.ops import backend
from mlx_hybrid.cache import RecurrentCache
from mlx_hybrid.models.qwen3_5 import LINEAR
from mlx_hybrid.speculative import keep_snapshot_buffers

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES  # noqa: E402

VERIFY_TOKENS = range(2, 9)


def layer_inputs(args, tokens: int, seed: int) -> dict:
    """One layer's conv and rule inputs at the model's shapes, of the scale the model feeds them."""
    mx.random.seed(seed)
    Hk, Hv = args.linear_num_key_heads, args.linear_num_value_heads
    Dk, Dv, K = args.linear_key_head_dim, args.linear_value_head_dim, args.linear_conv_kernel_dim
    channels = 2 * Hk * Dk + Hv * Dv

    def unit(*shape):
        x = mx.random.normal(shape)
        return x / mx.linalg.norm(x, axis=-1, keepdims=True)

    inputs = {
        "x": mx.random.normal((1, tokens, channels)),
        "weight": 0.5 * mx.random.normal((channels, K)),
        "tail": mx.random.normal((1, K - 1, channels)),
        "q": unit(1, tokens, Hk, Dk) * Dk**-0.5,
        "k": unit(1, tokens, Hk, Dk),
        "v": mx.random.normal((1, tokens, Hv, Dv)),
        "g": -mx.random.uniform(0.01, 0.5, (1, tokens, Hv)),
        "beta": mx.random.uniform(0.1, 0.9, (1, tokens, Hv)),
        "state": 0.1 * mx.random.normal((1, Hv, Dk, Dv)),
        "norm_weight": 1 + 0.1 * mx.random.normal((Dv,)),
        "a": 0.5 * mx.random.normal((1, tokens, Hv)),
        "b": mx.random.normal((1, tokens, Hv)),
        "decay": ops.Decay(-mx.random.uniform(1, 8, (Hv,)), mx.random.uniform(-4, -1, (Hv,))),
        "z": mx.random.normal((1, tokens, Hv * Dv)),
        "heads": ops.HeadShape(Hk, Hv, Dk, Dv),
    }
    mx.eval({name: value for name, value in inputs.items() if name != "heads"})
    return inputs


def recurrent_cache(inputs) -> RecurrentCache:
    cache = RecurrentCache()
    cache.update((inputs["tail"], inputs["state"]))
    return cache


def conv(i, snapshots):
    return ops.conv1d_update(i["x"], i["weight"], i["tail"], snapshots=snapshots)


def rule(i, snapshots):
    return ops.gated_delta_update(i["q"], i["k"], i["v"], i["g"], i["beta"], i["state"], snapshots=snapshots)


def norms(i, snapshots):
    return [ops.l2_normalize(i["q"]), ops.l2_normalize(i["k"]), ops.rms_norm(i["v"], i["norm_weight"], 1e-6)]


def layer(i, snapshots):
    norm = ops.OutputNorm(i["norm_weight"], 1e-6, "silu")
    return ops.linear_attention(
        i["x"],
        i["weight"],
        i["a"],
        i["b"],
        i["z"],
        i["decay"],
        norm,
        i["heads"],
        i["tail"],
        i["state"],
        snapshots=snapshots,
    )


def outputs(result) -> list:
    """The arrays a result holds, for mx.eval, less its snapshots: those a verify pass computes come
    with them (a kernel's other outputs, the recurrence's steps), and the others are built only where a
    rollback reads one (`ops.reference.BuiltOnRead`)."""
    return [part for part in result if isinstance(part, mx.array)]


def median_ms(fn, layers, snapshots: bool, repeats: int) -> float:
    mx.eval([outputs(fn(i, snapshots)) for i in layers])  # warm up: builds, first-call checks
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([outputs(fn(i, snapshots)) for i in layers])
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def pure_mlx_ms(fn, layers, snapshots: bool, repeats: int) -> float:
    """median_ms with the ops on their pure-MLX forms (the package's own switch, so that the ops
    choose the form a call takes, the chunked rule for a prompt, as they do)."""
    before, backend.forced_by_environment = backend.forced_by_environment, True  # MLX_HYBRID_FORCE_REFERENCE=1
    try:
        return median_ms(fn, layers, snapshots, repeats)
    finally:
        backend.forced_by_environment = before


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.5-0.8b", choices=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 512], help="tokens a call (default: 1 4 512)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if any(t < 1 for t in args.tokens) or args.repeats < 1:
        p.error("--tokens and --repeats take positive numbers")
    model_args = SHAPES[args.shape]()
    n_layers = model_args.layer_types.count(LINEAR)
    print(f"{args.shape}: {n_layers} linear-attention layers; ops {ops.backend_name()}; device {mx.default_device()}")
    print(f"{'tokens':>6s} {'op':12s} {'ours ms':>9s} {'pure MLX ms':>12s} {'ratio':>7s}")
    for tokens in args.tokens:
        layers = [layer_inputs(model_args, tokens, seed) for seed in range(n_layers)]
        snapshots = tokens in VERIFY_TOKENS
        if snapshots:  # MLX's allocator keeps the snapshot buffers for reuse, as the decoder has it
            keep_snapshot_buffers([recurrent_cache(i) for i in layers], tokens - 1)
        repeats = args.repeats if tokens < 64 else max(1, args.repeats // 10)
        for name, op in [("conv + SiLU", conv), ("delta rule", rule), ("norms", norms), ("whole layer", layer)]:
            a, b = median_ms(op, layers, snapshots, repeats), pure_mlx_ms(op, layers, snapshots, repeats)
            print(f"{tokens:6d} {name:12s} {a:9.2f} {b:12.2f} {b / a:6.1f}x")


if __name__ == "__main__":
    main()
