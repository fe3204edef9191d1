"""Our CPU attention kernel (csrc/attention.cpp) against MLX's op on the CPU: at Qwen3.5-0.8B's
text attention shape (8 query heads over 2 KV heads of 256 features, causal) for decode steps and
verify passes over short and long caches, and prompt chunks; and at its vision tower's (12 heads of
64 features, every patch attending to every other, 3072 patches: a 1024x768 image) and the larger
towers' (16 heads of 72):

    python benchmarks/cpu_attention.py

Milliseconds a call for one layer, medians of --repeats calls after one untimed, both evaluated;
the ratio is MLX's time over ours. The op (`ops.scaled_dot_product_attention`) takes ours for any
number of query tokens: up to 16 each row on its own (a verify pass reproduces its decode steps),
more through the BLAS's products with our exponentials between them.

A second table: the text shape over a quantized cache (--kv-bits 8 and 4, groups of 64): ours
against ours over float32 entries and against MLX's quantized products over the same codes (the
form mlx-lm's quantized cache computes, `reference.quantized_attention`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx_hybrid  # noqa: F401  (first: on Linux it loads OpenBLAS before MLX's library)

import mlx.core as mx  # noqa: I001

from mlx_hybrid import ops
from mlx_hybrid.ops import cpu_extension, reference

# (query heads, KV heads, head features, causal, query tokens, keys): the text model's decode step,
# verify passes of k=3 and 15 drafts and prompt chunks; the vision towers' images
CASES = [
    (8, 2, 256, True, *shape)
    for shape in [(1, 2048), (4, 2048), (1, 16384), (4, 16384), (16, 16384), (512, 512), (512, 16384)]
] + [(12, 12, 64, False, 3072, 3072), (16, 16, 72, False, 1024, 1024)]
# (query tokens, keys) of the text shape over a quantized cache
QUANTIZED_CASES = [(1, 2048), (1, 32768), (4, 32768), (512, 8192)]


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
    print("| heads (KV) x features | mask | query tokens | keys | ours ms | MLX ms | MLX / ours |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for heads, kv_heads, features, causal, tokens, keys in CASES:
        q = mx.random.normal((1, heads, tokens, features))
        k, v = (mx.random.normal((1, kv_heads, keys, features)) for _ in range(2))
        mx.eval(q, k, v)
        scale, mask = features**-0.5, "causal" if causal else None
        ours = median_ms(lambda: mx.eval(kernel.attention(q, k, v, scale, causal)), args.repeats)
        theirs = median_ms(
            lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)), args.repeats
        )
        print(
            f"| {heads} ({kv_heads}) x {features} | {mask or 'none'} | {tokens} | {keys} | {ours:.2f} | "
            f"{theirs:.2f} | {theirs / ours:.2f}x |",
            flush=True,
        )
    print(
        "\n| KV bits | query tokens | keys | ours ms | ours over float32 ms | float32 / ours | MLX's quantized "
        "products ms | MLX / ours |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for tokens, keys in QUANTIZED_CASES:
        q = mx.random.normal((1, 8, tokens, 256))
        k, v = (mx.random.normal((1, 2, keys, 256)) for _ in range(2))
        mx.eval(q, k, v)
        plain = median_ms(lambda: mx.eval(kernel.attention(q, k, v, 1 / 16, True)), args.repeats)
        for bits in (8, 4):
            kq, vq = (ops.quantize_entries(x, bits, 64) for x in (k, v))
            mx.eval(kq.arrays, vq.arrays)
            ours = median_ms(
                lambda: mx.eval(ops.scaled_dot_product_attention(q, kq, vq, 1 / 16, "causal")), args.repeats
            )
            mlx = median_ms(lambda: mx.eval(reference.quantized_attention(q, kq, vq, 1 / 16, "causal")), args.repeats)
            print(
                f"| {bits} | {tokens} | {keys} | {ours:.2f} | {plain:.2f} | {plain / ours:.2f}x | {mlx:.2f} | "
                f"{mlx / ours:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
