"""The commands: `generate`, `chat`, `convert` and `serve` (the server's), and what they share
(`common`: arguments, usage errors, loading with a drafter, the engine they drive). Installed as
`mlx_hybrid.generate`, `mlx_hybrid.chat`, `mlx_hybrid.convert` and `mlx_hybrid.server`, and run
by those module paths with `python -m`."""
