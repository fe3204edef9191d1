"""Each custom kernel variant checks itself on its first call: a few tokens against the
pure-MLX op. A variant that fails to compile or disagrees logs one warning and runs the
pure-MLX path for the rest of the process (MLX_HYBRID_STRICT_KERNELS=1: an error)."""

from __future__ import annotations

import logging
import os
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..timing import one_time_work
from . import activations, cpu_kernels, gpu_kernels, reference, rotary


class KernelError(RuntimeError):
    """A custom kernel failed its first-call check (with MLX_HYBRID_STRICT_KERNELS=1)."""


_log = logging.getLogger("mlx_hybrid")
kernel_usable: dict[tuple, bool] = {}  # (kernel, platform, variant) -> passed its check
KERNEL_CHECK_TOLERANCE = 1e-3  # float32 accumulation either way; inputs cast the same
# A 16-bit output is a float32 result rounded: two results a hair apart may round to neighbouring
# values, one step of the dtype's precision (relative) apart.
ROUNDING_STEP = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10}


def _strict_kernels() -> bool:
    return os.environ.get("MLX_HYBRID_STRICT_KERNELS", "") not in ("", "0")


def passed(spec, small_case: Callable[..., tuple], platform: str, *variant) -> bool:
    """Whether this kernel variant may run: checked once, on its first call.

    small_case(platform, *variant) -> (kernel outputs, reference outputs) for a few tokens.
    """
    key = (spec.name, platform, *variant)
    if key not in kernel_usable:
        with one_time_work():
            kernel_usable[key] = _check(spec, small_case, platform, *variant)
    return kernel_usable[key]


def _check(spec, small_case, platform, *variant) -> bool:
    """Run the variant's small case against the pure-MLX op: whether it agrees (else one warning)."""
    try:
        got, want = small_case(platform, *variant)
        compared = [_compare(g, w) for g, w in zip(got, want)]
        worst = max(error for error, _ in compared)
        problem = None if all(ok for _, ok in compared) else f"differs from the pure-MLX op by {worst:.3g}"
    except Exception as e:  # a compile error, a bad launch: the message is for the warning
        problem = f"failed ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e})"
    if problem is not None:
        described = ", ".join(map(str, variant))
        message = f"the {platform} kernel {spec.file} ({described}) {problem}; {spec.fallback}"
        if _strict_kernels():
            raise KernelError(message + " (MLX_HYBRID_STRICT_KERNELS=1 makes this an error)")
        _log.warning("mlx_hybrid: %s", message)
    return problem is None


def _compare(got: mx.array, want: mx.array) -> tuple[float, bool]:
    """The largest difference, in float32 (numpy reads no bfloat16), and whether every value is
    within the check's tolerance."""
    allowed_step = ROUNDING_STEP.get(want.dtype, 0.0)
    got, want = (np.array(a.astype(mx.float32)) for a in (got, want))
    error = np.abs(got - want)
    return float(error.max()), bool((error <= KERNEL_CHECK_TOLERANCE + allowed_step * np.abs(want)).all())


def small_gated_delta_case(platform, dtype, key_dim: int, vector_gate: bool, snapshots: bool):
    """Three tokens, one key head, two value heads: the kernel (platform 'cpu': ours for MLX's CPU
    backend) against the recurrence."""
    rng = np.random.default_rng(0)
    B, T, Hk, Hv, Dv = 1, 3, 1, 2, 44  # 44 columns: blocks of 32 and of 8, and a partial vector
    q = rng.standard_normal((B, T, Hk, key_dim))
    k = rng.standard_normal((B, T, Hk, key_dim))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    g = -rng.uniform(0.01, 0.5, (B, T, Hv, key_dim) if vector_gate else (B, T, Hv))
    inputs = [mx.array(x.astype(np.float32)).astype(dtype) for x in (q, k, rng.standard_normal((B, T, Hv, Dv)), g)]
    inputs += [mx.array(rng.uniform(0.1, 0.9, (B, T, Hv)).astype(np.float32)).astype(dtype)]
    state = mx.array(rng.standard_normal((B, Hv, key_dim, Dv)).astype(np.float32))
    if platform == "cpu":
        out, final, states = cpu_kernels.gated_delta_recurrent(*inputs, state, snapshots=snapshots)
        states = mx.stack(states, axis=1) if snapshots else None
    else:
        launch = gpu_kernels.gated_delta_launch(*inputs, state, snapshots)
        out, final, states = gpu_kernels.run(gpu_kernels.GATED_DELTA, launch, platform)
    want_out, want_final, want_states = reference.gated_delta_recurrent(*inputs, state, snapshots=snapshots)
    got, want = [out, final], [want_out, want_final]
    if snapshots:
        got.append(states)
        want.append(mx.stack(want_states, axis=1))
    return got, want


