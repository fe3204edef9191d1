"""Row-invariant kernels for a GPU's decode steps and verify passes: products and attention in which
a row's (a query token's) sums never depend on the rows beside it.

MLX's GPU kernels pick other tilings for a verify pass's 2-16 rows than for one, so a token of a verify
pass would not get its decode step's bits and greedy speculation would leave plain decoding. The
bodies in metal/ (`row_product.metal`, `row_attention.metal`) fix each row's reduction order; `ops`
takes them for passes of at most ROW_KERNEL_PASS_TOKENS tokens (products: the engine packs a pass's
rows along one token axis) and rows of at most ROW_KERNEL_TOKENS (attention), and leaves prompts to
MLX's kernels (a prompt's numbers need not equal anything). Launches are described here, run by
`gpu_kernels.run`.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .gpu_kernels import KernelSpec, Launch, run
from .reference import QuantizedEntries

NOT_INVARIANT = "using MLX's own kernel for it, no longer row-invariant (greedy speculation may leave plain decoding)"
ROW_PRODUCT = KernelSpec(
    "mlx_hybrid_row_product",
    "row_product.metal",
    ("x", "w", "scales", "biases", "indices"),
    ("out",),
    fallback=NOT_INVARIANT,
)
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
QUANTIZED_BITS, GROUP_SIZES = (4, 8), (32, 64, 128)  # MLX's affine codes the bodies read
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


class ProductForm(NamedTuple):
    """What a product launch of one shape takes, made once (a step launches a hundred or more)."""

    variant: tuple  # the first-use check's key: (dtype, weights: dtype or bits, group size, rows, share)
    template: list
    grid: tuple
    threadgroup: tuple
    output_shape: tuple


@lru_cache(maxsize=4096)
def product_form(x_shape, dtype, w_shape, w_dtype, bits: int, group_size: int, indices_shape) -> ProductForm | None:
    """The launch of x [..., K] @ W^T (w [N, K] float, or MLX's affine codes when bits; with indices_shape
    [..., k], w [E, N, ...] and x [..., 1 or k, 1, K]: an expert product, [..., k, 1, N]); None where the
    row kernel does not take it (more than ROW_KERNEL_PASS_TOKENS tokens, a dtype it does not read)."""
    experts = indices_shape is not None
    tokens = math.prod(indices_shape[:-1]) if experts else math.prod(x_shape[:-1])
    if tokens > ROW_KERNEL_PASS_TOKENS or dtype not in FLOAT_DTYPES:
        return None
    if (bits not in QUANTIZED_BITS or group_size not in GROUP_SIZES) if bits else w_dtype not in FLOAT_DTYPES:
        return None
    share = (indices_shape[-1] if x_shape[-3] == 1 else 1) if experts else 1
    N = w_shape[1 if experts else 0]
    M = math.prod(x_shape[:-1]) * share
    rows = 1 if experts else rows_a_threadgroup(M)
    columns = COLUMNS_A_SIMDGROUP if N >= COLUMNS_A_SIMDGROUP else 1
    simdgroups = min(SIMDGROUPS, math.ceil(N / columns))
    template = [
        ("T", dtype),
        ("Bits", bits),
        ("GroupSize", group_size or 1),
        ("Rows", rows),
        ("Columns", columns),
        ("Experts", experts),
        ("Share", share),
    ]
    grid = (32, simdgroups * math.ceil(N / (simdgroups * columns)), math.ceil(M / rows))
    out_shape = (*indices_shape, 1, N) if experts else (*x_shape[:-1], N)
    variant = (dtype, bits or w_dtype, group_size, rows, share if experts else 0)
    return ProductForm(variant, template, grid, (32, simdgroups, 1), out_shape)


def form_launch(form: ProductForm, x, w, scales=None, biases=None, indices=None) -> Launch:
    """A product's launch of this form (unread inputs: a one-element array)."""
    unused = _unused()
    return Launch(
        inputs=[
            x,
            w,
            unused if scales is None else scales,
            unused if biases is None else biases,
            _unused(mx.int32) if indices is None else indices,
        ],
        template=form.template,
        grid=form.grid,
        threadgroup=form.threadgroup,
        output_shapes=[form.output_shape],
        output_dtypes=[x.dtype],
    )


def product_launch(x, w, scales=None, biases=None, indices=None, *, bits: int = 0, group_size: int = 0) -> Launch:
    """`product_form`'s launch for these arrays (indices: int32 or uint32, as a router's top-k gives them)."""
    chosen = None if indices is None else indices.shape
    return form_launch(
        product_form(x.shape, x.dtype, w.shape, w.dtype, bits, group_size, chosen), x, w, scales, biases, indices
    )


def rows_a_threadgroup(rows: int) -> int:
    """Rows one threadgroup of a plain product takes: the fewest powers of two for up to 8 (each a
    compiled variant), then 8."""
    return min(ROWS_A_THREADGROUP, 1 << (rows - 1).bit_length())


