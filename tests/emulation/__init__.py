"""Run the Metal kernel bodies of metal/ on the CPU: g++ behind metal_shim.h.

`emulate(spec, launch)` takes the same KernelSpec and Launch the GPU runners take,
writes the function signature the way mx.fast.metal_kernel does (inputs, their
`_shape` arrays when the body uses them, outputs, template arguments as
constants), compiles it once per distinct source, and runs every thread of the grid.

The signature was checked against MLX's own generator: `write_signature` and the
attribute table in mlx/backend/common/metal_kernel.cpp at v0.32.1 (lines 52-160 and
255-257), and in mlx/backend/metal/custom_kernel.cpp at v0.29.0, the oldest version
the package allows (lines 52-115, 207-209). Inputs are `const device T*` (`const
constant T*` below 8 elements, which the shim's empty `constant` makes the same here,
and which the bodies never name), `name_shape` is `const constant int*` when the body
uses it, `name_strides` is `const constant int64_t*` (in elements) when the body uses it (the
inputs of a kernel that takes them as they are: MLX's `ensure_row_contiguous=False`), `name_ndim`
`const constant int&` when the body uses it, outputs are
`device T*`, and `thread_position_in_grid` (uint3) and
`thread_index_in_simdgroup` (uint) are the attributes the bodies use. MLX makes the
template arguments template parameters; here they are constants of the same names.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).parent
BUILD = Path(tempfile.gettempdir()) / "mlx_hybrid_kernel_emulation"
# MLX dtype -> (the Metal type, the numpy type its elements travel as); 16-bit floats travel as
# their bits
C_TYPES = {
    mx.float32: ("float", np.float32),
    mx.int32: ("int", np.int32),
    mx.uint32: ("uint", np.uint32),
    mx.bfloat16: ("bfloat", np.uint16),
    mx.float16: ("half", np.uint16),
}


def render(spec, launch) -> str:
    source = spec.source
    params = []
    for name, array in zip(spec.input_names, launch.inputs):
        params.append(f"const device {C_TYPES[array.dtype][0]}* {name}")
        if f"{name}_shape" in source:
            params.append(f"const constant int* {name}_shape")
        if f"{name}_strides" in source:
            params.append(f"const constant int64_t* {name}_strides")
        if f"{name}_ndim" in source:
            params.append(f"const constant int& {name}_ndim")
    for name, dtype in zip(spec.output_names, launch.output_dtypes):
        params.append(f"device {C_TYPES[dtype][0]}* {name}")
    constants = []
    for name, value in launch.template:
        if isinstance(value, bool):
            constants.append(f"constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            constants.append(f"constexpr int {name} = {value};")
        else:
            constants.append(f"using {name} = {C_TYPES[value][0]};")
    return "\n".join(
        [
            '#include "metal_shim.h"',
            f'extern "C" long run({", ".join(params)}, uint gx, uint gy, uint gz, uint tx, uint ty, uint tz) {{',
            "    auto body = [&](uint3 thread_position_in_grid, uint thread_index_in_simdgroup) {",
            "        (void)thread_position_in_grid; (void)thread_index_in_simdgroup;",
            *("        " + c for c in constants),
            f'#line 1 "{spec.path}"',  # compiler messages and coverage name the kernel file
            source,
            "    };",
            "    return emu::dispatch(emu::body_of(body), uint3{gx, gy, gz}, uint3{tx, ty, tz});",
            "}",
            "#ifdef EMU_COVERAGE",  # counters reach the .gcda files only when asked (or at exit)
            'extern "C" void __gcov_dump(void);',
            'extern "C" void dump_coverage(void) { __gcov_dump(); }',
            "#endif",
        ]
    )


COMPILE = ["g++", "-std=c++17", "-fPIC"]
OPTIMIZED = [*COMPILE, "-O2"]  # the kernels' flags, which the precompiled shim must share for g++ to take it


def compile_source(code: str, coverage_dir: Path | None = None) -> ctypes.CDLL:
    shim = (HERE / "metal_shim.h").read_bytes()
    digest = hashlib.sha256(code.encode() + shim).hexdigest()[:16]
    build = coverage_dir or BUILD
    build.mkdir(parents=True, exist_ok=True)
    # sources and libraries built under names of this process's, the library then renamed: test
    # processes running at once (CI's two passes) never read a file another is still writing
    source = build / f"kernel_{digest}.{os.getpid()}.cpp"
    library = build / f"kernel_{digest}.so"
    if not library.exists() or coverage_dir:
        source.write_text(code)
        if coverage_dir:
            command = [*COMPILE, "--coverage", "-O0", "-DEMU_COVERAGE", "-I", str(HERE)]
        else:  # g++ reads the shim precompiled where it finds it first on the include path
            command = [*OPTIMIZED, "-I", str(_precompiled_shim(shim)), "-I", str(HERE)]
        partial = library.with_suffix(f".{os.getpid()}.so")
        subprocess.run([*command, "-shared", "-o", str(partial), str(source)], check=True, cwd=build)
        os.replace(partial, library)
    return ctypes.CDLL(str(library))


def _precompiled_shim(shim: bytes) -> Path:
    """A directory holding metal_shim.h precompiled with OPTIMIZED (a third of a kernel's compile time is
    the shim's headers; the suite compiles a few hundred kernels), named by the shim's contents: g++
    checks a precompiled header's flags, not whether its source has changed since."""
    directory = BUILD / f"shim_{hashlib.sha256(shim).hexdigest()[:16]}"
    header = directory / "metal_shim.h.gch"
    if not header.exists():
        directory.mkdir(parents=True, exist_ok=True)
        partial = header.with_suffix(f".{os.getpid()}.gch")
        subprocess.run([*OPTIMIZED, "-x", "c++-header", str(HERE / "metal_shim.h"), "-o", str(partial)], check=True)
        os.replace(partial, header)
    return directory


def emulate(spec, launch, coverage_dir: Path | None = None, strided: bool = False):
    """Outputs as numpy arrays (16-bit ones as float32), and the number of simd_sum barriers
    the run went through. strided: the inputs a body reads through their strides lie inside
    larger buffers (every axis one longer), as a cache's views do, so that no stride is the
    contiguous one."""
    library = compile_source(render(spec, launch), coverage_dir)
    source = spec.source
    args, keep = [], []
    for name, array in zip(spec.input_names, launch.inputs):
        data = np.ascontiguousarray(np.array(array.view(mx.uint16) if array.itemsize == 2 else array))
        assert data.dtype == C_TYPES[array.dtype][1]
        takes_strides = f"{name}_strides" in source
        if strided and takes_strides:
            buffer = np.zeros([n + 1 for n in data.shape], data.dtype)
            buffer[tuple(slice(0, n) for n in data.shape)] = data
            data = buffer[tuple(slice(0, n) for n in data.shape)]
        keep.append(data)
        args.append(ctypes.c_void_p(data.__array_interface__["data"][0]))
        if f"{name}_shape" in source:
            shape = np.array(array.shape, dtype=np.int32)
            keep.append(shape)
            args.append(shape.ctypes.data_as(ctypes.c_void_p))
        if takes_strides:
            strides = np.array([n // data.itemsize for n in data.strides], dtype=np.int64)
            keep.append(strides)
            args.append(strides.ctypes.data_as(ctypes.c_void_p))
        if f"{name}_ndim" in source:  # a reference: its address
            ndim = np.array([array.ndim], dtype=np.int32)
            keep.append(ndim)
            args.append(ndim.ctypes.data_as(ctypes.c_void_p))
    outputs = [
        np.zeros(shape, dtype=C_TYPES[dtype][1]) for shape, dtype in zip(launch.output_shapes, launch.output_dtypes)
    ]
    args += [out.ctypes.data_as(ctypes.c_void_p) for out in outputs]
    library.run.restype = ctypes.c_long
    barriers = library.run(*args, *map(ctypes.c_uint, launch.grid), *map(ctypes.c_uint, launch.threadgroup))
    if coverage_dir:
        library.dump_coverage()
    return [_values(out, dtype) for out, dtype in zip(outputs, launch.output_dtypes)], barriers


def _values(out: np.ndarray, dtype) -> np.ndarray:
    """An output as numpy reads it: a 16-bit float's bits as float32 (every value exact)."""
    if out.dtype != np.uint16:
        return out
    return np.array(mx.array(out).view(dtype).astype(mx.float32))
