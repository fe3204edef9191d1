"""Splitting a model over an `mx.distributed` group: the specs of its parameters, layers
another pipeline rank runs, and cutting each parameter to this rank's part."""

from __future__ import annotations

import mlx.nn as nn

from ..parallel import (
    ShardingError,
)
from ..quantized_tensor import QuantizedTensor


def prefixed(prefix: str, specs: dict) -> dict:
    return {f"{prefix}.{name}": split for name, split in specs.items()}


class LayerElsewhere(nn.Module):
    """A layer another rank of the pipeline runs: nothing held here."""

    def __init__(self, layer_type: str):
        super().__init__()
        self.layer_type = layer_type


def cut_parameters(model: nn.Module, specs: dict, rank: int, size: int):
    """Replace each split parameter by this rank's part (quantized modules: all their parts)."""
    for name, split in specs.items():
        path, leaf = name.rsplit(".", 1)
        module = model
        for part in path.split("."):
            module = module[int(part)] if part.isdigit() else module[part]
        if leaf == "weight" and "scales" in module:
            taken = split.take(QuantizedTensor.of_module(module), rank, size)
            if not hasattr(taken, "scales"):
                raise ShardingError(f"{name}: its split falls inside quantization groups")
            module.update(taken.module_parameters())
            module.block = taken.block
        else:
            setattr(module, leaf, split.take(module[leaf], rank, size))