def small_conv_case(platform, dtype, width: int, snapshots: bool):
    """Three tokens of 12 channels (platform 'cpu': a vector of 8 and a partial one)."""
    rng = np.random.default_rng(0)
    x, tail = (
        mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        for shape in [(1, 3, 12), (1, width - 1, 12)]
    )
    weight = mx.array(rng.standard_normal((12, width)).astype(np.float32))
    if platform == "cpu":
        y, new_tail, tails = cpu_kernels.causal_conv1d_silu(x, weight, tail, snapshots=snapshots)
        tails = mx.stack(tails, axis=1) if snapshots else None
    else:
        launch = gpu_kernels.conv1d_silu_launch(x, weight, tail, snapshots)
        y, new_tail, tails = gpu_kernels.run(gpu_kernels.CONV1D_SILU, launch, platform)
    want_y, want_tail, want_tails = reference.causal_conv1d_silu(x, weight, tail, snapshots=snapshots)
    got, want = [y, new_tail], [want_y, want_tail]
    if snapshots:
        got.append(tails)
        want.append(mx.stack(want_tails, axis=1))
    return got, want


def small_add_rms_norm_case(platform, dtype):
    """Three rows of 200 features (a partial simdgroup) in `dtype`: the GPU body against MLX's sum
    and `reference.rms_norm`."""
    rng = np.random.default_rng(0)
    x, y = (mx.array(rng.standard_normal((3, 200)).astype(np.float32)).astype(dtype) for _ in range(2))
    weight = mx.array(rng.standard_normal(200).astype(np.float32)).astype(dtype)
    got = gpu_kernels.run(gpu_kernels.ADD_RMS_NORM, gpu_kernels.add_rms_norm_launch(x, y, weight, 1e-6), platform)
    return got, [x + y, reference.rms_norm(x + y, weight, 1e-6)]


def small_norm_case(platform, kind: str):
    """Two rows of 28 values (a block of 16, one of 8 and a tail of 4): our CPU kernel
    (kind 'rms', 'add-rms' or 'l2') against the compiled MLX form."""
    rng = np.random.default_rng(0)
    x, y = (mx.array(rng.standard_normal((2, 1, 28)).astype(np.float32)) for _ in range(2))
    weight = mx.array(rng.standard_normal(28).astype(np.float32))
    if kind == "rms":
        return [cpu_kernels.rms_norm(x, weight, 1e-6)], [reference.rms_norm(x, weight, 1e-6)]
    if kind == "add-rms":
        return list(cpu_kernels.add_rms_norm(x, y, weight, 1e-6)), [x + y, reference.rms_norm(x + y, weight, 1e-6)]
    return [cpu_kernels.l2_normalize(x, 1e-6)], [reference.l2_normalize(x, 1e-6)]


def linear_attention_args(rng, B: int, T: int, heads, width: int, vector_gate: bool, activation: str, dtype) -> tuple:
    """Random arguments of ops.linear_attention (x, conv weight, a, b, gate, decay, norm, heads, tail,
    state) at these sizes: x, a, b, gate and the tail in `dtype`, the weights and state float32."""
    Hk, Hv, Dk, Dv = heads
    C = 2 * Hk * Dk + Hv * Dv

    def array(shape, scale=1.0, dtype=mx.float32):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)

    decay = reference.Decay(
        mx.array(-rng.uniform(1, 8, Hv).astype(np.float32)),
        mx.array(rng.uniform(-4, -1, Hv * (Dk if vector_gate else 1)).astype(np.float32)),
    )
    norm = reference.OutputNorm(1 + array(Dv, 0.1), 1e-6, activation)
    a = array((B, T, Hv, Dk) if vector_gate else (B, T, Hv), dtype=dtype)
    return (
        array((B, T, C), dtype=dtype),
        array((C, width), 0.5),
        a,
        array((B, T, Hv), dtype=dtype),
        array((B, T, Hv * Dv), dtype=dtype),
        decay,
        norm,
        heads,
        array((B, width - 1, C), dtype=dtype),
        array((B, Hv, Dk, Dv)),
    )


