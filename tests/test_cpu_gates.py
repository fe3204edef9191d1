"""SwiGLU's and the attention output's gates on the CPU (csrc/gated_product.cpp): against the
gates in float64, each value the same bits whatever comes with it, and what the ops run."""

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
