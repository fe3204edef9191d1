"""MLX affine-quantized products on x86-64 CPUs through our extension
(csrc/quantized_matmul.cpp: an MLX primitive, built on first use with the system's C++
compiler against MLX's headers and the nanobind sources).

MLX's own CPU quantized matmul is a reference loop, about 13x slower for a decode step.
Where the extension cannot be built (no compiler, no nanobind, a CPU without AVX2/FMA/F16C)
one warning names why, and MLX's op computes.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import platform
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

import mlx
import mlx.core as mx

from ..native import BuildError, build_once, compiler
from ..quantized_tensor import BlockScales, QuantizedTensor

_SOURCES = [Path(__file__).resolve().parents[1] / "csrc" / name for name in ("quantized_matmul.cpp", "quantized_matmul_body.inc")]
_MODULE = "quantized_matmul_ext"
BITS = (4, 5, 6, 8)
GROUP_SIZES = (16, 32, 64, 128)  # 16: GGUF's Q6_K

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
    mlx_dir = Path(mlx.__path__[0])
    nb_include = Path(nanobind.include_dir())
    includes = [mlx_dir / "include", nb_include, nb_include.parent / "ext" / "robin_map" / "include"]
    includes.append(Path(sysconfig.get_paths()["include"]))
    if not (includes[-1] / "Python.h").is_file():
        raise Unavailable(f"Python's headers are missing ({includes[-1]}; Debian: apt install python3-dev)")
    sources = [str(_SOURCES[0]), str(Path(nanobind.source_dir()) / "nb_combined.cpp")]

    def command(out):
        return [
            cxx, "-O3", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-DNDEBUG",
            "-DNB_DOMAIN=mlx",  # mlx.core's nanobind domain: arrays pass between the modules
            *[f"-I{d}" for d in includes], *sources,
            f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(out),
        ]  # fmt: skip

    identity = f"{mx.__version__} {nanobind.__version__} {sysconfig.get_config_var('EXT_SUFFIX')} {cxx}"
    try:
        return build_once(_MODULE, _SOURCES, command, identity)
    except BuildError as e:
        raise Unavailable(str(e)) from None


@lru_cache(maxsize=None)
def extension():
    """The extension module, or None (after one warning saying why)."""
    try:
        path = _build()
        loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
        spec = importlib.util.spec_from_file_location(_MODULE, str(path), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        if not module.supported():
            raise Unavailable("this CPU lacks AVX2, FMA or F16C")
    except (Unavailable, ImportError, OSError) as e:
        _log.warning("mlx_hybrid: the CPU quantized kernels are not in use (%s); MLX's slower op computes", e)
        return None
    return module


def supports(bits: int, group_size: int) -> bool:
    # a kernel step spans at most two groups: 64 values at 4 bits, 32 at the others
    return bits in BITS and group_size in GROUP_SIZES and group_size * 2 >= (64 if bits == 4 else 32)


def random_weights(shape, bits: int, group_size: int, seed: int = 0):
    """Random (w, scales, biases) in the affine layout. MLX quantizes in groups of 32 at least:
    smaller groups halve its groups, each half given a scale and bias of its own."""
    dense = mx.random.normal(shape, key=mx.random.key(seed))
    if group_size >= 32:
        return mx.quantize(dense, group_size=group_size, bits=bits)
    w, scales, biases = mx.quantize(dense, group_size=32, bits=bits)
    halves = mx.array([1.0, -0.75])  # the halves differ in size and sign

    def split(part):
        return (mx.repeat(part, 2, axis=-1).reshape(*part.shape[:-1], -1, 2) * halves).reshape(*part.shape[:-1], -1)

    return w, split(scales), split(biases)


def random_block_weights(shape, bits: int, group_size: int, block: BlockScales, seed: int = 0) -> QuantizedTensor:
    """A random block-form tensor [..., N, K] (see BlockScales): float16 factors of both signs,
    codes over the whole int8 range GGUF uses (Q6_K's are signed, the k-quants' 0..63)."""
    *lead, N, K = shape
    keys = mx.random.split(mx.random.key(seed), 3)
    w = mx.random.randint(0, 256, (*lead, N, K * bits // 8), key=keys[0]).astype(mx.uint8).view(mx.uint32)
    groups = K // group_size
    factors = (mx.random.normal((*lead, N, groups // block.groups_per_factor * block.factor_count), key=keys[1]) / 64)
    codes = mx.random.randint(-64, 64, (*lead, N, groups * block.code_count), key=keys[2]).astype(mx.int8)
    return QuantizedTensor(w, factors.astype(mx.float16), codes, bits, group_size, block)


def _layout(block: BlockScales | None) -> dict:
    if block is None:
        return {}
    return {"groups_per_factor": block.groups_per_factor, "factor_count": block.factor_count,
            "code_count": block.code_count, "bias_ratio": block.bias_ratio}  # fmt: skip


def quantized_matmul(x, w, scales, biases, group_size: int, bits: int, block: BlockScales | None = None) -> mx.array:
    """x [..., K] @ W^T for W [N, K] in MLX's affine layout (or a block form): float32 [..., N]."""
    return extension().quantized_matmul(x, w, scales, biases, group_size, bits, **_layout(block))


def gather_quantized_matmul(x, w, scales, biases, indices, group_size: int, bits: int, block=None) -> mx.array:
    """x [T, 1 or k, K] against experts w [E, N, ...] chosen by indices [T, k]: float32 [T, k, N]."""
    return extension().gather_quantized_matmul(x, w, scales, biases, indices, group_size, bits, **_layout(block))


def small_case(_platform, bits: int, group_size: int, scales_form):
    """A first-use check of a variant (scales_form: the scales' dtype, or a BlockScales): 1 row
    (the small-row path), 9 rows (the tiled path) and gathered experts, against MLX's op on the
    same weights (its dequantized weights for the groups or forms its op refuses)."""
    K = max(64, 2 * group_size)
    if isinstance(scales_form, BlockScales):
        K = max(K, 2 * group_size * scales_form.groups_per_factor)
        tensor = random_block_weights((3, 24, K), bits, group_size, scales_form)
    else:
        w, scales, biases = random_weights((3, 24, K), bits, group_size)
        tensor = QuantizedTensor(w, scales.astype(scales_form), biases.astype(scales_form), bits, group_size)
    x = mx.random.normal((9, K), key=mx.random.key(1))
    indices = mx.array([[2, 0], [1, 2]], dtype=mx.uint32)
    if group_size >= 32 and tensor.block is None:
        def mlx_product(rows, e):
            w, scales, biases = tensor.weight[e], tensor.scales[e], tensor.biases[e]
            return mx.quantized_matmul(rows, w, scales, biases, group_size=group_size, bits=bits)
    else:
        dense = tensor.dequantize()

        def mlx_product(rows, e):
            return rows @ dense[e].T

    parts = (tensor.weight, tensor.scales, tensor.biases)
    one = [part[1] for part in parts]
    got = [quantized_matmul(rows, *one, group_size, bits, tensor.block) for rows in (x[:1], x)]
    want = [mlx_product(rows, 1) for rows in (x[:1], x)]
    got.append(gather_quantized_matmul(x[:2, None], *parts, indices, group_size, bits, tensor.block))
    want.append(mx.stack([mx.concatenate([mlx_product(x[t : t + 1], e) for e in row]) for t, row in
                          enumerate(indices.tolist())]))  # fmt: skip
    return got, want
