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
