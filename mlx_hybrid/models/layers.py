"""Layers the model files share: norms, MLPs and mixtures of experts, linear and embedding
layers (float and quantized), the layer kinds of the hybrid models."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from ..parallel import (
    COLUMNS,
    ROWS,
    Split,
    all_sum,
    require,
)
from ..quantized_tensor import FLOAT_MODES, GridBlocks, dequantize, mode_refused
from .sharding import prefixed

F32 = mx.float32

# layer kinds of the hybrid models
LINEAR, FULL = "linear_attention", "full_attention"


def widest_product(args) -> int:
    """The most weights one product of a model with these arguments multiplies: its LM head's or its
    dense feed-forward's, where it has one (`ops.layer_built` asks)."""
    return args.hidden_size * max(args.vocab_size, vars(args).get("intermediate_size", 0))


def check_layer_types(layer_types, num_layers: int):
    if len(layer_types) != num_layers or set(layer_types) - {LINEAR, FULL}:
        raise ValueError(f"layer_types must list {num_layers} of {LINEAR!r}/{FULL!r}")


def group_rms_norm(x: mx.array, weight: mx.array, eps: float, group: int) -> mx.array:
    """RMSNorm of each `group` features of x [..., n group] on its own, times weight [n group]."""
    normed = mx.fast.rms_norm(x.reshape(*x.shape[:-1], -1, group).astype(F32), None, eps)
    return (normed.reshape(x.shape) * weight.astype(F32)).astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a plain weight (loaders turn zero-centred weights w into 1 + w)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


def check_heads(heads: int, size: int, what: str):
    require(heads % size == 0, f"{heads} {what} cannot be split evenly over {size} ranks")


def projections(x: mx.array, *modules) -> list[mx.array]:
    """Each module's product of x, the bits its own call gives: one node where the CPU computes every one
    as llama.cpp computes it (`ops.llama_cpp_products`: a layer's projections of one input, each node
    costing the host's thread and MLX's a few microseconds; the 0.8B shape's decode step 481 -> 391
    nodes, docs/benchmarks.md). The decision is kept beside the first module per x's dtype,
    `ops.path_key` and the arrays multiplied; a pass of more rows than a matrix's limit
    (`ops.int8_row_limit`) takes each module's own call."""
    key = (x.dtype, ops.path_key(), *(id(m.get(name)) for m in modules for name in ("weight", "scales", "biases")))
    kept = modules[0].__dict__.get("_projections")
    if kept is None or kept[0] != key:
        each = [m.llama_cpp_operands(x) if isinstance(m, (Linear, QuantizedLinear)) else None for m in modules]
        grouped = len(modules) > 1 and all(e is not None for e in each)
        limits = [e[1] for e in each if grouped and e[1] is not None]
        kept = (key, [e[0] for e in each] if grouped else None, min(limits, default=None))
        modules[0].__dict__["_projections"] = kept  # not a parameter: beside the module's tree
    _, operands, limit = kept
    if operands is None or not ops.rows_within(x, limit):
        return [m(x) for m in modules]
    return ops.llama_cpp_products(x, operands)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dims, hidden, bias=False)
        self.up_proj = Linear(dims, hidden, bias=False)
        self.down_proj = Linear(hidden, dims, bias=False)
        self.group = None  # split: each rank's down projection gives a partial sum

    def __call__(self, x):
        return all_sum(self.down_proj(ops.swiglu(*projections(x, self.gate_proj, self.up_proj))), self.group)

    def split_heads(self, group, reduce: bool = True) -> dict[str, Split]:
        """Split the hidden units; reduce=False leaves the all-sum to the caller (a shared expert)."""
        check_heads(self.gate_proj.weight.shape[0], group.size(), "feed-forward units")
        self.group = group if reduce else None
        return {"gate_proj.weight": ROWS, "up_proj.weight": ROWS, "down_proj.weight": COLUMNS}


def quantized_product(x: mx.array, module) -> mx.array:
    """x @ W^T for a module holding a quantized W (weight, scales, and biases but in a float mode
    such as mxfp4), in x's dtype, through `ops` (our CPU kernels where they run)."""
    return ops.quantized_matmul(
        x,
        module["weight"],
        module["scales"],
        module.get("biases"),
        group_size=module.group_size,
        bits=module.bits,
        block=module.block,
    )


def mode_form(mode: str):
    """The block form that holds MLX's quantization mode `mode` (None: affine)."""
    if refused := mode_refused(mode):
        raise ValueError(refused)
    return FLOAT_MODES[mode][2] if mode in FLOAT_MODES else None


