"""What a wheel carries: the native sources built on first use must ship with the package."""

import tomllib
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_native_source_ships_in_the_package():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["mlx_hybrid.csrc"]
    sources = sorted(path.name for path in (ROOT / "mlx_hybrid" / "csrc").iterdir() if path.is_file())
    assert sources and [name for name in sources if not any(fnmatch(name, p) for p in patterns)] == []


def test_mlx_without_a_backend_is_named_at_import(tmp_path):
    """MLX on Linux without its CPU or CUDA build cannot load its library (here: an `mlx` with no
    `mlx.core`, first on the path): importing the package says which extra to install."""
    import os
    import subprocess
    import sys

    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", "import mlx_hybrid"], env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "mlx-hybrid[cpu]" in result.stderr and "mlx-hybrid[cuda]" in result.stderr
