"""The causal conv1d + SiLU CPU kernel (csrc/conv1d_silu.cpp) against the conv written the slow,
obvious way in float64, and against itself token by token: a verify pass must reproduce the
decode steps' bits."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from conftest import cpu_kernel_tests

from mlx_hybrid import ops
from mlx_hybrid.ops import cpu_extension, cpu_kernels
from test_ops import OP_TOL, numpy_conv_silu

pytestmark = cpu_kernel_tests()

# channels: one vector, one and a partial one, ranges of 256 (the kernel's parts) and a partial
# range, Qwen3.5-0.8B's 6144
SHAPES = list(itertools.product([(1, 1), (2, 5), (1, 70)], [8, 13, 300, 6144], [2, 4, 8]))


def conv_inputs(B, T, C, K, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    x = (scale * rng.standard_normal((B, T, C))).astype(np.float32)
    weight = rng.standard_normal((C, K)).astype(np.float32)
    tail = (scale * rng.standard_normal((B, K - 1, C))).astype(np.float32)
    return x, weight, tail


@pytest.mark.parametrize("BT,C,K", SHAPES)
def test_kernel_equals_the_float64_conv(BT, C, K):
    (B, T) = BT
    x, weight, tail = conv_inputs(B, T, C, K, seed=B + T + C + K)
    want_y, want_tail, want_tails = numpy_conv_silu(x, weight, tail)
    for snapshots in (False, True):
        y, new_tail, tails = cpu_kernels.causal_conv1d_silu(*map(mx.array, (x, weight, tail)), snapshots=snapshots)
        # float32 sums of K products of scale ~1 against float64: their rounding (as the pure-MLX conv)
        np.testing.assert_allclose(np.array(y), want_y, atol=OP_TOL, rtol=0)
        np.testing.assert_array_equal(np.array(new_tail), want_tail)  # copies of inputs: exact
        if snapshots:
            np.testing.assert_array_equal(np.array(mx.stack(tails, axis=1)), want_tails)
        else:
            assert tails is None


def test_silu_is_accurate_over_the_float_range():
    """The taps [0, ..., 0, 1] give y = silu(x): the kernel's e^-x against float64 over [-120, 120]."""
    x = np.linspace(-120, 120, 24001, dtype=np.float32).reshape(1, -1, 1)
    weight = np.array([[0, 0, 0, 1]], np.float32)
    y, _, _ = cpu_kernels.causal_conv1d_silu(mx.array(x), mx.array(weight), mx.zeros((1, 3, 1)))
    x64 = x.astype(np.float64).ravel()
    want = x64 / (1 + np.exp(-x64))
    got = np.array(y, np.float64).ravel()
    # within a few float32 ulp (measured at most 1.4e-7 relative) where e^-x is a normal float; past
    # that (x < -87) silu is below 1e-35 and e^-x is clamped: the result stays as small
    normal = x64 >= -87
    np.testing.assert_allclose(got[normal], want[normal], rtol=5e-7, atol=0)
    assert np.abs(got[~normal]).max() < 1e-35


def test_a_token_gives_the_same_bits_whatever_comes_with_it():
    """k tokens at once (a verify pass) against k calls of one token (decode steps), and each
    batch row alone: equal to the bit."""
    x, weight, tail = map(mx.array, conv_inputs(3, 6, 300, 4, seed=7))
    y, final, tails = cpu_kernels.causal_conv1d_silu(x, weight, tail, snapshots=True)
    for row in range(3):
        state = tail[row : row + 1]
        for t in range(6):
            step_y, state, _ = cpu_kernels.causal_conv1d_silu(x[row : row + 1, t : t + 1], weight, state)
            assert mx.array_equal(step_y[:, 0], y[row : row + 1, t])
            assert mx.array_equal(state, tails[t][row : row + 1])
    assert mx.array_equal(final, tails[-1])


def test_the_op_runs_the_kernel_on_the_cpu():
    x, weight, tail = map(mx.array, conv_inputs(1, 4, 24, 4, seed=3))
    got = ops.conv1d_update(x, weight, tail, snapshots=True)
    want = cpu_kernels.causal_conv1d_silu(x, weight, tail, snapshots=True)
    assert mx.array_equal(got.out, want[0]) and mx.array_equal(got.tail, want[1])
    assert all(mx.array_equal(a, b) for a, b in zip(got.snapshots, want[2]))
    # no carried tail: zeros, as the reference
    np.testing.assert_allclose(
        np.array(ops.conv1d_update(x, weight).out),
        numpy_conv_silu(*(np.array(a) for a in (x, weight, 0 * tail)))[0],
        atol=OP_TOL,
        rtol=0,
    )


def test_shapes_that_do_not_fit_are_refused():
    x, weight, tail = map(mx.array, conv_inputs(1, 2, 16, 4, seed=0))
    module = cpu_extension.extension()
    for bad in [
        (x, weight, tail[:, :2]),  # tail rows
        (x, weight[:8], tail),  # weight channels
        (x, mx.zeros((16, 9)), mx.zeros((1, 8, 16))),  # wider than the kernel takes
        (x, weight[:, :1], mx.zeros((1, 0, 16))),  # width 1
        (x.astype(mx.float16), weight, tail),  # not float32
        (x[0], weight, tail),  # x not [B, T, C]
    ]:
        with pytest.raises(ValueError):
            module.conv1d_silu(*bad, False)
