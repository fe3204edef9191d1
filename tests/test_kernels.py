"""The kernel bodies of metal/, run by the g++ emulation, against the pure-MLX reference.

Like llama.cpp's backend-op tests: every kernel over a grid of shapes. These run
on Linux in CI; on a Mac or an NVIDIA machine the same launches run on the GPU
(test_kernels_on_gpu below).
"""

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from emulation import emulate
from mlx_hybrid import ops
from mlx_hybrid.ops import gpu_kernels, reference, row_kernels
from mlx_hybrid.ops.reference import QuantizedEntries
from mlx_hybrid.ops.selfcheck import linear_attention_args
from test_ops import OP_TOL, make_inputs

ROOT = Path(__file__).resolve().parents[1]
TOL = OP_TOL  # a kernel's sums against the reference recurrence's: two float32 orders


def check_gated_delta(B, T, Hk, Hv, Dk, Dv, vector_gate, snapshots, run, dtype=mx.float32):
    """The kernel against the reference recurrence, q, k, v, g and beta in `dtype` (the state,
    the output and the snapshots float32 either way)."""
    inputs = [mx.array(x) for x in make_inputs(B, T, Hk, Hv, Dk, Dv, vector_gate, seed=B + T + Dk + Dv + Hv)]
    inputs = [x.astype(dtype) for x in inputs[:5]] + inputs[5:]
    (out, state, states), barriers = run(gpu_kernels.GATED_DELTA, gpu_kernels.gated_delta_launch(*inputs, snapshots))
    want_out, want_state, want_states = reference.gated_delta_recurrent(*inputs, snapshots=snapshots)
    np.testing.assert_allclose(out, np.array(want_out), atol=TOL, rtol=0)
    np.testing.assert_allclose(state, np.array(want_state), atol=TOL, rtol=0)
    if snapshots:
        np.testing.assert_allclose(states, np.array(mx.stack(want_states, axis=1)), atol=TOL, rtol=0)
    return barriers


# A 16-bit output is a float32 result rounded to the dtype: the kernel's and the reference's
# float32 values (SiLU written two ways, exp from two libraries) may round to neighbouring
# values, one step of the dtype's precision (relative) apart. Emulated, all 20,448 conv outputs
# of test_kernels_take_16_bit_inputs came out bit-equal in either dtype; a GPU's exp is another.
ROUNDING_STEP = {mx.float32: 0.0, mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10}


def check_conv(B, T, C, K, snapshots, run, dtype=mx.float32):
    """The kernel against the pure-MLX form, x and the tail in `dtype` (the weights float32): the
    output within TOL and a rounding step of the dtype, the tails exact (copies of inputs)."""
    rng = np.random.default_rng(T * 7 + B + C)
    x, w, tail = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in [(B, T, C), (C, K), (B, K - 1, C)])
    x, tail = x.astype(dtype), tail.astype(dtype)
    (y, new_tail, tails), _ = run(gpu_kernels.CONV1D_SILU, gpu_kernels.conv1d_silu_launch(x, w, tail, snapshots))
    want_y, want_tail, want_tails = reference.causal_conv1d_silu(x, w, tail, snapshots=snapshots)
    want_y = np.array(want_y.astype(mx.float32))
    assert (np.abs(y - want_y) <= TOL + ROUNDING_STEP[dtype] * np.abs(want_y)).all(), np.abs(y - want_y).max()
    np.testing.assert_array_equal(new_tail, np.array(want_tail.astype(mx.float32)))
    if snapshots:
        np.testing.assert_array_equal(tails, np.array(mx.stack(want_tails, axis=1).astype(mx.float32)))


