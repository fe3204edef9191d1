"""Which packages the wheel carries: every directory under mlx_hybrid/ (a new one ships without being
listed), and the Metal bodies, which live in metal/ at the top of the repository and ship as
mlx_hybrid.ops.metal (pyproject.toml maps the directory and names each package's data files)."""

from setuptools import find_namespace_packages, setup

packages = find_namespace_packages(include=["mlx_hybrid", "mlx_hybrid.*"], exclude=["*__pycache__*"])
setup(packages=packages + ["mlx_hybrid.ops.metal"])
