"""An optimized BLAS for MLX's CPU backend on Linux.

MLX's Linux wheel links the reference (netlib) BLAS. `import mlx_hybrid` opens
OpenBLAS into the process's global symbol scope before MLX's own library loads, so
MLX's matrix products resolve to it: about 40x faster here for a 64x1024x8192 float32
product. The system's OpenBLAS where installed (Debian/Ubuntu: `libopenblas0-pthread`),
else the one the package installs with it from PyPI (scipy-openblas32, OpenBLAS as numpy
and SciPy build it, its symbols renamed `scipy_*`: it reaches MLX only through the library
below).
That needs `mlx_hybrid` imported before `mlx`; otherwise a warning names the fix.
`prefer_optimized_blas()` remains for programs that import `mlx` first: it restarts
the process once with OpenBLAS in LD_PRELOAD. MLX_HYBRID_BLAS=reference turns all
of this off.

In front of OpenBLAS goes a small library of ours (csrc/gemv_forward.c, built once
with the system C compiler into the user's cache directory) that computes products
of up to 16 rows (decode steps, verify passes) itself, reading the weights once for
all rows. Without a C compiler the system's OpenBLAS is loaded alone, and the wheel's
is not used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import sys
import warnings
from pathlib import Path

from .native import BuildError, build_once, compiler

_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
]
_RESTARTED = "MLX_HYBRID_BLAS_RESTARTED"

# OpenBLAS's idle workers spin (sched_yield) for 2^28 cycles after each threaded call. In a
# decode step they take the cores from our kernels' threads (a Q4_K_M step then varies by up
# to half its time: benchmarks/bench_generate.py with OPENBLAS_THREAD_TIMEOUT=28); at 2^4
# cycles they sleep at once, and waking them costs microseconds against the milliseconds of a
# prefill product. Read when OpenBLAS loads; a value the user set stays.
_OPENBLAS_IDLE = ("OPENBLAS_THREAD_TIMEOUT", "4")


def find_openblas() -> str | None:
    """The system's OpenBLAS library, else the scipy-openblas32 wheel's; None without either."""
    for candidate in _CANDIDATES:
        if Path(candidate).is_file():
            return candidate
    if (found := ctypes.util.find_library("openblas")) is not None:
        return found
    # found, not imported: importing the package loads its library
    wheel = importlib.util.find_spec("scipy_openblas32")
    for directory in wheel.submodule_search_locations if wheel is not None else []:
        for found in sorted((Path(directory) / "lib").glob("libscipy_openblas*.so")):
            return str(found)
    return None


def _symbol_prefix(blas: ctypes.CDLL) -> str | None:
    """The prefix of the library's cblas_sgemm and cblas_sgemv ("" for OpenBLAS's own names,
    "scipy_" for the wheel's; the forwarding library looks for the same two); None without them."""
    for prefix in ("scipy_", ""):
        if hasattr(blas, prefix + "cblas_sgemm") and hasattr(blas, prefix + "cblas_sgemv"):
            return prefix
    return None


_GEMV_FORWARD_SOURCE = Path(__file__).parent / "csrc" / "gemv_forward.c"


def gemv_forward_library() -> str | None:
    """The gemv-forwarding library (to preload in front of OpenBLAS), built on first
    use; None without a C compiler."""
    cc = compiler("c")
    if cc is None:
        return None
    source = str(_GEMV_FORWARD_SOURCE)
    try:
        built = build_once(
            "gemv_forward",
            [_GEMV_FORWARD_SOURCE],
            lambda out: [cc, "-O3", "-shared", "-fPIC", "-pthread", "-o", str(out), source, "-ldl"],
            timeout=60,
        )
    except BuildError:
        return None
    return str(built)


def active_blas() -> str:
    """The BLAS this process has mapped: 'openblas' (with ' + gemv forwarding' when in
    front of it), 'accelerate', 'reference' or 'unknown'."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    # the system's, or the wheel's, which only the forwarding library uses (numpy's own,
    # libscipy_openblas64_, is never MLX's)
    if "gemv_forward-" in maps and ("/libopenblas" in maps or "/scipy_openblas32/" in maps):
        return "openblas + gemv forwarding"
    if "/libopenblas" in maps:
        return "openblas"
    return "reference" if "libblas" in maps else "unknown"


def _wanted() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("MLX_HYBRID_BLAS", "") != "reference"


def load_optimized_blas() -> bool:
    """Open OpenBLAS (behind the gemv forwarding) into the global symbol scope, so that
    MLX's library, loaded after it, computes with it. Called by `import mlx_hybrid`.

    Returns whether OpenBLAS is in use. If MLX is already loaded, it is too late: this
    warns once, naming the fix.
    """
    if not _wanted():
        return False
    if active_blas().startswith("openblas"):
        return True  # preloaded, or loaded by an earlier call
    library = find_openblas()
    if library is None:
        return False
    if "mlx.core" in sys.modules:
        warnings.warn(
            "mlx was imported before mlx_hybrid, so MLX keeps its reference BLAS (about 40x slower matrix "
            "products on the CPU); import mlx_hybrid first, or call mlx_hybrid.blas.prefer_optimized_blas() "
            "at the start of the program",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    os.environ.setdefault(*_OPENBLAS_IDLE)
    try:
        # privately first: a BLAS that fails to load must not leave the forwarding library
        # in the global scope with nothing behind it
        prefix = _symbol_prefix(ctypes.CDLL(library))
        forwarding = gemv_forward_library() if prefix is not None else None
        if forwarding is not None:
            # first in the global scope, so MLX's cblas_sgemm resolves to it; binding then
            # moves the BLAS (already loaded, so it cannot fail) into the scope after it
            return ctypes.CDLL(forwarding, mode=ctypes.RTLD_GLOBAL).mlx_hybrid_gemv_bind(library.encode()) == 0
        if prefix != "":  # no OpenBLAS names that MLX could resolve to
            return False
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    return True


def prefer_optimized_blas() -> None:
    """Make sure MLX computes with OpenBLAS: nothing to do when `import mlx_hybrid` loaded
    it (or it was preloaded); otherwise restart this process once with it in LD_PRELOAD."""
    if not _wanted() or os.environ.get(_RESTARTED) or active_blas().startswith("openblas"):
        return
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return
    library = find_openblas()
    if library is None:
        return
    forwarding = gemv_forward_library()
    if forwarding is None and "scipy_openblas32" in library:  # the wheel's renamed symbols need it
        return
    env = dict(os.environ)
    env.setdefault(*_OPENBLAS_IDLE)
    env["LD_PRELOAD"] = ":".join(filter(None, [forwarding, library, env.get("LD_PRELOAD")]))
    env[_RESTARTED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
