"""The CPU quantized kernels (csrc/quantized_matmul.cpp) against MLX's own op and a float64
product of the dequantized weights."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, assert_close_to_floor, assert_every_instruction_set_agrees, cpu_kernel_tests, reference

import mlx_hybrid
from mlx_hybrid import ops
from mlx_hybrid.loaders.gguf_blocks import BLOCK_TYPES
from mlx_hybrid.quantized_tensor import GRID_TYPES
from mlx_hybrid.ops import cpu_quantized, llama_reference

pytestmark = cpu_kernel_tests()


def quantized(shape, bits, group_size, scales_dtype=mx.float32, seed=0):
    w, scales, biases = llama_reference.random_weights(shape, bits, group_size, seed)
    return w, scales.astype(scales_dtype), biases.astype(scales_dtype)


LAYOUTS = [(b, g) for b in cpu_quantized.BITS for g in cpu_quantized.GROUP_SIZES if cpu_quantized.supports(b, g)]


def float64_product(x, w, scales, biases, group_size, bits):
    dense = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)
    return np.array(x, np.float64) @ np.array(dense, np.float64).swapaxes(-1, -2)


@pytest.mark.parametrize("scales_dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits, group_size", LAYOUTS)
def test_products_of_every_layout_match_float64(bits, group_size, scales_dtype):
    # K = 416 is not a whole number of 64-value steps (the 4-bit kernel's): the padded tail is read too
    K = 416 if group_size <= 32 else 384
    w, scales, biases = quantized((37, K), bits, group_size, scales_dtype)
    for rows in (1, 2, 3, 5, 8, 9, 16, 33):  # the small-row kernel and the tiled one
        x = mx.random.normal((rows, K), key=mx.random.key(rows))
        got = cpu_quantized.quantized_matmul(x, w, scales, biases, group_size, bits)
        assert_close_to_floor(got, float64_product(x, w, scales, biases, group_size, bits))


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
def test_block_form_products_match_float64(type_name):
    """Scales as GGUF stores them (codes times float16 factors), each type's layout: products and
    gathered experts against float64 products of the dequantized weights, and a row the same
    bits alone as with up to 15 others."""
    bits, group_size, _, block = BLOCK_TYPES[type_name]
    q = llama_reference.random_block_weights((2, 37, 512), bits, group_size, block)
    dense = np.array(q.dequantize(), np.float64)
    one = (q.weight[1], q.scales[1], q.biases[1])
    x = mx.random.normal((33, 512), key=mx.random.key(4))
    alone = cpu_quantized.quantized_matmul(x[:1], *one, group_size, bits, block)
    for rows in (1, 3, 8, 16, 33):
        got = cpu_quantized.quantized_matmul(x[:rows], *one, group_size, bits, block)
        assert_close_to_floor(got, np.array(x[:rows], np.float64) @ dense[1].T)
        if rows <= 16:  # the row-invariant path (a verify pass); more rows take the BLAS's order
            np.testing.assert_array_equal(np.array(got[:1]), np.array(alone))
    indices = mx.array([[1, 0], [0, 1], [1, 1]], dtype=mx.uint32)
    got = ops.gather_quantized_matmul(
        x[:3, None, None], q.weight, q.scales, q.biases, indices, group_size=group_size, bits=bits, block=block
    )
    want = np.einsum("tk,tenk->ten", np.array(x[:3], np.float64), dense[np.array(indices)])
    assert_close_to_floor(got[:, :, 0], want)


@pytest.mark.parametrize("type_name", sorted(GRID_TYPES))
def test_grid_type_products_match_float64(type_name):
    """The grid types multiplied as the file stores them, the grid decoded in the kernel: against
    the float64 product of gguf-py's dequantization (an independent decoder of the same bytes),
    1 to 16 rows (the small-row kernel, 8 rows at a time) and 33 (dequantized tiles through the BLAS), 37 rows
    of W over three blocks, a view (W's rows stepped, x's columns offset), gathered experts; a row
    the same bits alone as with up to 15 others."""
    grid = GRID_TYPES[type_name]
    q = llama_reference.random_grid_weights((2, 37, 768), grid, seed=len(type_name))
    dense = np.array(q.dequantize(), np.float64)
    x = mx.random.normal((33, 769), key=mx.random.key(4))[:, 1:]  # an offset view
    alone = cpu_quantized.quantized_matmul(x[:1], q.weight[1], q.scales[1], q.biases[1], 256, 8, grid)
    for rows in (1, 2, 3, 5, 8, 9, 16, 33):
        got = cpu_quantized.quantized_matmul(x[:rows], q.weight[1], q.scales[1], q.biases[1], 256, 8, grid)
        assert_close_to_floor(got, np.array(x[:rows], np.float64) @ dense[1].T)
        if rows <= 16:  # the row-invariant path (a verify pass); more rows take the BLAS's order
            np.testing.assert_array_equal(np.array(got[:1]), np.array(alone))
    stepped = q.weight[0, ::2]  # every other row of W
    got = cpu_quantized.quantized_matmul(x[:3], stepped, q.scales[0, ::2], q.biases[0, ::2], 256, 8, grid)
    assert_close_to_floor(got, np.array(x[:3], np.float64) @ dense[0, ::2].T)
    indices = mx.array([[1, 0], [0, 1], [1, 1]], dtype=mx.uint32)
    got = ops.gather_quantized_matmul(
        x[:3, None, None], q.weight, q.scales, q.biases, indices, group_size=256, bits=8, block=grid
    )
    want = np.einsum("tk,tenk->ten", np.array(x[:3], np.float64), dense[np.array(indices)])
    assert_close_to_floor(got[:, :, 0], want)


@pytest.mark.parametrize("bits", cpu_quantized.BITS)
def test_each_row_takes_the_same_sums_whatever_rows_come_with_it(bits):
    """A verify pass of up to 16 rows gives each row the bits a decode step gives it alone."""
    w, scales, biases = quantized((300, 1024), bits, 32)
    x = mx.random.normal((16, 1024), key=mx.random.key(1))
    alone = [np.array(cpu_quantized.quantized_matmul(x[i : i + 1], w, scales, biases, 32, bits)) for i in range(16)]
    for rows in range(2, 17):
        together = np.array(cpu_quantized.quantized_matmul(x[:rows], w, scales, biases, 32, bits))
        np.testing.assert_array_equal(together, np.concatenate(alone[:rows]))


@pytest.mark.skipif(len(cpu_quantized.extension().instruction_sets()) < 2, reason="this CPU runs one build only")
@pytest.mark.parametrize("type_name", sorted({*BLOCK_TYPES, *GRID_TYPES}))
def test_every_instruction_set_gives_the_same_bits(type_name):
    """The kernels are compiled once per instruction set (AVX2; AVX-512 where the CPU has it) and
    promise the same sequence of operations: a model gives the same tokens on either CPU."""
    if type_name in GRID_TYPES:
        bits, group_size, block = 8, 256, GRID_TYPES[type_name]
        q = llama_reference.random_grid_weights((37, 512), block)
    else:
        bits, group_size, _, block = BLOCK_TYPES[type_name]
        q = llama_reference.random_block_weights((37, 512), bits, group_size, block)
    w, scales, biases = quantized((37, 512), bits, 32)
    x = mx.random.normal((9, 512), key=mx.random.key(5))
    assert_every_instruction_set_agrees(
        lambda: [
            cpu_quantized.quantized_matmul(x[:rows], *parts, layout)
            for rows in (1, 3, 8, 9)  # the small-row kernel and the tiled one
            for *parts, layout in (
                (q.weight, q.scales, q.biases, group_size, bits, block),
                (w, scales, biases, 32, bits, None),
            )
        ]
    )


@pytest.mark.parametrize("tokens", [1, 4, 20])
def test_expert_products_match_mlx_gather_qmm(tokens):
    w, scales, biases = quantized((6, 48, 256), 4, 64)
    indices = mx.array(np.random.default_rng(tokens).permuted(np.tile(np.arange(6), (tokens, 1)), axis=1)[:, :3])
    x = mx.random.normal((tokens, 1, 1, 256), key=mx.random.key(2))
    want = mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True, group_size=64, bits=4)
    up = ops.gather_quantized_matmul(x, w, scales, biases, indices, group_size=64, bits=4)
    assert_close_to_floor(up, want)
    # the down projection's input has one row per selected expert
    hidden = mx.random.normal((tokens, 3, 1, 256), key=mx.random.key(3))
    want = mx.gather_qmm(hidden, w, scales, biases, rhs_indices=indices, transpose=True, group_size=64, bits=4)
    assert_close_to_floor(ops.gather_quantized_matmul(hidden, w, scales, biases, indices, group_size=64, bits=4), want)


def test_ops_keep_the_input_dtype():
    w, scales, biases = quantized((16, 128), 8, 32)
    x = mx.random.normal((2, 128)).astype(mx.bfloat16)
    assert ops.quantized_matmul(x, w, scales, biases, group_size=32, bits=8).dtype == mx.bfloat16


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("family", ["qwen35", "qwen35moe"])
def test_greedy_speculation_equals_plain_decoding_on_quantized_files(family, quant):
    model, tok = mlx_hybrid.load(FIXTURES / family / f"model-{quant}.gguf")
    prompt = reference(family)["prompt_ids"][0].tolist()
    plain = [r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=24, draft=None)]
    for k in (1, 2, 3, 4):
        spec = mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=24, draft="mtp", num_draft_tokens=k)
        assert [r.token for r in spec] == plain, k


def test_without_a_compiler_one_warning_and_mlx_computes(tmp_path):
    script = (
        "import mlx_hybrid, mlx.core as mx\n"
        "from mlx_hybrid import ops\n"
        "mx.set_default_device(mx.cpu)\n"
        "w, s, b = mx.quantize(mx.ones((8, 64)), group_size=32, bits=4)\n"
        "for _ in range(3): y = ops.quantized_matmul(mx.ones((1, 64)), w, s, b, group_size=32, bits=4)\n"
        "q = mx.ones((1, 2, 1, 8)) / 8 ** 0.5\n"
        "rule = ops.gated_delta_update(q, q, mx.ones((1, 2, 1, 8)), -mx.ones((1, 2, 1)), mx.ones((1, 2, 1)))\n"
        "print(float(y.sum()), float(rule.out.sum()))\n"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), CXX=str(tmp_path / "no-such-compiler"))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    product, rule = map(float, run.stdout.split())
    assert product == pytest.approx(8 * 64)
    # unit q = k, v = 1, beta = 1 from a zero state: token 1 writes k (x) 1 and reads q . k = 1 a
    # column; token 2 decays that by e^-1 and delta = 1 - e^-1 restores it: 1 a column again
    assert rule == pytest.approx(8 * 2 * 1.0)
    assert run.stderr.count("our CPU kernels are not in use") == 1, run.stderr
    assert "did not compile" in run.stderr or "could not be built" in run.stderr


SIXTEEN_BITS = [mx.bfloat16, mx.float16]


def float16_weights(shape, dtype, seed=0):
    """Random 16-bit weights, with float16's subnormals (below 6.1e-5) in one row."""
    w = mx.random.normal(shape, key=mx.random.key(seed)) / 8
    w = mx.concatenate([w[..., :-1, :], w[..., -1:, :] * 1e-4], axis=-2)
    return w.astype(dtype)


