"""Safetensors checkpoint files: a directory's files (by its index, or all of them), their tensors,
and MLX's quantized triplets gathered into `QuantizedTensor`s."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from ..errors import ModelLoadError
from ..quantized_tensor import FLOAT_MODES, QuantizedTensor, mode_refused, no_codes


def safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable index ({e})") from None
        files = sorted({path / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index} names {f.name}, which is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no .safetensors files")
    return files


def read_tensors(files: list[Path]) -> dict[str, mx.array]:
    tensors = {}
    for f in files:
        try:
            tensors.update(mx.load(str(f)))
        except Exception as e:  # MLX raises RuntimeError/ValueError on short or corrupt files
            raise ModelLoadError(f"{f}: unreadable safetensors file ({e})") from None
    return tensors


def group_quantized(tensors: dict, quantization: dict) -> dict:
    """Gather MLX-quantized .weight/.scales/.biases triplets (.weight/.scales in a float mode such
    as mxfp4) into QuantizedTensors under .weight."""
    grouped = dict(tensors)
    for name in [n for n in tensors if n.endswith(".scales")]:
        path = name[: -len(".scales")]
        # a layer's own settings (mlx-lm's 8-bit MoE routers) name no mode: affine, as MLX reads them
        params = quantization.get(path) if isinstance(quantization.get(path), dict) else quantization
        mode = params.get("mode", "affine")
        if refused := mode_refused(mode):
            raise ModelLoadError(f"{path}: {refused}")
        try:
            weight, scales = grouped.pop(path + ".weight"), grouped.pop(name)
            if mode == "affine":
                tensor = QuantizedTensor(
                    weight, scales, grouped.pop(path + ".biases"), params["bits"], params["group_size"]
                )
            else:
                bits, group_size, form = FLOAT_MODES[mode]
                if (params.get("bits", bits), params.get("group_size", group_size)) != (bits, group_size):
                    raise ModelLoadError(f"{path}: {mode} takes {bits} bits in groups of {group_size}")
                tensor = QuantizedTensor(weight, scales, no_codes(scales), bits, group_size, form)
        except KeyError as e:
            raise ModelLoadError(f"quantized tensor {path} is incomplete: no {e.args[0]}") from None
        grouped[path + ".weight"] = tensor
    return grouped
