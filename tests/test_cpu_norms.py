"""The CPU norm kernels (csrc/rms_norm.cpp: RMSNorm, with the residual sum before it, and L2
normalization) against the norms written the obvious way in float64, and against themselves row by
row."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import cpu_kernel_tests

from mlx_hybrid import ops
from mlx_hybrid.ops import cpu_extension, reference
from test_ops import OP_TOL

pytestmark = cpu_kernel_tests()


def float64_norm(x, weight, eps, kind):
    x = np.asarray(x, np.float64)
    squares = (x * x).mean(-1, keepdims=True) if kind == "rms" else (x * x).sum(-1, keepdims=True)
    y = x / np.sqrt(squares + eps)
    return y * np.asarray(weight, np.float64) if kind == "rms" else y


def kernel(kind, x, weight, eps):
    module = cpu_extension.extension()
    return module.rms_norm(x, weight, eps) if kind == "rms" else module.l2_normalize(x, eps)


# widths: below one vector, one, blocks of 16 with and without a block of 8 and a tail, a
# model's 128 and 1024; rows: one, a few, enough to be split over the pool's threads
@pytest.mark.parametrize("kind", ["rms", "l2"])
@pytest.mark.parametrize("D", [1, 7, 8, 16, 28, 128, 1024, 1027])
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_kernel_equals_the_float64_norm(kind, D, rows):
    rng = np.random.default_rng(D + rows)
    x = (3 * rng.standard_normal((rows, 1, D))).astype(np.float32)
    weight = rng.standard_normal(D).astype(np.float32)
    for eps in (1e-6, 1e-2):
        got = kernel(kind, mx.array(x), mx.array(weight), eps)
        # outputs of scale ~1 (rms) or below 1 (l2): a float32 sum of D squares against float64
        np.testing.assert_allclose(np.array(got), float64_norm(x, weight, eps, kind), atol=OP_TOL, rtol=0)


@pytest.mark.parametrize("kind", ["rms", "l2"])
def test_a_row_gives_the_same_bits_whatever_rows_come_with_it(kind):
    """70 rows of 1024 (split over the pool) against each row alone (a decode step)."""
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((70, 1024)).astype(np.float32))
    weight = mx.array(rng.standard_normal(1024).astype(np.float32))
    together = kernel(kind, x, weight, 1e-6)
    for r in (0, 15, 16, 69):
        assert mx.array_equal(kernel(kind, x[r : r + 1], weight, 1e-6), together[r : r + 1])


def test_the_ops_run_the_kernels_on_the_cpu():
    rng = np.random.default_rng(2)
    x = mx.array(rng.standard_normal((2, 3, 4, 64)).astype(np.float32))
    weight = mx.array(rng.standard_normal(64).astype(np.float32))
    assert mx.array_equal(ops.rms_norm(x, weight, 1e-6), kernel("rms", x, weight, 1e-6))
    assert mx.array_equal(ops.l2_normalize(x), kernel("l2", x, weight, 1e-6))
    # a view read in its logical order (the kernel copies a view to rows itself)
    view = x.transpose(0, 2, 1, 3)
    assert mx.array_equal(ops.rms_norm(view, weight, 1e-6), kernel("rms", mx.contiguous(view), weight, 1e-6))
    # other dtypes: the compiled MLX form, in x's dtype
    half = x.astype(mx.bfloat16)
    got = ops.rms_norm(half, weight.astype(mx.bfloat16), 1e-6)
    assert got.dtype == mx.bfloat16
    assert mx.array_equal(got, reference.rms_norm(half, weight.astype(mx.bfloat16), 1e-6))


def test_inputs_that_do_not_fit_are_refused():
    x, weight = mx.zeros((2, 16)), mx.ones((16,))
    module = cpu_extension.extension()
    for bad_x, bad_weight in [
        (x.astype(mx.float16), weight),  # not float32
        (x, weight[:8]),  # weight length
        (x, weight.reshape(2, 8)),  # weight not [D]
        (x, weight.astype(mx.float16)),
        (mx.array(1.0), weight),  # no axis
    ]:
        with pytest.raises(ValueError):
            module.rms_norm(bad_x, bad_weight, 1e-6)
    with pytest.raises(ValueError):
        module.l2_normalize(mx.zeros((2, 0)), 1e-6)


@pytest.mark.parametrize("rows", [1, 70])
def test_the_residual_sum_and_its_norm_give_the_two_ops_bits(rows):
    """add_rms_norm against x + y and the RMSNorm kernel on it: equal to the bit (MLX's add is
    one float32 add a value, as the kernel's)."""
    rng = np.random.default_rng(rows)
    x, y = (mx.array(rng.standard_normal((rows, 1, 1024)).astype(np.float32)) for _ in range(2))
    weight = mx.array(rng.standard_normal(1024).astype(np.float32))
    total, normed = ops.add_rms_norm(x, y, weight, 1e-6)
    assert mx.array_equal(total, x + y)
    assert mx.array_equal(normed, kernel("rms", x + y, weight, 1e-6))
    with pytest.raises(ValueError, match="add_rms_norm"):
        cpu_extension.extension().add_rms_norm(x, y[:, :, :8], weight, 1e-6)
