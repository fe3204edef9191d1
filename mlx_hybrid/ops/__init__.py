"""The op boundary of the model layers' compute.

Models and the speculative loop call `linear_attention` (a layer's work between its
projections), `gated_delta_update`, `conv1d_update`, the norms, attention, the gates and the
quantized products here and nothing below them. This module is the one place that decides
which implementation runs a call: a custom kernel (Metal, or CUDA through the same bodies)
where the platform has one and the shape is supported; on the CPU our C++ kernels
(`cpu_extension`: the gated delta rule, the conv, quantized products, the norms, the
linear-attention layer's steps fused, attention of a few tokens, the rotary embedding, the
gates) where they build; else the pure-MLX reference. MLX_HYBRID_FORCE_REFERENCE=1 forces the
pure-MLX path. Nothing else in the package asks which device it runs on.

A safety net for kernels no compiler on the user's machine has seen before: the first
call of each kernel variant (its template arguments) runs it on a small case against
the pure-MLX op. If it fails to compile or disagrees, one warning is logged and that
variant runs the pure-MLX path for the rest of the process;
MLX_HYBRID_STRICT_KERNELS=1 makes it an error instead (see `selfcheck`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from . import activations, backend, cpu_extension, cpu_kernels, gpu_kernels, reference, rotary, row_kernels, selfcheck
from .activations import sigmoid, silu  # noqa: F401  (MLX's compiled forms, on every backend)
from .attention import (  # noqa: F401  (attention and the KV cache's forms, for the layers)
    KV_BITS,
    KV_GROUP_SIZES,
    dequantized_entries,
    leading_features,
    quantize_entries,
    scaled_dot_product_attention,
)
from .backend import (  # noqa: F401  (where ops compute, for the package)
    backend_name,
    default_dtype,
    differentiable,
    force_reference,
    kernel_platform,
    path_key,
)
from .cpu_extension import CONV1D, GATED_DELTA, GATED_PRODUCT, LINEAR_ATTENTION, NORMS, ROPE
from .products import (  # noqa: F401  (the products, for the layers)
    HALF_ROWS,
    MLX_GROUP_SIZES,
    SIXTEEN_BITS,
    activations_of,
    compute_as_llama_cpp,
    compute_like,
    computes_block_scales,
    computes_quantized,
    gather_matmul,
    gather_quantized_matmul,
    half_activations,
    held_interleaved,
    int8_activations,
    int8_activations_computed,
    int8_row_limit,
    keeps_16bit_weights,
    linear,
    llama_cpp_operands,
    llama_cpp_products,
    llama_cpp_row_limits,
    quantized_matmul,
    quantized_product_path,
    rows_alike_pass_tokens,
    rows_within,
)
from .reference import Decay, HeadShape, LayerResult, OutputNorm  # noqa: F401  (linear_attention's types)
from .reference import QuantizedEntries  # noqa: F401  (a quantized cache's entries, for the caches)
from .schedule import (  # noqa: F401  (how passes are evaluated, for the models and the engine)
    drafts_stop_below_p_min,
    layer_built,
    open_drafting_with_pass,
    overlap_decode_steps,
    prefill_layer_by_layer,
    read_draft_verdicts_first,
    verified_tokens_cost_arithmetic,
)

# Below this many tokens the token-by-token recurrence is cheaper than building the
# chunked form's matrices (benchmarks/linear_attention_ops.py --tokens 64 128, pure-MLX
# column); decode and verify passes use it too.
CHUNKED_MIN_TOKENS = 128


class GatedDeltaResult(NamedTuple):
    out: mx.array  # [B, T, Hv, Dv] float32
    state: mx.array  # [B, Hv, Dk, Dv] float32, after the last token
    snapshots: Sequence | None  # T arrays [B, Hv, Dk, Dv]: the state after each token


class ConvResult(NamedTuple):
    out: mx.array  # [B, T, C]
    tail: mx.array  # [B, K-1, C]
    snapshots: Sequence | None  # T arrays [B, K-1, C]: the tail after each token


# Float32 matrix products in float32. By default MLX rounds their inputs to TF32 (a 10-bit
# mantissa) where the hardware has it (NVIDIA GPUs; Apple's newest): the chunked delta rule's
# float32 products, a float32 model's prefill and verify passes would then drift from its decode
# steps and from the checkpoint's reference (bfloat16 products are unaffected). MLX reads the
# variable at its first such product; a user's own setting stands.
os.environ.setdefault("MLX_ENABLE_TF32", "0")


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """x / sqrt(mean(x^2) + eps) * weight, accumulated in float32, in x's dtype.

    mx.fast.rms_norm is one kernel on a GPU; on the CPU it runs as ten separate ops, compiled as
    three, our CPU kernel as one (benchmarks/linear_attention_ops.py times the norms).
    """
    if backend.gpu_computes():
        return mx.fast.rms_norm(x, weight, eps)
    if x.dtype == weight.dtype == mx.float32 and backend.cpu_kernel_passed(NORMS, selfcheck.small_norm_case, "rms"):
        return cpu_kernels.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(x: mx.array, y: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """(x + y, rms_norm(x + y, weight, eps)): a residual sum and the norm after it, on the CPU one
    node of ours (the same bits as the two), on a GPU one kernel."""
    platform = backend.kernel_platform()
    if (
        platform
        and x.dtype == y.dtype == weight.dtype
        and x.dtype in KERNEL_DTYPES
        and x.shape == y.shape
        and selfcheck.passed(gpu_kernels.ADD_RMS_NORM, selfcheck.small_add_rms_norm_case, platform, x.dtype)
    ):
        total, normed = gpu_kernels.run(
            gpu_kernels.ADD_RMS_NORM, gpu_kernels.add_rms_norm_launch(x, y, weight, eps), platform
        )
        return total, normed
    if (
        x.dtype == y.dtype == weight.dtype == mx.float32
        and x.shape == y.shape
        and backend.cpu_kernel_passed(NORMS, selfcheck.small_norm_case, "add-rms")
    ):
        total, normed = cpu_kernels.add_rms_norm(x, y, weight, eps)
        return total, normed
    total = x + y
    return total, rms_norm(total, weight, eps)


def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (as FLA and transformers)."""
    x = x.astype(mx.float32)
    if backend.cpu_kernel_passed(NORMS, selfcheck.small_norm_case, "l2"):
        return cpu_kernels.l2_normalize(x, eps)
    return reference.l2_normalize(x, eps)