def check_linear_attention(B, T, heads, K, vector_gate, activation, snapshots, run, dtype=mx.float32):
    """The layer body against the pure-MLX composition (reference.linear_attention), x, a, b, the
    gate and the tail in `dtype`: outputs and states within TOL, and in 16 bits within a rounding
    step of their scale (a conv output the kernel rounds to the other neighbouring value moves the
    rest by about that), the tails exact (copies of inputs). Returns the simd_sum count and the launch."""
    rng = np.random.default_rng(B * 100 + T + heads.key_dim + heads.value_dim)
    args = linear_attention_args(rng, B, T, heads, K, vector_gate, activation, dtype)
    launch = gpu_kernels.linear_attention_launch(*args, snapshots)
    outputs, barriers = run(gpu_kernels.LINEAR_ATTENTION, launch)
    want = reference.linear_attention(*args, snapshots=snapshots)
    pairs = [(outputs[0], want.out), (outputs[2], want.state)]
    copies = [(outputs[1], want.tail)]
    if snapshots:
        pairs.append((outputs[4], mx.stack(want.state_snapshots, axis=1)))
        copies.append((outputs[3], mx.stack(want.tail_snapshots, axis=1)))
    for got, expected in pairs:
        expected = np.array(expected.astype(mx.float32))
        atol = TOL + ROUNDING_STEP[dtype] * np.abs(expected).max()
        np.testing.assert_allclose(got, expected, atol=atol, rtol=0)
    for got, expected in copies:
        np.testing.assert_array_equal(got, np.array(expected.astype(mx.float32)))
    return barriers, launch


# (B, T, Hk, Hv, Dk, Dv, K): lanes partly idle (Dk 20, 48) or holding several rows (128); one column
# a simdgroup (Dv 16: 16 simdgroups), 4 (44: 11) or 8 (128: 16); value heads sharing a key head
LAYER_SHAPES = [(2, 5, 1, 2, 20, 44, 4), (1, 65, 1, 3, 48, 16, 2), (2, 3, 2, 4, 128, 128, 4)]
LAYER_KINDS = {"gdn": (False, "silu"), "kda": (True, "sigmoid")}


@pytest.mark.parametrize("kind,snapshots", list(itertools.product(LAYER_KINDS, [False, True])))
def test_linear_attention_kernel_grid(kind, snapshots):
    for B, T, Hk, Hv, Dk, Dv, K in LAYER_SHAPES:
        heads = reference.HeadShape(Hk, Hv, Dk, Dv)
        barriers, launch = check_linear_attention(B, T, heads, K, *LAYER_KINDS[kind], snapshots, emulate)
        columns = dict(launch.template)["Columns"]
        # every simdgroup (one per sequence, value head and Columns columns) met the two L2 sums and
        # two sums a column, every token
        assert barriers == B * Hv * (Dv // columns) * T * (2 + 2 * columns)


def check_add_rms_norm(rows, N, run, dtype=mx.float32):
    """The residual + norm body against MLX's sum (equal: one rounding of the same float32 sum) and
    reference.rms_norm (within TOL of the row's scale for float32: sums of squares in two orders;
    one rounding step of the dtype in 16 bits)."""
    rng = np.random.default_rng(rows * 1000 + N)
    x, y = (mx.array(rng.standard_normal((rows, N)).astype(np.float32)).astype(dtype) for _ in range(2))
    weight = mx.array((1 + 0.5 * rng.standard_normal(N)).astype(np.float32)).astype(dtype)
    (total, normed), barriers = run(gpu_kernels.ADD_RMS_NORM, gpu_kernels.add_rms_norm_launch(x, y, weight, 1e-6))
    np.testing.assert_array_equal(total, np.array((x + y).astype(mx.float32)))
    want = np.array(reference.rms_norm(x + y, weight, 1e-6).astype(mx.float32))
    assert (np.abs(normed - want) <= TOL + ROUNDING_STEP[dtype] * np.abs(want)).all(), np.abs(normed - want).max()
    return barriers


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["float32", "bfloat16", "float16"])
def test_add_rms_norm_kernel_grid(dtype):
    # features: fewer than a simdgroup, a partial one, a full threadgroup's worth, several per thread
    for rows, N in itertools.product([1, 3], [16, 200, 256, 1000, 2048]):
        barriers = check_add_rms_norm(rows, N, emulate, dtype)
        assert barriers == rows * min(8, -(-N // 32))  # one simd_sum per simdgroup a row


@pytest.mark.parametrize(
    "Dk,vector_gate,snapshots", list(itertools.product([16, 32, 64, 128], [False, True], [False, True]))
)
def test_gated_delta_kernel_grid(Dk, vector_gate, snapshots):
    """Dv x (Hv/Hk) x T x batch for each key size, gate kind and snapshot setting."""
    # tokens: a decode step, a verify pass, a prompt chunk (past 64: a lane's loop over many tokens)
    for Dv, ratio, T, B in itertools.product([16, 64, 128], [1, 2, 4], [1, 5, 65], [1, 2]):
        barriers = check_gated_delta(B, T, 1, ratio, Dk, Dv, vector_gate, snapshots, emulate)
        # every simdgroup (one per batch, value head and column) met both simd_sums every token
        assert barriers == 2 * T * B * ratio * Dv


@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4), (3, 12)])
def test_gated_delta_kernel_maps_value_heads_to_key_heads(Hk, Hv):
    check_gated_delta(2, 3, Hk, Hv, 32, 16, False, True, emulate)


