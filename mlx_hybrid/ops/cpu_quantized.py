"""MLX affine-quantized products, GGUF's grid types, and products with 16-bit weights, on x86-64
CPUs through our extension (csrc/quantized_matmul.cpp: an MLX primitive in the CPU kernels'
module, see `cpu_extension`).

MLX's own CPU quantized matmul is a reference loop, many times slower for a decode step
(benchmarks/quantized_cpu.py, with MLX_HYBRID_FORCE_REFERENCE=1).
Where the extension cannot be built, MLX's op computes.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..quantized_tensor import GRID_TYPES, BlockScales, GridBlocks, QuantizedTensor, int8_number, no_codes
from . import llama_reference as ref
from .cpu_extension import extension

BITS = (2, 3, 4, 5, 6, 8)


GROUP_SIZES = (16, 32, 64, 128)  # 16: GGUF's Q2_K, Q3_K, Q6_K


def supports(bits: int, group_size: int, form=None) -> bool:
    """Whether the kernels take this layout (form: a grid type's GridBlocks, the kernels' own)."""
    if isinstance(form, GridBlocks):
        return (bits, group_size) == (GridBlocks.BITS, GridBlocks.VALUES)
    # a kernel step (64 values at 4 bits, 32 at the others) spans at most four groups
    return bits in BITS and group_size in GROUP_SIZES


@lru_cache(maxsize=None)
def grid_of(type_name: str) -> mx.array:
    """A grid type's grid, uint8 [entries, magnitudes a row], as gguf-py defines it; the IQ1 types'
    -1, 0 and 1 times 8, as signed bytes (the kernels add their deltas of +-1/8 as +-1); none for
    TQ1_0 (ternary values the kernels decode from base 3)."""
    import gguf.quants

    if type_name == "TQ1_0":
        return mx.zeros((0, 8), mx.uint8)
    traits = getattr(gguf.quants, type_name)  # the type's class, which holds its grid
    traits.init_grid()
    grid = np.asarray(traits.grid).reshape(traits.grid_shape) * (8 if type_name.startswith("IQ1") else 1)
    return mx.array(grid.astype(np.int8).view(np.uint8))


def _layout(block: BlockScales | None) -> dict:
    """A block form's description as the kernels take it (keywords; none for MLX's affine groups)."""
    if block is None:
        return {}
    return {
        "groups_per_factor": block.groups_per_factor,
        "factor_count": block.factor_count,
        "code_count": block.code_count,
        "code_bits": block.code_bits,
        "bias_ratio": block.bias_ratio,
        "factor_scale": block.factor_scale,
        "table": list(block.table),
    }


def quantized_matmul(x, w, scales, biases, group_size: int, bits: int, block=None) -> mx.array:
    """x [..., K] @ W^T for W [N, K] in MLX's affine layout (or a block form, or a grid type's
    blocks): float32 [..., N]."""
    return bound_product(group_size, bits, block)(x, w, scales, biases)


def bound_product(group_size: int, bits: int, block=None, dtype=mx.float32):
    """`quantized_matmul` for one layout with its settings bound, giving `dtype`: a function
    (x, w, scales, biases) that calls the kernel directly (no codes given: a float mode's none)."""
    if isinstance(block, GridBlocks):
        grid, name = grid_of(block.type_name), block.type_name
        return lambda x, w, scales, biases: extension().grid_matmul(x, w, grid, name).astype(dtype)
    settings = _layout(block)
    return lambda x, w, scales, biases: (
        extension()
        .quantized_matmul(x, w, scales, no_codes(scales) if biases is None else biases, group_size, bits, **settings)
        .astype(dtype)
    )


def gather_quantized_matmul(x, w, scales, biases, indices, group_size: int, bits: int, block=None) -> mx.array:
    """x [T, 1 or k, K] against experts w [E, N, ...] chosen by indices [T, k]: float32 [T, k, N]."""
    if isinstance(block, GridBlocks):
        return extension().gather_grid_matmul(x, w, grid_of(block.type_name), indices, block.type_name)
    return extension().gather_quantized_matmul(x, w, scales, biases, indices, group_size, bits, **_layout(block))


def small_case(_platform, bits: int, group_size: int, scales_form):
    """A first-use check of a variant (scales_form: the scales' dtype, a BlockScales or a
    GridBlocks): 1 row (the small-row kernel), 9 (the same, 8 rows at a time), 17 (the tiled path)
    and gathered experts, against MLX's op on the same weights (its dequantized weights for the
    groups or forms its op refuses)."""
    K = max(64, 2 * group_size)
    if isinstance(scales_form, GridBlocks):
        tensor = ref.random_grid_weights((3, 24, K), scales_form)
    elif isinstance(scales_form, BlockScales):
        K = max(K, 2 * group_size * scales_form.groups_per_factor)
        tensor = ref.random_block_weights((3, 24, K), bits, group_size, scales_form)
    else:
        w, scales, biases = ref.random_weights((3, 24, K), bits, group_size)
        tensor = QuantizedTensor(w, scales.astype(scales_form), biases.astype(scales_form), bits, group_size)
    # outputs of tens, not thousands (the random block factors make weights of up to ~100): a few
    # float32 roundings of them stay well inside the check's absolute tolerance, a wrong weight not
    x = mx.random.normal((17, K), key=mx.random.key(1)) / 32
    indices = mx.array([[2, 0], [1, 2]], dtype=mx.uint32)
    if group_size >= 32 and tensor.block is None:

        def mlx_product(rows, e):
            w, scales, biases = tensor.weight[e], tensor.scales[e], tensor.biases[e]
            return mx.quantized_matmul(rows, w, scales, biases, group_size=group_size, bits=bits)
    else:
        dense = tensor.dequantize()

        def mlx_product(rows, e):
            return rows @ dense[e].T

    parts = (tensor.weight, tensor.scales, tensor.biases)
    one = [part[1] for part in parts]
    got = [quantized_matmul(rows, *one, group_size, bits, tensor.block) for rows in (x[:1], x[:9], x)]
    want = [mlx_product(rows, 1) for rows in (x[:1], x[:9], x)]
    got.append(gather_quantized_matmul(x[:2, None], *parts, indices, group_size, bits, tensor.block))
    want.append(
        mx.stack(
            [mx.concatenate([mlx_product(x[t : t + 1], e) for e in row]) for t, row in enumerate(indices.tolist())]
        )
    )
    return got, want


def matmul_16bit(x, w) -> mx.array:
    """x [..., K] @ W^T for W [N, K] bfloat16 or float16, products and sums in float32: float32 [..., N]."""
    return extension().matmul_16bit(x, w)


def gather_matmul_16bit(x, w, indices) -> mx.array:
    """x [T, 1 or k, K] against 16-bit experts w [E, N, K] chosen by indices [T, k]: float32 [T, k, N]."""
    return extension().gather_matmul_16bit(x, w, indices)


def small_case_16bit(_platform, dtype):
    """A first-use check of the 16-bit products: 1, 9 and 17 rows (the small-row kernel, then the
    tiled path) and gathered experts against MLX's float32 product of the same weights."""
    w = (mx.random.normal((3, 24, 80), key=mx.random.key(0)) / 8).astype(dtype)
    x = mx.random.normal((17, 80), key=mx.random.key(1))
    indices = mx.array([[2, 0], [1, 2]], dtype=mx.uint32)
    dense = w.astype(mx.float32)
    got = [matmul_16bit(rows, w[1]) for rows in (x[:1], x[:9], x)]
    want = [rows @ dense[1].T for rows in (x[:1], x[:9], x)]
    got.append(gather_matmul_16bit(x[:2, None], w, indices))
    want.append(mx.stack([dense[row] @ x[t] for t, row in enumerate(indices.tolist())]))
    return got, want


def int8_matmul(x, w, factors, codes, held_type: int, grid: mx.array | None = None, interleaved: bool = False):
    """x [..., K] (any rows) @ W^T for a GGUF matrix held as the package holds its type
    (`quantized_tensor.INT8_TYPES`, numbered in order: packed codes, float16 factors, int8 codes; a grid
    type's blocks and empty factors and codes, with its `grid_of`), as llama.cpp computes it on x86: each
    row quantized to the type's 8-bit blocks, integer block sums: float32 [..., N]. interleaved: a matrix
    whose packed codes `interleave_eights` made."""
    return extension().int8_matmul(x, w, factors, codes, held_type, grid, interleaved)


def int8_matmuls(x, matrices) -> list:
    """`int8_matmul` of x with each of `matrices` ((w, factors, codes, held_type, grid, interleaved) each),
    as one MLX node: the same bits as a call a matrix."""
    return extension().int8_matmuls(x, matrices)


def int8_gather_matmul(
    x, w, factors, codes, indices, held_type: int, grid: mx.array | None = None, interleaved: bool = False
) -> mx.array:
    """`int8_matmul` for x [T, 1 or k, K] against the matrices of w [E, N, ...] chosen by indices [T, k]:
    float32 [T, k, N]."""
    return extension().int8_gather_matmul(x, w, factors, codes, indices, held_type, grid, interleaved)


def interleaved_unit(held_type: int, rows: int, words: int) -> int:
    """The 32-bit words of a row's turn where a matrix of the kernel's type `held_type`, its packed codes
    [rows, words] uint32, can be held interleaved (`interleave_eights`), else 0."""
    return extension().interleaved_unit(held_type, rows, words)


def interleave_eights(w: mx.array, held_type: int) -> mx.array:
    """The packed codes [..., N, K / 8] of a matrix of the kernel's type `held_type` (`interleaved_unit`)
    as `int8_matmul(..., interleaved=True)` reads them: each 8 rows' turns in turn, as llama.cpp's x86
    build repacks Q4_K, Q4_0, IQ4_NL and MXFP4 (its factors and codes stay as they are)."""
    return extension().interleave_eights(w, held_type)


def rows_as_stored(w: mx.array, held_type: int) -> mx.array:
    """The packed codes of a matrix held interleaved (`interleave_eights`) as stored, for the products
    that read rows as they are stored: each eight's [turns, 8 rows, unit] back to [8 rows, turns, unit]."""
    *lead, rows, words = w.shape
    unit = interleaved_unit(held_type, rows, words)
    eights = w.reshape(*lead, rows // 8, words // unit, 8, unit)
    return eights.swapaxes(-3, -2).reshape(*lead, rows, words)


def half_matmul(x, w) -> mx.array:
    """x [..., K] float32 @ W^T for W [N, K] float16 or bfloat16 as llama.cpp computes it on x86 (its AVX2
    build's ggml_vec_dot_f16 and ggml_vec_dot_bf16): each row of x rounded to W's 16 bits, a row's
    products in 4 accumulators of 8 lanes: float32 [..., N]."""
    return extension().half_matmul(x, w)


def half_gather_matmul(x, w, indices) -> mx.array:
    """`half_matmul` for x [T, 1 or k, K] against the matrices of w [E, N, K] chosen by indices [T, k]:
    float32 [T, k, N]."""
    return extension().half_gather_matmul(x, w, indices)


def int8_grid(block) -> mx.array | None:
    """What `int8_matmul` takes beside a matrix of this form: a grid type's grid, else None."""
    return grid_of(block.type_name) if isinstance(block, GridBlocks) else None


def small_case_int8(_platform):
    """A first-use check of the products with llama.cpp's activations: 1 and 9 rows and gathered experts
    against the references, for each type (`quantized_tensor.INT8_TYPES`), and F16 and BF16 matrices'
    (`half_matmul`)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    indices = np.array([[2, 0], [1, 2]], np.uint32)
    codes = rng.integers(-127, 128, (3, 24, 512)).astype(np.int8)
    d = (rng.uniform(-1, 1, (3, 24, 16)) / 64).astype(np.float16)
    four_bits, five_bits = ref.random_k_quant(rng, (3, 24, 512), 4), ref.random_k_quant(rng, (3, 24, 512), 5)
    six_bits, three_bits = ref.random_groups16(rng, (3, 24, 512)), ref.random_groups16(rng, (3, 24, 512), 3)
    two_bits = ref.random_q2_k(rng, (3, 24, 512))
    xs_four = ref.random_iq4_xs(rng, (3, 24, 512))
    cases = [
        (ref.held_q8_0(codes, d), lambda rows, e: ref.q8_0_reference(rows, codes[e], d[e]), "Q8_0"),
        (
            ref.held_k_quant(four_bits[0], 4, *four_bits[1:]),
            lambda rows, e: ref.k_quant_reference(rows, *(a[e] for a in four_bits)),
            "Q4_K",
        ),
        (
            ref.held_groups16(six_bits[0], 6, *six_bits[1:]),
            lambda rows, e: ref.groups16_reference(rows, *(a[e] for a in six_bits), 32),
            "Q6_K",
        ),
        (
            ref.held_groups16(three_bits[0], 3, *three_bits[1:]),
            lambda rows, e: ref.groups16_reference(rows, *(a[e] for a in three_bits), 4),
            "Q3_K",
        ),
        (ref.held_q2_k(*two_bits), lambda rows, e: ref.q2_k_reference(rows, *(a[e] for a in two_bits)), "Q2_K"),
        (ref.held_iq4_xs(*xs_four), lambda rows, e: ref.iq4_xs_reference(rows, *(a[e] for a in xs_four)), "IQ4_XS"),
        (
            ref.held_k_quant(five_bits[0], 5, *five_bits[1:]),
            lambda rows, e: ref.k_quant_reference(rows, *(a[e] for a in five_bits)),
            "Q5_K",
        ),
    ]
    # the 32-value types (5, 4 and 4 bits with an offset, Q5_1 and Q4_1 with m, IQ4_NL's table)
    for type_name, bits, with_m, reference in [
        ("Q5_0", 5, False, lambda x, q, d: ref.offset_reference(x, q, d, 16)),
        ("Q5_1", 5, True, ref.d_and_m_reference),
        ("Q4_0", 4, False, lambda x, q, d: ref.offset_reference(x, q, d, 8)),
        ("Q4_1", 4, True, ref.d_and_m_reference),
        ("IQ4_NL", 4, False, ref.iq4_nl_reference),
    ]:
        weights = ref.random_b32(rng, (3, 24, 512), bits, with_m)
        cases.append(
            (
                ref.held_b32(weights[0], bits, *weights[1:]),
                lambda rows, e, w=weights, f=reference: f(rows, *(a[e] for a in w)),
                type_name,
            )
        )
    for seed, name in enumerate(GRID_TYPES):
        tensor = ref.random_grid_weights((3, 24, 512), GRID_TYPES[name], 12 + seed)
        blocks = np.array(tensor.weight)
        cases.append(
            (
                (tensor.weight, tensor.scales, tensor.biases),
                lambda rows, e, b=blocks, n=name: ref.grid_reference(rows, b[e], n),
                name,
                grid_of(name),
            )
        )
    ternary, mxfp4 = ref.random_ternary(rng, (3, 24, 512)), ref.random_mxfp4(rng, (3, 24, 512))
    cases.append(
        (ref.held_ternary(*ternary), lambda rows, e: ref.ternary_reference(rows, *(a[e] for a in ternary)), "TQ2_0")
    )
    cases.append((ref.held_mxfp4(*mxfp4), lambda rows, e: ref.mxfp4_reference(rows, *(a[e] for a in mxfp4)), "MXFP4"))
    got, want = [], []
    for held, reference, type_name, *grid in cases:
        held_type = int8_number(type_name)
        grid = grid[0] if grid else None
        got += [int8_matmul(mx.array(x[:rows]), *(a[1] for a in held), held_type, grid) for rows in (1, 9)]
        want += [reference(x[:rows], 1) for rows in (1, 9)]
        got.append(int8_gather_matmul(mx.array(x[:2, None]), *held, mx.array(indices), held_type, grid))
        want.append(np.stack([[reference(x[t : t + 1], e)[0] for e in row] for t, row in enumerate(indices)]))
    # F16 and BF16 matrices with 16-bit activations (half_matmul): 3 steps of 32 and 4 values past them,
    # 9 weight rows (two at a time, the last alone)
    for dtype in (mx.float16, mx.bfloat16):
        w = mx.array((rng.standard_normal((3, 9, 100)) / 8).astype(np.float32)).astype(dtype)
        values, rows = np.array(w.astype(mx.float32)), rng.standard_normal((9, 100)).astype(np.float32)
        got += [half_matmul(mx.array(rows[:n]), w[1]) for n in (1, 9)]
        want += [ref.half_reference(rows[:n], values[1], dtype == mx.bfloat16) for n in (1, 9)]
        got.append(half_gather_matmul(mx.array(rows[:2, None]), w, mx.array(indices)))
        want.append(
            np.stack(
                [
                    [ref.half_reference(rows[t : t + 1], values[e], dtype == mx.bfloat16)[0] for e in row]
                    for t, row in enumerate(indices)
                ]
            )
        )
    return got, [mx.array(a.astype(np.float32)) for a in want]
