"""Which of a decode step's ops give a row the same bits whatever rows come with it, on this device.

    python benchmarks/row_invariance.py                  # the model's dtype on this device
    python benchmarks/row_invariance.py --dtype float32

Greedy speculative decoding reproduces plain decoding only where a verify pass (1 + k tokens)
computes each token as a decode step (one token) would. For each op a Qwen3.5-0.8B decode step
runs, at that model's widths, random inputs: T rows through the op at once against each row
alone (attention: token t over the keys up to it, as its decode step sees them; the linear-
attention layer: token t after t single-token calls, from the same state), for T = 2, 4, 8, 16.
Prints, per op, whether every row came out bit-equal and the largest difference. Runs wherever
MLX computes: on the CPU our kernels are bit-equal by contract, so this shows what a GPU's
kernels (MLX's and ours) do where they run.
"""

from __future__ import annotations

import argparse

import mlx_hybrid  # noqa: F401  (first: on Linux it loads OpenBLAS before MLX's library)

import mlx.core as mx  # noqa: I001
import numpy as np

from mlx_hybrid import ops
from mlx_hybrid.ops import reference
from mlx_hybrid.ops.selfcheck import linear_attention_args

ROWS = (2, 4, 8, 16)
HIDDEN, FEED_FORWARD, HEADS, KV_HEADS, HEAD_DIM, KEYS = 1024, 3584, 8, 2, 256, 2048
EXPERTS, EXPERT_WIDTH = 32, 512  # 35B-A3B's experts are 512 wide (of 256: 32 here keeps it small)
LINEAR_HEADS = reference.HeadShape(16, 16, 128, 128)


def random(shape, dtype, key: int, scale: float = 1.0) -> mx.array:
    return (scale * mx.random.normal(shape, key=mx.random.key(key))).astype(dtype)


def products(dtype):
    """op name -> fn(x, y), x and y [1, T, HIDDEN], for the ops whose token t depends on token t alone."""
    weight = random((FEED_FORWARD, HIDDEN), dtype, 1, HIDDEN**-0.5)
    quantized = {bits: mx.quantize(weight, group_size=64, bits=bits) for bits in (4, 8)}
    norm_weight = random((HIDDEN,), dtype, 2)
    experts = random((EXPERTS, EXPERT_WIDTH, HIDDEN), dtype, 3, HIDDEN**-0.5)
    chosen = mx.array([[[3, 17, 5, 30, 11, 0, 22, 9]]])  # every token the same 8 experts: [1, 1, 8]

    def expert_product(x, _):
        indices = mx.broadcast_to(chosen, (*x.shape[:2], chosen.shape[-1]))
        return ops.gather_matmul(mx.expand_dims(x, (-2, -3)), experts, indices)

    return {
        "matrix product (x W^T)": lambda x, _: ops.linear(x, weight),
        **{
            f"{bits}-bit product (groups of 64)": lambda x, _, q=q, bits=bits: ops.quantized_matmul(
                x, *q, group_size=64, bits=bits
            )
            for bits, q in quantized.items()
        },
        f"expert product (8 of {EXPERTS}, {HIDDEN} -> {EXPERT_WIDTH})": expert_product,
        "RMSNorm": lambda x, _: ops.rms_norm(x, norm_weight, 1e-6),
        "residual + RMSNorm": lambda x, y: ops.add_rms_norm(x, y, norm_weight, 1e-6)[1],
        "SwiGLU": lambda x, y: ops.swiglu(x, y),
    }


def row_wise(fn, dtype, rows: int) -> float | None:
    """The largest difference between fn over `rows` tokens and over each token alone (None: bit-equal)."""
    x, y = (random((1, rows, HIDDEN), dtype, key + rows) for key in (10, 30))
    together = fn(x, y)
    alone = mx.concatenate([fn(x[:, t : t + 1], y[:, t : t + 1]) for t in range(rows)], axis=1)
    return difference(together, alone)


def attention(dtype, rows: int, kv_bits: int | None = None) -> float | None:
    """A verify pass's T query tokens over a cache (causal) against each token's decode step (the
    cache float, or held as --kv-bits's groups of 64)."""
    k, v = (random((1, KV_HEADS, KEYS, HEAD_DIM), dtype, key) for key in (20, 21))
    if kv_bits:
        k, v = (ops.quantize_entries(a, kv_bits, 64) for a in (k, v))
    q = random((1, HEADS, rows, HEAD_DIM), dtype, 22)
    scale = HEAD_DIM**-0.5
    together = ops.scaled_dot_product_attention(q, k, v, scale, mask="causal")
    seen = [KEYS - rows + t + 1 for t in range(rows)]  # the keys token t's decode step has
    alone = [
        ops.scaled_dot_product_attention(q[:, :, t : t + 1], first_keys(k, n), first_keys(v, n), scale)
        for t, n in enumerate(seen)
    ]
    return difference(together, mx.concatenate(alone, axis=2))


def first_keys(entries, keys: int):
    """A cache's first `keys` entries (views), float or quantized."""
    if isinstance(entries, mx.array):
        return entries[:, :, :keys]
    return entries._replace(
        codes=entries.codes[:, :, :keys], scales=entries.scales[:, :, :keys], biases=entries.biases[:, :, :keys]
    )


def linear_attention(dtype, rows: int) -> float | None:
    """A GDN layer over T tokens (snapshots on, as a verify pass) against T single-token calls."""
    args = linear_attention_args(np.random.default_rng(rows), 1, rows, LINEAR_HEADS, 4, False, "silu", dtype)
    together = ops.linear_attention(*args, snapshots=True).out
    x, conv_weight, a, b, gate, decay, norm, heads, tail, state = args
    outs = []
    for t in range(rows):
        x_t, a_t, b_t, gate_t = (u[:, t : t + 1] for u in (x, a, b, gate))
        step = ops.linear_attention(x_t, conv_weight, a_t, b_t, gate_t, decay, norm, heads, tail, state, snapshots=True)
        outs.append(step.out)
        tail, state = step.tail, step.state
    return difference(together, mx.concatenate(outs, axis=1))


def difference(a: mx.array, b: mx.array) -> float | None:
    a, b = (np.array(x.astype(mx.float32)) for x in (a, b))
    return None if np.array_equal(a, b) else float(np.abs(a - b).max())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: the device's model dtype")
    args = p.parse_args()
    dtype = getattr(mx, args.dtype) if args.dtype else ops.default_dtype()
    checks = {name: (lambda rows, fn=fn: row_wise(fn, dtype, rows)) for name, fn in products(dtype).items()}
    checks["attention over 2048 cached keys"] = lambda rows: attention(dtype, rows)
    checks["attention over 2048 keys, --kv-bits 8"] = lambda rows: attention(dtype, rows, kv_bits=8)
    checks["linear-attention layer"] = lambda rows: linear_attention(dtype, rows)
    print(f"device {mx.default_device()}, ops {ops.backend_name()}, {dtype}")
    print("| op | " + " | ".join(f"{t} rows" for t in ROWS) + " |")
    print("| --- |" + " --- |" * len(ROWS))
    for name, check in checks.items():
        cells = []
        for rows in ROWS:
            diff = check(rows)
            cells.append("bit-equal" if diff is None else f"differs by {diff:.2g}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
