from mlx_hybrid.cli.serve import entry

entry()
