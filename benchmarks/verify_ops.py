"""What a verify pass's ops cost on the CPU beside a decode step's, at the bundled model's shapes (or
--model's): its 16-bit products as llama.cpp computes them, for 1 row of x and for several, and a
linear-attention layer (one primitive of ours) over 1 token and over several: alone, keeping what a
rollback needs (as a verify pass does), and with a rollback to its first token (the state it keeps
computed). Each kernel keeps to MLX's CPU thread, as a small model's queued layers do
(`ops.schedule.layer_built`).

    python benchmarks/verify_ops.py
    python benchmarks/verify_ops.py --rows 1 4 16 --calls 200

Each figure: microseconds a call, `--calls` calls on random inputs built and evaluated at once (as a
pass queues them), the best of --repeats. What any op costs through MLX is in each (an 8-row matrix's
product shows about how much).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library

import mlx.core as mx
from mlx_hybrid.ops import cpu_kernels, cpu_quantized
from mlx_hybrid.ops.reference import Decay, HeadShape, OutputNorm


def best_us(make, calls: int, repeats: int) -> float:
    """Microseconds a call of make() (its outputs evaluated together), the best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        outputs = [make() for _ in range(calls)]
        started = time.perf_counter()
        mx.eval(outputs)
        best = min(best, (time.perf_counter() - started) / calls)
    return 1e6 * best


def layer_outputs(x, a, b, gate, snapshots: bool, fixed: dict, rolled_back_to: int | None = None) -> list:
    """The layer's output and state, and the state a rollback to token `rolled_back_to` keeps."""
    result = cpu_kernels.linear_attention(x, a=a, b=b, gate=gate, snapshots=snapshots, **fixed)
    kept = [] if rolled_back_to is None else [result.state_snapshots[rolled_back_to]]
    return [result.out, result.state, *kept]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint directory or GGUF file (default: the bundled model)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="rows of x, tokens of a layer")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    model, _ = mlx_hybrid.load(args.model or mlx_hybrid.bundled_model_path())
    config, timed = model.args, partial(best_us, calls=args.calls, repeats=args.repeats)
    cpu_kernels.keep_to_one_thread(True)
    E, V = config.hidden_size, config.vocab_size
    mx.random.seed(0)
    for N, K in ((8, E), (config.intermediate_size, E), (E, config.intermediate_size), (V, E)):
        w = mx.random.normal((N, K)).astype(mx.float16)
        times = []
        for rows in args.rows:
            x = mx.random.normal((1, rows, K))
            mx.eval(w, x, cpu_quantized.half_matmul(x, w))  # (the first call's check)
            times.append(f"{rows} rows {timed(partial(cpu_quantized.half_matmul, x, w)):.1f}")
        print(f"F16 product {N} x {K}: " + ", ".join(times) + " us")
    Hk, Hv, Dk, Dv = (
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )
    C, width = 2 * Hk * Dk + Hv * Dv, config.linear_conv_kernel_dim
    fixed = {
        "conv_weight": mx.random.normal((C, width)) * 0.1,
        "decay": Decay(-mx.exp(mx.random.normal((Hv,))), mx.random.normal((Hv,))),
        "norm": OutputNorm(mx.ones((Dv,)), 1e-6, "silu"),
        "heads": HeadShape(Hk, Hv, Dk, Dv),
        "tail": mx.random.normal((1, width - 1, C)),
        "state": mx.random.normal((1, Hv, Dk, Dv)) * 0.1,
    }
    for tokens in args.rows:
        x = mx.random.normal((1, tokens, C))
        a, b = mx.random.normal((1, tokens, Hv)), mx.random.normal((1, tokens, Hv))
        gate = mx.random.normal((1, tokens, Hv * Dv))
        mx.eval(x, a, b, gate, *fixed.values())
        without, kept, rolled_back = (
            timed(partial(layer_outputs, x, a, b, gate, snapshots, fixed, rolled_back_to))
            for snapshots, rolled_back_to in ((False, None), (True, None), (True, 0))
        )
        print(
            f"linear-attention layer, {tokens} tokens: {without:.1f} us, {kept:.1f} keeping what a rollback needs, "
            f"{rolled_back:.1f} with a rollback to its first token"
        )


if __name__ == "__main__":
    main()