@pytest.mark.parametrize("K,snapshots", list(itertools.product([2, 4], [False, True])))
def test_conv_kernel_grid(K, snapshots):
    for T, B, C in itertools.product([1, 5, 65], [1, 2], [24, 264]):
        check_conv(B, T, C, K, snapshots, emulate)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
def test_kernels_take_16_bit_inputs(dtype):
    """A GPU's default dtypes: inputs in 16 bits, sums in float32; the rule's output and states
    float32, the conv's output and tails in the input's dtype."""
    for T, B, K, snapshots in itertools.product([1, 5, 65], [1, 2], [2, 4], [False, True]):
        check_conv(B, T, 24, K, snapshots, emulate, dtype)
    for T, vector_gate, snapshots in itertools.product([1, 5], [False, True], [False, True]):
        check_gated_delta(2, T, 1, 2, 32, 16, vector_gate, snapshots, emulate, dtype)
    for kind, snapshots in (("gdn", False), ("kda", True)):
        check_linear_attention(
            2, 5, reference.HeadShape(1, 2, 20, 44), 4, *LAYER_KINDS[kind], snapshots, emulate, dtype
        )


def _gcov_unexecuted(build: Path, source_name: str) -> list[str]:
    """Executable lines of a kernel body that no emulated run reached (gcov's '#####')."""
    subprocess.run(
        ["gcov", "-o", str(build), *map(str, build.glob("*.gcda"))], cwd=build, capture_output=True, check=True
    )
    report = build / f"{source_name}.gcov"
    assert report.exists(), f"gcov wrote no report for {source_name}"
    lines = report.read_text().splitlines()
    assert sum(bool(re.match(r"\s*\d+\*?:", line)) for line in lines) > 10, "the report counts no kernel lines"
    return [line for line in lines if re.match(r"\s*#####:", line)]


