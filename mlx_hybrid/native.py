"""Native code built on first use with the system compiler, cached per user."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Callable


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx_hybrid"


def build_once(stem: str, suffix: str, key: list[str | bytes], command: Callable[[Path], list[str]]) -> Path | None:
    """The file `command(output)` builds, under a name hashed from `key` (sources, versions,
    flags); built only when missing. None when the build fails."""
    digest = hashlib.sha256()
    for part in key:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    target = cache_dir() / f"{stem}-{digest.hexdigest()[:12]}{suffix}"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as build:
            built = Path(build) / target.name
            subprocess.run(command(built), check=True, capture_output=True, timeout=300)
            built.replace(target)  # atomic: concurrent first runs each build, one wins
    except (OSError, subprocess.SubprocessError):
        return None
    return target
