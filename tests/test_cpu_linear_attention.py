"""A linear-attention layer's steps in one CPU primitive (csrc/linear_attention.cpp) against the
layer written the slow, obvious way in float64, against the single kernels it shares its code
with, and against itself token by token: a verify pass must reproduce the decode steps' bits."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from conftest import cpu_kernel_tests

from mlx_hybrid import ops
from mlx_hybrid.ops import cpu_extension, cpu_kernels, reference
from test_ops import layer_inputs, numpy_linear_attention, run_layer

pytestmark = cpu_kernel_tests()

# (Hk, ratio, Dk, Dv): value channels past one conv range of 256 (3 x 128), partial vectors in the
# norms (Dk 20) and the rule's columns (Dv 44, 5); g per head or per key channel; both gates
SHAPES = list(
    itertools.product(
        [(1, 1), (2, 5), (1, 70)],
        [(1, 1, 16, 16), (2, 3, 128, 128), (2, 2, 20, 44), (1, 2, 8, 5)],
        [False, True],
        ["silu", "sigmoid"],
    )
)

# The layer in float32 against float64: its output is an RMS-normalised row (values ~1) times
# the activated gate (up to ~3 for inputs of scale 1), so the conv's and the rule's float32
# rounding comes through amplified: at most 5.0e-6 over SHAPES, the pure-MLX composition too (our
# kernels use no BLAS and the same AVX2 code on every x86-64 CPU). A wrong head, gate or norm
# moves values by 1e-2 or more.
LAYER_TOL = 2e-5


def run(inputs, heads, activation, snapshots, layer=cpu_kernels.linear_attention):
    return run_layer(inputs, heads, activation, snapshots, layer)


@pytest.mark.parametrize("BT,shape,vector_gate,activation", SHAPES)
def test_kernel_equals_the_float64_layer(BT, shape, vector_gate, activation):
    (B, T), (Hk, ratio, Dk, Dv) = BT, shape
    heads = reference.HeadShape(Hk, Hk * ratio, Dk, Dv)
    inputs = layer_inputs(B, T, heads, 4, vector_gate, seed=B + T + Dk + Dv)
    want_out, want_tail, want_state, want_tails, want_states = numpy_linear_attention(*inputs, heads, activation)
    for snapshots in (False, True):
        got = run(inputs, heads, activation, snapshots)
        np.testing.assert_allclose(np.array(got.out), want_out, atol=LAYER_TOL, rtol=0)
        np.testing.assert_array_equal(np.array(got.tail), want_tail)  # copies of inputs: exact
        np.testing.assert_allclose(np.array(got.state), want_state, atol=LAYER_TOL, rtol=0)
        if snapshots:
            np.testing.assert_array_equal(np.array(mx.stack(got.tail_snapshots, axis=1)), want_tails)
            np.testing.assert_allclose(np.array(mx.stack(got.state_snapshots, axis=1)), want_states, atol=LAYER_TOL)
        else:
            assert got.tail_snapshots is None and got.state_snapshots is None


@pytest.mark.parametrize("vector_gate,activation", [(False, "silu"), (True, "sigmoid")])
def test_its_steps_agree_with_the_single_kernels(vector_gate, activation):
    """Against the same steps as separate ops (on the CPU our single kernels, the gates and the
    output's activation MLX's): the conv's tail equal to the bit; the state and the output to the
    last bits of the gates' and the activation's e^x (MLX's against ours)."""
    heads = reference.HeadShape(2, 4, 128, 128)
    inputs = layer_inputs(2, 5, heads, 4, vector_gate, seed=11)
    fused = run(inputs, heads, activation, True)

    def single_ops(*args, **kwargs):
        return reference.linear_attention(
            *args, **kwargs, conv=ops.conv1d_update, rule=ops.gated_delta_update, l2=ops.l2_normalize, rms=ops.rms_norm
        )

    apart = run(inputs, heads, activation, True, layer=single_ops)
    assert mx.array_equal(fused.tail, apart.tail)
    assert all(mx.array_equal(a, b) for a, b in zip(fused.tail_snapshots, apart.tail_snapshots))
    # e^x and log1p within a few float32 ulps either way, carried through five tokens' decays into
    # states of ~0.1 and outputs of ~1: measured 9.5e-7 apart
    for got, want in [(fused.out, apart.out), (fused.state, apart.state)]:
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=5e-6)


@pytest.mark.parametrize(
    "vector_gate,key_dim,tokens",
    [(False, 128, 6), (True, 128, 6), (False, 64, 18)],  # 18: past a chunk of 16
)
def test_a_token_gives_the_same_bits_whatever_comes_with_it(vector_gate, key_dim, tokens):
    """k tokens at once (a verify pass: its states after each token replayed from what it kept) against
    k calls of one token (decode steps), and each batch row alone: equal to the bit."""
    heads = reference.HeadShape(2, 4, key_dim, key_dim)
    x, weight, tail, a, b, A, dt_bias, gate, norm_weight, state = map(
        mx.array, layer_inputs(3, tokens, heads, 4, vector_gate, seed=7)
    )
    decay, norm = reference.Decay(A, dt_bias), reference.OutputNorm(norm_weight, 1e-6, "silu")
    whole = cpu_kernels.linear_attention(x, weight, a, b, gate, decay, norm, heads, tail, state, snapshots=True)
    for row in range(3):
        row_tail, row_state = tail[row : row + 1], state[row : row + 1]
        for t in range(tokens):
            xt, at, bt, zt = (u[row : row + 1, t : t + 1] for u in (x, a, b, gate))
            step = cpu_kernels.linear_attention(xt, weight, at, bt, zt, decay, norm, heads, row_tail, row_state)
            row_tail, row_state = step.tail, step.state
            assert mx.array_equal(step.out[:, 0], whole.out[row : row + 1, t])
            assert mx.array_equal(row_tail, whole.tail_snapshots[t][row : row + 1])
            assert mx.array_equal(row_state, whole.state_snapshots[t][row : row + 1])
    assert mx.array_equal(whole.state, whole.state_snapshots[-1])
    assert mx.array_equal(whole.tail, whole.tail_snapshots[-1])


def test_the_op_runs_the_kernel_on_the_cpu():
    heads = reference.HeadShape(2, 4, 32, 32)
    inputs = layer_inputs(1, 4, heads, 4, True, seed=3)
    got = run(inputs, heads, "sigmoid", True, layer=ops.linear_attention)
    want = run(inputs, heads, "sigmoid", True)
    for a, b in zip(
        [got.out, got.tail, got.state, *got.state_snapshots], [want.out, want.tail, want.state, *want.state_snapshots]
    ):
        assert mx.array_equal(a, b)


def test_shapes_that_do_not_fit_are_refused():
    heads = reference.HeadShape(2, 4, 16, 16)
    good = list(map(mx.array, layer_inputs(1, 2, heads, 4, False)))
    module = cpu_extension.extension()
    for which, bad in [
        (0, good[0][..., :-1]),  # channels
        (2, good[2][:, :1]),  # a tail not K-1 long
        (3, good[3][..., None]),  # a per-channel decay input of the wrong width
        (5, good[5][:-1]),  # A
        (6, good[6][:-1]),  # dt_bias
        (7, good[7][..., :-1]),  # gate values
        (8, good[8][:-1]),  # norm weight
        (9, good[9][:, :3]),  # value heads not a multiple of key heads
    ]:
        inputs = good[:which] + [bad] + good[which + 1 :]
        with pytest.raises(ValueError, match="linear_attention"):
            module.linear_attention(*inputs, heads.key_heads, 0.25, 1e-6, 1e-6, False, False)
