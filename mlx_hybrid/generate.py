"""`python -m mlx_hybrid.generate`: the command of `mlx_hybrid.cli.generate` (the module path users run)."""

from mlx_hybrid.cli.generate import entry

if __name__ == "__main__":
    entry()