class QuantizedLinear(nn.QuantizedLinear):
    """Computes in the input's dtype (see `quantized_product`)."""

    block = None  # a BlockScales where scales and biases are a block form's factors and codes

    @property
    def input_order(self) -> mx.array | None:
        return self.get("_input_order")  # (underscored: not a parameter)

    def take_inputs_in(self, order: mx.array):
        """Multiply x[..., order]: the weight's column p is the matrix's column order[p] (a GGUF
        file's value heads in its order, where its blocks are larger than a head)."""
        self._input_order = order

    def __call__(self, x):
        if "_input_order" in self:
            x = mx.take(x, self["_input_order"], axis=-1)
        out = self._path(x)(x, self["weight"], self["scales"], self.get("biases"))
        return out + self["bias"].astype(out.dtype) if "bias" in self else out

    def _path(self, x):
        """The product's path, decided once per input dtype and `ops.path_key` and kept beside the
        parameters (a decode step runs hundreds of these: each costs the host this call, the key's and
        the kernel's)."""
        key = (x.dtype, self["scales"].dtype, self.block, ops.activations_of(self["weight"]), ops.path_key())
        chosen = self.__dict__.get("_path_chosen")
        if chosen is None or chosen[0] != key:
            dtype, scales_dtype, block, activations, where = key
            path = ops.quantized_product_path(
                dtype, self.bits, self.group_size, block, scales_dtype, activations, *where
            )
            chosen = self.__dict__["_path_chosen"] = (key, path)  # not a parameter: beside the module's tree
        return chosen[1]

    def llama_cpp_operands(self, x):
        """See `projections`."""
        if "_input_order" in self or "bias" in self:
            return None
        return ops.llama_cpp_operands(x.dtype, self["weight"], self._path(x), self["scales"], self.get("biases"))


def _mlx_group(group_size: int) -> int:
    """The nearest group size MLX quantizes in."""
    return min(max(group_size, 32), 128)


def quantization_of(module) -> dict:
    """The settings (`to_quantized`'s) that quantize another module as `module` is held: its bits,
    group and mode where MLX quantizes in them; GGUF's groups of 16 in groups of 32, and a grid
    type's blocks (their storage is bytes, their values 1 to 4 bits) as 4-bit groups of 32."""
    block = getattr(module, "block", None)
    if isinstance(block, GridBlocks):
        return {"group_size": 32, "bits": 4, "mode": "affine"}
    mode = block.mlx_mode if block is not None and block.mlx_mode else "affine"
    return {"group_size": _mlx_group(module.group_size), "bits": module.bits, "mode": mode}


