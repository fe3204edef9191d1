"""`python -m mlx_hybrid.convert`: the command of `mlx_hybrid.cli.convert` (the module path users run)."""

from mlx_hybrid.cli.convert import entry

if __name__ == "__main__":
    entry()
