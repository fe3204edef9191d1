"""What both checkpoint formats share: renaming rules, transforms, and filling a model.

Each format keeps its name mapping as a table of `Rule`s: a regular expression over
the source tensor name, the canonical parameter name(s) it becomes, and an optional
transform. Canonical names are the module paths of our models
(`layers.3.self_attn.q_proj.weight`, `mtp.fc.weight`, ...). A target ending in
`[{expert}]` collects one slice of a stacked tensor.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import ops
from ..errors import ModelLoadError
from ..models.layers import Embedding, Linear, SwitchLinear
from ..quantized_tensor import QuantizedTensor

_MATRIX_MODULES = (Linear, Embedding, SwitchLinear)

Transform = Callable[[mx.array, object], "mx.array | tuple[mx.array, ...]"]


@dataclass(frozen=True)
class Rule:
    source: str  # regular expression matched against the whole source name
    target: str | tuple[str, ...]  # canonical name template(s), filled from the named groups
    transform: Transform | None = None  # (tensor, model args) -> tensor, or one per target

    def compiled(self):
        return re.compile(self.source)


# Transforms shared by the formats -------------------------------------------


def plus_one(w, _args):
    """Zero-centred RMSNorm weight w -> the plain weight 1 + w."""
    return 1.0 + w.astype(mx.float32)


def neg_exp(a_log, _args):
    """A_log -> A = -exp(A_log), the decay rate the GGUF files store."""
    return -mx.exp(a_log.astype(mx.float32))


def squeeze_conv(w, _args):
    """Depthwise conv weight [C, 1, K] -> [C, K]."""
    return w.reshape(w.shape[0], -1)


def halves(w, _args):
    """Split the first axis after the expert axis in two: fused [E, 2I, D] -> gate, up."""
    return tuple(mx.split(w, 2, axis=1))


def rowwise(transform):
    """Mark a transform that only selects or reorders rows: it applies to a quantized tensor's parts as they are."""

    def on_quantized(tensor, args):
        parts = [transform(part, args) for part in (tensor.weight, tensor.scales, tensor.biases)]
        if isinstance(parts[0], tuple):
            return tuple(replace(tensor, weight=w, scales=s, biases=b) for w, s, b in zip(*parts))
        return replace(tensor, weight=parts[0], scales=parts[1], biases=parts[2])

    transform.on_quantized = on_quantized
    return transform


def apply_transform(transform, tensor, args):
    """A transform's `on_quantized(tensor, args)`, where it has one, keeps a quantized tensor
    quantized (None: it cannot for this one); otherwise the tensor is dequantized first."""
    if isinstance(tensor, QuantizedTensor):
        on_quantized = getattr(transform, "on_quantized", None)
        result = on_quantized(tensor, args) if on_quantized else None
        return result if result is not None else transform(tensor.dequantize(), args)
    return transform(tensor, args)


@rowwise
def split_fused_ba(w, args):
    """Qwen3-Next's fused b/a projection (HF `in_proj_ba`, GGUF `ssm_ba`), per key head
    [b (R rows), a (R rows)] -> b, a."""
    Hk = args.linear_num_key_heads
    b, a = mx.split(w.reshape(Hk, -1, w.shape[-1]), 2, axis=1)
    return b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])


# Applying a table ------------------------------------------------------------


class RankPart:
    """What one rank of a split model reads (see `HybridModel.shard`): only the tensors of
    its parameters, each cut to its part as soon as it is read, so that no rank ever
    holds the whole model (at most one whole tensor at a time)."""

    def __init__(self, model, specs: dict):
        self.specs = specs
        self.rank, self.size = model.parallel.rank, model.parallel.size
        self.ndims = {name: p.ndim for name, p in tree_flatten(model.parameters())}

    def wants(self, name: str) -> bool:
        return name in self.ndims

    def cut(self, name: str, tensor):
        split = self.specs.get(name)
        if split is None:
            return tensor
        if not isinstance(tensor, QuantizedTensor) and tensor.ndim != self.ndims[name]:
            tensor = tensor.reshape(_squeezed(tensor.shape))  # GGUF and HF store some vectors as [1, ..., n, 1]
        part = split.take(tensor, self.rank, self.size)
        mx.eval([part.weight, part.scales, part.biases] if isinstance(part, QuantizedTensor) else part)
        return part


