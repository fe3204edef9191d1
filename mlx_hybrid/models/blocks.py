"""Blocks shared by the model files."""

from __future__ import annotations

from functools import partial
from itertools import accumulate

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from ..cache import KVCache, RecurrentCache, RowCaches
from ..parallel import (
    COLUMNS,
    PIPELINE,
    ROWS,
    TENSOR,
    Parallel,
    ShardingError,
    Split,
    all_sum,
    gather_last_axis,
    layer_range,
    require,
)

F32 = mx.float32

# layer kinds of the hybrid models
LINEAR, FULL = "linear_attention", "full_attention"


def check_layer_types(layer_types, num_layers: int):
    if len(layer_types) != num_layers or set(layer_types) - {LINEAR, FULL}:
        raise ValueError(f"layer_types must list {num_layers} of {LINEAR!r}/{FULL!r}")


class RMSNorm(nn.Module):
    """RMSNorm with a plain weight (loaders turn zero-centred weights w into 1 + w)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


@partial(mx.compile, shapeless=True)
def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (as FLA and transformers)."""
    x = x.astype(F32)
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def gated_rms_norm(x: mx.array, weight: mx.array, gate: mx.array, eps: float) -> mx.array:
    """RMSNorm(x) * weight * gate, in float32 (the output norm of linear attention)."""
    return ops.rms_norm(x.astype(F32), weight.astype(F32), eps) * gate.astype(F32)


def prefixed(prefix: str, specs: dict) -> dict:
    return {f"{prefix}.{name}": split for name, split in specs.items()}


def check_heads(heads: int, size: int, what: str):
    require(heads % size == 0, f"{heads} {what} cannot be split evenly over {size} ranks")


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dims, hidden, bias=False)
        self.up_proj = Linear(dims, hidden, bias=False)
        self.down_proj = Linear(hidden, dims, bias=False)
        self.group = None  # split: each rank's down projection gives a partial sum

    def __call__(self, x):
        return all_sum(self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x))), self.group)

    def split_heads(self, group, reduce: bool = True) -> dict[str, Split]:
        """Split the hidden units; reduce=False leaves the all-sum to the caller (a shared expert)."""
        check_heads(self.gate_proj.weight.shape[0], group.size(), "feed-forward units")
        self.group = group if reduce else None
        return {"gate_proj.weight": ROWS, "up_proj.weight": ROWS, "down_proj.weight": COLUMNS}


class QuantizedLinear(nn.QuantizedLinear):
    """Returns the input's dtype: exact GGUF scales are float32, and MLX would promote a
    16-bit model's products, and everything after them, to float32."""

    def __call__(self, x):
        return super().__call__(x).astype(x.dtype)


class Linear(nn.Linear):
    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """Looks rows up in float32: MLX's own gives its scales' dtype (16 bits when loaded compact)."""

    def __call__(self, x):
        scales, biases = self["scales"][x].astype(F32), self["biases"][x].astype(F32)
        return mx.dequantize(self["weight"][x], scales, biases, group_size=self.group_size, bits=self.bits)

    def as_linear(self, x):
        return super().as_linear(x).astype(x.dtype)


class Embedding(nn.Embedding):
    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        return QuantizedEmbedding.from_embedding(self, group_size, bits, mode)


