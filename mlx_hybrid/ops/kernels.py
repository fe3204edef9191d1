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

SOURCE_DIRS = [Path(__file__).resolve().parents[2] / "metal", Path(__file__).resolve().parent / "metal"]


@dataclass(frozen=True)
class KernelSpec:
    name: str
    file: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

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


# Maps the Metal names the bodies use onto CUDA. mx.fast.cuda_kernel turns template
# arguments into constexpr values at the top of the body and launches
# ceil(grid / threadgroup) blocks; the launches above divide their grids exactly.
CUDA_PRELUDE = r"""
typedef unsigned int uint;
#define thread_position_in_grid \
    make_uint3(blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y, \
               blockIdx.z * blockDim.z + threadIdx.z)
#define thread_index_in_simdgroup (threadIdx.x & 31u)
namespace metal {
__device__ inline float exp(float x) { return expf(x); }
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
        name=spec.name, input_names=list(spec.input_names), output_names=list(spec.output_names), source=spec.source
    )


@lru_cache(maxsize=None)
def _cuda_kernel(spec: KernelSpec):
    return mx.fast.cuda_kernel(
        name=spec.name,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source,
        header=CUDA_PRELUDE,
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
