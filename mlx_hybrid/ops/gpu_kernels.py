"""Custom kernels for the linear-attention ops: one body, three runners.

Each kernel body in `metal/` is written once, in the Metal dialect that
`mx.fast.metal_kernel` compiles. The same text runs
- on Apple GPUs through `mx.fast.metal_kernel`;
- on NVIDIA GPUs through `mx.fast.cuda_kernel`, behind `CUDA_PRELUDE`, a thin
  macro layer that maps the few Metal names the bodies use onto CUDA;
- on the CPU in the test suite, compiled by g++ behind an emulation shim
  (tests/emulation), which is how the bodies are checked without a Mac.

`*_launch` functions describe a call (inputs, template arguments, grid, output
shapes) independently of the runner, so all three run exactly the same launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from .reference import L2_EPS

SOURCE_DIRS = [Path(__file__).resolve().parents[2] / "metal", Path(__file__).resolve().parent / "metal"]


@dataclass(frozen=True)
class KernelSpec:
    name: str
    file: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    # False: inputs arrive as they are (a cache's views), the body reading them through `name_strides`
    contiguous_inputs: bool = True
    # what computes the op when this kernel's first-call check fails (the warning's last words)
    fallback: str = "using the pure-MLX path for it"

    @property
    def path(self) -> Path:
        for directory in SOURCE_DIRS:
            if (directory / self.file).is_file():
                return directory / self.file
        raise FileNotFoundError(f"kernel source {self.file} not found in {SOURCE_DIRS}")

    @property
    def source(self) -> str:
        return self.path.read_text()


@dataclass
class Launch:
    inputs: list  # mx.array, in the order of the spec's input_names
    template: list  # (name, mx.Dtype | int | bool)
    grid: tuple[int, int, int]  # threads, as Metal's dispatchThreads
    threadgroup: tuple[int, int, int]
    output_shapes: list
    output_dtypes: list


GATED_DELTA = KernelSpec(
    "mlx_hybrid_gated_delta",
    "gated_delta.metal",
    ("q", "k", "v", "g", "beta", "state_in"),
    ("out", "state_out", "snapshots"),
)
CONV1D_SILU = KernelSpec(
    "mlx_hybrid_conv1d_silu",
    "conv1d_silu.metal",
    ("x", "weight", "tail_in"),
    ("y", "tail_out", "snapshots"),
)

LINEAR_ATTENTION = KernelSpec(
    "mlx_hybrid_linear_attention",
    "linear_attention.metal",
    ("x", "conv_weight", "a", "b", "gate", "A", "dt_bias", "norm_weight", "scalars", "tail_in", "state_in"),
    ("out", "tail_out", "state_out", "tail_snapshots", "state_snapshots"),
)
ADD_RMS_NORM = KernelSpec(
    "mlx_hybrid_add_rms_norm", "add_rms_norm.metal", ("x", "y", "weight", "eps"), ("total", "normed")
)
# the most threads a residual + norm row takes (each then sums features / threads values)
ADD_RMS_NORM_THREADS = 256

# the most simdgroups a linear-attention threadgroup takes (at most the body's MaxGroups), each
# holding value_dim / groups columns of a head's state: 16 x 32 threads, under any GPU's limit
LINEAR_ATTENTION_GROUPS = 16


def gated_delta_launch(q, k, v, g, beta, state, snapshots: bool) -> Launch:
    B, T, Hv, Dv = v.shape
    Dk = q.shape[-1]
    if state is None:
        state = mx.zeros((B, Hv, Dk, Dv), dtype=mx.float32)
    dtype = q.dtype
    inputs = [x.astype(dtype) for x in (q, k, v, g, beta)] + [state.astype(mx.float32)]
    return Launch(
        inputs=inputs,
        template=[("T", dtype), ("Dk", Dk), ("VectorGate", g.ndim == 4), ("Snapshots", snapshots)],
        grid=(32, Dv, B * Hv),
        # dividing the grid exactly, so CUDA's rounded-up blocks launch no extra threads
        threadgroup=(32, math.gcd(Dv, 4), 1),
        output_shapes=[(B, T, Hv, Dv), (B, Hv, Dk, Dv), (B, T, Hv, Dk, Dv) if snapshots else (1,)],
        output_dtypes=[mx.float32] * 3,
    )


def conv1d_silu_launch(x, weight, tail, snapshots: bool) -> Launch:
    B, T, C = x.shape
    K = weight.shape[-1]
    if tail is None:
        tail = mx.zeros((B, K - 1, C), dtype=x.dtype)
    return Launch(
        inputs=[x, weight.astype(mx.float32), tail.astype(x.dtype)],
        template=[("T", x.dtype), ("K", K), ("Snapshots", snapshots)],
        grid=(C, B, 1),
        threadgroup=(math.gcd(C, 256), 1, 1),
        output_shapes=[(B, T, C), (B, K - 1, C), (B, T, K - 1, C) if snapshots else (1,)],
        output_dtypes=[x.dtype] * 3,
    )


def linear_attention_launch(x, conv_weight, a, b, gate, decay, norm, heads, tail, state, snapshots: bool) -> Launch:
    """ops.linear_attention's arguments (see reference.linear_attention) as one launch of the
    linear-attention body: a threadgroup per sequence and value head."""
    B, T, C = x.shape
    Hk, Hv, Dk, Dv = heads
    K = conv_weight.shape[-1]
    if tail is None:
        tail = mx.zeros((B, K - 1, C), dtype=x.dtype)
    if state is None:
        state = mx.zeros((B, Hv, Dk, Dv), dtype=mx.float32)
    # the fewest columns a simdgroup that divide the head's, in at most LINEAR_ATTENTION_GROUPS simdgroups
    columns = next(c for c in range(1, Dv + 1) if Dv % c == 0 and Dv // c <= LINEAR_ATTENTION_GROUPS)
    scalars = _float32_constants(norm.eps, L2_EPS, Dk**-0.5)
    f32 = mx.float32
    flags = {"VectorGate": a.ndim == 4, "SigmoidGate": norm.activation == "sigmoid", "Snapshots": snapshots}
    return Launch(
        # the weights as stored (the body reads them into float32): no cast to launch each step
        inputs=[x, conv_weight, a, b, gate, *decay, norm.weight, scalars, tail.astype(x.dtype), state.astype(f32)],
        template=[("T", x.dtype), ("Dk", Dk), ("K", K), ("Columns", columns), *flags.items()],
        grid=(32, Dv // columns, B * Hv),
        threadgroup=(32, Dv // columns, 1),
        output_shapes=[(B, T, Hv * Dv), (B, K - 1, C), (B, Hv, Dk, Dv)]
        + ([(B, T, K - 1, C), (B, T, Hv, Dk, Dv)] if snapshots else [(1,), (1,)]),
        output_dtypes=[x.dtype, x.dtype, f32, x.dtype, f32],
    )


@lru_cache(maxsize=None)
def _float32_constants(*values: float) -> mx.array:
    """A launch's scalar arguments as one float32 input, made once (every layer of every step asks)."""
    return mx.array(values, dtype=mx.float32)