def rename(tensors: Iterable[tuple[str, Callable[[], mx.array]]], rules: list[Rule], args, progress=None, part=None):
    """Map source tensors to canonical ones. Returns (weights, unmatched source names).

    part: a `RankPart`, for a split model: tensors it does not want are not even read."""
    compiled = [(rule.compiled(), rule) for rule in rules]
    weights: dict[str, mx.array] = {}
    stacks: dict[str, dict[int, mx.array]] = defaultdict(dict)
    unmatched = []
    for name, load in tensors:
        for pattern, rule in compiled:
            match = pattern.fullmatch(name)
            if match:
                break
        else:
            unmatched.append(name)
            continue
        if rule.target == "":  # deliberately dropped
            continue
        templates = rule.target if isinstance(rule.target, tuple) else (rule.target,)
        targets = [_stack_slot(template.format(**match.groupdict())) for template in templates]
        if part is not None and not any(part.wants(base) for base, _ in targets):
            continue
        tensor = load()
        results = apply_transform(rule.transform, tensor, args) if rule.transform else tensor
        results = results if isinstance(results, tuple) else (results,)
        for (base, index), result in zip(targets, results):
            if part is not None:
                result = part.cut(base, result)
            if index is None:
                weights[base] = result
            else:
                stacks[base][index] = result
        if progress is not None:
            progress.update(1)
    for base in list(stacks):
        parts = stacks.pop(base)
        if sorted(parts) != list(range(len(parts))):
            raise ModelLoadError(f"experts of {base} are incomplete: found {sorted(parts)}")
        weights[base] = mx.stack([parts[i] for i in range(len(parts))])
        if part is not None:  # one layer's experts twice at a time, not every layer's
            mx.eval(weights[base])
    return weights, unmatched


def _stack_slot(target: str) -> tuple[str, int | None]:
    """`name[i]` -> (name, i), the i-th slice of a stacked tensor; `name` -> (name, None)."""
    if not target.endswith("]"):
        return target, None
    base, index = target[:-1].split("[")
    return base, int(index)


def _quantize_modules(model, weights: dict):
    """Turn the modules whose weights came quantized into MLX quantized modules, in place.

    Returns the names of their quantized parts (packed weights, float32 scales and biases).
    """
    modules = dict(model.named_modules())
    parts = {}
    for name in [n for n, t in weights.items() if isinstance(t, QuantizedTensor)]:
        tensor, path = weights.pop(name), name.rsplit(".", 1)[0]
        module = modules.get(path)
        # (columns in another order: linear layers take their inputs reordered)
        takes = isinstance(module, Linear) if tensor.column_order is not None else hasattr(module, "to_quantized")
        if not takes or not name.endswith(".weight"):
            weights[name] = tensor.dequantize()
            continue
        parts[path] = tensor
        weights.update({f"{path}.{part}": value for part, value in tensor.module_parameters().items()})
    if parts:
        nn.quantize(
            model,
            class_predicate=lambda path, m: (
                {"group_size": parts[path].group_size, "bits": parts[path].bits} if path in parts else False
            ),
        )
        for path, module in model.named_modules():
            if path not in parts:
                continue
            tensor = parts[path]
            if tensor.block:  # a block form's factors and codes (a grid type's blocks), as they come
                if tensor.block.mlx_mode:  # as MLX's own modules in that mode: no biases
                    module.pop("biases")
                    module.mode = tensor.block.mlx_mode
                module.update(tensor.module_parameters())
                module.block = tensor.block
            if tensor.column_order is not None:
                module.take_inputs_in(tensor.column_order)
    return {f"{path}.{part}" for path, tensor in parts.items() for part in tensor.module_parameters()}


def fill_model(model, weights: dict, dtype, float32_params=(), source=""):
    """Check names and shapes against the model, cast, and load the weights.

    Weights may be QuantizedTensors: their modules become MLX quantized modules.
    """
    weights = dict(weights)
    keep_as_is = _quantize_modules(model, weights)
    # matrices multiplied through `ops`, which may keep them in their 16-bit dtype
    matrices = {f"{path}.weight" for path, m in model.named_modules() if isinstance(m, _MATRIX_MODULES)}
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    where = f"{source}: " if source else ""
    if missing:
        raise ModelLoadError(f"{where}missing tensors: {_some(missing)}")
    if unexpected:
        raise ModelLoadError(f"{where}unexpected tensors: {_some(unexpected)}")
    loaded = []
    for name, param in expected.items():
        tensor = weights[name]
        if tensor.shape != param.shape:
            # GGUF drops trailing unit dimensions of some small tensors
            if tensor.size == param.size and _squeezed(tensor.shape) == _squeezed(param.shape):
                tensor = tensor.reshape(param.shape)
            else:
                raise ModelLoadError(
                    f"{where}tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
        if name not in keep_as_is and not (name in matrices and ops.keeps_16bit_weights(tensor.dtype, dtype)):
            keep_f32 = name.rsplit(".", 1)[-1] in float32_params
            tensor = tensor.astype(mx.float32 if keep_f32 else dtype)
        # row-contiguous once here: a strided view (GGUF's reordered value heads) would be
        # copied again, whole, by every product that reads it
        loaded.append((name, mx.contiguous(tensor)))
    model.load_weights(loaded)
    mx.eval(model.parameters())
    return model


def _squeezed(shape):
    return tuple(d for d in shape if d != 1)


def _some(names, limit=5):
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
