"""An MTP head taken from another checkpoint (`load(..., mtp=)`): mlx-lm's and mlx-vlm's conversions drop
it, the checkpoint they came from has it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import ModelLoadError
from ..models.layers import quantization_of
from .common import fill_model, rename


# settings an MTP head may differ in from the model that takes it
_HEAD_OWN_SETTINGS = ("mtp_num_hidden_layers", "mtp_hidden", "vision")


def attach_mtp_head(model, checkpoint, source: Path, dtype):
    """`model.mtp` from a checkpoint's `mtp.*` tensors (`checkpoint`: the loader's reading of `source`),
    quantized as the model's layers are; a head for another model is refused, naming the settings."""
    module, args = checkpoint.module, checkpoint.args
    if not getattr(args, "mtp_num_hidden_layers", 0):
        raise ModelLoadError(f"{source}: this checkpoint has no MTP head (no mtp.* tensors)")
    differ = [
        f"{name} {getattr(args, name)!r} against the model's {value!r}"
        for name, value in vars(model.args).items()
        if name not in _HEAD_OWN_SETTINGS and not _same_setting(getattr(args, name, None), value)
    ]
    if differ:
        raise ModelLoadError(f"{source}: its MTP head is for another model: " + "; ".join(differ))
    with_head = dataclasses.replace(
        model.args, mtp_num_hidden_layers=args.mtp_num_hidden_layers, mtp_hidden=args.mtp_hidden
    )
    head = module.MTPHead(with_head)
    weights, _ = rename(checkpoint.tensors, checkpoint.rules, args, part=_Prefix("mtp."))
    head_weights = {name[len("mtp.") :]: tensor for name, tensor in weights.items()}
    fill_model(head, head_weights, dtype, module.FLOAT32_PARAMS, source=str(source))
    _quantize_as_trunk(head, model)
    model.args, model.mtp = with_head, head


def _quantize_as_trunk(head, model):
    """Quantize the head's float modules as the model's are: each as the module in the same place of
    a trunk layer (the MTP block is a decoder layer: its routers as the trunk's routers), the others
    (its `fc`) as the trunk's largest; where the group size divides the module's inputs."""
    in_layers, largest = {}, None
    for layer in model.layers:
        for path, module in layer.named_modules():
            if hasattr(module, "bits"):
                in_layers.setdefault(path, module)
                largest = module if largest is None or module.weight.size > largest.weight.size else largest
    if largest is None:  # a float model: a float head
        return

    def settings(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        place = path.split(".", 2)[2] if path.startswith("layers.") else None
        chosen = quantization_of(in_layers.get(place, largest))
        return chosen if module.weight.shape[-1] % chosen["group_size"] == 0 else False

    nn.quantize(head, class_predicate=settings)
    mx.eval(head.parameters())  # here, not lazily on whichever thread generates first


def _same_setting(a, b) -> bool:
    """Equal settings; floats as GGUF stores them (float32: 1e-6 reads back as 9.999999974752427e-07)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


class _Prefix:
    """What `rename` reads of a checkpoint: the tensors under one prefix, whole (others are not read)."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def wants(self, name: str) -> bool:
        return name.startswith(self.prefix)

    def cut(self, name: str, tensor):
        return tensor
