"""Native code built on first use with the system's compiler, cached per source and toolchain
in the user's cache directory (the forwarding BLAS, the CPU kernels)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


class BuildError(RuntimeError):
    """No compiler, or the compiler refused the source: the message says which."""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx_hybrid"


def compiler(kind: str = "c") -> str | None:
    """The C (kind 'c') or C++ ('c++') compiler: $CC / $CXX, else cc / c++ or gcc / g++."""
    if kind == "c":
        return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build_once(
    name: str,
    sources: list[Path],
    command,
    identity: str = "",
    timeout: float = 300,
    compile_steps=(),
    announce: str | None = None,
) -> Path:
    """The shared object `name-<hash>.so` built from `sources`, reusing an earlier build.

    command(output_path) -> the compiler's argument list; identity: whatever else the build
    depends on (toolchain and library versions), part of the hash. compile_steps: argument
    lists run first, side by side on the machine's cores (translation units compiled to
    object files in the build directory, which `command` then links). announce: a line written
    to stderr when a build starts (and how long it took when it ends): a first run is otherwise
    silent for as long as the compiler takes.
    """
    digest = hashlib.sha256(identity.encode())
    for source in sources:
        digest.update(source.read_bytes())
    target = cache_dir() / f"{name}-{digest.hexdigest()[:12]}.so"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # one build at a time: processes started together (test workers, ranks) wait for the first
        # one's, where each building its own would share the cores among them all
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.is_file():
                _build(target, command, timeout, compile_steps, announce)
    except subprocess.CalledProcessError as e:
        lines = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        errors = [line for line in lines if "error" in line] or lines or [f"exit status {e.returncode}"]
        raise BuildError(f"{name} did not compile: {errors[0]}")
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{name} could not be built: {e}") from None
    return target


def _build(target: Path, command, timeout: float, compile_steps, announce: str | None):
    started = time.perf_counter()
    if announce:
        print(announce, file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as build:
        built = Path(build) / target.name

        def run(arguments):
            subprocess.run(arguments, check=True, capture_output=True, timeout=timeout, cwd=build)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(run, compile_steps))  # the first failure raises here
        run(command(built))
        built.replace(target)  # atomic: a process that does not wait on the lock never sees half a file
    if announce:
        print(f"  built in {time.perf_counter() - started:.0f} s, kept in {target.parent}", file=sys.stderr, flush=True)