@pytest.mark.skipif(shutil.which("gcov") is None, reason="needs gcov")
def test_every_line_of_every_kernel_body_runs(tmp_path):
    """With all template variants run, gcov finds no kernel line left unexecuted (no dead branch)."""
    for i, (vector_gate, snapshots) in enumerate(itertools.product([False, True], [False, True])):
        inputs = [mx.array(x) for x in make_inputs(1, 3, 1, 2, 48, 16, vector_gate)]  # Dk=48: a partly idle lane
        emulate(
            gpu_kernels.GATED_DELTA,
            gpu_kernels.gated_delta_launch(*inputs, snapshots),
            coverage_dir=tmp_path / f"gd{i}",
        )
    for i, (K, snapshots) in enumerate(itertools.product([2, 4], [False, True])):
        x, w, tail = mx.ones((1, 3, 8)), mx.ones((8, K)), mx.ones((1, K - 1, 8))
        emulate(
            gpu_kernels.CONV1D_SILU,
            gpu_kernels.conv1d_silu_launch(x, w, tail, snapshots),
            coverage_dir=tmp_path / f"cv{i}",
        )
    for i, ((vector_gate, activation), snapshots) in enumerate(itertools.product(LAYER_KINDS.values(), [False, True])):
        args = linear_attention_args(  # Dk=48: a partly idle lane
            np.random.default_rng(0), 1, 3, reference.HeadShape(1, 2, 48, 16), 4, vector_gate, activation, mx.float32
        )
        launch = gpu_kernels.linear_attention_launch(*args, snapshots)
        emulate(gpu_kernels.LINEAR_ATTENTION, launch, coverage_dir=tmp_path / f"la{i}")
    x = mx.ones((2, 200))
    emulate(gpu_kernels.ADD_RMS_NORM, gpu_kernels.add_rms_norm_launch(x, x, x[0], 1e-6), coverage_dir=tmp_path / "an0")
    # products: float and 4-bit, plain (3 rows in a tile of 4, 13 columns) and over experts (3 tokens' rows)
    x, w = mx.ones((3, 1, 1, 64)), mx.ones((2, 13, 64))
    codes, scales, biases = mx.quantize(w, group_size=32, bits=4)
    for i, (experts, quantized) in enumerate(itertools.product([False, True], [False, True])):
        matrices = dict(w=codes, scales=scales, biases=biases, bits=4, group_size=32) if quantized else dict(w=w)
        if not experts:
            matrices = {name: a[0] if isinstance(a, mx.array) else a for name, a in matrices.items()}
        indices = mx.array([[0], [1], [1]], mx.int32) if experts else None
        launch = row_kernels.product_launch(x, indices=indices, **matrices)
        emulate(row_kernels.ROW_PRODUCT, launch, coverage_dir=tmp_path / f"rp{i}")
    # attention: float and 4-bit entries, causal or not
    q, entries = mx.ones((1, 2, 2, 32)), mx.ones((1, 1, 5, 32))
    held = QuantizedEntries(*mx.quantize(entries, group_size=32, bits=4), 4, 32)
    for i, (causal, quantized) in enumerate(itertools.product([False, True], [False, True])):
        kv = (held, held) if quantized else (entries, entries)
        launch = row_kernels.attention_launch(q, *kv, 0.5, causal, mx.array([5], mx.int32))
        emulate(row_kernels.ROW_ATTENTION, launch, coverage_dir=tmp_path / f"ra{i}")
    for prefix, spec in (
        ("gd", gpu_kernels.GATED_DELTA),
        ("cv", gpu_kernels.CONV1D_SILU),
        ("la", gpu_kernels.LINEAR_ATTENTION),
        ("an", gpu_kernels.ADD_RMS_NORM),
        ("rp", row_kernels.ROW_PRODUCT),
        ("ra", row_kernels.ROW_ATTENTION),
    ):
        dead = None  # a line is dead only if no variant ran it
        for build in sorted(tmp_path.glob(f"{prefix}*")):
            lines = {int(line.split(":")[1]) for line in _gcov_unexecuted(build, spec.file)}
            dead = lines if dead is None else dead & lines
        assert not dead, f"{spec.file}: lines never executed: {sorted(dead)}"