@pytest.mark.parametrize("dtype", SIXTEEN_BITS)
def test_16bit_products_match_float64(dtype):
    """bfloat16 and float16 weights as stored, float32 products and sums: 1 to 16 rows (the
    small-row kernel, 8 rows at a time) and 33 (dequantized tiles through the BLAS), odd widths, a view of
    the weights, and a row the same bits alone as with up to 15 others."""
    for K in (37, 100, 416):
        w = float16_weights((2, 29, K), dtype)
        dense = np.array(w.astype(mx.float32), np.float64)
        x = mx.random.normal((33, K), key=mx.random.key(K))
        alone = cpu_quantized.matmul_16bit(x[:1], w[1])
        for rows in (1, 2, 3, 5, 8, 9, 16, 33):
            got = cpu_quantized.matmul_16bit(x[:rows], w[1])
            assert_close_to_floor(got, np.array(x[:rows], np.float64) @ dense[1].T)
            if rows <= 16:
                np.testing.assert_array_equal(np.array(got[:1]), np.array(alone))
        view = w[1, ::2, 1:]  # strided rows, columns from 1: copied row-contiguous for the kernel
        got = cpu_quantized.matmul_16bit(x[:3, 1:], view)
        assert_close_to_floor(got, np.array(x[:3, 1:], np.float64) @ dense[1, ::2, 1:].T)
        indices = mx.array([[1, 0], [0, 1], [1, 1]], dtype=mx.uint32)
        got = ops.gather_matmul(x[:3, None, None], w, indices)
        want = np.einsum("tk,tenk->ten", np.array(x[:3], np.float64), dense[np.array(indices)])
        assert_close_to_floor(got[:, :, 0], want)


@pytest.mark.skipif(len(cpu_quantized.extension().instruction_sets()) < 2, reason="this CPU runs one build only")
@pytest.mark.parametrize("dtype", SIXTEEN_BITS)
def test_every_instruction_set_gives_the_same_bits_for_16bit_weights(dtype):
    w = float16_weights((37, 416), dtype)
    x = mx.random.normal((9, 416), key=mx.random.key(5))
    assert_every_instruction_set_agrees(lambda: [cpu_quantized.matmul_16bit(x[:rows], w) for rows in (1, 3, 8, 9)])
