"""The gated delta rule's CPU kernel (csrc/gated_delta.cpp) against the rule written the slow,
obvious way in float64, and against itself token by token: a verify pass must reproduce the
decode steps' bits."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_every_instruction_set_agrees, cpu_kernel_tests

from mlx_hybrid import ops
from mlx_hybrid.ops import cpu_extension, cpu_kernels
from test_ops import OP_TOL, make_inputs, numpy_gated_delta

pytestmark = cpu_kernel_tests()

# value sizes: blocks of 32 columns, of 8, and a last partial vector (12, 44, 5)
SHAPES = [
    (B, T, Hk, Hk * ratio, Dk, Dv, vector_gate)
    for (B, T), (Dk, Dv), (Hk, ratio), vector_gate in itertools.product(
        [(1, 1), (2, 5), (1, 70)], [(16, 16), (32, 44), (128, 128), (8, 5), (64, 12)], [(1, 1), (2, 3)], [False, True]
    )
]


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv,vector_gate", SHAPES)
def test_kernel_equals_the_float64_rule(B, T, Hk, Hv, Dk, Dv, vector_gate):
    inputs = make_inputs(B, T, Hk, Hv, Dk, Dv, vector_gate, seed=B + T + Dk + Dv)
    want_out, want_state, want_states = numpy_gated_delta(*inputs)
    for snapshots in (False, True):
        out, state, states = cpu_kernels.gated_delta_recurrent(*map(mx.array, inputs), snapshots=snapshots)
        # float32 against float64: the rule's own rounding, as for the pure-MLX recurrence
        np.testing.assert_allclose(np.array(out), want_out, atol=OP_TOL, rtol=0)
        np.testing.assert_allclose(np.array(state), want_state, atol=OP_TOL, rtol=0)
        if snapshots:
            np.testing.assert_allclose(np.array(mx.stack(states, axis=1)), want_states, atol=OP_TOL, rtol=0)
        else:
            assert states is None


@pytest.mark.parametrize("vector_gate", [False, True])
def test_a_token_gives_the_same_bits_whatever_comes_with_it(vector_gate):
    """k tokens at once (a verify pass) against k calls of one token (decode steps), and each
    batch row alone: equal to the bit."""
    inputs = [mx.array(x) for x in make_inputs(3, 6, 2, 4, 128, 128, vector_gate, seed=7)]
    out, final, states = cpu_kernels.gated_delta_recurrent(*inputs, snapshots=True)
    for row in range(3):
        state = inputs[5][row : row + 1]
        for t in range(6):
            token = [x[row : row + 1, t : t + 1] for x in inputs[:5]]
            step_out, state, _ = cpu_kernels.gated_delta_recurrent(*token, state)
            assert mx.array_equal(step_out[:, 0], out[row : row + 1, t])
            assert mx.array_equal(state, states[t][row : row + 1])
    assert mx.array_equal(final, states[-1])


@pytest.mark.parametrize("Dk,Dv", [(64, 64), (128, 128)])
def test_the_first_tokens_alone_give_the_states_kept_a_token(Dk, Dv):
    """The rule over the first n of a call's tokens (a rollback's replay) against the state the whole
    call kept after token n, over 18 tokens (past a chunk of 16) and 3 rows: equal to the bit."""
    inputs = [mx.array(x) for x in make_inputs(3, 18, 2, 4, Dk, Dv, False, seed=5)]
    _, _, states = cpu_kernels.gated_delta_recurrent(*inputs, snapshots=True)
    module = cpu_extension.extension()
    for count in range(1, 19):
        out, state = module.gated_delta(*inputs, False, count)
        assert out.shape == (3, count, 4, Dv)
        assert mx.array_equal(state, states[count - 1])


@pytest.mark.parametrize("vector_gate", [False, True])
def test_every_instruction_set_gives_a_decode_step_the_same_bits(vector_gate):
    """A token alone (a decode step: whole rows at a time where the AVX-512 build runs, 32 columns at a
    time in the AVX2 one): the same bits from each build this CPU runs."""
    inputs = [mx.array(x) for x in make_inputs(1, 1, 2, 4, 128, 128, vector_gate, seed=11)]
    assert_every_instruction_set_agrees(lambda: cpu_kernels.gated_delta_recurrent(*inputs)[:2])


def test_the_op_runs_the_kernel_on_the_cpu():
    inputs = [mx.array(x) for x in make_inputs(1, 4, 2, 4, 32, 32, True, seed=3)]
    got = ops.gated_delta_update(*inputs, snapshots=True)
    want = cpu_kernels.gated_delta_recurrent(*inputs, snapshots=True)
    assert mx.array_equal(got.out, want[0]) and mx.array_equal(got.state, want[1])
    assert all(mx.array_equal(a, b) for a, b in zip(got.snapshots, want[2]))


def test_shapes_that_do_not_fit_are_refused():
    q, k, v, g, beta, state = (mx.array(x) for x in make_inputs(1, 2, 2, 4, 16, 16, False))
    module = cpu_extension.extension()
    for bad in [
        (q, k, v, g, beta, state[:, :3]),  # state heads
        (q, k[:, :1], v, g, beta, state),  # k tokens
        (q, k, v[:, :, :3], g, beta, state),  # value heads not a multiple of key heads
        (q, k, v, g[..., None], beta, state),  # a vector gate of the wrong width
    ]:
        with pytest.raises(ValueError, match="gated_delta"):
            module.gated_delta(*bad, False)
    for count in (0, 3):  # the first none, or more tokens than there are
        with pytest.raises(ValueError, match="gated_delta"):
            module.gated_delta(q, k, v, g, beta, state, False, count)