# template arguments as mx.fast.cuda_kernel writes them, and the element types of the inputs and
# outputs where they are not float (the row kernels: bfloat16 rows over 4- and 8-bit codes)
CUDA_TEMPLATES = {
    gpu_kernels.GATED_DELTA: "using T = float; constexpr int Dk = 64; constexpr bool VectorGate = true; "
    "constexpr bool Snapshots = true;",
    gpu_kernels.CONV1D_SILU: "using T = float; constexpr int K = 4; constexpr bool Snapshots = true;",
    gpu_kernels.LINEAR_ATTENTION: "using T = float; constexpr int Dk = 128; constexpr int K = 4; "
    "constexpr int Columns = 8; constexpr bool VectorGate = true; constexpr bool SigmoidGate = false; "
    "constexpr bool Snapshots = true;",
    gpu_kernels.ADD_RMS_NORM: "using T = float; constexpr int Threads = 256;",
    row_kernels.ROW_PRODUCT: "using T = __nv_bfloat16; constexpr int Bits = 4; constexpr int GroupSize = 64; "
    "constexpr int Rows = 8; constexpr int Columns = 4; constexpr bool Experts = true; constexpr int Share = 8;",
    row_kernels.ROW_ATTENTION: "using T = __nv_bfloat16; constexpr int Bits = 8; constexpr int GroupSize = 64; "
    "constexpr int Dk = 256; constexpr int Dv = 256; constexpr bool Causal = true; constexpr int KeyGroups = 16;",
}
BF16 = "__nv_bfloat16"
CUDA_TYPES = {
    row_kernels.ROW_PRODUCT: {"x": BF16, "w": "uint32_t", "scales": BF16, "biases": BF16, "indices": "int",
                              "out": BF16},
    row_kernels.ROW_ATTENTION: {"q": BF16, "k": "uint32_t", "v": "uint32_t", "k_scales": BF16, "k_biases": BF16,
                                "v_scales": BF16, "v_biases": BF16, "lengths": "int", "out": BF16},
}  # fmt: skip


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compiles only; no GPU needed)")
@pytest.mark.parametrize("spec", list(CUDA_TEMPLATES), ids=lambda s: s.file)
def test_cuda_twin_compiles(spec, tmp_path):
    """The CUDA prelude + the same bodies, wrapped the way mx.fast.cuda_kernel wraps them (MLX's
    Shape and Strides: fixed arrays passed by value)."""
    types = CUDA_TYPES.get(spec, {})
    params = []
    for name in spec.input_names:
        params.append(f"const {types.get(name, 'float')}* {name}")
        if f"{name}_shape" in spec.source:
            params.append(f"const __grid_constant__ Shape {name}_shape")
        if f"{name}_strides" in spec.source:
            params.append(f"const __grid_constant__ Strides {name}_strides")
        if f"{name}_ndim" in spec.source:
            params.append(f"const __grid_constant__ int {name}_ndim")
    params += [f"{types.get(name, 'float')}* {name}" for name in spec.output_names]
    code = "\n".join(
        [
            "#include <cuda_bf16.h>",
            "#include <cstdint>",
            "struct Shape { int d[8]; __device__ int operator[](int i) const { return d[i]; } };",
            "struct Strides { long long d[8]; __device__ long long operator[](int i) const { return d[i]; } };",
            gpu_kernels.CUDA_PRELUDE,
            f"__global__ void kernel({', '.join(params)}) {{",
            CUDA_TEMPLATES[spec],
            spec.source,
            "}",
        ]
    )
    (tmp_path / "twin.cu").write_text(code)
    result = subprocess.run(
        ["nvcc", "-c", "-std=c++17", "twin.cu", "-o", "twin.o"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(ops.kernel_platform() is None, reason="no Metal or CUDA device here")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["float32", "bfloat16", "float16"])
def test_kernels_on_gpu(dtype):
    def on_gpu(spec, launch):
        return [np.array(o.astype(mx.float32)) for o in gpu_kernels.run(spec, launch, ops.kernel_platform())], None

    for Dk, Dv, ratio, T, vector_gate in itertools.product([16, 128], [16, 128], [1, 4], [1, 5, 65], [False, True]):
        check_gated_delta(2, T, 1, ratio, Dk, Dv, vector_gate, True, on_gpu, dtype)
    for K, snapshots, T, B in itertools.product([2, 4], [False, True], [1, 5, 65], [1, 2]):
        check_conv(B, T, 264, K, snapshots, on_gpu, dtype)
    for (B, T, Hk, Hv, Dk, Dv, K), kind, snapshots in itertools.product(LAYER_SHAPES, LAYER_KINDS, [False, True]):
        heads = reference.HeadShape(Hk, Hv, Dk, Dv)
        check_linear_attention(B, T, heads, K, *LAYER_KINDS[kind], snapshots, on_gpu, dtype)
    for rows, N in itertools.product([1, 3], [16, 200, 1024, 2048]):
        check_add_rms_norm(rows, N, on_gpu, dtype)


def test_only_the_ops_module_asks_which_device_runs():
    """Models, caches and the speculative loop never branch on the platform."""
    pattern = re.compile(r"mx\.metal|mx\.cuda|metal_kernel|cuda_kernel|mx\.gpu\b|mx\.cpu\b|default_device")
    offenders = []
    for path in (ROOT / "mlx_hybrid").rglob("*.py"):
        if path.parent.name == "ops":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
