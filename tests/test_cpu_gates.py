"""SwiGLU's and the attention output's gates, and GELU's tanh approximation, on the CPU
(csrc/gated_product.cpp): against the same functions in float64, each value the same bits
whatever comes with it, and what the ops run."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import cpu_kernel_tests

from mlx_hybrid import ops
from mlx_hybrid.ops import cpu_extension

pytestmark = cpu_kernel_tests()


@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 37), (2, 3, 3584), (5, 40000)])  # partial vectors; the pool's parts
def test_kernel_equals_the_float64_gate(shape, sigmoid):
    rng = np.random.default_rng(len(shape))
    x, gate = (8 * rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    got = np.array(cpu_extension.extension().gated_product(mx.array(x), mx.array(gate), sigmoid), dtype=np.float64)
    z = gate.astype(np.float64)
    want = x * (1 / (1 + np.exp(-z)) if sigmoid else z / (1 + np.exp(-z)))
    # e^x within 2 ulp, then a division and a product: a few float32 ulps (measured 1.8e-7)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("shape", [(1, 37), (3072, 3072)])  # a partial vector; a 1024x768 image's hidden layer
def test_gelu_kernel_equals_the_float64_gelu(shape):
    """x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)), the tanh form's value, against the tanh form in
    float64: z rounded to float32 (a few ulps) moves e^z by |z| times that, 1e-5 relative where
    z is -50; within 1e-7 of the largest |x| (measured 2.8e-8; MLX's own form 2.4e-8) and 1e-5
    relative where the value is not tiny (measured 1.1e-6; MLX's form, through 1 + tanh(z),
    5.1e-5)."""
    x = (4 * np.random.default_rng(3).standard_normal(shape)).astype(np.float32)
    got = np.array(cpu_extension.extension().gelu_tanh(mx.array(x)), dtype=np.float64)
    z = x.astype(np.float64)
    want = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z * z * z)))  # (z**3: numpy's slow pow)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7 * np.abs(x).max())
    large = np.abs(want) > 1e-3
    np.testing.assert_allclose(got[large], want[large], rtol=1e-5)
    assert mx.array_equal(ops.gelu_approx(mx.array(x)), cpu_extension.extension().gelu_tanh(mx.array(x)))


def test_a_row_gives_the_same_bits_whatever_comes_with_it():
    rng = np.random.default_rng(0)
    x, gate = (mx.array(rng.standard_normal((9, 3584)).astype(np.float32)) for _ in range(2))
    module = cpu_extension.extension()
    whole = module.gated_product(x, gate, False)
    for row in (0, 4, 8):
        assert mx.array_equal(module.gated_product(x[row : row + 1], gate[row : row + 1], False), whole[row : row + 1])


def test_the_ops_run_the_kernel_on_float32_and_mlx_otherwise():
    rng = np.random.default_rng(1)
    x, gate = (mx.array(rng.standard_normal((2, 64)).astype(np.float32)) for _ in range(2))
    module = cpu_extension.extension()
    assert mx.array_equal(ops.swiglu(gate, x), module.gated_product(x, gate, False))
    assert mx.array_equal(ops.sigmoid_gated(x, gate), module.gated_product(x, gate, True))
    half = ops.swiglu(gate.astype(mx.bfloat16), x.astype(mx.bfloat16))
    assert half.dtype == mx.bfloat16
    assert mx.array_equal(half, ops.activations.swiglu(gate.astype(mx.bfloat16), x.astype(mx.bfloat16)))


def test_shapes_that_do_not_fit_are_refused():
    module = cpu_extension.extension()
    for x, gate in [(mx.zeros((2, 8)), mx.zeros((2, 9))), (mx.zeros((2, 8), mx.float16), mx.zeros((2, 8), mx.float16))]:
        with pytest.raises(ValueError, match="gated_product"):
            module.gated_product(x, gate, True)
