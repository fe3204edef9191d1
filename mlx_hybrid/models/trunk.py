"""The trunk every architecture shares: embedding, decoder layers, final norm and LM head,
with its caches and its split over a group's ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import ops
from ..cache import KVCache, QuantizedKVCache, RecurrentCache, check_kv_quantization
from ..parallel import (
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
from .heads import SplitVocabularySubsetHead, VocabularySubsetHead
from .layers import LINEAR, Embedding, Linear, RMSNorm, widest_product
from .sharding import LayerElsewhere, cut_parameters, prefixed


@dataclass
class TrunkArgs:
    """The arguments the trunk reads; each family's `ModelArgs` adds its layers' own."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool = field(default=False, kw_only=True)


class HybridModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; subclasses build the layers.

    Each layer has a `layer_type` ("linear_attention" or "full_attention") and is
    called as layer(h, cache), its cache a `row_caches.PassCache`.
    """

    def __init__(self, args: TrunkArgs, layers):
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
        cut_parameters(self, specs, rank, size)
        return specs

    @property
    def has_mtp(self) -> bool:
        return "mtp" in self

    @property
    def nbytes(self) -> int:
        """The bytes the model's weights take in memory (its MTP head and vision tower included)."""
        return sum(p.nbytes for _, p in tree_flatten(self.parameters()))

    @property
    def mapped_nbytes(self) -> int:
        """The bytes of the tables read by rows where they lie in their files (`row_tables`)."""
        return sum(table.nbytes for table in self.row_tables().values())

    @property
    def kv_features(self) -> tuple[int, ...]:
        """The widths of what an attention layer caches per token and KV head."""
        raise NotImplementedError

    def make_cache(self, kv_bits: int | None = None, kv_group_size: int = 64) -> list:
        """A cache per layer. kv_bits: the attention layers hold their keys and values in 4 or 8 bits,
        in groups of kv_group_size features (`cache.QuantizedKVCache`); None: in the compute dtype."""
        if kv_bits is not None:
            check_kv_quantization(kv_bits, kv_group_size, self.kv_features)

        def attention_cache():
            return KVCache() if kv_bits is None else QuantizedKVCache(kv_bits, kv_group_size)

        # a layer another rank runs gets an empty KV cache: it trims and checkpoints to nothing
        return [
            RecurrentCache() if layer.layer_type == LINEAR and not isinstance(layer, LayerElsewhere)
            else attention_cache()
            for layer in self.layers
        ]  # fmt: skip

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

    @property
    def has_vision(self) -> bool:
        return "vision" in self

    def image_features(self, images) -> mx.array:
        """The tokens [n, E] of `images` (each with `patches` and `grid`), in order."""
        return mx.concatenate([self.vision(mx.array(image.patches), image.grid) for image in images])

    def take_stored_values(self, weights: dict) -> dict:
        """The weights less the values a checkpoint stores that are not parameters (a model takes them in
        place of those it computes): none for most models."""
        return weights

    def stored_values(self) -> dict:
        """Those values by the names `take_stored_values` takes them by (for writing them out)."""
        return {}

    def take_row_tables(self, tables: dict):
        """The tables the loader left in their files (name -> rows(ids) -> [..., d]): none for most models."""
        if tables:
            raise ValueError(f"tables this model does not read: {', '.join(sorted(tables))}")

    def row_tables(self) -> dict:
        """The tables `take_row_tables` gave, by the names the loader gave them (for writing them out)."""
        return {}

    @property
    def residual_width(self) -> int:
        """The width of the state the layers carry per token (`residual_streams`)."""
        return self.args.hidden_size

    def residual_streams(self, h: mx.array) -> mx.array:
        """The residual state the layers carry, from the embeddings [B, T, E] (their own; a model with
        several residual streams, its copies of them)."""
        return h

    def layer_inputs(self, ids: mx.array) -> dict:
        """What else the layers read of the tokens (keywords; none for most models)."""
        return {}

    def hidden_states(
        self, ids: mx.array, cache=None, inserted=None, evaluate_each_layer: bool = False, taps: dict | None = None
    ) -> mx.array:
        """The trunk's hidden state before the final norm, [B, T, E]. inserted: (at [n], rows
        [n, E]), embeddings that replace those of the tokens at `at` of a one-row input (an
        image's tokens, from `image_features`). evaluate_each_layer: each layer's output
        evaluated before the next layer is built, so that a long pass holds one layer's
        intermediates at a time (see `ops.prefill_layer_by_layer`). taps: layer index -> filled
        with that layer's output [B, T, E] (what a drafter reads of the trunk's states)."""
        h = self.embed(ids)
        if inserted is not None:
            at, rows = inserted
            h[0, at] = rows.astype(h.dtype)
        h, extra = self.residual_streams(h), self.layer_inputs(ids)
        pipeline = self.parallel if self.parallel is not None and self.parallel.mode == PIPELINE else None
        if pipeline is not None and pipeline.rank > 0:
            # the embedding's all-sum first, as on the ranks before: a receive does not depend on it
            mx.eval(h)
            h = mx.distributed.recv_like(h, pipeline.rank - 1, group=pipeline.group)
        widest = self.widest_product
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerElsewhere):
                h = layer(h, cache[i] if cache is not None else None, **extra)
                ops.layer_built(h, widest, evaluate=evaluate_each_layer)
                if taps is not None and i in taps:
                    taps[i] = h
        if pipeline is not None:
            if pipeline.rank < pipeline.size - 1:
                h = mx.distributed.send(h, pipeline.rank + 1, group=pipeline.group)
            # the last rank's output, on every rank (the gather also makes the send run)
            h = mx.distributed.all_gather(h, group=pipeline.group)[-h.shape[0] :]
        return h

    @property
    def widest_product(self) -> int:
        """The most weights one of its products multiplies (`layers.widest_product`)."""
        return widest_product(self.args)

    def mtp_input(self, hidden: mx.array) -> mx.array:
        """The trunk's hidden states (`hidden_states`) as the MTP head (`mtp`) reads them."""
        return hidden

    def mtp_teacher_forced(self, hidden: mx.array, next_ids: mx.array) -> mx.array:
        """MTP logits [B, T, V] for the trunk's hidden states [B, T, ...] (`hidden_states`) and the tokens
        after them [B, T]: position t predicts the token after next_ids[t]."""
        y, _ = self.mtp(self.mtp_input(hidden), self.embed(next_ids))
        return self.project(y)

    def mtp_logits(self, ids: mx.array) -> mx.array:
        """Teacher-forced MTP predictions [B, T-1, V]: position t from h_t and token t+1."""
        if not self.has_mtp:
            raise ValueError("this model has no MTP head")
        return self.mtp_teacher_forced(self.hidden_states(ids)[:, :-1], ids[:, 1:])

    def states_at(self, taps: dict, layer_ids) -> mx.array:
        """The trunk's states at `layer_ids` concatenated per position, [B, T, L E], from the outputs a
        pass left in `taps` (`hidden_states(..., taps=...)`), numbered as transformers' hidden_states[id
        + 1], which DFlash drafters were trained on: a layer's output, the last layer's after the norm."""
        last = len(self.layers) - 1
        return mx.concatenate([self.norm(taps[i]) if i == last else taps[i] for i in layer_ids], axis=-1)

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
