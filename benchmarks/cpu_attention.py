"""Our CPU attention kernel (csrc/attention.cpp) against MLX's op on the CPU, at Qwen3.5-0.8B's
attention shape (8 query heads over 2 KV heads of 256 features), for decode steps and verify
passes over short and long caches, and prompt chunks:

    python benchmarks/cpu_attention.py

Milliseconds a call for one layer, medians of --repeats calls after one untimed, both evaluated;
the ratio is MLX's time over ours. The op (`ops.scaled_dot_product_attention`) takes ours for up
to `ops.CPU_ATTENTION_MAX_TOKENS` query tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx_hybrid  # noqa: F401  (first: on Linux it loads OpenBLAS before MLX's library)

import mlx.core as mx  # noqa: I001

from mlx_hybrid.ops import cpu_extension

# (query tokens, cached keys): a decode step, verify passes of k=3 and 15 drafts, prompt chunks
CASES = [(1, 2048), (4, 2048), (1, 16384), (4, 16384), (16, 16384), (512, 512), (512, 16384)]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    kernel = cpu_extension.extension()
    if kernel is None:
        raise SystemExit("our CPU kernels are not built on this machine")
    print("| query tokens | keys | ours ms | MLX ms | MLX / ours |\n| --- | --- | --- | --- | --- |")
    for tokens, keys in CASES:
        q = mx.random.normal((1, 8, tokens, 256))
        k, v = mx.random.normal((1, 2, keys, 256)), mx.random.normal((1, 2, keys, 256))
        mx.eval(q, k, v)
        ours = median_ms(lambda: mx.eval(kernel.attention(q, k, v, 0.0625, True)), args.repeats)
        theirs = median_ms(
            lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.0625, mask="causal")), args.repeats
        )
        print(f"| {tokens} | {keys} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