class SwitchLinear(nn.Module):
    """Stacked expert matrices [E, out, in], applied to the experts each token selected."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, output_dims, input_dims))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return ops.gather_matmul(x, self.weight.swapaxes(-1, -2), indices)

    def to_quantized(self, group_size: int = 32, bits: int = 4, mode: str = "affine"):
        return QuantizedSwitchLinear(self.weight.shape, group_size, bits)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with MLX affine-quantized experts (gathered quantized matmul)."""

    def __init__(self, shape, group_size: int, bits: int):
        super().__init__()
        E, out, inp = shape
        self.group_size, self.bits = group_size, bits
        self.weight = mx.zeros((E, out, inp * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((E, out, inp // group_size))
        self.biases = mx.zeros((E, out, inp // group_size))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return mx.gather_qmm(
            x, self.weight, self.scales, self.biases, rhs_indices=indices, transpose=True,
            group_size=self.group_size, bits=self.bits,
        ).astype(x.dtype)  # fmt: skip


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


class VocabularySubsetHead(nn.Module):
    """An output projection restricted to some rows of the vocabulary (for drafting).

    Takes the rows of a (possibly quantized) LM head or tied embedding once; the logits
    it gives are over `ids`, in their order.
    """

    def __init__(self, projection: nn.Module, ids: mx.array):
        super().__init__()
        self.ids = ids
        self.weight = projection["weight"][ids]
        self.quantized = "scales" in projection
        if self.quantized:
            self.scales = projection["scales"][ids]
            self.biases = projection["biases"][ids] if "biases" in projection else None
            self.group_size, self.bits = projection.group_size, projection.bits
            self.mode = getattr(projection, "mode", "affine")
        mx.eval(self.parameters())

    def __call__(self, x: mx.array) -> mx.array:
        if not self.quantized:
            return x @ self.weight.T
        return mx.quantized_matmul(
            x, self.weight, self.scales, self.biases, transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode,
        ).astype(x.dtype)  # fmt: skip


def top_k_indices(scores: mx.array, k: int) -> mx.array:
    """Indices of the k largest scores along the last axis."""
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


def causal_mask_for(num_tokens: int):
    """Mask argument for attention over a cache: causal when several tokens come at once."""
    return "causal" if num_tokens > 1 else None


def _row_pieces(cache: RowCaches, arrays) -> list[list[mx.array]]:
    """Each packed array split into its rows' parts along the token axis."""
    bounds = list(accumulate(cache.lengths))[:-1]
    return [mx.split(array, bounds, axis=1) for array in arrays]


def for_each_row(fn, cache, *arrays: mx.array) -> mx.array:
    """fn(*arrays, cache) -> [B, T, ...], run per sequence when several come packed along
    the token axis (axis 1) with `RowCaches`, so that no row sees another's tokens."""
    if not isinstance(cache, RowCaches):
        return fn(*arrays, cache)
    pieces = _row_pieces(cache, arrays)
    outs = [fn(*(p[row] for p in pieces), row_cache) for row, row_cache in enumerate(cache.caches)]
    return mx.concatenate(outs, axis=1)


def delta_rule_attention(
    mixed_qkv, conv_weight, g, beta, cache, key_heads: int, value_heads: int, key_dim: int, value_dim: int
):
    """The shared core of GDN and KDA layers: causal conv + SiLU over q|k|v, L2-normalised
    q and k, then the gated delta rule; reads and updates the layer's recurrent cache.

    Returns the rule's output [B, T, value_heads, value_dim] in float32.
    """

    def one_sequence(mixed_qkv, g, beta, cache):
        B, T, _ = mixed_qkv.shape
        record = cache is not None and cache.record_snapshots
        conv = ops.conv1d_update(mixed_qkv, conv_weight, cache.conv_tail if cache else None, snapshots=record)
        q, k, v = mx.split(conv.out, [key_heads * key_dim, 2 * key_heads * key_dim], axis=-1)
        q = l2_normalize(q.reshape(B, T, key_heads, key_dim)) * key_dim**-0.5
        k = l2_normalize(k.reshape(B, T, key_heads, key_dim))
        v = v.reshape(B, T, value_heads, value_dim)
        rule = ops.gated_delta_update(q, k, v, g, beta, cache.state if cache else None, snapshots=record)
        if cache is not None:
            cache.update(conv.tail, rule.state, conv.snapshots, rule.snapshots)
        return rule.out

    if isinstance(cache, RowCaches):
        return _rows_in_groups(one_sequence, cache, mixed_qkv, g, beta)
    return one_sequence(mixed_qkv, g, beta, cache)


def _rows_in_groups(one_sequence, cache: RowCaches, *arrays: mx.array) -> mx.array:
    """Recurrent layers of packed rows: rows of one length whose states exist run as one batch
    (each row's state is its own slice, and every op is per row, so each row computes what
    it computes alone); the others one by one. Batching saves the per-op overhead of
    B small calls, which at decode dominates the recurrence's work."""
    pieces = _row_pieces(cache, arrays)
    groups: dict[tuple, list[int]] = {}
    for row, (n, row_cache) in enumerate(zip(cache.lengths, cache.caches)):
        key = (n, row_cache.record_snapshots) if row_cache.state is not None else ("alone", row)
        groups.setdefault(key, []).append(row)
    outs = [None] * len(cache.caches)
    for rows in groups.values():
        if len(rows) == 1:
            (row,) = rows
            outs[row] = one_sequence(*(p[row] for p in pieces), cache.caches[row])
            continue
        members = [cache.caches[row] for row in rows]
        batch = RecurrentCache()
        batch.record_snapshots = members[0].record_snapshots
        batch.update(mx.concatenate([c.conv_tail for c in members]), mx.concatenate([c.state for c in members]))
        out = one_sequence(*(mx.concatenate([p[row] for row in rows]) for p in pieces), batch)
        for i, (row, member) in enumerate(zip(rows, members)):
            outs[row] = out[i : i + 1]
            member.update(
                batch.conv_tail[i : i + 1],
                batch.state[i : i + 1],
                [s[i : i + 1] for s in batch.conv_snapshots] if batch.conv_snapshots else None,
                [s[i : i + 1] for s in batch.state_snapshots] if batch.state_snapshots else None,
            )
    return mx.concatenate(outs, axis=1)


class SplitVocabularySubsetHead(nn.Module):
    """`VocabularySubsetHead` of a head split by vocabulary rows: each rank projects onto the
    subset's tokens it holds, and the parts are gathered back into the subset's order."""

    def __init__(self, projection: nn.Module, ids: mx.array, parallel: Parallel, vocab_size: int):
        super().__init__()
        ranges = [ROWS.bounds(vocab_size, r, parallel.size)[0] for r in range(parallel.size)]
        wanted = ids.tolist()
        held = [[i - start for i in wanted if start <= i < end] for start, end in ranges]
        self.width = max(1, max(len(h) for h in held))
        self.count = len(held[parallel.rank])
        # a rank holding none of the subset still takes part in the gather (with one row)
        self.local = VocabularySubsetHead(projection, mx.array(held[parallel.rank] or [0]))
        self.order = mx.array([r * self.width + j for r, h in enumerate(held) for j in range(len(h))])
        self.group = parallel.group

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.local(x)[..., : self.count]
        return gather_last_axis(logits, self.group, self.width * self.group.size())[..., self.order]


class LayerElsewhere(nn.Module):
    """A layer another rank of the pipeline runs: nothing held here."""

    def __init__(self, layer_type: str):
        super().__init__()
        self.layer_type = layer_type


class HybridModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; subclasses build the layers.

    Each layer has a `layer_type` ("linear_attention" or "full_attention") and is
    called as layer(h, cache).
    """

    def __init__(self, args, layers):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.parallel: Parallel | None = None  # set by shard
        self.vocab_range = None  # split: the [start, end) of the vocabulary rows this rank holds

    @property
    def group(self):
        return self.parallel.group if self.parallel is not None else None

    def shard(self, group, mode: str = TENSOR) -> dict[str, Split]:
        """Split this model over `group`'s ranks in place (see `mlx_hybrid.parallel`): this rank
        keeps its part of every parameter. mode: "tensor" or "pipeline". Returns the `Split`
        of each split parameter by name (the loaders cut checkpoint tensors with them).
        The MTP head is split like the layers in tensor mode; a pipeline keeps it whole on
        every rank (one layer's worth), so that every rank drafts without communicating."""
        if self.parallel is not None:
            raise ShardingError("this model is already split")
        rank, size = group.rank(), group.size()
        specs = {"embed_tokens.weight": ROWS}
        if not self.args.tie_word_embeddings:
            specs["lm_head.weight"] = ROWS
        if mode == TENSOR:
            for i, layer in enumerate(self.layers):
                specs |= prefixed(f"layers.{i}", layer.split_heads(group))
            for i, layer in enumerate(self.mtp.layers if self.has_mtp else []):
                specs |= prefixed(f"mtp.layers.{i}", layer.split_heads(group))
        elif mode == PIPELINE:
            count = len(self.layers)
            require(size <= count, f"a pipeline over {size} ranks needs at least {size} layers; the model has {count}")
            held = layer_range(count, rank, size)
            for i, layer in enumerate(self.layers):
                if i not in held:
                    self.layers[i] = LayerElsewhere(layer.layer_type)
        else:
            raise ShardingError(f"unknown split {mode!r} (use {TENSOR!r} or {PIPELINE!r})")
        self.parallel = Parallel(group, mode)
        self.vocab_range = ROWS.bounds(self.args.vocab_size, rank, size)[0]
        _cut_parameters(self, specs, rank, size)
        return specs

    @property
    def has_mtp(self) -> bool:
        return "mtp" in self

    def make_cache(self):
        # a layer another rank runs gets an empty KV cache: it trims and checkpoints to nothing
        return [
            RecurrentCache() if layer.layer_type == LINEAR and not isinstance(layer, LayerElsewhere) else KVCache()
            for layer in self.layers
        ]

    def embed(self, ids: mx.array) -> mx.array:
        # in the compute dtype: a quantized embedding gives float32
        dtype = self.norm.weight.dtype
        if self.vocab_range is None:
            return self.embed_tokens(ids).astype(dtype)
        start, end = self.vocab_range
        local = ids - start
        held = (local >= 0) & (local < end - start)
        rows = self.embed_tokens(mx.where(held, local, 0)).astype(dtype)
        return all_sum(mx.where(held[..., None], rows, 0), self.group)

    def hidden_states(self, ids: mx.array, cache=None) -> mx.array:
        """The trunk's hidden state before the final norm, [B, T, E]."""
        h = self.embed(ids)
        pipeline = self.parallel if self.parallel is not None and self.parallel.mode == PIPELINE else None
        if pipeline is not None and pipeline.rank > 0:
            # the embedding's all-sum first, as on the ranks before: a receive does not depend on it
            mx.eval(h)
            h = mx.distributed.recv_like(h, pipeline.rank - 1, group=pipeline.group)
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerElsewhere):
                h = layer(h, cache[i] if cache is not None else None)
        if pipeline is not None:
            if pipeline.rank < pipeline.size - 1:
                h = mx.distributed.send(h, pipeline.rank + 1, group=pipeline.group)
            # the last rank's output, on every rank (the gather also makes the send run)
            h = mx.distributed.all_gather(h, group=pipeline.group)[-h.shape[0] :]
        return h

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        return self.project(self.norm(h))

    def _output_projection(self) -> nn.Module:
        return self.embed_tokens if self.args.tie_word_embeddings else self.lm_head

    def project(self, x: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            logits = self.embed_tokens.as_linear(x)
        else:
            logits = self.lm_head(x)
        return logits if self.parallel is None else gather_last_axis(logits, self.group, self.args.vocab_size)

    def vocabulary_head(self, ids: mx.array) -> nn.Module:
        """`project` restricted to the tokens `ids`."""
        if self.parallel is not None:
            return SplitVocabularySubsetHead(self._output_projection(), ids, self.parallel, self.args.vocab_size)
        return VocabularySubsetHead(self._output_projection(), ids)

    def __call__(self, ids: mx.array, cache=None) -> mx.array:
        return self.logits_from_hidden(self.hidden_states(ids, cache))


def _cut_parameters(model: nn.Module, specs: dict, rank: int, size: int):
    """Replace each split parameter by this rank's part (quantized modules: all their parts)."""
    from ..loaders.quantized import QuantizedTensor

    for name, split in specs.items():
        path, leaf = name.rsplit(".", 1)
        module = model
        for part in path.split("."):
            module = module[int(part)] if part.isdigit() else module[part]
        if leaf == "weight" and "scales" in module:
            parts = QuantizedTensor(module.weight, module.scales, module.biases, module.bits, module.group_size)
            taken = split.take(parts, rank, size)
            if not hasattr(taken, "scales"):
                raise ShardingError(f"{name}: its split falls inside quantization groups")
            module.weight, module.scales, module.biases = taken.weight, taken.scales, taken.biases
        else:
            setattr(module, leaf, split.take(module[leaf], rank, size))