def _regrouped(module, group_size: int, mode: str):
    """A quantized module for groups MLX does not quantize in (GGUF's Q6_K: 16; a grid type's
    blocks: 256), made at 32 or 128: the packed weight's shape does not depend on the groups;
    scales and biases get theirs. In a float mode, its block form (`mode_form`)."""
    module.block = mode_form(mode)
    if module.group_size != group_size:
        shape = (*module.scales.shape[:-1], module.scales.shape[-1] * module.group_size // group_size)
        module.scales, module.biases, module.group_size = mx.zeros(shape), mx.zeros(shape), group_size
    return module


class Linear(nn.Linear):
    """nn.Linear through `ops.linear`: weights in another dtype than the input (16-bit weights kept
    as stored under float32 compute), a GPU's decode steps and verify passes row-invariant."""

    def __call__(self, x):
        return ops.linear(x, self["weight"], self.get("bias"))

    def llama_cpp_operands(self, x):
        """See `projections`."""
        return None if "bias" in self else ops.llama_cpp_operands(x.dtype, self["weight"])

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        return _regrouped(QuantizedLinear.from_linear(self, _mlx_group(group_size), bits, mode), group_size, mode)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """Looks rows up in float32: MLX's own gives its scales' dtype (16 bits when loaded compact)."""

    block = None  # as QuantizedLinear's

    def __call__(self, x):
        biases = self.get("biases")
        return dequantize(
            self.weight[x],
            self.scales[x],
            None if biases is None else biases[x],
            self.bits,
            self.group_size,
            self.block,
        )

    def as_linear(self, x):
        return quantized_product(x, self)


class Embedding(nn.Embedding):
    def as_linear(self, x):
        return ops.linear(x, self.weight)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        quantized = QuantizedEmbedding.from_embedding(self, _mlx_group(group_size), bits, mode)
        return _regrouped(quantized, group_size, mode)


class SwitchLinear(nn.Module):
    """Stacked expert matrices [E, out, in], applied to the experts each token selected."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, output_dims, input_dims))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return ops.gather_matmul(x, self.weight, indices)

    def to_quantized(self, group_size: int = 32, bits: int = 4, mode: str = "affine"):
        quantized = QuantizedSwitchLinear(self.weight.shape, _mlx_group(group_size), bits, mode)
        quantized.update(
            dict(zip(("weight", "scales", "biases"), mx.quantize(self.weight, _mlx_group(group_size), bits, mode=mode)))
        )
        return _regrouped(quantized, group_size, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with MLX-quantized experts (gathered quantized matmul): affine, or a mode
    held as a block form (see `mode_form`: weight and scales, no biases)."""

    def __init__(self, shape, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        E, out, inp = shape
        self.group_size, self.bits, self.block = group_size, bits, mode_form(mode)
        self.weight = mx.zeros((E, out, inp * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((E, out, inp // group_size), mx.uint8 if self.block else mx.float32)
        if self.block is None:
            self.biases = mx.zeros((E, out, inp // group_size))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return ops.gather_quantized_matmul(
            x,
            self.weight,
            self.scales,
            self.get("biases"),
            indices,
            group_size=self.group_size,
            bits=self.bits,
            block=self.block,
        )


class SwitchGLU(nn.Module):
    """SwiGLU experts; each projection is one SwitchLinear over all experts."""

    def __init__(self, dims: int, hidden: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden, num_experts)
        self.up_proj = SwitchLinear(dims, hidden, num_experts)
        self.down_proj = SwitchLinear(hidden, dims, num_experts)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [..., D], indices [..., k] -> [..., k, D]."""
        x = mx.expand_dims(x, (-2, -3))
        hidden = ops.swiglu(self.gate_proj(x, indices), self.up_proj(x, indices))
        return self.down_proj(hidden, indices).squeeze(-2)

    def split_heads(self, group) -> dict[str, Split]:
        """Every expert keeps its share of hidden units; the caller sums the partial outputs."""
        check_heads(self.gate_proj.weight.shape[-2], group.size(), "expert feed-forward units")
        return {"gate_proj.weight": ROWS, "up_proj.weight": ROWS, "down_proj.weight": COLUMNS}


def top_k_indices(scores: mx.array, k: int) -> mx.array:
    """Indices of the k largest scores along the last axis."""
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


class PreNormLayer(nn.Module):
    """A decoder layer: h = x + mixer(input_layernorm(x)), then h + mlp(post_attention_layernorm(h)). The
    mixer (attention or a recurrent mixer, called as mixer(x, cache)) sits under its checkpoint name."""

    def __init__(self, args, layer_type: str, mixer_name: str, mixer: nn.Module, mlp: nn.Module):
        super().__init__()
        self.layer_type, self.mixer_name = layer_type, mixer_name
        self[mixer_name] = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x, cache=None):
        norm = self.post_attention_layernorm
        mixed = self[self.mixer_name](self.input_layernorm(x), cache)
        h, normed = ops.add_rms_norm(x, mixed, norm.weight, norm.eps)
        return h + self.mlp(normed)

    def split_heads(self, group) -> dict[str, Split]:
        mixer = self.mixer_name
        return prefixed(mixer, self[mixer].split_heads(group)) | prefixed("mlp", self.mlp.split_heads(group))


class RoutedExperts(nn.Module):
    """A mixture of experts: the experts a router picks for each token (`route`, each family's own),
    weighted, plus the shared experts every token takes (`shared`), held under the checkpoint's name
    `shared_name`. Split over ranks by hidden unit, with one all-sum at the end."""

    shared_name = "shared_expert"

    def __init__(self, args, shared_units: int):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        self[self.shared_name] = MLP(args.hidden_size, shared_units)
        self.group = None  # split: every expert's output is a partial sum

    def split_heads(self, group) -> dict[str, Split]:
        """Each expert's hidden units split (the router stays whole)."""
        self.group = group
        return prefixed("switch_mlp", self.switch_mlp.split_heads(group)) | prefixed(
            self.shared_name, self[self.shared_name].split_heads(group, reduce=False)
        )

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The experts chosen for each token [..., k] and their weights [..., k]."""
        raise NotImplementedError

    def shared(self, x: mx.array) -> mx.array:
        return self[self.shared_name](x)

    def __call__(self, x: mx.array) -> mx.array:
        experts, weights = self.route(x)
        routed = (self.switch_mlp(x, experts) * weights[..., None].astype(x.dtype)).sum(axis=-2)
        return all_sum(routed + self.shared(x), self.group)


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, cache) -> mx.array:
    """Attention of q [B, H, T, D] over the keys and values [B, H(kv), S, D] the cache gave, causal where
    several tokens come at once, each batch row over its own keys where rows run together (the cache's
    `key_lengths`); the result [B, T, H, Dv]."""
    mask, key_lengths = ("causal" if q.shape[2] > 1 else None), cache.key_lengths if cache is not None else None
    return ops.scaled_dot_product_attention(q, k, v, scale, mask, key_lengths).transpose(0, 2, 1, 3)
