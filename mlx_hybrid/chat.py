"""`python -m mlx_hybrid.chat`: the command of `mlx_hybrid.cli.chat` (the module path users run)."""

from mlx_hybrid.cli.chat import entry

if __name__ == "__main__":
    entry()
