"""llama.cpp's quantized and 16-bit products the slow obvious way, in numpy, and random tensors of each
GGUF type held as the CPU kernels hold them. The kernels' first-use check of those products
(`cpu_quantized.small_case_int8`) reads them, as do the tests and benchmarks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..quantized_tensor import GRID_TYPES, IQ4_NL_TABLE, BlockScales, GridBlocks, QuantizedTensor, no_codes, pack


MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)


def random_grid_weights(shape, grid: GridBlocks, seed: int = 0) -> QuantizedTensor:
    """A random grid-type tensor [..., N, K] (K a multiple of 256): random bytes (every index,
    sign and code a type stores is valid), each block's d a float16 of either sign, small enough
    that the weights (d times codes up to 31 and magnitudes up to 62) stay below about 2."""
    *lead, N, K = shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*lead, N, K // GridBlocks.VALUES, grid.block_bytes), dtype=np.uint8)
    d = (rng.uniform(-1, 1, blocks.shape[:-1]) / 256).astype(np.float16)
    with_grid_d(blocks, grid.type_name, d)
    return GridBlocks.tensor(mx.array(blocks.reshape(*lead, N, -1)), grid)


def with_grid_d(blocks: np.ndarray, type_name: str, d: np.ndarray):
    """Writes each block's d (float16 [...]) into a grid type's blocks [..., block bytes]: its first two
    bytes; IQ1_M's as the top nibbles of its four 16-bit scale words; TQ1_0's last."""
    bits = d.astype(np.float16).view(np.uint16)
    if type_name == "IQ1_M":
        words = blocks[..., 48:56].copy().view(np.uint16)
        nibbles = (bits[..., None] >> (4 * np.arange(4, dtype=np.uint16))) & 0xF
        blocks[..., 48:56] = ((words & 0x0FFF) | (nibbles << 12)).astype(np.uint16).view(np.uint8)
    elif type_name == "TQ1_0":
        blocks[..., -2:] = bits[..., None].view(np.uint8)
    else:
        blocks[..., :2] = bits[..., None].view(np.uint8)


def grid_d(blocks: np.ndarray, type_name: str) -> np.ndarray:
    """Each block's d (float16 [...]) of a grid type's blocks [..., block bytes] (`with_grid_d`'s place)."""
    if type_name == "IQ1_M":
        nibbles = blocks[..., 48:56].copy().view(np.uint16) >> 12
        return (nibbles << (4 * np.arange(4, dtype=np.uint16))).sum(-1).astype(np.uint16).view(np.float16)
    at = slice(-2, None) if type_name == "TQ1_0" else slice(0, 2)
    return blocks[..., at].copy().view(np.float16)[..., 0]


def random_weights(shape, bits: int, group_size: int, seed: int = 0):
    """Random (w, scales, biases) in the affine layout. MLX quantizes in groups of 32 at least:
    smaller groups halve its groups, each half given a scale and bias of its own."""
    dense = mx.random.normal(shape, key=mx.random.key(seed))
    if group_size >= 32:
        return mx.quantize(dense, group_size=group_size, bits=bits)
    w, scales, biases = mx.quantize(dense, group_size=32, bits=bits)
    halves = mx.array([1.0, -0.75])  # the halves differ in size and sign

    def split(part):
        return (mx.repeat(part, 2, axis=-1).reshape(*part.shape[:-1], -1, 2) * halves).reshape(*part.shape[:-1], -1)

    return w, split(scales), split(biases)


def random_block_weights(shape, bits: int, group_size: int, block: BlockScales, seed: int = 0) -> QuantizedTensor:
    """A random block-form tensor [..., N, K] (see BlockScales): float16 factors of both signs (E8M0
    exponents: 2^-127, the smallest, and 2^-12 to 2^3), codes over the whole int8 range GGUF uses
    (Q6_K's are signed, the k-quants' 0..63)."""
    *lead, N, K = shape
    keys = mx.random.split(mx.random.key(seed), 3)
    w = mx.random.randint(0, 256, (*lead, N, K * bits // 8), key=keys[0]).astype(mx.uint8).view(mx.uint32)
    groups = K // group_size
    factor_shape = (*lead, N, groups // block.groups_per_factor * block.factor_count)
    if block.exponent_factors:
        factors = mx.random.randint(114, 131, factor_shape, key=keys[1])
        factors = mx.where(factors == 114, 0, factors).astype(mx.uint8)
    else:
        factors = (mx.random.normal(factor_shape, key=keys[1]) / 64).astype(mx.float16)
    low = -128 if block.code_bits == 4 else -64  # nibbles: any byte
    codes = mx.random.randint(low, 64, (*lead, N, round(groups * block.code_bytes)), key=keys[2]).astype(mx.int8)
    return QuantizedTensor(w, factors, codes, bits, group_size, block)


def rounded_to_16_bits(x: np.ndarray, bfloat16: bool) -> np.ndarray:
    """x float32 rounded to float16 or bfloat16 as ggml rounds them (to nearest even; a NaN made quiet),
    as float64."""
    if not bfloat16:
        return x.astype(np.float16).astype(np.float64)
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = np.where(nan, (u | 0x400000) >> 16, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return ((rounded & 0xFFFF) << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def half_reference(x: np.ndarray, w: np.ndarray, bfloat16: bool) -> np.ndarray:
    """llama.cpp's F16 and BF16 products the slow obvious way: x [M, K] float32 rounded to 16 bits, w
    [N, K] (its values as float32, bfloat16's or float16's); value i of every 32 into accumulator i // 8
    mod 4, lane i mod 8, each product exact and each sum rounded to float32 (a fused multiply-add); the
    accumulators (0 + 2) + (1 + 3), the halves, then F16's lanes (0 + 1) + (2 + 3), BF16's (0 + 2) +
    (1 + 3); the last K mod 32 products added in float64, then float32."""
    f32 = np.float32
    xs, ws = rounded_to_16_bits(x, bfloat16), w.astype(np.float64)
    M, K = xs.shape
    steps = K // 32 * 32
    out = np.empty((M, len(ws)), np.float32)
    for m in range(M):
        products = xs[m, :steps].reshape(-1, 4, 8)[None] * ws[:, :steps].reshape(len(ws), -1, 4, 8)  # exact
        acc = np.zeros((len(ws), 4, 8), np.float32)
        for step in range(products.shape[1]):
            acc = (acc.astype(np.float64) + products[:, step]).astype(f32)  # (exact before the rounding)
        lanes = ((acc[:, 0] + acc[:, 2]) + (acc[:, 1] + acc[:, 3])).astype(f32)
        four = (lanes[:, :4] + lanes[:, 4:]).astype(f32)
        if bfloat16:
            total = (four[:, 0] + four[:, 2]) + (four[:, 1] + four[:, 3])
        else:
            total = (four[:, 0] + four[:, 1]) + (four[:, 2] + four[:, 3])
        leftovers = (xs[m, steps:].astype(f32)[None] * ws[:, steps:].astype(f32)).astype(np.float64)
        for i in range(leftovers.shape[1]):
            total = total.astype(np.float64) + leftovers[:, i]
        out[m] = np.asarray(total, np.float64).astype(f32)
    return out


def q8_0_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows x [M, K] as llama.cpp's quantize_row_q8_0 and quantize_row_q8_1 on x86 quantize them: per
    block of 32, d = max |x| / 127, codes rounded half to even from x * (127 / max |x|); codes [M, K / 32,
    32], d as float16 [M, K / 32] (float64), and Q8_1's s, d (unrounded) times the codes' sum as
    float16 (float64)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    largest = np.abs(blocks).max(-1)
    d = largest / np.float32(127)
    inverse = np.where(largest != 0, np.float32(127) / np.where(largest != 0, largest, 1), 0).astype(np.float32)
    q_x = np.rint(blocks * inverse[..., None]).astype(np.int64)
    s = (d * q_x.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float64)
    return q_x, d.astype(np.float16).astype(np.float64), s


def q8_0_reference(x: np.ndarray, codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """llama.cpp's Q8_0 product the slow obvious way (float64 sums): x [M, K] float32 quantized as
    `q8_0_rows`, the weight's signed codes [N, K] and float16 d [N, K / 32]: integer sums a block,
    times d_w d_x."""
    q_x, d_x, _ = q8_0_rows(x)
    sums = np.einsum("mbi,nbi->mnb", q_x, codes.reshape(codes.shape[0], -1, 32).astype(np.int64))
    return (sums * d_x[:, None, :] * d.astype(np.float64)[None]).sum(-1)


def offset_reference(x: np.ndarray, q: np.ndarray, d: np.ndarray, offset: int) -> np.ndarray:
    """llama.cpp's Q5_0 (offset 16) and Q4_0 (offset 8) products the slow obvious way: the weight's
    values q [N, K] (q - offset times its block's d) and float16 d [N, K / 32]: `q8_0_reference` of the
    signed values."""
    return q8_0_reference(x, q.astype(np.int64) - offset, d)


def iq4_nl_reference(x: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """llama.cpp's IQ4_NL product the slow obvious way: the weight's 4-bit indices q [N, K] into
    IQ4_NL's values (`IQ4_NL_TABLE` less 128) and float16 d [N, K / 32]: `q8_0_reference` of the values."""
    return q8_0_reference(x, np.array(IQ4_NL_TABLE, np.int64)[q] - 128, d)


# MXFP4's values as llama.cpp multiplies them (kvalues_mxfp4: twice the E2M1 values)


def mxfp4_reference(x: np.ndarray, q: np.ndarray, e: np.ndarray) -> np.ndarray:
    """llama.cpp's MXFP4 product the slow obvious way: the weight's 4-bit indices q [N, K] into
    `MXFP4_VALUES` and E8M0 exponents e [N, K / 32] (uint8), each block's scale 2^(e - 128):
    `q8_0_reference` of the values."""
    return q8_0_reference(x, MXFP4_VALUES[q], np.ldexp(1.0, e.astype(np.int64) - 128))


def held_mxfp4(q, e) -> tuple[mx.array, mx.array, mx.array]:
    """An MXFP4 matrix (indices q [..., K], exponents e [..., K / 32]) as the package holds it (MLX's
    mxfp4 mode): indices packed, the exponents, no codes."""
    exponents = mx.array(e.astype(np.uint8))
    return mx.array(pack(q, 4)), exponents, no_codes(exponents)


def random_mxfp4(rng, shape):
    """Random MXFP4 weights [..., N, K]: indices, exponents 2^-128 (e 0), 2^-127 (1) and 2^-12 to 2^2."""
    *lead, N, K = shape
    e = rng.choice(np.r_[0, 1, 116:131], (*lead, N, K // 32)).astype(np.uint8)
    return rng.integers(0, 16, shape).astype(np.uint8), e


def iq4_xs_reference(x: np.ndarray, q: np.ndarray, d: np.ndarray, ls: np.ndarray) -> np.ndarray:
    """llama.cpp's IQ4_XS product the slow obvious way (float64 sums): x quantized as `q8_k_rows`, the
    weight's 4-bit indices q [N, K] into IQ4_NL's values, float16 d [N, K / 256] and signed ls_j - 32
    [N, K / 32]: per block d_w d_x sum_j ls_j (values . x codes over group j)."""
    codes, d_x = q8_k_rows(x)
    values = np.array(IQ4_NL_TABLE, np.int64)[q] - 128
    dots = np.einsum("mgi,ngi->mng", codes.reshape(len(x), -1, 32), values.reshape(len(q), -1, 32))
    blocks = (dots * ls[None]).reshape(len(x), len(q), -1, 8).sum(-1)
    return (blocks * d.astype(np.float64)[None] * d_x.astype(np.float64)[:, None]).sum(-1)


def d_and_m_reference(x: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """llama.cpp's Q5_1 and Q4_1 products the slow obvious way (float64 sums): x quantized as
    `q8_0_rows` (Q8_1: with s), the weight's values q [N, K] (q d + m), float16 d and m [N, K / 32]: per
    block d_w d_x (q . x codes) + m_w s_x."""
    _, _, s_x = q8_0_rows(x)
    return q8_0_reference(x, q.astype(np.int64), d) + s_x @ m.astype(np.float64).T


def q8_k_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows x [M, K] as llama.cpp's quantize_row_q8_K quantizes them: per block of 256 the value of
    largest magnitude v (the first of equals), codes min(127, round-half-even(x * (-127 / v))) and
    d = 1 / (-127 / v), all in float32 (a block of zeros: codes and d 0). Codes [M, K], d [M, K / 256]."""
    blocks = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    at = np.abs(blocks).argmax(-1)
    largest = np.take_along_axis(blocks, at[..., None], -1)[..., 0]
    inverse = np.where(largest != 0, np.float32(-127) / np.where(largest != 0, largest, 1), 0).astype(np.float32)
    codes = np.minimum(127, np.rint(blocks * inverse[..., None])).astype(np.int64)
    d = np.where(inverse != 0, np.float32(1) / np.where(inverse != 0, inverse, 1), 0).astype(np.float32)
    return codes.reshape(x.shape), d


def k_quant_reference(
    x: np.ndarray, q: np.ndarray, d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray, group: int = 32
) -> np.ndarray:
    """llama.cpp's Q4_K and Q5_K (groups of 32) and Q2_K (groups of 16) products the slow obvious way
    (float64 sums): x [M, K] float32 quantized as `q8_k_rows`, the weight's values q [N, K], float16 d
    and dmin [N, K / 256] and codes sc and m [N, K / group]: per block d_w d_x sum_j sc_j (q . x codes
    over group j) - dmin_w d_x sum_j m_j (the group's x codes)."""
    codes, d_x = q8_k_rows(x)
    groups = codes.reshape(len(x), -1, group)
    dots = np.einsum("mgi,ngi->mng", groups, q.reshape(len(q), -1, group).astype(np.int64))
    scaled = (dots * sc[None]).reshape(len(x), len(q), -1, 256 // group).sum(-1)
    mins = (groups.sum(-1)[:, None] * m[None]).reshape(len(x), len(q), -1, 256 // group).sum(-1)
    wide = d_x.astype(np.float64)[:, None]
    return (scaled * d.astype(np.float64)[None] * wide - mins * dmin.astype(np.float64)[None] * wide).sum(-1)


def groups16_reference(x: np.ndarray, q: np.ndarray, d: np.ndarray, sc: np.ndarray, offset: int) -> np.ndarray:
    """llama.cpp's Q6_K (offset 32) and Q3_K (offset 4) products the slow obvious way (float64 sums): x
    [M, K] float32 quantized as `q8_k_rows`, the weight's values q [N, K], float16 d [N, K / 256] and
    signed sc [N, K / 16]: per block d_w d_x sum_j sc_j ((q - offset) . x codes over group j of 16)."""
    codes, d_x = q8_k_rows(x)
    groups = q.reshape(len(q), -1, 16).astype(np.int64) - offset
    dots = np.einsum("mgi,ngi->mng", codes.reshape(len(x), -1, 16), groups)
    blocks = (dots * sc[None]).reshape(len(x), len(q), -1, 16).sum(-1)
    return (blocks * d.astype(np.float64)[None] * d_x.astype(np.float64)[:, None]).sum(-1)


def q2_k_reference(
    x: np.ndarray, q: np.ndarray, d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray
) -> np.ndarray:
    """llama.cpp's Q2_K product the slow obvious way: `k_quant_reference` over groups of 16 (2-bit values,
    4-bit sc and m [N, K / 16])."""
    return k_quant_reference(x, q, d, dmin, sc, m, group=16)


# the grid types with 8-bit activations: llama.cpp's factor of each block's float sum (0.125f, 0.25f:
# d (2 s + 1) / divisor times the signed grid values)


GRID_DIVISORS = {"IQ2_XXS": 8, "IQ2_XS": 8, "IQ2_S": 8, "IQ3_XXS": 4, "IQ3_S": 1, "IQ1_S": 8, "IQ1_M": 8, "TQ1_0": 1}
# (the IQ1 types': d (2 s + 1) (g +- 1/8) = d (2 s + 1) / 8 times the integer 8 g +- 1; TQ1_0's: d (q - 1))


def grid_integers(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """A grid type's weights as integers: the blocks [N, K / 256 * block bytes] dequantized by gguf-py,
    divided by each block's d / divisor: (2 s + 1) times the signed grid value [N, K] (int64, exact: at
    most 31 * 62 in magnitude (IQ1: 15 * 9), rounded from float32 quotients within 1e-3 of them), and d
    [N, K / 256] (float16; a block of d 0 is all zeros)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    N = blocks.shape[0]
    d = grid_d(blocks.reshape(N, -1, GRID_TYPES[type_name].block_bytes), type_name)
    weights = dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float64).reshape(N, -1, 256)
    unit = d.astype(np.float64)[..., None] / GRID_DIVISORS[type_name]
    integers = np.rint(np.divide(weights, unit, out=np.zeros_like(weights), where=unit != 0)).astype(np.int64)
    return integers.reshape(N, -1), d


def grid_reference(x: np.ndarray, blocks: np.ndarray, type_name: str) -> np.ndarray:
    """llama.cpp's IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M and TQ1_0 products the slow obvious
    way (float64 sums): x [M, K] quantized as `q8_k_rows`, the weight's integers (`grid_integers`) times x's
    codes summed a block, times d_w d_x / the type's divisor."""
    codes, d_x = q8_k_rows(x)
    integers, d = grid_integers(blocks, type_name)
    sums = np.einsum("mbi,nbi->mnb", codes.reshape(len(x), -1, 256), integers.reshape(len(integers), -1, 256))
    scale = d_x.astype(np.float64)[:, None] * d.astype(np.float64)[None] / GRID_DIVISORS[type_name]
    return (sums * scale).sum(-1)


def held_groups16(q, bits: int, d, sc) -> tuple[mx.array, mx.array, mx.array]:
    """A Q6_K (bits 6) or Q3_K (3) matrix (values q [..., K], float16 d [..., K / 256], signed sc [...,
    K / 16]) as the package holds it: values packed from the lowest bits up, the factors, the codes."""
    return mx.array(pack(q, bits)), mx.array(d.astype(np.float16)), mx.array(sc.astype(np.int8))


def random_groups16(rng, shape, bits: int = 6):
    """Random Q6_K (or Q3_K: bits 3) weights [..., N, K]: values, d of either sign, signed 8-bit sc."""
    *lead, N, K = shape
    d = (rng.uniform(-1, 1, (*lead, N, K // 256)) / 256).astype(np.float16)
    return rng.integers(0, 2**bits, shape).astype(np.uint8), d, rng.integers(-128, 128, (*lead, N, K // 16))


def ternary_reference(x: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """llama.cpp's TQ2_0 product the slow obvious way: `groups16_reference` of the values q - 1 (q [N, K]
    0 to 2, float16 d [N, K / 256]), every group's code 1."""
    return groups16_reference(x, q, d, np.ones((len(q), q.shape[-1] // 16), np.int64), 1)


def held_ternary(q, d) -> tuple[mx.array, mx.array, mx.array]:
    """A TQ2_0 matrix (values q [..., K], float16 d [..., K / 256]) as the package holds it: values packed,
    d a block, no codes."""
    factors = mx.array(d.astype(np.float16))
    return mx.array(pack(q, 2)), factors, no_codes(factors)


def random_ternary(rng, shape):
    """Random TQ2_0 weights [..., N, K]: values 0 to 2, d of either sign."""
    *lead, N, K = shape
    d = (rng.uniform(-1, 1, (*lead, N, K // 256)) / 64).astype(np.float16)
    return rng.integers(0, 3, shape).astype(np.uint8), d


def held_q2_k(q, d, dmin, sc, m) -> tuple[mx.array, mx.array, mx.array]:
    """A Q2_K matrix (values q [..., K], float16 d, dmin [..., K / 256], 4-bit sc, m [..., K / 16]) as the
    package holds it: (values packed, factors (d, -dmin) a block, codes sc | m << 4 a group)."""
    factors = np.stack([d, -dmin], -1).reshape(*d.shape[:-1], -1).astype(np.float16)
    codes = (sc.astype(np.uint8) | (m.astype(np.uint8) << 4)).view(np.int8)
    return mx.array(pack(q, 2)), mx.array(factors), mx.array(codes)


def random_q2_k(rng, shape):
    """Random Q2_K weights [..., N, K]: values, d and dmin of either sign's magnitude, 4-bit sc and m."""
    *lead, N, K = shape
    d, dmin = ((rng.uniform(0, 1, (*lead, N, K // 256)) / 64).astype(np.float16) for _ in range(2))
    sc, m = (rng.integers(0, 16, (*lead, N, K // 16)) for _ in range(2))
    return rng.integers(0, 4, shape).astype(np.uint8), d, dmin, sc, m


def held_iq4_xs(q, d, ls) -> tuple[mx.array, mx.array, mx.array]:
    """An IQ4_XS matrix (indices q [..., K], float16 d [..., K / 256], signed ls_j - 32 [..., K / 32]) as the
    package holds it: indices packed, the factors, the codes."""
    return mx.array(pack(q, 4)), mx.array(d.astype(np.float16)), mx.array(ls.astype(np.int8))


def random_iq4_xs(rng, shape):
    """Random IQ4_XS weights [..., N, K]: indices, d of either sign, ls_j - 32 in [-32, 31]."""
    *lead, N, K = shape
    d = (rng.uniform(-1, 1, (*lead, N, K // 256)) / 256).astype(np.float16)
    return rng.integers(0, 16, shape).astype(np.uint8), d, rng.integers(-32, 32, (*lead, N, K // 32))


def held_b32(q, bits: int, d, m=None) -> tuple[mx.array, mx.array, mx.array]:
    """A matrix of GGUF's 32-value blocks of 4 or 5 bits (values q [..., K], float16 d [..., K / 32];
    Q4_1 and Q5_1 with m [..., K / 32]) as the package holds it: values packed from the lowest bits
    up, factors d (and m) a group, codes 1."""
    factors = d if m is None else np.stack([d, m], -1).reshape(*d.shape[:-1], -1)
    return mx.array(pack(q, bits)), mx.array(factors.astype(np.float16)), mx.ones(d.shape, mx.int8)


def random_b32(rng, shape, bits: int, with_m: bool):
    """Random weights [..., N, K] in 32-value blocks of `bits`-bit values: values, d (and m) of either sign."""
    *lead, N, K = shape
    scales = [(rng.uniform(-1, 1, (*lead, N, K // 32)) / 64).astype(np.float16) for _ in range(1 + with_m)]
    return rng.integers(0, 2**bits, shape).astype(np.uint8), *scales


def held_q8_0(codes: np.ndarray, d: np.ndarray) -> tuple[mx.array, mx.array, mx.array]:
    """A Q8_0 matrix (signed codes [..., K], float16 d [..., K / 32]) as the package holds it: (w,
    factors, codes)."""
    w = mx.array((codes.astype(np.int16) + 128).astype(np.uint8).view(np.uint32))
    return w, mx.array(d), mx.ones(d.shape, mx.int8)


def held_k_quant(q, bits: int, d, dmin, sc, m) -> tuple[mx.array, mx.array, mx.array]:
    """A Q4_K (bits 4) or Q5_K (5) matrix (values q [..., K], float16 d, dmin [..., K / 256], codes sc, m
    [..., K / 32]) as the package holds it: (values packed from the lowest bits up, factors (d, -dmin) a
    block, codes (sc, m) a group)."""
    factors = np.stack([d, -dmin], -1).reshape(*d.shape[:-1], -1).astype(np.float16)
    codes = np.stack([sc, m], -1).reshape(*sc.shape[:-1], -1).astype(np.int8)
    return mx.array(pack(q, bits)), mx.array(factors), mx.array(codes)


def random_k_quant(rng, shape, bits: int = 4):
    """Random Q4_K or Q5_K weights [..., N, K]: values, d and dmin of either sign's magnitude, 6-bit sc and m."""
    *lead, N, K = shape
    q = rng.integers(0, 2**bits, shape).astype(np.uint8)
    d, dmin = ((rng.uniform(0, 1, (*lead, N, K // 256)) / 64).astype(np.float16) for _ in range(2))
    sc, m = (rng.integers(0, 64, (*lead, N, K // 32)) for _ in range(2))
    return q, d, dmin, sc, m
