"""GGUF products with llama.cpp's 8-bit activations (`load(cpu_activations="int8")`): our CPU kernel
(csrc/int8_products.cpp) against the arithmetic written the slow obvious way
(`llama_reference.q8_0_reference`, `k_quant_reference`, `groups16_reference`, ...: each row quantized as llama.cpp
quantizes it, integer sums a block, float scales), and the models on it.
"""

import hashlib
import json
import re
from pathlib import Path

import gguf
import mlx.core as mx
from mlx.utils import tree_flatten
import numpy as np
import pytest
from conftest import FIXTURES, assert_every_instruction_set_agrees

import mlx_hybrid
from mlx_hybrid import ModelLoadError, ops
from mlx_hybrid.export import save_gguf
from mlx_hybrid.ops import cpu_quantized, llama_reference
from mlx_hybrid.loaders.quantized import from_gguf_blocks
from mlx_hybrid.models.layers import Embedding, Linear, QuantizedLinear
from mlx_hybrid.quantized_tensor import GRID_TYPES, INT8_TYPES, GridBlocks, int8_number, no_codes

pytestmark = pytest.mark.skipif(not ops.backend.cpu_kernels_built(), reason="needs the CPU kernels (x86-64, AVX2)")
FLOAT32_EPS = 2.0**-23
# (33 blocks of 32: the kernels' last block alone, where they take two at a time)
ODD_BLOCKS = 1056


# the kernel's type numbers, each found by its name (`quantized_tensor.int8_number`)
(
    Q8_0,
    Q4_K,
    Q6_K,
    Q5_0,
    Q5_1,
    Q4_0,
    Q4_1,
    IQ4_NL,
    Q5_K,
    Q3_K,
    Q2_K,
    IQ4_XS,
    IQ2_XXS,
    IQ2_XS,
    IQ2_S,
    IQ3_XXS,
    IQ3_S,
    IQ1_S,
    IQ1_M,
    TQ1_0,
    TQ2_0,
    MXFP4,
) = map(
    int8_number,
    """Q8_0 Q4_K Q6_K Q5_0 Q5_1 Q4_0 Q4_1 IQ4_NL Q5_K Q3_K Q2_K IQ4_XS
    IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ1_S IQ1_M TQ1_0 TQ2_0 MXFP4""".split(),
)


