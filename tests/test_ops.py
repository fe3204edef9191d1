"""The linear-attention ops against recurrences written the slow, obvious way in numpy."""

import itertools
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_hybrid import ops
from mlx_hybrid.ops import reference, rotary

# The ops on inputs of scale ~1 (outputs and states up to 1.8): two float32 summation orders
# (chunked against recurrent) differ by at most 2.4e-6 over GRID, float32 against float64
# numpy by 1.7e-7. A wrong gate, decay or normalisation moves them by 1e-2 or more.
OP_TOL = 1e-5


def numpy_gated_delta(q, k, v, g, beta, state):
    """Per token, per value head, in float64: the rule as docs/models.md writes it."""
    q, k, v, g, beta, S = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta, state))
    B, T, Hk, _ = k.shape
    Hv = v.shape[2]
    R = Hv // Hk
    out = np.zeros(v.shape)
    states = []
    S = S.copy()
    for t in range(T):
        for b in range(B):
            for h in range(Hv):
                decay = np.exp(g[b, t, h])
                S[b, h] = S[b, h] * (decay[:, None] if decay.ndim else decay)
                kv = S[b, h].T @ k[b, t, h // R]
                delta = beta[b, t, h] * (v[b, t, h] - kv)
                S[b, h] = S[b, h] + np.outer(k[b, t, h // R], delta)
                out[b, t, h] = S[b, h].T @ q[b, t, h // R]
        states.append(S.copy())
    return out, S, np.stack(states, axis=1)


def make_inputs(B, T, Hk, Hv, Dk, Dv, vector_gate, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, Dk))
    k = rng.standard_normal((B, T, Hk, Dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * Dk**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, Dv))
    g = -rng.uniform(0.01, 1.0, (B, T, Hv, Dk) if vector_gate else (B, T, Hv))
    beta = rng.uniform(0.0, 1.0, (B, T, Hv))
    state = 0.1 * rng.standard_normal((B, Hv, Dk, Dv))
    return [x.astype(np.float32) for x in (q, k, v, g, beta, state)]


GRID = list(itertools.product([1, 63, 64, 65, 200], [16, 32, 64, 128], [1, 2, 4], [False, True]))


@pytest.mark.parametrize("T,Dk,ratio,vector_gate", GRID)
def test_chunked_equals_recurrent(T, Dk, ratio, vector_gate):
    inputs = [mx.array(x) for x in make_inputs(1, T, 2, 2 * ratio, Dk, 32, vector_gate, seed=T + Dk)]
    out_r, state_r, _ = reference.gated_delta_recurrent(*inputs)
    out_c, state_c = reference.gated_delta_chunked(*inputs)
    np.testing.assert_allclose(np.array(out_c), np.array(out_r), atol=OP_TOL, rtol=0)
    np.testing.assert_allclose(np.array(state_c), np.array(state_r), atol=OP_TOL, rtol=0)


@pytest.mark.parametrize(
    "B,T,Hk,Hv,Dk,Dv,vector_gate",
    [(1, 1, 2, 4, 16, 16, False), (2, 5, 2, 2, 32, 16, False), (2, 7, 1, 4, 16, 32, True), (1, 70, 2, 4, 16, 16, True)],
)
def test_recurrent_and_chunked_equal_numpy(B, T, Hk, Hv, Dk, Dv, vector_gate):
    inputs = make_inputs(B, T, Hk, Hv, Dk, Dv, vector_gate)
    out_n, state_n, states_n = numpy_gated_delta(*inputs)
    out_r, state_r, states_r = reference.gated_delta_recurrent(*map(mx.array, inputs), snapshots=True)
    out_c, state_c = reference.gated_delta_chunked(*map(mx.array, inputs))
    states_r = mx.stack(states_r, axis=1)
    for got, want in [(out_r, out_n), (state_r, state_n), (states_r, states_n), (out_c, out_n), (state_c, state_n)]:
        np.testing.assert_allclose(np.array(got), want, atol=OP_TOL, rtol=0)


def test_zero_initial_state_is_the_default():
    q, k, v, g, beta, state = map(mx.array, make_inputs(1, 9, 2, 4, 16, 16, False))
    out, final, _ = reference.gated_delta_recurrent(q, k, v, g, beta, None)
    out0, final0, _ = reference.gated_delta_recurrent(q, k, v, g, beta, mx.zeros_like(state))
    assert mx.array_equal(out, out0) and mx.array_equal(final, final0)


def test_unit_lower_inverse():
    rng = np.random.default_rng(1)
    # entries of the size beta * (k_i . k_j) * decay takes for unit keys
    a = np.tril(rng.uniform(-0.2, 0.2, (3, 64, 64)), -1).astype(np.float32)
    inv = np.array(reference.unit_lower_inverse(mx.array(a)))
    # float32 forward substitution over 64 rows (measured 1e-7)
    np.testing.assert_allclose(inv @ (np.eye(64) + a), np.broadcast_to(np.eye(64), a.shape), atol=OP_TOL)


def numpy_conv_silu(x, weight, tail):
    full = np.concatenate([tail, x], axis=1).astype(np.float64)
    K = weight.shape[1]
    T = x.shape[1]
    y = np.stack([(full[:, t : t + K] * weight.T[None]).sum(axis=1) for t in range(T)], axis=1)
    tails = np.stack([full[:, t + 1 : t + K] for t in range(T)], axis=1)
    return y / (1 + np.exp(-y)), full[:, T:], tails


def layer_inputs(B, T, heads, K, vector_gate, seed=0):
    """A linear-attention layer's inputs in the CPU kernel's order (x, conv weight, tail, a, b, A,
    dt_bias, gate, norm weight, state), float32, of the scale a model feeds them (decays
    A softplus(a + dt_bias) from about -0.02 to -3)."""
    rng = np.random.default_rng(seed)
    Hk, Hv, Dk, Dv = heads
    C = 2 * Hk * Dk + Hv * Dv
    a = 0.5 * rng.standard_normal((B, T, Hv, Dk) if vector_gate else (B, T, Hv))
    arrays = [
        rng.standard_normal((B, T, C)),
        0.5 * rng.standard_normal((C, K)),
        rng.standard_normal((B, K - 1, C)),
        a,
        rng.standard_normal((B, T, Hv)),
        -rng.uniform(1, 8, Hv),
        rng.uniform(-4, -1, a[0, 0].size),
        rng.standard_normal((B, T, Hv * Dv)),
        1 + 0.1 * rng.standard_normal(Dv),
        0.1 * rng.standard_normal((B, Hv, Dk, Dv)),
    ]
    return [x.astype(np.float32) for x in arrays]


def numpy_linear_attention(x, weight, tail, a, b, A, dt_bias, gate, norm_weight, state, heads, activation, eps=1e-6):
    """The layer as docs/models.md writes it, in float64: (out, tail, state, the tails and the
    states after each token)."""
    B, T, _ = x.shape
    Hk, Hv, Dk, Dv = heads
    a, A = a.astype(np.float64), A.astype(np.float64)
    if a.ndim == 4:
        A = A[:, None]
    g = A * np.logaddexp(a + dt_bias.astype(np.float64).reshape(a.shape[2:]), 0)
    beta = 1 / (1 + np.exp(-b.astype(np.float64)))
    y, new_tail, tails = numpy_conv_silu(x, weight, tail)
    q, k, v = np.split(y, [Hk * Dk, 2 * Hk * Dk], axis=-1)

    def l2(u):
        return u / np.sqrt((u * u).sum(axis=-1, keepdims=True) + 1e-6)

    q, k = l2(q.reshape(B, T, Hk, Dk)) * Dk**-0.5, l2(k.reshape(B, T, Hk, Dk))
    out, new_state, states = numpy_gated_delta(q, k, v.reshape(B, T, Hv, Dv), g, beta, state)
    out = out / np.sqrt((out * out).mean(axis=-1, keepdims=True) + eps) * norm_weight.astype(np.float64)
    z = gate.reshape(B, T, Hv, Dv).astype(np.float64)
    activated = z / (1 + np.exp(-z)) if activation == "silu" else 1 / (1 + np.exp(-z))
    return (out * activated).reshape(B, T, Hv * Dv), new_tail, new_state, tails, states


def run_layer(inputs, heads, activation, snapshots, layer=reference.linear_attention):
    """layer (reference.linear_attention's signature) on layer_inputs' arrays."""
    x, weight, tail, a, b, A, dt_bias, gate, norm_weight, state = map(mx.array, inputs)
    decay, norm = reference.Decay(A, dt_bias), reference.OutputNorm(norm_weight, 1e-6, activation)
    return layer(x, weight, a, b, gate, decay, norm, heads, tail, state, snapshots=snapshots)


@pytest.mark.parametrize("T,vector_gate,activation", [(1, False, "silu"), (5, True, "sigmoid"), (70, False, "silu")])
def test_linear_attention_against_numpy(T, vector_gate, activation):
    """The pure-MLX composition (what a GPU and MLX_HYBRID_FORCE_REFERENCE run)."""
    heads = reference.HeadShape(2, 4, 32, 24)
    inputs = layer_inputs(2, T, heads, 4, vector_gate, seed=T)
    got = run_layer(inputs, heads, activation, True)
    want = numpy_linear_attention(*inputs, heads, activation)
    # float32 against float64 through an RMS-normalised output times the gate: see
    # test_cpu_linear_attention.LAYER_TOL
    np.testing.assert_allclose(np.array(got.out), want[0], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.array(got.tail), want[1])
    np.testing.assert_allclose(np.array(got.state), want[2], atol=OP_TOL, rtol=0)
    np.testing.assert_array_equal(np.array(mx.stack(got.tail_snapshots, axis=1)), want[3])
    np.testing.assert_allclose(np.array(mx.stack(got.state_snapshots, axis=1)), want[4], atol=OP_TOL, rtol=0)


@pytest.mark.parametrize("K,T", [(2, 1), (2, 9), (4, 1), (4, 3), (4, 70)])
def test_conv_against_numpy(K, T):
    rng = np.random.default_rng(K * 100 + T)
    x = rng.standard_normal((2, T, 24)).astype(np.float32)
    w = rng.standard_normal((24, K)).astype(np.float32)
    tail = rng.standard_normal((2, K - 1, 24)).astype(np.float32)
    y, new_tail, tails = reference.causal_conv1d_silu(mx.array(x), mx.array(w), mx.array(tail), snapshots=True)
    want_y, want_tail, want_tails = numpy_conv_silu(x, w, tail)
    np.testing.assert_allclose(np.array(y), want_y, atol=OP_TOL, rtol=0)
    np.testing.assert_array_equal(np.array(new_tail), want_tail)
    np.testing.assert_array_equal(np.array(mx.stack(tails, axis=1)), want_tails)


def test_dispatch_returns_snapshots_that_match_prefix_runs():
    """The state snapshot after token t is the final state of a run over tokens 0..t."""
    inputs = [mx.array(x) for x in make_inputs(1, 4, 2, 4, 16, 16, False)]
    result = ops.gated_delta_update(*inputs, snapshots=True)
    for t in range(4):
        prefix = [x[:, : t + 1] for x in inputs[:5]] + [inputs[5]]
        np.testing.assert_allclose(
            np.array(result.snapshots[t]), np.array(ops.gated_delta_update(*prefix).state), atol=OP_TOL
        )


def numpy_rope(x, dims, base, offset):
    """Rotate-half RoPE in float64, pair (i, i + dims/2) at angle position * base^(-2i/dims)."""
    x = np.asarray(x, dtype=np.float64)
    half = dims // 2
    angle = np.arange(offset, offset + x.shape[-2])[:, None] * base ** (-2.0 * np.arange(half) / dims)
    x1, x2 = x[..., :half], x[..., half:dims]
    rotated = [x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)]
    return np.concatenate([*rotated, x[..., dims:]], axis=-1)


@pytest.mark.parametrize(
    "shape,dims,offset",
    [((1, 8, 1, 256), 64, 0), ((1, 8, 1, 256), 64, 511), ((2, 2, 37, 128), 128, 5), ((1, 3, 5, 64), 32, 100_000)],
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rope_against_numpy(shape, dims, offset, dtype):
    x = mx.array(np.random.default_rng(offset).standard_normal(shape).astype(np.float32)).astype(dtype)
    out = rotary.rope(x, dims, 1e7, offset)
    assert out.dtype == dtype
    expected = numpy_rope(np.array(x.astype(mx.float32)), dims, 1e7, offset)
    # float32: an ulp of outputs up to 4 (measured 2.7e-7); bfloat16: the output's own rounding,
    # half an ulp at 4 is 1.6e-2 (measured 7.8e-3)
    atol = 1e-6 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, atol=atol, rtol=0)


def test_rope_one_token_equals_its_row_of_a_longer_call():
    """Decode steps and verify passes must rotate a position to the same bits."""
    x = mx.array(np.random.default_rng(0).standard_normal((1, 4, 6, 128)).astype(np.float32))
    together = np.array(rotary.rope(x, 64, 1e4, 10))
    for t in range(6):
        alone = np.array(rotary.rope(x[:, :, t : t + 1], 64, 1e4, 10 + t))
        np.testing.assert_array_equal(alone[:, :, 0], together[:, :, t])


def test_activations_against_numpy():
    """sigmoid, SiLU, SwiGLU and the sigmoid gate (through 2^x, or on the CPU our kernel's e^x for
    the gates): as accurate as MLX's own, in float32 and bfloat16."""
    x = mx.array(np.linspace(-100, 100, 200_001).astype(np.float32))
    up = mx.array(np.random.default_rng(0).standard_normal(x.shape).astype(np.float32))
    # bfloat16: the inputs are rounded first, the output's own rounding is the tolerance
    for dtype, rtol in [(mx.float32, 4e-6), (mx.bfloat16, 2**-8)]:
        xs, ups = x.astype(dtype), up.astype(dtype)
        x64, up64 = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (xs, ups))
        exact_sigmoid = 1 / (1 + np.exp(-x64))
        cases = [
            ("sigmoid", ops.sigmoid(xs), exact_sigmoid),
            ("silu", ops.silu(xs), x64 * exact_sigmoid),
            ("swiglu", ops.swiglu(xs, ups), x64 * exact_sigmoid * up64),
            ("sigmoid_gated", ops.sigmoid_gated(ups, xs), up64 * exact_sigmoid),
        ]
        for name, out, want in cases:
            assert out.dtype == dtype, name
            out = np.array(out.astype(mx.float32)).astype(np.float64)
            # below x = -88 exp(-x) overflows float32 (in mx.sigmoid too): values under 1e-30 give 0
            close = np.abs(out - want) <= rtol * np.abs(want) + 1e-30
            assert close.all(), (name, dtype, x64[~close][:5], out[~close][:5], want[~close][:5])


def test_float32_products_stay_float32_unless_the_user_chooses_tf32():
    """MLX rounds float32 products' inputs to TF32 by default where the hardware has it (an H200:
    a 256x512x256 product 0.033 off float64, 1.9e-5 without); importing mlx_hybrid turns that off
    before any product runs, and a user's own setting stands."""
    code = "import os, mlx_hybrid; print(os.environ['MLX_ENABLE_TF32'])"
    inherited = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    for chosen, want in ((None, "0"), ("1", "1")):
        env = inherited if chosen is None else {**inherited, "MLX_ENABLE_TF32": chosen}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.split()[-1] == want


def test_a_model_near_mlxs_memory_limit_raises_it_to_the_machines_memory():
    """Above MLX's memory limit each op waits for the ones before it: on the CPU, weights over half the
    limit raise it to the machine's memory; smaller ones leave it."""
    limit = mx.get_memory_limit()
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        ops.allow_memory_for(limit // 4)
        assert mx.get_memory_limit() == limit
        ops.allow_memory_for(limit // 2 + 1)
        assert mx.get_memory_limit() == max(limit, machine)
    finally:
        mx.set_memory_limit(limit)


def test_a_pass_on_the_cpu_queues_each_layer_as_it_is_built(monkeypatch):
    """MLX's host runs only about 100 dispatches ahead of its CPU stream, so a pass queued whole would
    compute only after most of it was built: where every product runs on one thread (the fixture's),
    the trunk queues each layer's output as it is built. A model with a product wide enough for
    every core, and the GPU path (whose engine queues whole passes a step ahead), queue none."""
    from conftest import load_fixture

    from mlx_hybrid.models.layers import widest_product
    from mlx_hybrid.ops import backend, schedule

    model, _ = load_fixture("qwen35", "model.gguf")
    assert widest_product(model.args) < schedule.ONE_THREAD_WEIGHTS
    queued = []
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: queued.append(arrays))
    hidden = model.hidden_states(mx.array([[5, 6, 7]]), model.make_cache())
    assert [arrays[0].shape for arrays in queued] == [hidden.shape] * len(model.layers)
    assert queued[-1][0] is hidden
    # plain decoding queues its next step too, there only (the engine's default)
    assert ops.overlap_decode_steps(model.widest_product) and not ops.overlap_decode_steps(schedule.ONE_THREAD_WEIGHTS)
    queued.clear()
    ops.layer_built(hidden, schedule.ONE_THREAD_WEIGHTS)
    monkeypatch.setattr(backend, "gpu_computes", lambda: True)
    ops.layer_built(hidden, 1)
    assert queued == [] and ops.overlap_decode_steps(schedule.ONE_THREAD_WEIGHTS)


def test_queued_layers_keep_their_kernels_to_one_thread_and_read_verdicts_with_the_tokens():
    """Where the host builds the next layers beside the CPU's thread (a queued layer: the fixture's
    decoding), the kernels keep to that thread, which a helper woken for a larger job would take
    the host's core from; a prompt's layers, evaluated in turn, and a model with products wide
    enough for every core take every core. The same models read a speculative pass's draft
    verdicts with its tokens (one wait), the wider ones before they verify."""
    from conftest import load_fixture

    from mlx_hybrid.ops import schedule
    from mlx_hybrid.ops.cpu_extension import extension

    kernels = extension()
    if kernels is None or mx.default_device() != mx.cpu:
        pytest.skip("needs our CPU kernels, computing on the CPU")
    model, _ = load_fixture("qwen35", "model.gguf")
    model.hidden_states(mx.array([[5, 6, 7]]), model.make_cache())
    assert kernels.kept_to_one_thread()
    model.hidden_states(mx.array([[5, 6, 7]]), model.make_cache(), evaluate_each_layer=True)
    assert not kernels.kept_to_one_thread()
    ops.layer_built(mx.zeros(3), model.widest_product)
    assert kernels.kept_to_one_thread()
    ops.layer_built(mx.zeros(3), schedule.ONE_THREAD_WEIGHTS)
    assert not kernels.kept_to_one_thread()
    assert not ops.read_draft_verdicts_first(model.widest_product)
    assert ops.read_draft_verdicts_first(schedule.ONE_THREAD_WEIGHTS)
