"""The row-invariant kernels' speed against MLX's own GPU kernels on the same shapes (a GPU only).

    python benchmarks/row_kernels.py                 # Qwen3.5-0.8B's shapes, bfloat16
    python benchmarks/row_kernels.py --calls 200

For each product of a Qwen3.5-0.8B decode step (bfloat16 and 4-bit weights, groups of 64) and for
attention over 2048 cached keys: microseconds a call of ours (`ops.row_kernels`) and of MLX's
(`x @ W.T`, `mx.quantized_matmul`, `mx.fast.scaled_dot_product_attention`) at 1, 4 and 16 rows,
`calls` independent calls queued and evaluated together (the GPU's time, not the host's), best of
five. Prints ours / MLX's at one row (the aim: at most 1.1) and ours at 4 rows / ours at one (the aim:
under 1.3: a verify pass of 4 rows must not cost what it earns).
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx_hybrid  # noqa: F401  (first: on Linux it loads OpenBLAS before MLX's library)

import mlx.core as mx  # noqa: I001

from mlx_hybrid import ops
from mlx_hybrid.ops import row_kernels

ROWS = (1, 4, 16)
HIDDEN, FEED_FORWARD, VOCABULARY, HEADS, KV_HEADS, HEAD_DIM, KEYS = 1024, 3584, 248320, 8, 2, 256, 2048


def random(shape, dtype, key: int, scale: float = 1.0) -> mx.array:
    return (scale * mx.random.normal(shape, key=mx.random.key(key))).astype(dtype)


def microseconds(fn, calls: int) -> float:
    """A call's time: `calls` calls queued and evaluated together, best of five."""
    mx.eval(fn())
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def cases(platform: str):
    """name -> (ours(rows), MLX's(rows)), each a function of the row count giving a call."""
    found = {}
    for name, (inputs, outputs) in {
        "q/k/v-sized (1024 -> 3584)": (HIDDEN, FEED_FORWARD),
        "down (3584 -> 1024)": (FEED_FORWARD, HIDDEN),
        "output head (1024 -> 248320)": (HIDDEN, VOCABULARY),
    }.items():
        weight = random((outputs, inputs), mx.bfloat16, 1, inputs**-0.5)
        codes, scales, biases = mx.quantize(weight, group_size=64, bits=4)
        x = {rows: random((1, rows, inputs), mx.bfloat16, 2 + rows) for rows in ROWS}
        found[f"bfloat16 {name}"] = (
            lambda rows, x=x, w=weight: row_kernels.product(x[rows], w, platform),
            lambda rows, x=x, w=weight: x[rows] @ w.T,
        )
        found[f"4-bit {name}"] = (
            lambda rows, x=x, q=(codes, scales, biases): row_kernels.product(
                x[rows], q[0], platform, *q[1:], bits=4, group_size=64
            ),
            lambda rows, x=x, q=(codes, scales, biases): mx.quantized_matmul(x[rows], *q, group_size=64, bits=4),
        )
    k, v = (random((1, KV_HEADS, KEYS, HEAD_DIM), mx.bfloat16, key) for key in (20, 21))
    q = {rows: random((1, HEADS, rows, HEAD_DIM), mx.bfloat16, 22 + rows) for rows in ROWS}
    scale = HEAD_DIM**-0.5
    found[f"attention over {KEYS} keys"] = (
        lambda rows: row_kernels.attention(q[rows], k, v, scale, True, None, platform),
        lambda rows: mx.fast.scaled_dot_product_attention(q[rows], k, v, scale=scale, mask="causal"),
    )
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=100, help="calls queued together per timing (default 100)")
    args = p.parse_args()
    if args.calls < 1:
        p.error("--calls must be at least 1")
    platform = ops.kernel_platform()
    if platform is None:
        print("row_kernels.py times GPU kernels: no Metal or CUDA device computes here", file=sys.stderr)
        sys.exit(2)
    print(f"device {mx.default_device()}, {platform} kernels, {args.calls} calls a timing; microseconds a call")
    print("| shape | " + " | ".join(f"{r} rows ours / MLX's" for r in ROWS) + " | 1 row ours / MLX's | 4 rows / 1 |")
    print("| --- |" + " --- |" * (len(ROWS) + 2))
    for name, (ours, theirs) in cases(platform).items():
        times = {
            rows: (microseconds(lambda: ours(rows), args.calls), microseconds(lambda: theirs(rows), args.calls))
            for rows in ROWS
        }
        cells = [f"{a:.1f} / {b:.1f}" for a, b in times.values()]
        print(
            f"| {name} | " + " | ".join(cells) + f" | {times[1][0] / times[1][1]:.2f}x | "
            f"{times[4][0] / times[1][0]:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
