"""The architectures mlx_hybrid implements, one file a family (`loaders.families` names each file's
model types)."""
