"""What a wheel carries: every module, the native sources built on first use, the Metal bodies and
the bundled model, as a wheel built from the tree holds them (a module the wheel lacks fails on
import only where users install it: an editable install reads the tree)."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what the package reads at run time besides its modules
SHIPPED_SUFFIXES = {".py", ".c", ".cpp", ".h", ".inc", ".metal", ".gguf", ".json", ".safetensors"}


def files_users_need(root: Path) -> set[str]:
    """The paths each shipped file of the tree has inside the wheel (metal/ ships as mlx_hybrid/ops/metal)."""
    files = set()
    for source, inside in ((root / "mlx_hybrid", "mlx_hybrid"), (root / "metal", "mlx_hybrid/ops/metal")):
        for path in source.rglob("*"):
            if path.is_file() and path.suffix in SHIPPED_SUFFIXES and "__pycache__" not in path.parts:
                files.add(f"{inside}/{path.relative_to(source).as_posix()}")
    return files


def build_wheel(tree: Path, out: Path) -> Path:
    """A wheel built from a copy of what the build reads (setuptools' build/ of an earlier build
    would otherwise carry files the configuration no longer names)."""
    source = out / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (tree / name).exists():
            shutil.copy(tree / name, source / name)
    for name in ("mlx_hybrid", "metal"):
        shutil.copytree(tree / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        str(source),
        "-w",
        str(out),
    ]
    subprocess.run(command, check=True, capture_output=True, cwd=out, env={**os.environ, "PIP_NO_INDEX": "1"})
    (wheel,) = out.glob("mlx_hybrid-*.whl")
    return wheel


def test_a_wheel_carries_every_module_kernel_source_and_the_bundled_model_and_drafter(tmp_path):
    with zipfile.ZipFile(build_wheel(ROOT, tmp_path)) as wheel:
        carried = {name for name in wheel.namelist() if name.startswith("mlx_hybrid/")}
    needed = files_users_need(ROOT)
    assert "mlx_hybrid/drafting/__init__.py" in needed and "mlx_hybrid/data/tiny-qwen35.gguf" in needed
    assert "mlx_hybrid/data/tiny-qwen35-dflash/model.safetensors" in needed  # the bundled model's drafter
    assert sorted(needed - carried) == []
    assert sorted(carried - needed) == []  # nothing else: no tests, no build leftovers


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