def add_rms_norm_launch(x, y, weight, eps: float) -> Launch:
    """(x + y, rms_norm(x + y, weight, eps)) over the last axis, a threadgroup a row."""
    N = x.shape[-1]
    rows = x.size // N
    threads = min(ADD_RMS_NORM_THREADS, 32 * math.ceil(N / 32))
    return Launch(
        inputs=[x.reshape(rows, N), y.reshape(rows, N), weight, _float32_constants(eps)],
        template=[("T", x.dtype), ("Threads", threads)],
        grid=(threads, rows, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )


# Maps the Metal names the bodies use onto CUDA. mx.fast.cuda_kernel turns template
# arguments into constexpr values at the top of the body and launches
# ceil(grid / threadgroup) blocks; the launches above divide their grids exactly.
CUDA_PRELUDE = r"""
typedef unsigned int uint;
#define thread_position_in_grid \
    make_uint3(blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y, \
               blockIdx.z * blockDim.z + threadIdx.z)
#define thread_index_in_simdgroup (threadIdx.x & 31u)
#define threadgroup_barrier(flags) __syncthreads()
#define threadgroup __shared__
namespace metal {
__device__ inline float exp(float x) { return expf(x); }
__device__ inline float log(float x) { return logf(x); }
__device__ inline float rsqrt(float x) { return rsqrtf(x); }
__device__ inline float fma(float a, float b, float c) { return fmaf(a, b, c); }
}
__device__ inline float simd_sum(float value) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    }
    return value;
}
// last: CUDA's own __device__ is built from the word `device`
#define device
#define constant
"""


@lru_cache(maxsize=None)
def _metal_kernel(spec: KernelSpec):
    return mx.fast.metal_kernel(
        name=spec.name,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source,
        ensure_row_contiguous=spec.contiguous_inputs,
    )


@lru_cache(maxsize=None)
def _cuda_kernel(spec: KernelSpec):
    return mx.fast.cuda_kernel(
        name=spec.name,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source,
        header=CUDA_PRELUDE,
        ensure_row_contiguous=spec.contiguous_inputs,
    )


def _run_compiled(kernel, launch: Launch):
    return kernel(
        inputs=launch.inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
    )


# platform -> runner(spec, launch) -> outputs; the test suite adds its g++ emulation here
RUNNERS = {
    "metal": lambda spec, launch: _run_compiled(_metal_kernel(spec), launch),
    "cuda": lambda spec, launch: _run_compiled(_cuda_kernel(spec), launch),
}


def run(spec: KernelSpec, launch: Launch, platform: str):
    """Run a launch on a platform of RUNNERS ('metal', 'cuda')."""
    return RUNNERS[platform](spec, launch)