def rope(x: mx.array, dims: int, base: float, offset: int | tuple[int, ...]) -> mx.array:
    """Rotary embedding (rotate-half layout) of the first `dims` features of x [B, H, T, D],
    for positions offset .. offset + T - 1 (offset: one for all, or a tuple, each batch row's).

    mx.fast.rope is one kernel on a GPU; on the CPU it runs as about 25 separate ops,
    where angles computed on the host (cached for the call's positions) and one pass do: our
    kernel, or MLX's gather and fused products.
    """
    if backend.gpu_computes():
        start = mx.array(offset, mx.int32) if isinstance(offset, tuple) else offset
        return mx.fast.rope(x, dims, traditional=False, base=base, scale=1.0, offset=start)
    return rotary.rope(x, dims, base, offset, rotate=_rotate)


def rope_at(x: mx.array, dims: int, base: float, positions, sections=None) -> mx.array:
    """Rotary embedding of x [B, H, T, D] with token t at its own position: positions [T], or [3, T]
    (temporal, row, column) turned by MRoPE's `sections` (numpy)."""
    if positions.ndim == 2:
        return mrope(x, dims, base, positions, sections)
    return rotary.rope_at(x, dims, base, positions, rotate=_rotate)


def mrope(x: mx.array, dims: int, base: float, positions, sections) -> mx.array:
    """Rotary embedding of x [B, H, T, D] at 3-D positions [3, T] (temporal, row, column; numpy),
    the frequencies interleaved over the axes by `sections` (Qwen3.5's MRoPE). Only the prompt's
    image spans need it (text sits at equal positions on every axis, which `rope` computes): the
    host-computed factors serve every backend."""
    return rotary.mrope(x, dims, base, positions, sections, rotate=_rotate)


def _rotate(x, c, s, dims: int) -> mx.array:
    """The rotary factors applied (see `rotary.rotate`): one node of ours on the CPU, four of MLX's."""
    if x.dtype == mx.float32 and backend.cpu_kernel_passed(ROPE, selfcheck.small_rope_case):
        return cpu_kernels.rope(x, c, s, dims)
    return rotary.rotate(x, c, s, dims)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """SiLU(gate) * up, in up's dtype: the SwiGLU feed-forward's hidden layer (one launch on a GPU;
    on the CPU one node of ours where MLX's compiled form makes three)."""
    if backend.gpu_computes():
        return activations.swiglu_gpu(gate, up)
    if _gated_product_runs(up, gate):
        return cpu_kernels.gated_product(up, gate, False)
    return activations.swiglu(gate, up)