def small_linear_attention_case(platform, vector_gate: bool, activation: str, snapshots: bool, *shape):
    """Three tokens, one key head, two value heads, against the pure-MLX composition: our CPU kernel
    (platform 'cpu': keys of 20 channels, a vector and a partial one, values of 44, a conv of width
    4, float32), or the GPU body at a call's shape = (dtype, key_dim, value_dim, width)."""
    dtype, key_dim, value_dim, width = shape or (mx.float32, 20, 44, 4)
    args = linear_attention_args(
        np.random.default_rng(0),
        1,
        3,
        reference.HeadShape(1, 2, key_dim, value_dim),
        width,
        vector_gate,
        activation,
        dtype,
    )
    want = _layer_arrays(reference.linear_attention(*args, snapshots=snapshots))
    if platform == "cpu":
        got = _layer_arrays(cpu_kernels.linear_attention(*args, snapshots=snapshots))
    else:
        launch = gpu_kernels.linear_attention_launch(*args, snapshots)
        got = gpu_kernels.run(gpu_kernels.LINEAR_ATTENTION, launch, platform)[: len(want)]
    return got, want


def _layer_arrays(result: reference.LayerResult) -> list:
    """A layer's output, tail and state, and its snapshots stacked over the tokens where it has them."""
    snapshots = result.state_snapshots is not None
    stacked = [mx.stack(result.tail_snapshots, axis=1), mx.stack(result.state_snapshots, axis=1)] if snapshots else []
    return [result.out, result.tail, result.state, *stacked]


def small_attention_case(_platform):
    """Four heads over two KV heads, 3 query tokens (the per-row path) and 20 (the BLAS's) over 23
    keys of 20 features (values 12), with and without the causal mask: our CPU kernel against MLX's op."""
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)) for shape in [(1, 2, 23, 20), (1, 2, 23, 12)])
    got, want = [], []
    for tokens in (3, 20):
        q = mx.array(rng.standard_normal((1, 4, tokens, 20)).astype(np.float32))
        got += [cpu_kernels.attention(q, k, v, 0.3, causal) for causal in (False, True)]
        want += [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask) for mask in (None, "causal")]
    # a batch of two rows holding 23 and 17 keys: the second as its keys alone
    q = mx.array(rng.standard_normal((2, 4, 3, 20)).astype(np.float32))
    k2, v2, lengths = mx.concatenate([k, k[:, ::-1]]), mx.concatenate([v, v[:, ::-1]]), mx.array([23, 17])
    got += [cpu_kernels.attention(q, k2, v2, 0.3, causal, lengths)[1:] for causal in (False, True)]
    want += [
        mx.fast.scaled_dot_product_attention(q[1:], k2[1:, :, :17], v2[1:, :, :17], scale=0.3, mask=mask)
        for mask in (None, "causal")
    ]
    return got, want


def small_quantized_attention_case(_platform, bits: int, group_size: int):
    """As `small_attention_case`, the keys (256 features) and values (128) held as mx.quantize's
    groups: our CPU kernel against MLX's quantized products (`reference.quantized_attention`)."""
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)) for shape in [(1, 2, 23, 256), (1, 2, 23, 128)])
    k, v = (reference.QuantizedEntries(*mx.quantize(x, group_size, bits), bits, group_size) for x in (k, v))
    got, want = [], []
    for tokens in (3, 20):
        q = mx.array(rng.standard_normal((1, 4, tokens, 256)).astype(np.float32))
        got += [cpu_kernels.quantized_attention(q, k, v, 0.3, causal) for causal in (False, True)]
        want += [reference.quantized_attention(q, k, v, 0.3, mask) for mask in (None, "causal")]
    return got, want


def small_rope_case(_platform):
    """Two heads, 3 tokens of 20 features, 12 of them rotary: our CPU kernel against the pure-MLX form."""
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 2, 3, 20)).astype(np.float32))
    c, s = rotary._rope_factors(range(5, 8), 20, 12, 10000.0)
    rows = mx.concatenate([x, -x])  # two batch rows at their own positions
    rows_c, rows_s = rotary._rows_rope_factors((5, 9), 3, 20, 12, 10000.0)
    got = [cpu_kernels.rope(x, c, s, 12), cpu_kernels.rope(rows, rows_c, rows_s, 12)]
    return got, [rotary.rotate(x, c, s, 12), rotary.rotate(rows, rows_c, rows_s, 12)]


def small_gated_product_case(_platform):
    """Two rows of 37 values (vectors and a partial one): our CPU kernel's SiLU and sigmoid gates
    and GELU (tanh) against MLX's forms."""
    rng = np.random.default_rng(0)
    x, gate = (mx.array(4 * rng.standard_normal((2, 37)).astype(np.float32)) for _ in range(2))
    got = [cpu_kernels.gated_product(x, gate, False), cpu_kernels.gated_product(x, gate, True)]
    got.append(cpu_kernels.gelu_tanh(x))
    return got, [activations.swiglu(gate, x), activations.sigmoid_gated(x, gate), nn.gelu_approx(x)]
