"""Row-invariant kernels for a GPU's decode steps and verify passes: products and attention in which
a row's (a query token's) sums never depend on the rows beside it.

MLX's GPU kernels pick other tilings for a verify pass's 2-16 rows than for one, so a token of a verify
pass would not get its decode step's bits and greedy speculation would leave plain decoding. The
bodies in metal/ (`row_product.metal`, `row_attention.metal`) fix each row's reduction order; `ops`
takes them for passes of at most ROW_KERNEL_PASS_TOKENS tokens (products: the engine packs a pass's
rows along one token axis) and rows of at most ROW_KERNEL_TOKENS (attention), and leaves prompts to
MLX's kernels (a prompt's numbers need not equal anything). Launches are described here, run by
`kernels.run`.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np

from .kernels import KernelSpec, Launch, run
from .reference import QuantizedEntries

NOT_INVARIANT = "MLX's own kernel, no longer row-invariant (greedy speculation may leave plain decoding)"
ROW_PRODUCT = KernelSpec(
    "mlx_hybrid_row_product", "row_product.metal", ("x", "w", "scales", "biases", "indices"), ("out",),
    fallback=NOT_INVARIANT,
)  # fmt: skip
ROW_ATTENTION = KernelSpec(
    "mlx_hybrid_row_attention",
    "row_attention.metal",
    ("q", "k", "v", "k_scales", "k_biases", "v_scales", "v_biases", "lengths", "scale"),
    ("out",),
    contiguous_inputs=False,  # the cache's views as they are: a copy would read the cache twice
    fallback=NOT_INVARIANT,
)

# The most query tokens of a row the row attention takes: a verify pass of a DFlash block (16), of
# MTP or n-gram drafts; and the most tokens of a pass the row products take: 8 such rows (the
# engine's default batch). Longer rows and passes are prompts.
ROW_KERNEL_TOKENS = 16
ROW_KERNEL_PASS_TOKENS = 8 * ROW_KERNEL_TOKENS
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
QUANTIZED_BITS = (4, 8)
ROWS_A_THREADGROUP = 8  # rows one threadgroup multiplies with the weights it reads once
COLUMNS_A_SIMDGROUP = 4
SIMDGROUPS = 4  # a product's threadgroup: 128 threads


@lru_cache(maxsize=None)
def _unused(dtype=mx.float32) -> mx.array:
    """A one-element input a variant does not read (scales of a float matrix, indices of a plain
    product), made once and evaluated: no step launches it."""
    unused = mx.zeros((1,), dtype)
    mx.eval(unused)
    return unused


def product_launch(x, w, scales=None, biases=None, indices=None, *, bits: int = 0, group_size: int = 0,
                   share: int = 1) -> Launch:  # fmt: skip
    """x [M / share, K] @ W^T -> [M, N] in x's dtype: w [N, K] (float) or MLX's affine codes [N, K * bits
    / 32] with scales and biases; with indices [M] (int32 or uint32, as a router's top-k gives them), w
    is [E, N, ...] and row r multiplies matrix indices[r] (row r's input x[r // share])."""
    experts = indices is not None
    if not experts:
        w, scales, biases = (a[None] if a is not None else None for a in (w, scales, biases))
    M, N = x.shape[0] * share, w.shape[1]
    rows = 1 if experts else rows_a_threadgroup(M)
    columns = COLUMNS_A_SIMDGROUP if N >= COLUMNS_A_SIMDGROUP else 1
    simdgroups = min(SIMDGROUPS, math.ceil(N / columns))
    unused = _unused()
    return Launch(
        inputs=[x, w, unused if scales is None else scales, unused if biases is None else biases,
                indices if experts else _unused(mx.int32)],  # fmt: skip
        template=[("T", x.dtype), ("Bits", bits), ("GroupSize", group_size or 1), ("Rows", rows),
                  ("Columns", columns), ("Experts", experts), ("Share", share)],  # fmt: skip
        grid=(32, simdgroups * math.ceil(N / (simdgroups * columns)), math.ceil(M / rows)),
        threadgroup=(32, simdgroups, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )


def rows_a_threadgroup(rows: int) -> int:
    """Rows one threadgroup of a plain product takes: the fewest powers of two for up to 8 (each a
    compiled variant), then 8."""
    return min(ROWS_A_THREADGROUP, 1 << (rows - 1).bit_length())


def rows_of_x(x: mx.array, indices: mx.array) -> int:
    """An expert product's rows a row of x [..., 1 or k, 1, K] feeds (indices [..., k])."""
    return indices.shape[-1] if x.shape[-3] == 1 else 1


def key_groups(value_dim: int) -> int:
    """Simdgroups a query token's keys are dealt to: fixed by the head size alone, so every call of a
    layer sums alike (16 x 256 floats of threadgroup memory at most)."""
    return 16 if value_dim <= 256 else 8


def attention_launch(q, k, v, scale: float, causal: bool, lengths: mx.array) -> Launch:
    """q [B, H, T, Dk] over k, v (arrays or a quantized cache's `QuantizedEntries`), row b's first
    lengths[b] keys -> [B, H, T, Dv] in q's dtype."""
    B, H, T, Dk = q.shape
    quantized = not isinstance(k, mx.array)
    if quantized:
        Dv = v.codes.shape[-1] * 32 // v.bits
        arrays = [k.codes, v.codes, k.scales, k.biases, v.scales, v.biases]
        bits, group_size = k.bits, k.group_size
    else:
        Dv = v.shape[-1]
        arrays = [k, v] + [_unused(q.dtype)] * 4
        bits, group_size = 0, 1
    groups = key_groups(Dv)
    return Launch(
        inputs=[q, *arrays, lengths, _scale(scale)],
        template=[("T", q.dtype), ("Bits", bits), ("GroupSize", group_size), ("Dk", Dk), ("Dv", Dv),
                  ("Causal", causal), ("KeyGroups", groups)],  # fmt: skip
        grid=(32, groups, B * H * T),
        threadgroup=(32, groups, 1),
        output_shapes=[(B, H, T, Dv)],
        output_dtypes=[q.dtype],
    )


@lru_cache(maxsize=64)
def _scale(value: float) -> mx.array:
    return mx.array([value], mx.float32)


@lru_cache(maxsize=8)
def key_counts(counts: tuple[int, ...]) -> mx.array:
    """Each row's key count as the kernel's input (a pass's layers share it; made on the host)."""
    return mx.array(counts, mx.int32)


def product(x, w, platform: str, scales=None, biases=None, *, bits: int = 0, group_size: int = 0) -> mx.array:
    """x [..., K] @ W^T for w [N, K] (float, or MLX's affine codes with scales and biases)."""
    flat = x.reshape(-1, x.shape[-1])
    launch = product_launch(flat, w, scales, biases, bits=bits, group_size=group_size)
    return run(ROW_PRODUCT, launch, platform)[0].reshape(*x.shape[:-1], -1)


def expert_product(x, w, indices, platform: str, scales=None, biases=None, *, bits=0, group_size=0) -> mx.array:
    """x [..., 1 or k, 1, K] against the matrices of w [E, N, ...] chosen by indices [..., k]:
    [..., k, 1, N]."""
    flat = x.reshape(-1, x.shape[-1])
    launch = product_launch(flat, w, scales, biases, indices.reshape(-1), bits=bits, group_size=group_size,
                            share=rows_of_x(x, indices))  # fmt: skip
    return run(ROW_PRODUCT, launch, platform)[0].reshape(*indices.shape, 1, -1)


def attention(q, k, v, scale: float, causal: bool, key_lengths, platform: str) -> mx.array:
    """ops.scaled_dot_product_attention's arguments (key_lengths None: every row holds all keys)."""
    keys = (k.codes if not isinstance(k, mx.array) else k).shape[2]
    counts = key_counts(tuple(key_lengths) if key_lengths is not None else (keys,) * q.shape[0])
    return run(ROW_ATTENTION, attention_launch(q, k, v, scale, causal, counts), platform)[0]


def tokens_of(x: mx.array) -> int:
    """Tokens of a product's input [..., K]: its rows."""
    return x.size // x.shape[-1]


def _random(rng, shape, dtype) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _decoded(codes, scales, biases, group_size: int, bits: int) -> mx.array:
    """MLX's affine codes as float32 values (16-bit scales widened first: no rounding on the way)."""
    f32 = mx.float32
    return mx.dequantize(codes, scales.astype(f32), biases.astype(f32), group_size=group_size, bits=bits)


def small_product_case(platform, dtype, weights, group_size: int, rows: int, share: int):
    """`rows` rows through the kernel against MLX's float32 product of the same values (weights: a float
    dtype, or the bits of MLX's affine codes; share: 0 for a plain product, else an expert product's
    rows a row of x, each token choosing two of three matrices or `share`)."""
    rng = np.random.default_rng(0)
    K, N, E = 2 * max(group_size, 64), 12, 3  # 12 outputs: a partial threadgroup
    matrices = _random(rng, (E, N, K), mx.float32)
    if isinstance(weights, int):
        codes, scales, biases = mx.quantize(matrices.astype(dtype), group_size=group_size, bits=weights)
        matrices = _decoded(codes, scales, biases, group_size, weights)
        stored = dict(w=codes, scales=scales, biases=biases, bits=weights, group_size=group_size)
    else:
        matrices = matrices.astype(weights)
        stored = dict(w=matrices)
    wide = matrices.astype(mx.float32)
    if share:
        k = max(share, 2)
        x = _random(rng, (rows, 1 if share > 1 else k, 1, K), dtype)
        indices = mx.array(rng.integers(0, E, (rows, k)), mx.int32)
        got = expert_product(x, indices=indices, platform=platform, **stored)
        want = (x.astype(mx.float32) @ wide[indices].swapaxes(-1, -2))  # [rows, k, 1, N]
        return [got], [want.astype(dtype)]
    x = _random(rng, (rows, K), dtype)
    stored.update({name: stored[name][0] for name in ("w", "scales", "biases") if name in stored})
    return [product(x, platform=platform, **stored)], [(x.astype(mx.float32) @ wide[0].T).astype(dtype)]


def small_attention_case(platform, dtype, bits: int, group_size: int, key_dim: int, value_dim: int, causal: bool):
    """Two rows holding 23 and 17 keys (float, or mx.quantize's groups), 3 query tokens of four heads
    over two KV heads: the kernel against MLX's float32 attention of each row over its own keys (their
    decoded values)."""
    rng = np.random.default_rng(0)
    q = _random(rng, (2, 4, 3, key_dim), dtype)
    k, v = (_random(rng, (2, 2, 23, dim), dtype) for dim in (key_dim, value_dim))
    if bits:
        held = [QuantizedEntries(*mx.quantize(a, group_size=group_size, bits=bits), bits, group_size) for a in (k, v)]
        k, v = (_decoded(*a.arrays, group_size, bits) for a in held)
    got = attention(q, *(held if bits else (k, v)), 0.3, causal, (23, 17), platform)
    want = [
        mx.fast.scaled_dot_product_attention(
            q[b : b + 1].astype(mx.float32), *(a[b : b + 1, :, :keys].astype(mx.float32) for a in (k, v)), scale=0.3,
            mask="causal" if causal else None,
        )
        for b, keys in enumerate((23, 17))
    ]  # fmt: skip
    return [got], [mx.concatenate(want).astype(dtype)]
