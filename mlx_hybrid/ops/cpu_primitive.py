"""The gated delta rule's token step as a compiled MLX primitive for the CPU (Linux).

`csrc/delta_step.cpp` is built on first use with the system C++ compiler against
the headers and library in MLX's wheel, bound with nanobind in MLX's nanobind domain,
and cached per user. It must agree with the pure-MLX step on a small case before it
is used; when anything fails (no compiler, no nanobind, an MLX whose nanobind ABI
differs) `token_step()` is None and the pure-MLX step runs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from ..native import build_once
from . import reference

_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "delta_step.cpp"
_MODULE = "mlx_hybrid_delta_step"  # the NB_MODULE name in the source


def _cpu_flags() -> str:
    """The CPU's feature flags: the build uses -march=native, so they key the cache."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


def _build() -> Path | None:
    try:
        import nanobind
    except ImportError:
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    mlx_root = Path(mx.__file__).resolve().parent
    nb_root = Path(nanobind.__file__).resolve().parent

    def command(output):
        return [
            compiler, "-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
            "-DNB_DOMAIN=mlx",  # share mx.array's binding with mlx.core
            f"-I{nanobind.include_dir()}", f"-I{nb_root / 'ext' / 'robin_map' / 'include'}",
            f"-I{mlx_root / 'include'}", f"-I{sysconfig.get_paths()['include']}",
            str(_SOURCE), str(Path(nanobind.source_dir()) / "nb_combined.cpp"),
            f"-L{mlx_root / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_root / 'lib'}", "-o", str(output),
        ]  # fmt: skip

    key = [_SOURCE.read_bytes(), mx.__version__, nanobind.__version__, sys.version, _cpu_flags()]
    return build_once("delta_step", sysconfig.get_config_var("EXT_SUFFIX"), key, command)


def _step_with(module):
    def step(state, q, k, v, g, beta):
        """Same arguments and results as reference._delta_step."""
        decay = mx.exp(g)
        if g.ndim == 2:  # one gate per head: the same decay for every key row
            decay = mx.broadcast_to(decay[..., None], q.shape)
        out, new_state = module.gated_delta_step(state, q, k, v, decay, beta)
        return out, new_state

    return step


def _agrees_with_reference(step) -> bool:
    keys = mx.random.split(mx.random.key(0), 6)
    B, H, Dk, Dv = 2, 3, 16, 8
    state = mx.random.normal((B, H, Dk, Dv), key=keys[0])
    q, k = (mx.random.normal((B, H, Dk), key=key) * 0.3 for key in keys[1:3])
    v = mx.random.normal((B, H, Dv), key=keys[3])
    g, beta = -mx.random.uniform(shape=(B, H), key=keys[4]), mx.random.uniform(shape=(B, H), key=keys[5])
    got, expected = step(state, q, k, v, g, beta), reference._delta_step(state, q, k, v, g, beta)
    return all(mx.allclose(a, b, rtol=1e-5, atol=1e-5).item() for a, b in zip(got, expected))


@lru_cache(maxsize=None)
def token_step():
    """The compiled token step (reference._delta_step's signature), or None."""
    if not sys.platform.startswith("linux"):
        return None
    library = _build()
    if library is None:
        return None
    try:
        spec = importlib.util.spec_from_file_location(_MODULE, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        step = _step_with(module)
        return step if _agrees_with_reference(step) else None
    except Exception:  # an MLX whose nanobind ABI differs raises TypeError here, and more can go wrong
        return None