def key_groups(value_dim: int) -> int:
    """Simdgroups a query token's keys are dealt to: fixed by the head size alone, so every call of a
    layer sums alike (16 x 256 floats of threadgroup memory at most)."""
    return 16 if value_dim <= 256 else 8


# the widest value head the row attention takes (its threadgroup memory: 8 groups x 512 floats)
MAX_VALUE_DIM = 512


class AttentionForm(NamedTuple):
    """What an attention launch of one shape takes, made once."""

    variant: tuple  # the first-use check's key: (dtype, bits, group size, Dk, Dv, causal)
    template: list
    grid: tuple
    threadgroup: tuple
    output_shape: tuple


def entries_of(k, v) -> tuple:
    """(KV heads, value head size, bits, group size) of a cache's keys and values (arrays: 0 bits, or
    `QuantizedEntries`); bits None where keys and values are held in other forms."""
    if isinstance(k, mx.array):
        return k.shape[1], v.shape[-1], 0, 1
    same = (k.bits, k.group_size) == (v.bits, v.group_size)
    return k.codes.shape[1], v.codes.shape[-1] * 32 // v.bits, k.bits if same else None, k.group_size


@lru_cache(maxsize=1024)
def attention_form(q_shape, dtype, kv_heads: int, value_dim: int, bits, group_size: int, causal: bool):
    """The launch of q [B, H, T, Dk] over a cache of these entries (`entries_of`), or None where the row
    attention does not take it (more than ROW_KERNEL_TOKENS query tokens a row, a dtype or form)."""
    B, H, T, Dk = q_shape
    if T > ROW_KERNEL_TOKENS or dtype not in FLOAT_DTYPES or H % kv_heads or value_dim > MAX_VALUE_DIM:
        return None
    if bits is None or (bits and (bits not in QUANTIZED_BITS or group_size not in GROUP_SIZES)):
        return None
    groups = key_groups(value_dim)
    template = [
        ("T", dtype),
        ("Bits", bits),
        ("GroupSize", group_size),
        ("Dk", Dk),
        ("Dv", value_dim),
        ("Causal", causal),
        ("KeyGroups", groups),
    ]
    variant = (dtype, bits, group_size, Dk, value_dim, causal)
    return AttentionForm(variant, template, (32, groups, B * H * T), (32, groups, 1), (B, H, T, value_dim))


def attention_form_launch(form: AttentionForm, q, k, v, scale: float, lengths: mx.array) -> Launch:
    """An attention's launch of this form: row b of q over its first lengths[b] keys."""
    if isinstance(k, mx.array):
        arrays = [k, v, *[_unused(q.dtype)] * 4]
    else:
        arrays = [k.codes, v.codes, k.scales, k.biases, v.scales, v.biases]
    return Launch(
        inputs=[q, *arrays, lengths, _scale(scale)],
        template=form.template,
        grid=form.grid,
        threadgroup=form.threadgroup,
        output_shapes=[form.output_shape],
        output_dtypes=[q.dtype],
    )


def attention_launch(q, k, v, scale: float, causal: bool, lengths: mx.array) -> Launch:
    """`attention_form`'s launch for these arrays."""
    form = attention_form(q.shape, q.dtype, *entries_of(k, v), causal)
    return attention_form_launch(form, q, k, v, scale, lengths)


@lru_cache(maxsize=64)
def _scale(value: float) -> mx.array:
    return mx.array([value], mx.float32)


@lru_cache(maxsize=8)
def key_counts(counts: tuple[int, ...]) -> mx.array:
    """Each row's key count as the kernel's input (a pass's layers share it; made on the host)."""
    return mx.array(counts, mx.int32)


def product(x, w, platform: str, scales=None, biases=None, indices=None, *, bits: int = 0, group_size: int = 0):
    """x [..., K] @ W^T for w [N, K] (float, or MLX's affine codes with scales and biases); with indices
    [..., k], x [..., 1 or k, 1, K] against the matrices of w [E, N, ...] they choose: [..., k, 1, N]."""
    launch = product_launch(x, w, scales, biases, indices, bits=bits, group_size=group_size)
    return run(ROW_PRODUCT, launch, platform)[0]


def key_counts_of(q, k, key_lengths) -> mx.array:
    """The kernel's `lengths`: each row's key count (key_lengths None: every row holds all keys)."""
    keys = (k if isinstance(k, mx.array) else k.codes).shape[2]
    return key_counts(tuple(key_lengths) if key_lengths is not None else (keys,) * q.shape[0])


def attention(q, k, v, scale: float, causal: bool, key_lengths, platform: str) -> mx.array:
    """ops.scaled_dot_product_attention's arguments on the row attention."""
    launch = attention_launch(q, k, v, scale, causal, key_counts_of(q, k, key_lengths))
    return run(ROW_ATTENTION, launch, platform)[0]


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
        got = product(x, indices=indices, platform=platform, **stored)
        want = x.astype(mx.float32) @ wide[indices].swapaxes(-1, -2)  # [rows, k, 1, N]
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