def sigmoid_gated(x: mx.array, gate: mx.array) -> mx.array:
    """x * sigmoid(gate), in x's dtype (as `swiglu`)."""
    if backend.gpu_computes():
        return activations.sigmoid_gated_gpu(x, gate)
    if _gated_product_runs(x, gate):
        return cpu_kernels.gated_product(x, gate, True)
    return activations.sigmoid_gated(x, gate)


def gelu_approx(x: mx.array) -> mx.array:
    """GELU's tanh approximation (nn.gelu_approx: a vision tower's MLP), in x's dtype; on the CPU one
    node of ours, where MLX's elementwise tanh over an image's 3072 x 3072 hidden values took 0.33 s
    a block (benchmarks/vision_tower.py)."""
    if _gated_product_runs(x, x):
        return cpu_kernels.gelu_tanh(x)
    return nn.gelu_approx(x)


def _gated_product_runs(x, gate) -> bool:
    return (
        x.dtype == gate.dtype == mx.float32
        and x.shape == gate.shape
        and backend.cpu_kernel_passed(GATED_PRODUCT, selfcheck.small_gated_product_case)
    )


def allow_memory_for(weights_bytes: int):
    """Where the CPU computes, MLX's memory limit (about 85% of the machine's memory by default) is raised
    to the machine's memory once a model's weights take half of it: while its memory in use is above the
    limit, MLX's evaluation holds each op back until the ones before it are done, which made a model that
    nearly fills the machine decode 2.5x slower (the 35B-A3B shape's Q4_K_M file, 22.2 GB on a 23.7 GB
    machine: 3.3 against 8.1 tokens/s). On a GPU the limit is the device's, and stays."""
    if backend.gpu_computes() or weights_bytes < mx.get_memory_limit() // 2:
        return
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mx.set_memory_limit(max(mx.get_memory_limit(), machine))


def writable_array(shape, dtype) -> mx.array | None:
    """An evaluated array for a loader to write in place through a numpy view of its memory
    (`np.array(a, copy=False)`), where the CPU computes: memory no thread has touched yet where our
    CPU kernels are built (the loader's threads touch it as they write), else zeros. None where a GPU
    computes (its arrays are made from the host's)."""
    if backend.gpu_computes():
        return None
    extension = cpu_extension.extension() if backend.cpu_kernels_built() else None
    if extension is not None:
        return extension.uninitialized(list(shape), dtype)
    array = mx.zeros(shape, dtype)
    mx.eval(array)
    return array


# the kernels keep a column of S in registers: Dk / 32 floats per lane
KERNEL_MAX_KEY_DIM = 256
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def gated_delta_update(q, k, v, g, beta, state=None, *, snapshots: bool = False) -> GatedDeltaResult:
    """Advance the gated delta rule over T tokens (see `reference` for shapes)."""
    platform = backend.kernel_platform()
    recurrent = snapshots or q.shape[1] < CHUNKED_MIN_TOKENS
    if (
        platform
        and recurrent
        and q.shape[-1] <= KERNEL_MAX_KEY_DIM
        and q.dtype in KERNEL_DTYPES
        and selfcheck.passed(
            gpu_kernels.GATED_DELTA,
            selfcheck.small_gated_delta_case,
            platform,
            q.dtype,
            q.shape[-1],
            g.ndim == 4,
            snapshots,
        )
    ):
        out, final, states = gpu_kernels.run(
            gpu_kernels.GATED_DELTA, gpu_kernels.gated_delta_launch(q, k, v, g, beta, state, snapshots), platform
        )
        return GatedDeltaResult(out, final, reference.per_token(states) if snapshots else None)
    # our CPU kernel token by token beats the chunked form at every length too
    # (benchmarks/linear_attention_ops.py --tokens 128 512)
    if platform is None and backend.cpu_kernel_passed(
        GATED_DELTA, selfcheck.small_gated_delta_case, q.dtype, q.shape[-1], g.ndim == 4, snapshots
    ):
        return GatedDeltaResult(*cpu_kernels.gated_delta_recurrent(q, k, v, g, beta, state, snapshots=snapshots))
    if not recurrent:
        out, final = reference.gated_delta_chunked(q, k, v, g, beta, state)
        return GatedDeltaResult(out, final, None)
    return GatedDeltaResult(*reference.gated_delta_recurrent(q, k, v, g, beta, state, snapshots=snapshots))


