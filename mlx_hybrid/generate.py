"""`python -m mlx_hybrid.generate`: see `mlx_hybrid.cli`."""

from mlx_hybrid.cli import entry

if __name__ == "__main__":
    entry()
