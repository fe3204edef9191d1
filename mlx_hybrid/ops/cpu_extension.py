"""Our kernels for MLX's CPU backend on x86-64 (csrc/cpu_kernels.cpp: quantized products, the
gated delta rule and the conv before it, the norms, a linear-attention layer's steps fused,
attention of a few tokens and the rotary embedding, SiLU and sigmoid gates, each an MLX
primitive), built on first use with the system's C++ compiler against MLX's headers and the
nanobind sources, cached per source and toolchain.

Where the module cannot be built (no compiler, no nanobind, a CPU without AVX2/FMA/F16C) one
warning names why, and MLX's ops compute.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import platform
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from ..native import BuildError, build_once, compiler
from ..timing import one_time_work


@dataclass(frozen=True)
class CpuKernel:
    """One of our CPU kernels: what its first-call check is known by, its C++ unit in csrc/, and what
    computes in its place when that check fails (the warning's last words)."""

    name: str
    file: str
    fallback: str = "MLX's ops compute it instead"


# Every CPU kernel, the one list: the units are built from it (the quantized products' first, the
# longest to compile), then cpu_kernels.cpp, which defines the module and binds each unit's calls.
QUANTIZED = CpuKernel("quantized products", "quantized_matmul.cpp")
LINEAR_ATTENTION = CpuKernel("linear-attention layer", "linear_attention.cpp")
GATED_DELTA = CpuKernel("gated delta rule", "gated_delta.cpp")
CONV1D = CpuKernel("causal conv1d + SiLU", "conv1d_silu.cpp")
NORMS = CpuKernel("norms", "rms_norm.cpp")
ATTENTION = CpuKernel("attention", "attention.cpp")
ROPE = CpuKernel("rotary embedding", "attention.cpp")  # attention's unit, a first-call check of its own
GATED_PRODUCT = CpuKernel("gated products", "gated_product.cpp")
INT8_PRODUCTS = CpuKernel(
    "products with 8-bit activations",
    "int8_products.cpp",
    "GGUF files' products take float32 activations instead of llama.cpp's 8-bit ones",
)
KERNELS = (QUANTIZED, LINEAR_ATTENTION, GATED_DELTA, CONV1D, NORMS, ATTENTION, ROPE, GATED_PRODUCT, INT8_PRODUCTS)

_CSRC = Path(__file__).resolve().parents[1] / "csrc"
_UNITS = [_CSRC / name for name in (*dict.fromkeys(kernel.file for kernel in KERNELS), "cpu_kernels.cpp")]
_SOURCES = [*_UNITS, _CSRC / "cpu_kernels.h", _CSRC / "gguf_grid.h", _CSRC / "quantized_matmul_body.inc"]
_MODULE = "cpu_kernels_ext"

_log = logging.getLogger("mlx_hybrid")


class Unavailable(RuntimeError):
    pass


def _build() -> Path:
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")):
        raise Unavailable("they are built for x86-64 Linux only")
    cxx = compiler("c++")
    if cxx is None:
        raise Unavailable("no C++ compiler was found (set CXX)")
    try:
        import nanobind
    except ImportError:
        raise Unavailable("the nanobind package is not installed") from None
    mlx_dir = Path(mx.__file__).parent  # not mlx.__path__[0], which may be any directory named mlx
    nb_include = Path(nanobind.include_dir())
    includes = [mlx_dir / "include", nb_include, nb_include.parent / "ext" / "robin_map" / "include"]
    includes.append(Path(sysconfig.get_paths()["include"]))
    if not (includes[-1] / "Python.h").is_file():
        raise Unavailable(f"Python's headers are missing ({includes[-1]}; Debian: apt install python3-dev)")
    # compiled side by side, the longest first: the quantized products' two instruction-set builds,
    # then nanobind's sources (the build takes about as long as its longest unit)
    units = [_UNITS[0], Path(nanobind.source_dir()) / "nb_combined.cpp", *_UNITS[1:]]
    flags = [
        "-O3", "-std=c++20", "-fPIC", "-fvisibility=hidden", "-DNDEBUG",
        "-DNB_DOMAIN=mlx",  # mlx.core's nanobind domain: arrays pass between the modules
        *[f"-I{d}" for d in includes],
    ]  # fmt: skip
    compile_steps = [[cxx, *flags, "-c", str(unit), "-o", f"{i}.o"] for i, unit in enumerate(units)]

    def command(out):
        objects = [f"{i}.o" for i in range(len(units))]
        lib = mlx_dir / "lib"
        return [cxx, "-shared", *objects, f"-L{lib}", "-lmlx", f"-Wl,-rpath,{lib}", "-o", str(out)]

    identity = f"{mx.__version__} {nanobind.__version__} {sysconfig.get_config_var('EXT_SUFFIX')} {cxx}"
    try:
        announce = "mlx_hybrid: building its CPU kernels for this machine (once, about a minute)..."
        return build_once(_MODULE, _SOURCES, command, identity, compile_steps=compile_steps, announce=announce)
    except BuildError as e:
        raise Unavailable(str(e)) from None


@lru_cache(maxsize=None)
def extension():
    """The extension module, or None (after one warning saying why)."""
    with one_time_work():
        return _load()


def _load():
    try:
        path = _build()
        loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
        spec = importlib.util.spec_from_file_location(_MODULE, str(path), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        if not module.supported():
            raise Unavailable("this CPU lacks AVX2, FMA or F16C")
    except (Unavailable, ImportError, OSError) as e:
        _log.warning("mlx_hybrid: our CPU kernels are not in use (%s); MLX's slower ops compute", e)
        return None
    return module