CPU_CONV_MAX_WIDTH = 8  # the widest conv our CPU kernels take (csrc/cpu_kernels.h: CONV_MAX_WIDTH)


def conv1d_update(x, weight, tail=None, *, snapshots: bool = False) -> ConvResult:
    """Causal depthwise conv + SiLU over T tokens, continuing from `tail`."""
    platform = backend.kernel_platform()
    width = weight.shape[-1]
    if (
        platform
        and x.dtype in KERNEL_DTYPES
        and width >= 2
        and selfcheck.passed(gpu_kernels.CONV1D_SILU, selfcheck.small_conv_case, platform, x.dtype, width, snapshots)
    ):
        y, new_tail, tails = gpu_kernels.run(
            gpu_kernels.CONV1D_SILU, gpu_kernels.conv1d_silu_launch(x, weight, tail, snapshots), platform
        )
        return ConvResult(y, new_tail, reference.per_token(tails) if snapshots else None)
    if (
        platform is None
        and x.dtype == mx.float32
        and 2 <= width <= CPU_CONV_MAX_WIDTH
        and backend.cpu_kernel_passed(CONV1D, selfcheck.small_conv_case, x.dtype, width, snapshots)
    ):
        return ConvResult(*cpu_kernels.causal_conv1d_silu(x, weight, tail, snapshots=snapshots))
    return ConvResult(*reference.causal_conv1d_silu(x, weight, tail, snapshots=snapshots))


def linear_attention(x, conv_weight, a, b, gate, decay, norm, heads, tail=None, state=None, *, snapshots=False):
    """A linear-attention layer's work between its projections (see `reference.linear_attention`):
    on the CPU one primitive of ours where it runs (a decode step's ~300 nodes fewer on
    Qwen3.5-0.8B, each microseconds on MLX's CPU stream); on a GPU one kernel where the rule runs
    token by token (decode steps, verify passes, short prompts: 17 launches fewer a layer); else
    the single ops above, each on the path it chooses."""
    platform = backend.kernel_platform()
    dtypes = {array.dtype for array in (x, conv_weight, a, b, gate, *decay, norm.weight)}
    width = conv_weight.shape[-1]
    variant = (a.ndim == 4, norm.activation, snapshots, x.dtype, heads.key_dim, heads.value_dim, width)
    if (
        platform
        and (snapshots or x.shape[1] < CHUNKED_MIN_TOKENS)
        and dtypes <= set(KERNEL_DTYPES)
        and heads.key_dim <= KERNEL_MAX_KEY_DIM
        and width >= 2
        and selfcheck.passed(gpu_kernels.LINEAR_ATTENTION, selfcheck.small_linear_attention_case, platform, *variant)
    ):
        launch = gpu_kernels.linear_attention_launch(
            x, conv_weight, a, b, gate, decay, norm, heads, tail, state, snapshots
        )
        out, new_tail, new_state, tails, states = gpu_kernels.run(gpu_kernels.LINEAR_ATTENTION, launch, platform)
        per_token = (reference.per_token(tails), reference.per_token(states)) if snapshots else (None, None)
        return LayerResult(out, new_tail, new_state, *per_token)
    if (
        platform is None
        and x.dtype == mx.float32
        and 2 <= width <= CPU_CONV_MAX_WIDTH
        and backend.cpu_kernel_passed(
            LINEAR_ATTENTION, selfcheck.small_linear_attention_case, a.ndim == 4, norm.activation, snapshots
        )
    ):
        return cpu_kernels.linear_attention(
            x, conv_weight, a, b, gate, decay, norm, heads, tail, state, snapshots=snapshots
        )
    return reference.linear_attention(
        x,
        conv_weight,
        a,
        b,
        gate,
        decay,
        norm,
        heads,
        tail,
        state,
        snapshots=snapshots,
        conv=conv1d_update,
        rule=gated_delta_update,
        l2=l2_normalize,
        rms=rms_norm,
    )