def q8_0_matrix(rng, shape, scale=1 / 256):
    """Random Q8_0 weights [..., N, K]: signed codes, float16 d's, and the package's held form."""
    codes = rng.integers(-127, 128, shape).astype(np.int8)
    d = (rng.uniform(-1, 1, (*shape[:-1], shape[-1] // 32)) * scale).astype(np.float16)
    return codes, d, llama_reference.held_q8_0(codes, d)


def product(x, held, held_type: int, grid=None) -> np.ndarray:
    """x (numpy or MLX) @ W^T for a held matrix of the kernel's type `held_type` (a grid type's with its grid)."""
    x = mx.array(x) if isinstance(x, np.ndarray) else x
    return np.array(cpu_quantized.int8_matmul(x, *held, held_type, grid))


def rows_alone_as_together(x, held, held_type: int, grid=None) -> np.ndarray:
    """Each of x's 16 rows alone; asserts 2 to 16 of them at once, and 27 (a prompt's many rows: the 16,
    then 11 again), give the same bits (the kernels take rows in tiles of 4 or 8, the last one short)."""
    alone = np.concatenate([product(x[r : r + 1], held, held_type, grid) for r in range(16)])
    for rows in (2, 3, 4, 7, 8, 16):
        np.testing.assert_array_equal(product(x[:rows], held, held_type, grid), alone[:rows], err_msg=f"{rows} rows")
    many = product(np.concatenate([x[:16], x[:11]]), held, held_type, grid)
    np.testing.assert_array_equal(many, np.concatenate([alone, alone[:11]]), err_msg="27 rows")
    return alone


def assert_at_float32_floor(got, want, x, codes, d):
    """got within float32 accumulation of the float64 reference: per block one product of d's and an
    exact integer sum, the blocks' sums in float32 (at most blocks * eps of their absolute sum)."""
    blocks = codes.shape[-1] // 32
    magnitude = (np.abs(x).reshape(len(x), -1, 32).max(-1) / 127) @ (np.abs(d).astype(np.float64) * 32 * 127).T
    assert (np.abs(np.asarray(got) - want) <= blocks * FLOAT32_EPS * magnitude + 1e-30).all()


@pytest.mark.parametrize("K", [1024, 3584, ODD_BLOCKS], ids=["0.8B hidden", "0.8B feed-forward", "odd blocks"])
def test_q8_0_products_are_llama_cpps_arithmetic_and_row_invariant(K):
    rng = np.random.default_rng(K)
    codes, d, held = q8_0_matrix(rng, (24, K))
    x = rng.standard_normal((16, K)).astype(np.float32)
    alone = rows_alone_as_together(x, held, Q8_0)
    assert_at_float32_floor(alone, llama_reference.q8_0_reference(x, codes, d), x, codes, d)


def test_q8_0_products_are_exact_where_the_arithmetic_is():
    """Rows whose blocks hold integers up to 127 with one of 127 (d_x = 1, the codes the values) and
    d_w powers of two: every sum and scale exact in float32, so the kernel gives the reference exactly
    (a code rounded the other way, or a scale misplaced, would show)."""
    rng = np.random.default_rng(1)
    codes, _, _ = q8_0_matrix(rng, (8, 256))
    d = (2.0 ** rng.integers(-8, -2, (8, 8))).astype(np.float16)
    x = rng.integers(-126, 127, (3, 256)).astype(np.float32)
    x[:, ::32] = 127  # each block's largest magnitude
    got = product(x, llama_reference.held_q8_0(codes, d), Q8_0)
    np.testing.assert_array_equal(got, llama_reference.q8_0_reference(x, codes, d).astype(np.float32))


def test_q8_0_rounds_codes_half_to_even_and_zero_blocks_to_zero():
    """x * 127 / max |x| exactly halfway (2.5 -> 2, 3.5 -> 4, as AVX2's rounding) and a block of zeros."""
    codes, _, _ = q8_0_matrix(np.random.default_rng(2), (4, 64))
    x = np.zeros((1, 64), np.float32)
    x[0, 0], x[0, 1], x[0, 2] = 127, 2.5, 3.5  # the second block all zeros
    got = product(x, llama_reference.held_q8_0(codes, np.ones((4, 2), np.float16)), Q8_0)
    w = codes.astype(np.int64)
    np.testing.assert_array_equal(got[0], (127 * w[:, 0] + 2 * w[:, 1] + 4 * w[:, 2]).astype(np.float32))


@pytest.mark.parametrize("shared", [True, False], ids=["one row a token", "a row a choice"])
def test_q8_0_expert_products_gather_each_tokens_matrices(shared):
    rng = np.random.default_rng(3)
    codes, d, held = q8_0_matrix(rng, (6, 10, 512))
    indices = rng.integers(0, 6, (5, 3)).astype(np.uint32)
    x = rng.standard_normal((5, 1 if shared else 3, 512)).astype(np.float32)
    got = np.array(cpu_quantized.int8_gather_matmul(mx.array(x), *held, mx.array(indices), Q8_0))
    for t in range(5):
        for j, e in enumerate(indices[t]):
            row = x[t, 0 if shared else j][None]
            assert_at_float32_floor(
                got[t, j][None], llama_reference.q8_0_reference(row, codes[e], d[e]), row, codes[e], d[e]
            )
    alone = np.array(cpu_quantized.int8_gather_matmul(mx.array(x[2:3]), *held, mx.array(indices[2:3]), Q8_0))
    np.testing.assert_array_equal(got[2], alone[0])


def test_q8_0_product_of_a_view():
    rng = np.random.default_rng(4)
    _, _, held = q8_0_matrix(rng, (8, 128))
    view = mx.array(rng.standard_normal((3, 256)).astype(np.float32))[:, ::2]
    np.testing.assert_array_equal(product(view, held, Q8_0), product(mx.contiguous(view), held, Q8_0))


# Q4_K and Q5_K: the kernel's type and the values' bits. llama.cpp's x86 build multiplies Q4_K matrices
# of rows in eights repacked (ggml_gemv_q4_K_8x8_q8_K), others and Q5_K as stored (ggml_vec_dot_q4_K_q8_K,
# ggml_vec_dot_q5_K_q8_K): orders of the float sums
K_QUANTS = pytest.mark.parametrize(
    "held_type, bits, N", [(Q4_K, 4, 24), (Q4_K, 4, 20), (Q5_K, 5, 24)], ids=["Q4_K, rows in eights", "Q4_K", "Q5_K"]
)


@K_QUANTS
@pytest.mark.parametrize("K", [1024, 3584], ids=["0.8B hidden", "0.8B feed-forward"])
def test_k_quant_products_are_llama_cpps_arithmetic_and_row_invariant(K, held_type, bits, N):
    """Rows quantized to Q8_K, each block's integer sums (one and one of the mins, or 8 lanes and 4 or
    1), their float accumulators: every row the same bits alone or with others, at the float32 floor of
    the float64 reference (K / 256 terms an accumulator, then at most 3 sums of lanes, twice)."""
    rng = np.random.default_rng(K + N + bits)
    weights = llama_reference.random_k_quant(rng, (N, K), bits)
    x = rng.standard_normal((16, K)).astype(np.float32)
    alone = rows_alone_as_together(x, llama_reference.held_k_quant(weights[0], bits, *weights[1:]), held_type)
    want = llama_reference.k_quant_reference(x, *weights)
    q, d, dmin, sc, m = weights
    _, d_x = llama_reference.q8_k_rows(x)
    blocks = K // 256
    # each block's two terms at most 127 * q_max * 63 * 256 (and 127 * 63 * 256) times d_w d_x, dmin_w d_x
    largest = 2**bits - 1
    wide_d, wide_dmin = d.astype(np.float64), dmin.astype(np.float64)
    magnitude = np.abs(d_x).astype(np.float64) @ (wide_d * 127 * largest * 63 * 256 + wide_dmin * 127 * 63 * 256).T
    assert (np.abs(alone - want) <= 2 * (blocks + 3) * FLOAT32_EPS * magnitude).all()


@K_QUANTS
def test_k_quant_products_are_exact_where_the_arithmetic_is(held_type, bits, N):
    """Each block's largest value -127 (d_x = 1: the codes the values), integers of at most 15 elsewhere,
    d and dmin a power of two a row: every sum (below 2^24) and scale exact, the reference met exactly."""
    rng = np.random.default_rng(6)
    q, _, _, sc, m = llama_reference.random_k_quant(rng, (N, 512), bits)
    d, dmin = ((2.0 ** rng.integers(-12, -6, (N, 1)) * np.ones((N, 2))).astype(np.float16) for _ in range(2))
    x = rng.integers(-15, 16, (3, 512)).astype(np.float32)
    x[:, ::256] = -127
    got = product(x, llama_reference.held_k_quant(q, bits, d, dmin, sc, m), held_type)
    np.testing.assert_array_equal(got, llama_reference.k_quant_reference(x, q, d, dmin, sc, m).astype(np.float32))


@pytest.mark.parametrize(
    "held_type, N",
    [(Q4_K, 24), (Q4_K, 40), (Q4_0, 24), (IQ4_NL, 24), (MXFP4, 24)],
    ids=["Q4_K", "Q4_K, an eight past the sixteens", "Q4_0", "IQ4_NL", "MXFP4"],
)
def test_rows_held_interleaved_give_the_rows_as_stored(held_type, N):
    """A Q4_K, Q4_0, IQ4_NL or MXFP4 matrix of rows in eights held interleaved (`interleave_eights`: each
    eight's turns in turn, a 32-bit word of Q4_K, two blocks of the others, as llama.cpp's x86 build
    repacks them; in the matrix's own buffer where nothing else holds it) multiplies as the matrix as
    stored, to the bit: a decode step's row, a prompt's rows, experts' rows, from every build this CPU
    runs; and `rows_as_stored` gives the codes back as stored."""
    rng = np.random.default_rng(N + held_type)
    if held_type == Q4_K:
        weights = llama_reference.random_k_quant(rng, (5, N, 1024), 4)
        w, factors, codes = (mx.array(a) for a in llama_reference.held_k_quant(weights[0], 4, *weights[1:]))
    elif held_type == MXFP4:
        w, factors, codes = (
            mx.array(a) for a in llama_reference.held_mxfp4(*llama_reference.random_mxfp4(rng, (5, N, 1024)))
        )
    else:
        q, d = llama_reference.random_b32(rng, (5, N, 1024), 4, False)
        w, factors, codes = llama_reference.held_b32(q, 4, d)
    unit = cpu_quantized.interleaved_unit(held_type, N, w.shape[-1])
    interleaved = cpu_quantized.interleave_eights(w, held_type)
    turns = np.array(w).reshape(5, N // 8, 8, -1, unit)
    np.testing.assert_array_equal(np.array(interleaved), turns.swapaxes(2, 3).reshape(5, N, -1))
    # a matrix nothing else holds (a loader's) is interleaved in its own buffer: the same words
    in_place = cpu_quantized.interleave_eights(mx.array(np.array(w)), held_type)
    np.testing.assert_array_equal(np.array(in_place), turns.swapaxes(2, 3).reshape(5, N, -1))
    np.testing.assert_array_equal(np.array(cpu_quantized.rows_as_stored(interleaved, held_type)), np.array(w))
    x = mx.random.normal((9, 1024), key=mx.random.key(N))
    tokens, indices = mx.random.normal((4, 1, 1024), key=mx.random.key(1)), mx.array(rng.integers(0, 5, (4, 3)))

    def products(held, held_interleaved):
        matrix = (held[1], factors[1], codes[1], held_type, None, held_interleaved)
        return [np.array(cpu_quantized.int8_matmul(x[:rows], *matrix)) for rows in (1, 3, 9)] + [
            np.array(
                cpu_quantized.int8_gather_matmul(
                    tokens, held, factors, codes, indices, held_type, None, held_interleaved
                )
            )
        ]

    extension = cpu_quantized.extension()
    try:
        for name in extension.instruction_sets():
            extension.use_instruction_set(name)
            for got, want in zip(products(interleaved, True), products(w, False)):
                np.testing.assert_array_equal(got, want, err_msg=name)
    finally:
        extension.use_instruction_set(None)
    with pytest.raises(ValueError, match="only Q4_K, Q4_0, IQ4_NL and MXFP4 matrices of rows in eights are held"):
        cpu_quantized.int8_matmul(x, w[1, :20], factors[1, :20], codes[1, :20], held_type, None, True)


@pytest.mark.parametrize("type_name", ["Q4_0", "IQ4_NL", "MXFP4"])
def test_a_matrix_held_interleaved_multiplies_as_stored_past_its_row_limit(type_name):
    """A matrix the loader holds interleaved (`ops.held_interleaved`) computes as the matrix as stored at
    every row count: each row its own 8-bit product up to its type's row limit, and past it (a long
    prompt's chunk) the float32 path's product of the rows as stored (`cpu_quantized.rows_as_stored`),
    not of the interleaved codes."""
    bits, group_size, block = INT8_TYPES[type_name]
    q = llama_reference.random_block_weights((24, 256), bits, group_size, block)
    limit = ops.int8_row_limit(bits, group_size, block)
    rows = 160 if limit is None else limit + 1
    x = mx.random.normal((rows, 256), key=mx.random.key(6))
    held = ops.held_interleaved(mx.array(q.weight), bits, group_size, block, limit)
    mx.eval(held)
    assert ops.activations_of(held) == "int8, interleaved"
    assert not np.array_equal(np.array(held), np.array(q.weight))
    ops.compute_as_llama_cpp(q.weight, limit)

    def product(w, x):
        return np.array(ops.quantized_matmul(x, w, q.scales, q.biases, group_size=group_size, bits=bits, block=block))

    for part in (x[:1], x[: limit or rows], x):
        np.testing.assert_array_equal(product(held, part), product(q.weight, part))
    if limit is not None:
        floats = cpu_quantized.quantized_matmul(x, q.weight, q.scales, q.biases, q.group_size, q.bits, q.block)
        np.testing.assert_array_equal(product(held, x), np.array(floats))


def test_several_matrices_of_one_x_give_each_its_own_products_bits():
    """`int8_matmuls` (a layer's projections of one input as one node) gives each matrix the bits of its
    own product: Q4_K held interleaved, Q6_K, Q8_0, a grid type and F16, for a decode step's row and a
    verify pass's rows, from every build this CPU runs."""
    rng = np.random.default_rng(5)
    weights = llama_reference.random_k_quant(rng, (16, 1024), 4)
    q4_k = [mx.array(a) for a in llama_reference.held_k_quant(weights[0], 4, *weights[1:])]
    q4_k[0] = cpu_quantized.interleave_eights(q4_k[0], Q4_K)
    (q6_k, _), q8_0 = groups16_case(rng, Q6_K, 6, 32, (24, 1024)), q8_0_matrix(rng, (40, 1024))[2]
    _, grid_held, grid = grid_matrix((8, 1024), "IQ2_XXS", 3)
    f16 = mx.array(rng.standard_normal((12, 1024)).astype(np.float16))
    matrices = [
        (*q4_k, Q4_K, None, True),
        (*map(mx.array, q6_k), Q6_K, None, False),
        (*map(mx.array, q8_0), Q8_0, None, False),
        (*grid_held, IQ2_XXS, grid, False),
    ]
    extension = cpu_quantized.extension()
    try:
        for name in extension.instruction_sets():
            extension.use_instruction_set(name)
            for rows in (1, 5):
                x = mx.random.normal((rows, 1024), key=mx.random.key(rows))
                got = cpu_quantized.int8_matmuls(x, [*matrices, (f16, None, None, 0, None, False)])
                want = [cpu_quantized.int8_matmul(x, *matrix) for matrix in matrices]
                for g, w in zip(got, [*want, cpu_quantized.half_matmul(x, f16)]):
                    np.testing.assert_array_equal(np.array(g), np.array(w), err_msg=name)
    finally:
        extension.use_instruction_set(None)


def test_q8_k_quantization_is_llama_cpps():
    """The value of largest magnitude sets the scale with its sign (-127 / v), the first of equal
    magnitudes wins, codes above 127 are cut to 127, ties round to even: against values worked by hand."""
    x = np.zeros((1, 256), np.float32)
    x[0, :6] = [-2.0, 2.0, 1.0, 0.99, -0.0119, 0.0119]
    codes, d = llama_reference.q8_k_rows(x)
    # v = -2 (before the 2): -127 / -2 = 63.5, so 2 -> 127, -2 -> -127, 1 -> 63.5 -> 64 (even), 0.99 -> 63
    assert codes[0, :4].tolist() == [-127, 127, 64, 63] and d[0, 0] == np.float32(1) / np.float32(63.5)
    # the kernel agrees through a product that reads codes one by one: a unit matrix picks them out
    eye = np.zeros((4, 256), np.uint8)
    eye[np.arange(4), np.arange(4)] = 1
    ones = (np.ones((4, 1)) * 2.0**-8).astype(np.float16)
    held = llama_reference.held_k_quant(eye, 4, ones, np.zeros((4, 1), np.float16), np.ones((4, 8)), np.zeros((4, 8)))
    np.testing.assert_array_equal(product(x, held, Q4_K)[0] / (d[0, 0] * 2.0**-8), [-127, 127, 64, 63])


def test_q8_k_quantization_takes_a_nan_as_llama_cpp_does():
    """A NaN activation is passed over for the block's largest magnitude (the reference's strict >) and
    gets the code 0 (llama.cpp's nearest_int of a NaN): the product is the one of the row with a 0 there,
    whatever block it falls in, and the quantization stays within the row (no search past its end)."""
    rng = np.random.default_rng(17)
    q, *rest = llama_reference.random_k_quant(rng, (8, 512))
    held = llama_reference.held_k_quant(q, 4, *rest)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    x[:, [5, 300]] = 0
    with_nan = x.copy()
    with_nan[0, 5], with_nan[1, 300], with_nan[2, 5] = np.nan, np.nan, np.nan
    with_nan[2, 256:] = np.nan  # a block of NaN alone: as a block of zeros
    x[2, 256:] = 0
    np.testing.assert_array_equal(product(with_nan, held, Q4_K), product(x, held, Q4_K))


# the types of groups of 16: (kernel type, bits, the values' offset; Q2_K: none, its mins apart)
GROUPS16 = pytest.mark.parametrize(
    "held_type, bits, offset", [(Q6_K, 6, 32), (Q3_K, 3, 4), (Q2_K, 2, 0)], ids=["Q6_K", "Q3_K", "Q2_K"]
)


def groups16_case(rng, held_type, bits, offset, shape):
    """Random weights of a groups-of-16 type (Q2_K too): the held matrix and its reference (x -> float64)."""
    if held_type == Q2_K:
        weights = llama_reference.random_q2_k(rng, shape)
        return llama_reference.held_q2_k(*weights), lambda x: llama_reference.q2_k_reference(x, *weights)
    weights = llama_reference.random_groups16(rng, shape, bits)
    held = llama_reference.held_groups16(weights[0], bits, *weights[1:])
    return held, lambda x: llama_reference.groups16_reference(x, *weights, offset)


@GROUPS16
@pytest.mark.parametrize("K", [1024, 3584], ids=["0.8B hidden", "0.8B feed-forward"])
def test_groups_of_16_products_are_llama_cpps_arithmetic_and_row_invariant(K, held_type, bits, offset):
    """Rows quantized to Q8_K, (q - offset) times their codes in exact integer lanes (Q2_K: q, and m_j
    times the codes' sums of 16 in lanes of two groups), fused multiply-adds a block: every row the same
    bits alone or with others, at the float32 floor of the float64 reference (8 lanes of K / 256 terms
    (Q2_K: twice that), then their tree)."""
    rng = np.random.default_rng(K + held_type)
    held, reference = groups16_case(rng, held_type, bits, offset, (20, K))
    x = rng.standard_normal((16, K)).astype(np.float32)
    alone = rows_alone_as_together(x, held, held_type)
    _, d_x = llama_reference.q8_k_rows(x)
    # a block's terms at most 127 * 128 * 256 times the largest |value| and |d_w d_x| (Q2_K: sc and m
    # at most 15, values at most 3, both factors)
    factors = np.abs(np.array(held[1]).astype(np.float64).reshape(20, K // 256, -1)).sum(-1)
    largest = 3 * 15 if held_type == Q2_K else max(offset, 2**bits - offset) * 128
    magnitude = np.abs(d_x).astype(np.float64) @ factors.T * 127 * largest * 256
    rounds = 2 * K // 256 if held_type == Q2_K else K // 256
    assert (np.abs(alone - reference(x)) <= (rounds + 3) * FLOAT32_EPS * magnitude).all()


@GROUPS16
def test_groups_of_16_products_are_exact_where_the_arithmetic_is(held_type, bits, offset):
    """Each block's largest value -127 (d_x = 1: the codes the values), integers of at most 15 elsewhere,
    the factors a power of two a row: every sum (below 2^24) and scale exact, the reference met exactly."""
    rng = np.random.default_rng(8)
    q = rng.integers(0, 2**bits, (8, 512)).astype(np.uint8)
    sc = rng.integers(0, 16, (8, 32))
    d = (2.0 ** rng.integers(-14, -8, (8, 1)) * np.ones((8, 2))).astype(np.float16)
    x = rng.integers(-15, 16, (3, 512)).astype(np.float32)
    x[:, ::256] = -127
    if held_type == Q2_K:
        m = rng.integers(0, 16, (8, 32))
        held, want = llama_reference.held_q2_k(q, d, d, sc, m), llama_reference.q2_k_reference(x, q, d, d, sc, m)
    else:
        held = llama_reference.held_groups16(q, bits, d, sc)
        want = llama_reference.groups16_reference(x, q, d, sc, offset)
    np.testing.assert_array_equal(product(x, held, held_type), want.astype(np.float32))


@pytest.mark.parametrize("K", [1024, 3584], ids=["0.8B hidden", "0.8B feed-forward"])
def test_iq4_xs_products_are_llama_cpps_arithmetic_and_row_invariant(K):
    """Rows quantized to Q8_K, IQ4_NL's values times the codes in lanes of 4 times the group's ls_j - 32,
    exact integers, a fused multiply-add a block: every row the same bits alone or with others, at the
    float32 floor of the float64 reference (8 lanes of K / 256 terms, then their tree)."""
    rng = np.random.default_rng(K + IQ4_XS)
    weights = llama_reference.random_iq4_xs(rng, (20, K))
    x = rng.standard_normal((16, K)).astype(np.float32)
    alone = rows_alone_as_together(x, llama_reference.held_iq4_xs(*weights), IQ4_XS)
    _, d_x = llama_reference.q8_k_rows(x)
    # a block's terms at most 127 * 127 * 32 * 256 times |d_w d_x|
    magnitude = np.abs(d_x).astype(np.float64) @ np.abs(weights[1].astype(np.float64)).T * 127 * 127 * 32 * 256
    want = llama_reference.iq4_xs_reference(x, *weights)
    assert (np.abs(alone - want) <= (K // 256 + 3) * FLOAT32_EPS * magnitude).all()


def test_iq4_xs_products_are_exact_where_the_arithmetic_is():
    """Each block's largest value -127 (d_x = 1), integers of at most 15 elsewhere, d a power of two a
    row: every sum (below 2^24) and scale exact, the reference met exactly."""
    rng = np.random.default_rng(10)
    q, _, ls = llama_reference.random_iq4_xs(rng, (8, 512))
    d = (2.0 ** rng.integers(-14, -8, (8, 1)) * np.ones((8, 2))).astype(np.float16)
    x = rng.integers(-15, 16, (3, 512)).astype(np.float32)
    x[:, ::256] = -127
    got = product(x, llama_reference.held_iq4_xs(q, d, ls), IQ4_XS)
    np.testing.assert_array_equal(got, llama_reference.iq4_xs_reference(x, q, d, ls).astype(np.float32))


def reference_of(held_type: int):
    """A 32-value type's numpy reference (x, q, d[, m])."""
    return {
        Q5_0: lambda x, q, d: llama_reference.offset_reference(x, q, d, 16),
        Q4_0: lambda x, q, d: llama_reference.offset_reference(x, q, d, 8),
        Q5_1: llama_reference.d_and_m_reference,
        Q4_1: llama_reference.d_and_m_reference,
        IQ4_NL: llama_reference.iq4_nl_reference,
    }[held_type]


# the 32-value types: (kernel type, bits, with m, the largest magnitude of a value)
B32_TYPES = pytest.mark.parametrize(
    "held_type, bits, with_m, largest",
    [(Q5_0, 5, False, 16), (Q5_1, 5, True, 31), (Q4_0, 4, False, 8), (Q4_1, 4, True, 15), (IQ4_NL, 4, False, 127)],
    ids=["Q5_0", "Q5_1", "Q4_0", "Q4_1", "IQ4_NL"],
)
# llama.cpp's x86 build repacks Q4_0 and IQ4_NL matrices of rows in eights (ggml_gemv_q4_0_8x8_q8_0:
# a block's sum one integer), others as stored (lanes of 4)
B32_ROWS = pytest.mark.parametrize("N", [24, 20], ids=["rows in eights", "other rows"])


@B32_ROWS
@B32_TYPES
@pytest.mark.parametrize("K", [1024, 3584, ODD_BLOCKS], ids=["0.8B hidden", "0.8B feed-forward", "odd blocks"])
def test_32_value_products_are_llama_cpps_arithmetic_and_row_invariant(K, held_type, bits, with_m, largest, N):
    """Rows quantized to Q8_0 (Q8_1: with s), the values (q - 16, q - 8, q, IQ4_NL's table) times the
    codes as exact integers, a fused multiply-add a block (Q5_1, Q4_1: m_w s_x into one more sum):
    every row the same bits alone or with others, at the float32 floor of the float64 reference (K / 32
    terms an accumulator, then at most 4 sums of lanes and accumulators)."""
    rng = np.random.default_rng(K + held_type + N)
    weights = llama_reference.random_b32(rng, (N, K), bits, with_m)
    x = rng.standard_normal((16, K)).astype(np.float32)
    alone = rows_alone_as_together(x, llama_reference.held_b32(weights[0], bits, *weights[1:]), held_type)
    _, d_x, s_x = llama_reference.q8_0_rows(x)
    # a block's terms at most 127 * largest * 32 times |d_w d_x|, and |m_w s_x|
    magnitude = np.abs(d_x) @ np.abs(weights[1].astype(np.float64)).T * 127 * largest * 32
    if with_m:
        magnitude += np.abs(s_x) @ np.abs(weights[2].astype(np.float64)).T
    want = reference_of(held_type)(x, *weights)
    assert (np.abs(alone - want) <= (K // 32 + 4) * FLOAT32_EPS * magnitude).all()


@B32_ROWS
@B32_TYPES
def test_32_value_products_are_exact_where_the_arithmetic_is(held_type, bits, with_m, largest, N):
    """Each block's largest magnitude 127 (d_x = 1: the codes the values), integer values elsewhere, d
    and m powers of two: every sum and scale exact, the reference met exactly."""
    rng = np.random.default_rng(9)
    q = rng.integers(0, 2**bits, (N, 512)).astype(np.uint8)
    scales = [(2.0 ** rng.integers(-12, -6, (N, 16))).astype(np.float16) for _ in range(1 + with_m)]
    x = rng.integers(-126, 127, (3, 512)).astype(np.float32)
    x[:, ::32] = 127
    got = product(x, llama_reference.held_b32(q, bits, *scales), held_type)
    np.testing.assert_array_equal(got, reference_of(held_type)(x, q, *scales).astype(np.float32))


# the grid types with 8-bit activations: their kernel type numbers
GRID_KERNEL_TYPES = {
    "IQ2_XXS": IQ2_XXS,
    "IQ2_XS": IQ2_XS,
    "IQ2_S": IQ2_S,
    "IQ3_XXS": IQ3_XXS,
    "IQ3_S": IQ3_S,
    "IQ1_S": IQ1_S,
    "IQ1_M": IQ1_M,
    "TQ1_0": TQ1_0,
}
GRID_KINDS = pytest.mark.parametrize("type_name", sorted(GRID_KERNEL_TYPES))


def grid_matrix(shape, type_name: str, seed: int):
    """A random grid-type matrix: (its blocks as numpy, the held (w, factors, codes), its grid)."""
    tensor = llama_reference.random_grid_weights(shape, GRID_TYPES[type_name], seed)
    held = (tensor.weight, tensor.scales, tensor.biases)
    return np.array(tensor.weight), held, cpu_quantized.grid_of(type_name)


@GRID_KINDS
@pytest.mark.parametrize("K", [1024, 3584], ids=["0.8B hidden", "0.8B feed-forward"])
def test_grid_products_are_llama_cpps_arithmetic_and_row_invariant(K, type_name):
    """Rows quantized to Q8_K, each 32 values' signed grid values times the codes in lanes of 4 times
    2 s + 1 as exact integers, a fused multiply-add a block, the lanes' tree times 1 / divisor: every
    row the same bits alone or with others, at the float32 floor of the float64 reference (8 lanes of
    K / 256 terms, then their tree)."""
    blocks, held, grid = grid_matrix((20, K), type_name, K)
    x = np.random.default_rng(K).standard_normal((16, K)).astype(np.float32)
    alone = rows_alone_as_together(x, held, GRID_KERNEL_TYPES[type_name], grid)
    want = llama_reference.grid_reference(x, blocks, type_name)
    integers, d = llama_reference.grid_integers(blocks, type_name)
    _, d_x = llama_reference.q8_k_rows(x)
    # a block's terms at most 127 * (its largest integer) * 256 times |d_w d_x| / divisor
    largest = np.abs(integers).reshape(len(blocks), -1, 256).max(-1)
    divisor = llama_reference.GRID_DIVISORS[type_name]
    magnitude = np.abs(d_x).astype(np.float64) @ (np.abs(d.astype(np.float64)) * largest).T * 127 * 256 / divisor
    assert (np.abs(alone - want) <= (K // 256 + 3) * FLOAT32_EPS * magnitude).all()


@GRID_KINDS
def test_grid_products_are_exact_where_the_arithmetic_is(type_name):
    """Each block's largest value -127 (d_x = 1), integers of at most 7 elsewhere, d a power of two a
    block: every integer sum (below 2^24 in magnitude) and scale exact, the reference met exactly."""
    blocks, _, grid = grid_matrix((8, 512), type_name, 11)
    rng = np.random.default_rng(11)
    d = (2.0 ** rng.integers(-14, -8, (8, 2)) * rng.choice([-1, 1], (8, 2))).astype(np.float16)
    blocks = blocks.reshape(8, 2, -1).copy()
    llama_reference.with_grid_d(blocks, type_name, d)
    blocks = blocks.reshape(8, -1)
    x = rng.integers(-7, 8, (3, 512)).astype(np.float32)
    x[:, ::256] = -127
    tensor = GridBlocks.tensor(mx.array(blocks), GRID_TYPES[type_name])
    got = product(x, (tensor.weight, tensor.scales, tensor.biases), GRID_KERNEL_TYPES[type_name], grid)
    np.testing.assert_array_equal(got, llama_reference.grid_reference(x, blocks, type_name).astype(np.float32))


@GRID_KINDS
@pytest.mark.parametrize("shared", [True, False], ids=["one row a token", "a row a choice"])
def test_grid_expert_products_give_each_row_its_product_alone(type_name, shared):
    _, held, grid = grid_matrix((5, 16, 512), type_name, 12)
    rng = np.random.default_rng(12)
    indices = rng.integers(0, 5, (4, 2)).astype(np.uint32)
    x = rng.standard_normal((4, 1 if shared else 2, 512)).astype(np.float32)
    held_type = GRID_KERNEL_TYPES[type_name]
    got = np.array(cpu_quantized.int8_gather_matmul(mx.array(x), *held, mx.array(indices), held_type, grid))
    for t in range(4):
        for j, e in enumerate(indices[t]):
            row = x[t, 0 if shared else j][None]
            np.testing.assert_array_equal(got[t, j], product(row, tuple(a[int(e)] for a in held), held_type, grid)[0])


@pytest.mark.parametrize("K", [1024, 3584], ids=["0.8B hidden", "0.8B feed-forward"])
def test_tq2_0_products_are_llama_cpps_arithmetic_and_row_invariant(K):
    """Rows quantized to Q8_K, the values 0 to 2 times the codes in lanes of 4, less the codes by their sums
    of 16 (the -1), exact integers, a fused multiply-add a block: every row the same bits alone or with
    others, at the float32 floor of the float64 reference (8 lanes of K / 256 terms, then their tree)."""
    rng = np.random.default_rng(K + TQ2_0)
    q, d = llama_reference.random_ternary(rng, (20, K))
    x = rng.standard_normal((16, K)).astype(np.float32)
    alone = rows_alone_as_together(x, llama_reference.held_ternary(q, d), TQ2_0)
    _, d_x = llama_reference.q8_k_rows(x)
    # a block's terms at most 2 * 127 * 256 times |d_w d_x|
    magnitude = np.abs(d_x).astype(np.float64) @ np.abs(d.astype(np.float64)).T * 2 * 127 * 256
    want = llama_reference.ternary_reference(x, q, d)
    assert (np.abs(alone - want) <= (K // 256 + 3) * FLOAT32_EPS * magnitude).all()


def test_tq2_0_products_are_exact_where_the_arithmetic_is():
    """Each block's largest value -127 (d_x = 1), integers elsewhere, d a power of two: exact."""
    rng = np.random.default_rng(14)
    q, _ = llama_reference.random_ternary(rng, (8, 512))
    d = (2.0 ** rng.integers(-14, -8, (8, 2)) * rng.choice([-1, 1], (8, 2))).astype(np.float16)
    x = rng.integers(-126, 127, (3, 512)).astype(np.float32)
    x[:, ::256] = -127
    got = product(x, llama_reference.held_ternary(q, d), TQ2_0)
    np.testing.assert_array_equal(got, llama_reference.ternary_reference(x, q, d).astype(np.float32))


@pytest.mark.parametrize("N", [24, 20], ids=["rows in eights", "other rows"])
@pytest.mark.parametrize("K", [1024, 3584, ODD_BLOCKS], ids=["0.8B hidden", "0.8B feed-forward", "odd blocks"])
def test_mxfp4_products_are_llama_cpps_arithmetic_and_row_invariant(K, N):
    """Rows quantized to Q8_0, MXFP4's values (twice E2M1's) times the codes as exact integers, a fused
    multiply-add a block by 2^(e - 128) d_x (rows in eights as llama.cpp repacks them, others in lanes):
    every row the same bits alone or with others, at the float32 floor of the float64 reference (K / 32
    terms an accumulator, then at most 4 sums of lanes and accumulators)."""
    rng = np.random.default_rng(K + N + MXFP4)
    q, e = llama_reference.random_mxfp4(rng, (N, K))
    x = rng.standard_normal((16, K)).astype(np.float32)
    alone = rows_alone_as_together(x, llama_reference.held_mxfp4(q, e), MXFP4)
    _, d_x, _ = llama_reference.q8_0_rows(x)
    # a block's terms at most 127 * 12 * 32 times |d_w d_x|
    magnitude = np.abs(d_x) @ np.ldexp(1.0, e.astype(np.int64) - 128).T * 127 * 12 * 32
    assert (np.abs(alone - llama_reference.mxfp4_reference(x, q, e)) <= (K // 32 + 4) * FLOAT32_EPS * magnitude).all()


@pytest.mark.parametrize("N", [24, 20], ids=["rows in eights", "other rows"])
@pytest.mark.parametrize("lowest", [124, 0, 230], ids=["2^-4", "subnormal 2^-128", "2^102"])
def test_mxfp4_products_are_exact_where_the_arithmetic_is(N, lowest):
    """Each block's largest magnitude 127 (d_x = 1), integers elsewhere, scales 2^(e - 128) for e in 4
    octaves from `lowest` (E8M0's 0 and 1 make float32 subnormals): every sum and scale exact (a block's
    sum below 2^16, times 3 octaves of scales, 16 blocks: within float32's 24 bits), the reference met
    exactly."""
    rng = np.random.default_rng(15)
    q, _ = llama_reference.random_mxfp4(rng, (N, 512))
    e = rng.integers(lowest, lowest + 4, (N, 16)).astype(np.uint8)
    x = rng.integers(-126, 127, (3, 512)).astype(np.float32)
    x[:, ::32] = 127
    got = product(x, llama_reference.held_mxfp4(q, e), MXFP4)
    np.testing.assert_array_equal(got, llama_reference.mxfp4_reference(x, q, e).astype(np.float32))


def test_a_grid_type_takes_its_grid_and_others_none():
    _, held, grid = grid_matrix((8, 256), "IQ2_XXS", 13)
    x = mx.zeros((1, 256))
    with pytest.raises(ValueError, match="a grid type takes its grid"):
        cpu_quantized.int8_matmul(x, *held, IQ2_XXS)
    with pytest.raises(ValueError, match="a grid type takes its grid"):
        cpu_quantized.int8_matmul(x, *held, IQ2_XXS, cpu_quantized.grid_of("IQ2_XS"))  # 512 rows, not 256
    _, _, q8_0 = q8_0_matrix(np.random.default_rng(13), (8, 256))
    with pytest.raises(ValueError, match="the others none"):
        cpu_quantized.int8_matmul(x, *q8_0, Q8_0, grid)


@pytest.mark.parametrize(
    "held_type, weights, held, shared",
    [
        (Q4_K, llama_reference.random_k_quant, lambda q, *rest: llama_reference.held_k_quant(q, 4, *rest), True),
        (Q6_K, llama_reference.random_groups16, lambda q, *rest: llama_reference.held_groups16(q, 6, *rest), False),
        (Q2_K, llama_reference.random_q2_k, llama_reference.held_q2_k, True),
        (
            Q5_1,
            lambda rng, shape: llama_reference.random_b32(rng, shape, 5, True),
            lambda q, d, m: llama_reference.held_b32(q, 5, d, m),
            True,
        ),
        (
            IQ4_NL,
            lambda rng, shape: llama_reference.random_b32(rng, shape, 4, False),
            lambda q, d: llama_reference.held_b32(q, 4, d),
            False,
        ),
        (TQ2_0, llama_reference.random_ternary, llama_reference.held_ternary, False),
        (MXFP4, llama_reference.random_mxfp4, llama_reference.held_mxfp4, True),
    ],
    ids=[
        "Q4_K, one row a token",
        "Q6_K, a row a choice",
        "Q2_K, one row a token",
        "Q5_1, one row a token",
        "IQ4_NL, rows in eights",
        "TQ2_0, a row a choice",
        "MXFP4, rows in eights",
    ],
)
# (4 tokens' rows over 5 matrices; 20 tokens' over 3: the rows that chose one expert taken together, in
# tiles of up to 8 or 16 and a short last one)
@pytest.mark.parametrize("tokens, experts", [(4, 5), (20, 3)], ids=["few rows an expert", "many rows an expert"])
def test_expert_products_give_each_row_its_product_alone(held_type, weights, held, shared, tokens, experts):
    rng = np.random.default_rng(7 + held_type)
    matrices = held(*weights(rng, (experts, 16, 512)))
    indices = np.stack([rng.choice(experts, 2, replace=False) for _ in range(tokens)]).astype(np.uint32)
    x = rng.standard_normal((tokens, 1 if shared else 2, 512)).astype(np.float32)
    got = np.array(cpu_quantized.int8_gather_matmul(mx.array(x), *matrices, mx.array(indices), held_type))
    for t in range(tokens):
        for j, e in enumerate(indices[t]):
            row = x[t, 0 if shared else j][None]
            np.testing.assert_array_equal(got[t, j], product(row, tuple(a[int(e)] for a in matrices), held_type)[0])


def test_a_row_alone_gives_every_weight_row_its_product_wherever_the_threads_runs_meet():
    """A row of x alone against a product the threads share (csrc's `Stretches`: each thread its own
    stretch of the weight rows, then runs from the back of another's), call after call: each output is
    the one it gets beside a second row of x (runs of 64 from one cursor), for a matrix whose rows are
    no multiple of 64 and for experts of such matrices. Every call's x differs, so that a weight row
    no run covered would show another call's output."""
    rng = np.random.default_rng(11)
    held = q8_0_matrix(rng, (1091, 1024))[2]
    experts = q8_0_matrix(rng, (3, 1091, 1024))[2]
    for call in range(24):
        x = rng.standard_normal((2, 1024)).astype(np.float32)
        np.testing.assert_array_equal(product(x[:1], held, Q8_0), product(x, held, Q8_0)[:1], err_msg=f"call {call}")
        chosen = rng.choice(3, 2, replace=False)
        got = np.array(
            cpu_quantized.int8_gather_matmul(
                mx.array(x[:1, None]), *map(mx.array, experts), mx.array(chosen[None].astype(np.uint32)), Q8_0
            )
        )
        for j, e in enumerate(chosen):
            want = product(x, tuple(a[int(e)] for a in experts), Q8_0)[:1]
            np.testing.assert_array_equal(got[0, j][None], want, err_msg=f"call {call}, expert {e}")


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K_M"])
def test_a_file_with_int8_activations_verifies_as_it_decodes(type_name):
    """The Q8_0 and Q4_K_M fixtures on 8-bit activations: a 16-token verify pass gives each token its
    decode step's logits to the bit; greedy MTP speculation gives plain decoding's tokens; and the
    products did take the 8-bit path (the logits differ from the float32 path's)."""
    path = FIXTURES / "qwen35" / f"model-{type_name}.gguf"
    model, tokenizer = mlx_hybrid.load(path, cpu_activations="int8")
    floats, _ = mlx_hybrid.load(path, cpu_activations="float32")
    ids = list(range(3, 23))
    caches = model.make_cache(), model.make_cache()
    for cache in caches:
        mx.eval(model(mx.array([ids[:4]]), cache))
    together = np.array(model(mx.array([ids[4:20]]), caches[0]))
    alone = np.concatenate([np.array(model(mx.array([[t]]), caches[1])) for t in ids[4:20]], axis=1)
    np.testing.assert_array_equal(together, alone)
    assert not np.array_equal(np.array(model(mx.array([ids[:4]]))), np.array(floats(mx.array([ids[:4]]))))
    plain = mlx_hybrid.generate(model, tokenizer, "def f(", max_tokens=24)
    assert mlx_hybrid.generate(model, tokenizer, "def f(", max_tokens=24, draft="mtp", num_draft_tokens=3) == plain


@pytest.mark.skipif(len(cpu_quantized.extension().instruction_sets()) < 2, reason="this CPU runs one build only")
@pytest.mark.parametrize("type_name", list(INT8_TYPES))
def test_every_instruction_set_gives_the_same_bits(type_name):
    """Each type's 8-bit product from the AVX2 build and the AVX-512 one (the groups-of-16 K-quants' two
    runs a register) at 1, 3, 16 and 27 rows: the same bits, so a file computes alike on either CPU."""
    bits, group_size, block = INT8_TYPES[type_name]
    if type_name in GRID_TYPES:
        q = llama_reference.random_grid_weights((40, 512), GRID_TYPES[type_name])
    else:
        q = llama_reference.random_block_weights((40, 512), bits, group_size, block)
    codes = no_codes(q.scales) if q.biases is None else q.biases
    x = mx.random.normal((27, 512), key=mx.random.key(3))
    assert_every_instruction_set_agrees(
        lambda: [
            cpu_quantized.int8_matmul(
                x[:rows], q.weight, q.scales, codes, list(INT8_TYPES).index(type_name), cpu_quantized.int8_grid(q.block)
            )
            for rows in (1, 3, 16, 27)
        ]
    )


def test_a_q4_k_m_files_layer_matrices_are_held_interleaved_for_the_8_bit_products():
    """The bundled model in Q4_K_M, loaded in float32 with 8-bit activations: its Q4_K matrices of rows in
    eights held interleaved (the others as stored), which only the 8-bit products read, so a product that
    would read them otherwise (x in bfloat16) is refused by name; in bfloat16 none is interleaved."""
    path = FIXTURES / "llama-cpp" / "bundled-Q4_K_M.gguf"
    model, _ = mlx_hybrid.load(path)
    quantized = [m for _, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    held = {id(m): ops.activations_of(m["weight"]) for m in quantized}
    q4_k = [m for m in quantized if m.block == INT8_TYPES["Q4_K"][2]]
    assert q4_k and all((held[id(m)] == ops.products.INT8_INTERLEAVED) == (m.weight.shape[0] % 8 == 0) for m in q4_k)
    assert {held[id(m)] for m in quantized if m.block != INT8_TYPES["Q4_K"][2]} == {"int8"}
    matrix = next(m for m in q4_k if m.weight.shape[0] % 8 == 0)
    with pytest.raises(ValueError, match="a matrix held for the CPU's 8-bit products cannot be computed"):
        matrix(mx.zeros((1, matrix.weight.shape[1] * 8), mx.bfloat16))
    halves, _ = mlx_hybrid.load(path, dtype="bfloat16")
    assert ops.products.INT8_INTERLEAVED not in {
        ops.activations_of(m["weight"]) for _, m in halves.named_modules() if isinstance(m, QuantizedLinear)
    }


def test_a_q4_k_m_file_computes_many_rows_as_it_computes_one():
    """The bundled model in llama-quantize's Q4_K_M (Q4_K and Q6_K matrices, whose products take 8-bit
    activations at any row count): 20 sequences' tokens in one pass give each its own pass's logits to
    the bit (past 16 rows, where other types' products take float32 activations), and not the float32
    path's."""
    path = FIXTURES / "llama-cpp" / "bundled-Q4_K_M.gguf"
    model, _ = mlx_hybrid.load(path)
    floats, _ = mlx_hybrid.load(path, cpu_activations="float32")
    rows = mx.array([[t] for t in range(3, 23)])
    together = np.array(model(rows))
    np.testing.assert_array_equal(together, np.concatenate([np.array(model(row[None])) for row in rows]))
    assert not np.array_equal(together, np.array(floats(rows)))


@pytest.mark.parametrize("type_name", list(INT8_TYPES))
def test_products_take_8_bit_activations_up_to_their_types_row_limit(type_name):
    """A product of up to its type's row limit (`int8_row_limit`; 160 rows for the types without one)
    gives each row the bits it gets alone, a decode step's (so a batch's verify pass of 8 rows of 4
    does too); one row more takes the float32 path, the float32-activation product's bits."""
    bits, group_size, block = INT8_TYPES[type_name]
    if type_name in GRID_TYPES:
        q = llama_reference.random_grid_weights((16, 256), GRID_TYPES[type_name])
    else:
        q = llama_reference.random_block_weights((16, 256), bits, group_size, block)
    limit = ops.int8_row_limit(bits, group_size, block)
    rows = 160 if limit is None else limit + 1
    x = mx.random.normal((rows, 256), key=mx.random.key(5))

    ops.compute_as_llama_cpp(q.weight, limit)

    def int8(x):
        return np.array(
            ops.quantized_matmul(x, q.weight, q.scales, q.biases, group_size=group_size, bits=bits, block=block)
        )

    alone = np.concatenate([int8(x[r : r + 1]) for r in range(rows)])
    if limit is None:
        np.testing.assert_array_equal(int8(x), alone)
        return
    assert limit >= 32
    np.testing.assert_array_equal(int8(x[:limit]), alone[:limit])
    floats = cpu_quantized.quantized_matmul(x, q.weight, q.scales, q.biases, q.group_size, q.bits, q.block)
    np.testing.assert_array_equal(int8(x), np.array(floats))
    assert not np.array_equal(int8(x), alone)


@pytest.mark.parametrize("family", ["qwen35", "qwen35moe"])
def test_a_batch_speculating_on_a_q8_0_file_equals_its_single_runs(family):
    """8 rows drafting 3 tokens each with the MTP head (passes of 32 tokens, past 16) on a Q8_0 file (the
    MoE file's shared experts F16): each row's greedy tokens those of its run alone (the prompts, of at
    most 16 tokens, fed 16 at a time: each read in products of no more rows than alone). Then a prompt
    of 48 tokens joins while 6 rows decode: 24 + 48 would pass the file's limit, 64 rows (Q8_0's and
    F16's), and take the float32 path for every row of the pass, so its tokens wait for a pass of their
    own; every row still equals its run alone."""
    from mlx_hybrid.drafting import make_drafter
    from mlx_hybrid.engine import Engine, PrefixStore

    model, tokenizer = mlx_hybrid.load(FIXTURES / family / "model-Q8_0.gguf")
    assert ops.rows_alike_pass_tokens(model) == 64
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, n).tolist() for n in (3, 9, 14, 5, 2, 11, 7, 16)]
    late = rng.integers(3, 500, 48).tolist()

    def alone(prompt):
        return [r.token for r in mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=16, draft=None)]

    def engine(prefill_chunk):
        return Engine(
            model,
            tokenizer,
            make_drafter(model, tokenizer, "mtp"),
            num_draft_tokens=3,
            adaptive=False,
            prefill_chunk=prefill_chunk,
            prefix_store=PrefixStore(0),
        )

    batch = engine(16)
    sequences = [batch.submit(p, max_tokens=16) for p in prompts]
    batch.run()
    assert [s.tokens for s in sequences] == [alone(p) for p in prompts]
    batch = engine(48)
    sequences = [batch.submit(p, max_tokens=16) for p in prompts[:6]]
    for _ in range(6):
        batch.step()
    assert not any(row.prefilling for row in batch.rows)
    sequences.append(batch.submit(late, max_tokens=16))
    batch.run()
    assert [s.tokens for s in sequences] == [alone(p) for p in prompts[:6] + [late]]


def test_a_gguf_file_computes_llama_cpps_arithmetic_by_default():
    """load() without cpu_activations: a GGUF file's quantized products as llama.cpp computes them (here, where
    the CPU kernels compute them); float32 activations where asked, and for a checkpoint of another runtime."""
    path = FIXTURES / "qwen35" / "model-Q4_K_M.gguf"
    ids = mx.array([list(range(3, 11))])
    default, _ = mlx_hybrid.load(path)
    int8, _ = mlx_hybrid.load(path, cpu_activations="int8")
    floats, _ = mlx_hybrid.load(path, cpu_activations="float32")
    np.testing.assert_array_equal(np.array(default(ids)), np.array(int8(ids)))
    assert not np.array_equal(np.array(default(ids)), np.array(floats(ids)))
    hf, _ = mlx_hybrid.load(FIXTURES / "qwen35" / "mlx-lm-4bit")
    assert {ops.activations_of(array) for _, array in tree_flatten(hf.parameters())} == {"float32"}


def test_int8_activations_are_refused_where_they_are_not_computed():
    with pytest.raises(ModelLoadError, match="computes with float activations"):
        mlx_hybrid.load(FIXTURES / "qwen35" / "hf", cpu_activations="int8")
    with pytest.raises(ModelLoadError, match="cpu_activations must be one of float32, int8, got 'int4'"):
        mlx_hybrid.load(FIXTURES / "qwen35" / "model-Q8_0.gguf", cpu_activations="int4")


def greedy_token_by_token(model, prompt, steps):
    """The prompt fed a token a call, then `steps` greedy tokens: (tokens, each step's logits)."""
    cache = model.make_cache()
    for token in prompt[:-1]:
        mx.eval(model(mx.array([[token]]), cache))
    token, tokens, logits = prompt[-1], [], []
    for _ in range(steps):
        step = np.array(model(mx.array([[token]]), cache)[0, -1])
        token = int(step.argmax())
        tokens.append(token)
        logits.append(step)
    return tokens, logits


# the types gguf's Python package writes as llama-quantize does (byte for byte)
WRITTEN_HERE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def bundled_file(type_name: str, record: dict, directory: Path) -> Path:
    """The bundled model as llama-quantize wrote it in `type_name`: the types gguf writes written here
    (save_gguf with gguf's blocks), others as kept (gguf's Python package does not write K-quants);
    every tensor checked against the hashes of llama-quantize's file."""
    if type_name not in WRITTEN_HERE:
        path = FIXTURES / "llama-cpp" / f"bundled-{type_name}.gguf"
    else:
        bundled, tokenizer = mlx_hybrid.load(mlx_hybrid.bundled_model_path())

        def encode(name, array):
            held = gguf.GGMLQuantizationType[record["tensors"][name][0]]
            if held == gguf.GGMLQuantizationType.F32:
                return None
            return gguf.quants.quantize(np.asarray(array, np.float32), held), held

        path = directory / f"bundled-{type_name}.gguf"
        save_gguf(bundled, tokenizer, path, encode_matrix=encode)
    held = {
        t.name: [t.tensor_type.name, hashlib.sha256(np.asarray(t.data).tobytes()).hexdigest()]
        for t in gguf.GGUFReader(str(path)).tensors
    }
    assert held == record["tensors"]
    return path


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K_M", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ2_XXS"])
def test_the_bundled_model_computes_what_llama_cpp_computes(type_name, tmp_path):
    """The bundled model in llama-quantize's types (Q4_K_M: Q4_K, Q6_K; Q4_K matrices of 4 rows, which
    llama.cpp multiplies unpacked, and value-head columns reordered by their inputs; the 32-value types
    with their embedding in Q8_0; IQ2_XXS with Q2_K, Q5_K and Q8_0 beside it) on 8-bit activations:
    llama.cpp's greedy tokens for 32 steps and its top-5 logits each step within 0.02 (fixtures/llama-cpp:
    its CPU build for AVX2, whose arithmetic this path computes, the prompt a token a decode call as
    here, its KV cache in float32 as ours). Measured 0.0095 (Q8_0), 0.015 (Q4_K_M), 0.013 (Q5_1), 0.011
    (IQ2_XXS), below 1e-5 (Q4_0, Q4_1, Q5_0): at most steps within 1e-4, at a few an activation's code
    rounds the other way after a float32 difference upstream (the norms, attention and recurrence,
    computed in another order). The float32-activation path is 0.03-0.07 away."""
    record = json.loads((FIXTURES / "llama-cpp" / f"bundled-{type_name}.json").read_text())
    model, _ = mlx_hybrid.load(bundled_file(type_name, record, tmp_path), cpu_activations="int8")
    tokens, logits = greedy_token_by_token(model, record["prompt"], len(record["greedy"]))
    assert tokens == record["greedy"]
    for step, top in zip(logits, record["top"]):
        ids, values = zip(*top)
        np.testing.assert_allclose(step[list(ids)], values, atol=0.02, rtol=0)


def test_the_bundled_model_as_it_ships_computes_what_llama_cpp_computes():
    """The bundled model (its GGUF file's matrices F16) by default as llama.cpp computes it, each
    product's activations rounded to float16 (`half_matmul`): llama.cpp's greedy tokens for 32 steps
    (bundled-F16.json, its AVX2 build, a token a decode call), its top-5 logits each step within 2e-3
    and within 3e-4 at the median step (measured 1.1e-3 and 1.2e-4: the norms, attention and
    recurrence in float32 in another order; the float32-activation path is 2.7e-3 and 5.5e-4 away)."""
    record = json.loads((FIXTURES / "llama-cpp" / "bundled-F16.json").read_text())
    model, _ = mlx_hybrid.load(mlx_hybrid.bundled_model_path())
    matrices = [m["weight"] for _, m in model.named_modules() if isinstance(m, (Linear, Embedding))]
    assert matrices and {ops.activations_of(matrix) for matrix in matrices} == {"int8"}
    tokens, logits = greedy_token_by_token(model, record["prompt"], len(record["greedy"]))
    assert tokens == record["greedy"]
    differences = [
        np.abs(step[[i for i, _ in top]] - [v for _, v in top]).max() for step, top in zip(logits, record["top"])
    ]
    assert max(differences) <= 2e-3 and np.median(differences) <= 3e-4, (max(differences), np.median(differences))


VEC_DOTS = np.load(FIXTURES / "llama-cpp" / "vec-dot.npz")


@pytest.mark.parametrize("type_name", sorted({key.rsplit("_", 1)[0] for key in VEC_DOTS.files}))
def test_products_are_llama_cpps_to_the_bit(type_name):
    """Random blocks of each type against llama.cpp's own products of them (vec-dot.npz: its CPU build for
    AVX2, ggml-cpu's quantization of x and the type's vec_dot, as its mul_mat calls them): the same bits."""
    blocks, x, want = (VEC_DOTS[f"{type_name}_{part}"] for part in ("blocks", "x", "out"))
    if type_name in ("F16", "BF16"):  # (1000 values a row: 31 steps of 32, and 8 added in double)
        w = mx.array(blocks).view(mx.bfloat16 if type_name == "BF16" else mx.float16)
        np.testing.assert_array_equal(np.array(cpu_quantized.half_matmul(mx.array(x), w)), want)
        return
    tensor = from_gguf_blocks(blocks, type_name)
    held_type = next(i for i, name in enumerate(INT8_TYPES) if name == type_name)
    got = product(x, (tensor.weight, tensor.scales, tensor.biases), held_type, cpu_quantized.int8_grid(tensor.block))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("K", [1024, 1000, 7], ids=["0.8B hidden", "8 past the steps", "shorter than a step"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["F16", "BF16"])
def test_16_bit_products_are_llama_cpps_arithmetic_and_row_invariant(dtype, K):
    """F16 and BF16 matrices with llama.cpp's 16-bit activations (`half_matmul`) against the arithmetic
    written in numpy (`half_reference`: x rounded as ggml rounds it, each exact product into its lane by
    a float32 sum, llama.cpp's trees): exactly, every row the same alone or with others (2 to 8, 16 and 27
    rows; 25 weight rows, taken eight at a time, the last alone); the AVX2 and AVX-512 bodies alike;
    values halfway between two of the type's round to the even one."""
    rng = np.random.default_rng(K)
    w = mx.array((rng.standard_normal((25, K)) / 8).astype(np.float32)).astype(dtype)
    x = rng.standard_normal((16, K)).astype(np.float32)

    def half(rows):
        return np.array(cpu_quantized.half_matmul(mx.array(rows), w))

    alone = np.concatenate([half(x[r : r + 1]) for r in range(16)])
    np.testing.assert_array_equal(
        alone, llama_reference.half_reference(x, np.array(w.astype(mx.float32)), dtype == mx.bfloat16)
    )
    for rows in (2, 3, 4, 5, 6, 7, 8, 16):
        np.testing.assert_array_equal(half(x[:rows]), alone[:rows], err_msg=f"{rows} rows")
    np.testing.assert_array_equal(half(np.concatenate([x, x[:11]])), np.concatenate([alone, alone[:11]]))
    assert_every_instruction_set_agrees(lambda: [half(x[:rows]) for rows in (1, 3, 16)])
    # the kernel's rounding of x, through an identity matrix: values halfway between two of the type's,
    # which go to the even one (1 and 1 + 4 ulp), and the largest float32 short of a tie, which goes down
    ulp = 2.0**-7 if dtype == mx.bfloat16 else 2.0**-10
    halfway = np.zeros((1, 32), np.float32)
    halfway[0, :3] = [1 + ulp / 2, 1 + 3 * ulp / 2, np.nextafter(np.float32(1 + ulp / 2), 0)]
    got = np.array(cpu_quantized.half_matmul(mx.array(halfway), mx.eye(32, dtype=dtype)))
    np.testing.assert_array_equal(got[0, :3], [1, 1 + 2 * ulp, 1])


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["F16", "BF16"])
def test_16_bit_expert_products_gather_each_tokens_matrices(dtype):
    """20 tokens, each against 3 of 4 matrices (rows that chose the same expert taken together), and a
    view: each output the product of its row alone with its matrix."""
    rng = np.random.default_rng(6)
    w = mx.array((rng.standard_normal((4, 11, 96)) / 8).astype(np.float32)).astype(dtype)
    indices = mx.array(rng.integers(0, 4, (20, 3)).astype(np.uint32))
    x = mx.array(rng.standard_normal((20, 1, 96)).astype(np.float32))
    got = np.array(cpu_quantized.half_gather_matmul(x, w, indices))
    for t in range(20):
        for j in range(3):
            e = int(indices[t, j])
            np.testing.assert_array_equal(got[t, j], np.array(cpu_quantized.half_matmul(x[t], w[e]))[0])
    view = mx.array(rng.standard_normal((3, 192)).astype(np.float32))[:, ::2]
    np.testing.assert_array_equal(
        np.array(cpu_quantized.half_matmul(view, w[0])), np.array(cpu_quantized.half_matmul(mx.contiguous(view), w[0]))
    )


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K_M", "Q4_0", "Q4_1", "IQ4_NL"])
def test_a_random_fixture_computes_what_llama_cpp_computes(type_name):
    """The random Qwen3.5 fixture in Q8_0, Q4_K_M (Q4_K, Q6_K, and Q5_0 / Q5_1 where its rows are too
    short for K-quants), Q4_0, Q4_1 and IQ4_NL (llama.cpp's converter and llama-quantize) on 8-bit
    activations: llama.cpp's 24 greedy tokens, its top-2 logits within 1e-4 (measured 5e-8: float32
    roundings of logits near 10 in the norms and attention, in another order, would be about 1e-5).
    Random weights make every rounding difference grow: the float32-activation path leaves
    llama.cpp's tokens within the first 4 steps (Q8_0 at the third, at a top-2 gap of 0.11)."""
    record = json.loads((FIXTURES / "llama-cpp" / f"random-qwen35-{type_name}.json").read_text())
    path = FIXTURES / "qwen35" / f"model-{type_name}.gguf"
    model, _ = mlx_hybrid.load(
        path if path.exists() else FIXTURES / "llama-cpp" / f"random-qwen35-{type_name}.gguf", cpu_activations="int8"
    )
    tokens, logits = greedy_token_by_token(model, record["prompt"], len(record["greedy"]))
    assert tokens == record["greedy"]
    for step, top in zip(logits, record["top"]):
        ids, values = zip(*top)
        np.testing.assert_allclose(step[list(ids)], values, atol=1e-4, rtol=0)


def _c_enum(path: Path) -> dict[str, int]:
    """The names and numbers of a C or C++ source's `enum Type { ... }`."""
    body = re.search(r"enum Type \{([^}]*)\}", path.read_text()).group(1)
    return {name: int(number) for name, number in re.findall(r"(\w+) = (\d+)", body)}


def test_the_kernels_type_numbers_are_the_packages():
    """csrc/int8_products.cpp numbers its types as INT8_TYPES' order does (then F16 and BF16, its 16-bit
    ones), and counts them; csrc/gguf_blocks.c's are ggml's own (the file's), for types BLOCK_TYPES knows."""
    from mlx_hybrid.loaders.gguf_blocks import BLOCK_TYPES

    csrc = Path(mlx_hybrid.__file__).parent / "csrc"
    want = {name: int8_number(name) for name in INT8_TYPES} | {"F16": len(INT8_TYPES), "BF16": len(INT8_TYPES) + 1}
    assert _c_enum(csrc / "int8_products.cpp") == want
    assert f"constexpr int TYPES = {len(INT8_TYPES)};" in (csrc / "int8_products.cpp").read_text()
    unpacked = _c_enum(csrc / "gguf_blocks.c")
    assert set(unpacked) <= set(BLOCK_TYPES)
    assert unpacked == {name: gguf.GGMLQuantizationType[name].value for name in unpacked}
