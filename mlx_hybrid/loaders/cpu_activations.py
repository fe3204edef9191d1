"""How a loaded model's quantized and 16-bit products compute on the CPU (`load(..., cpu_activations=)`):
llama.cpp's 8-bit activations for a GGUF file where every such product takes them, else float32."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .. import ops
from ..errors import ModelLoadError
from ..models.layers import (
    Embedding,
    Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedSwitchLinear,
    SwitchLinear,
)
from .quantized import block_type_name

_MATRICES = (Linear, QuantizedLinear, Embedding, QuantizedEmbedding)
_EXPERTS = (SwitchLinear, QuantizedSwitchLinear)


def whole_products(group, pipeline: bool) -> bool:
    """Whether each product is computed whole in one process: alone, or a pipeline's layers (a tensor-parallel
    split sums the ranks' parts of a product, which is not llama.cpp's arithmetic)."""
    return group is None or group.size() == 1 or pipeline


def set_cpu_activations(model, activations: str | None, path: Path, whole_products: bool, dtype):
    """Every quantized product of the model, and every product of a 16-bit matrix, takes `activations`
    (see `load`), or the load is refused; None: "int8" for a GGUF file whose every such product takes
    it here, whole, else "float32". "int8" names the matrices to the CPU backend
    (`ops.compute_as_llama_cpp`), which computes them so; in a float32 model (dtype) it holds the
    layers' Q4_K matrices as their products read them fastest (`ops.held_interleaved`), but an output
    head's, whose rows a draft head gathers (`vocabulary_head`)."""
    named = {
        id(m): (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _MATRICES + _EXPERTS) and ("scales" in m or m.weight.dtype in ops.SIXTEEN_BITS)
    }
    modules = [m for _, m in named.values()]  # (each once, where it is shared)

    def refusal(m):
        return ops.int8_activations(m.bits, m.group_size, m.block) if "scales" in m else ops.half_activations()

    if activations is None:
        computed = whole_products and not path.is_dir() and modules and not any(map(refusal, modules))
        activations = "int8" if computed else "float32"
    if activations == "float32":
        return
    if path.is_dir():
        raise ModelLoadError(
            f"{path}: cpu_activations={activations!r} computes a GGUF file as llama.cpp does; a "
            "Hugging Face or MLX checkpoint computes with float activations"
        )
    if not whole_products:
        raise ModelLoadError(
            f"{path}: cpu_activations={activations!r} computes each product whole, as llama.cpp "
            "does; a tensor-parallel split sums its ranks' parts of it (pipeline=True, "
            "--pipeline, keeps products whole)"
        )
    refused = {}
    for module in modules:
        if reason := refusal(module):
            refused.setdefault(reason, set()).add(
                block_type_name(module.bits, module.group_size, module.block)
                if "scales" in module
                else {mx.float16: "F16", mx.bfloat16: "BF16"}[module.weight.dtype]
            )
    if refused:
        reason, names = next(iter(refused.items()))
        raise ModelLoadError(
            f"{path}: cpu_activations={activations!r} (--cpu-activations {activations}): {reason}; "
            f"this file holds {', '.join(sorted(names))} tensors"
        )
    held = {}  # the array held for each matrix (by id), where modules share one
    for name, module in named.values():
        if (
            dtype == mx.float32
            and isinstance(module, (QuantizedLinear, QuantizedSwitchLinear))
            and (name.split(".")[-1] != "lm_head")
        ):
            key = id(module["weight"])
            if key not in held:  # (taken out of the module first: interleaved in its own buffer)
                held[key] = ops.held_interleaved(
                    module.pop("weight"), module.bits, module.group_size, module.block, _rows_alike(module)
                )
                mx.eval(held[key])
            module["weight"] = held[key]
        else:
            ops.compute_as_llama_cpp(module["weight"], _rows_alike(module))


def _rows_alike(module) -> int | None:
    """The most rows a product of the module's matrix keeps each row's bits with llama.cpp's activations
    (an expert product's: any number)."""
    if isinstance(module, _EXPERTS):
        return None
    return ops.int8_row_limit(module.bits, module.group_size, module.block) if "scales" in module else ops.HALF_ROWS
