"""Qwen3.8-Flash-Next (`qwen4_exp`): Qwen3.5's gated delta layers and MoE, with hyper-connections,
indexed (QSA) attention and per-layer n-gram embeddings (PLE).

- Hyper-connections: the residual stream is `hc_count` copies of the hidden state, [B, T, n E]. Before
  each mixer and each MLP a low-rank gate mixes the streams into the block's input; the block's output is
  added back to every stream with per-stream weights. A last mixer folds the streams for the LM head: it
  stands where Qwen3.5's final norm does (`Model.norm`).
- Indexed attention: an indexer scores each query against blocks of `indexer_compress_ratio` keys
  (their raw index keys mean-pooled, normed, rotated at the block's first position) and the query sees
  only the best `indexer_budget / indexer_compress_ratio` complete blocks and the incomplete tail. Its
  cache holds the raw index keys beside the keys and values.
- PLE on some linear layers: hashed token n-grams looked up in a large table read row by row, gated by
  the normed streams (`ngram_embedding`).
- An MTP head (`MTPHead`) that reads the streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from operator import attrgetter

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import ops
from ..cache import AttentionCache
from ..parallel import TENSOR, ShardingError
from ..row_caches import PassCache, attend_rows, part_of
from .layers import F32, FULL, LINEAR, Linear, RMSNorm, group_rms_norm, widest_product
from .ngram_embedding import PLE, PLECache
from .qwen3_5 import FLOAT32_PARAMS  # noqa: F401  (the loaders')
from .qwen3_5 import PRE_NORM, GatedAttention, GatedDeltaNet, SparseMoE
from .qwen3_5 import ModelArgs as Qwen35Args
from .trunk import HybridModel
from .vision import VisionTower

INDEXED = "indexed_attention"  # the checkpoints' name for an indexed layer; published configs say "full_attention"


@dataclass
class ModelArgs(Qwen35Args):
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list[int] = field(default_factory=list)  # one-indexed
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    output_gate_type: str | None = None
    eos_token_id: int | list[int] | None = None
    mtp_hidden: str = PRE_NORM  # the MTP head reads the streams before the last mixer (`MTPHead`)

    def __post_init__(self):
        self.layer_types = [FULL if t == INDEXED else t for t in self.layer_types]
        self.ple_layer_ids = sorted(set(self.ple_layer_ids or ()))
        if self.ple_embed_dim is None:
            self.ple_embed_dim = self.hidden_size
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0] if self.eos_token_id else None

    def validate(self):
        super().validate()
        if self.hc_count <= 1:
            raise ValueError(f"hc_count must be above 1, got {self.hc_count}")
        if self.mtp_hidden != PRE_NORM:
            raise ValueError(
                f"a qwen4_exp MTP head reads the streams before the last mixer ({PRE_NORM!r}), not {self.mtp_hidden!r}"
            )
        if (self.output_gate_type or "silu") not in ("silu", "sigmoid"):
            raise ValueError(f"output_gate_type {self.output_gate_type!r} is not computed (silu or sigmoid)")
        indexer = (
            self.indexer_n_heads,
            self.indexer_kv_heads,
            self.indexer_head_dim,
            self.indexer_budget,
            self.indexer_compress_ratio,
        )
        if FULL in self.layer_types and (None in indexer or self.indexer_kv_heads != 1):
            raise ValueError(
                "indexed attention needs indexer_n_heads, indexer_head_dim, indexer_budget and "
                "indexer_compress_ratio, and indexer_kv_heads 1"
            )
        if FULL in self.layer_types and self.indexer_budget % self.indexer_compress_ratio:
            raise ValueError("indexer_budget must be a multiple of indexer_compress_ratio")
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        if self.ple_layer_ids:
            if heads <= 0 or self.ple_embed_dim % heads:
                raise ValueError(f"ple_embed_dim {self.ple_embed_dim} must split over {heads} n-gram heads")
            if any(
                not 1 <= i <= self.num_hidden_layers or self.layer_types[i - 1] != LINEAR for i in self.ple_layer_ids
            ):
                raise ValueError("ple_layer_ids must name linear-attention layers (one-indexed)")
            if self.eos_token_id is None:
                raise ValueError("PLE layers need eos_token_id (their n-grams restart after it)")


class GatedResidual(nn.Module):
    """A hyper-connection: the streams [B, T, n E] mixed into one block input [B, T, E] by a low-rank
    sigmoid gate over the group-normed streams; with `inject`, also each stream's weight for the block's
    output (2 sigmoid(...)), which `add` puts back."""

    def __init__(self, args: ModelArgs, inject: bool = True):
        super().__init__()
        self.count, self.width, self.eps = args.hc_count, args.hidden_size, args.rms_norm_eps
        wide = self.count * self.width
        self.hc_norm = RMSNorm(wide, args.rms_norm_eps)
        self.input_mix_weight_down = Linear(wide, args.hc_lowrank, bias=False)
        self.input_mix_weight_up = Linear(args.hc_lowrank, wide, bias=False)
        if inject:
            self.block_inject_weight = Linear(wide, self.count, bias=False)

    @property
    def weight(self) -> mx.array:
        """The norm's weight (its dtype is the trunk's compute dtype, as a final norm's is)."""
        return self.hc_norm.weight

    def mix(self, streams: mx.array):
        """(the block's input [B, T, E], the streams' weights for its output [B, T, n] or None)."""
        normed = group_rms_norm(streams, self.hc_norm.weight, self.eps, self.width)
        gate = mx.sigmoid(self.input_mix_weight_up(nn.silu(self.input_mix_weight_down(normed) / self.count)))
        split = (*streams.shape[:-1], self.count, self.width)
        block_input = (gate.reshape(split) * normed.reshape(split)).mean(axis=-2)
        if "block_inject_weight" not in self:
            return block_input, None
        return block_input, 2 * mx.sigmoid(self.block_inject_weight(normed) / self.count)

    @staticmethod
    def add(streams: mx.array, out: mx.array, weights: mx.array) -> mx.array:
        return streams + (out[..., None, :] * weights[..., None]).reshape(streams.shape)

    def __call__(self, streams: mx.array) -> mx.array:
        return self.mix(streams)[0]


# -- indexed attention ----------------------------------------------------------------------------


class IndexedAttention(GatedAttention):
    """Qwen3.5's gated attention over the keys an indexer keeps for each query (see the module's
    docstring). Its cache holds keys, values and the raw index keys [B, 1, S, d]."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.index_heads, self.index_dim = args.indexer_n_heads, args.indexer_head_dim
        self.block, self.blocks_kept = args.indexer_compress_ratio, args.indexer_budget // args.indexer_compress_ratio
        self.index_qk_proj = Linear(args.hidden_size, (self.index_heads + 1) * self.index_dim, bias=False)
        self.q_layernorm = RMSNorm(self.index_dim, args.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.index_dim, args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: PassCache | None = None) -> mx.array:
        B, T, _ = x.shape
        q, gate, k, v = self.projected(x)
        index_q, index_k = mx.split(
            self.index_qk_proj(x).reshape(B, T, self.index_heads + 1, self.index_dim), [self.index_heads], axis=2
        )
        out = attend_rows(self._attend, cache, q, k, v, self.q_layernorm(index_q), index_k, reads_key_positions=True)
        return self.gated_output(out, gate)

    def _attend(self, q, k, v, index_q, index_k, cache: AttentionCache | None):
        """Arrays and result [B, T, heads, D]. A batch's rows come here together only while their keys
        all sit at their indices (`attend_rows`' reads_key_positions)."""
        q, k, v, index_q, index_k = (a.transpose(0, 2, 1, 3) for a in (q, k, v, index_q, index_k))
        position = cache.rotary_span(q.shape[2]) if cache is not None else 0
        q, k, index_q = self._rope(q, position), self._rope(k, position), self._rope(index_q, position)
        if cache is not None:
            k, v, index_k = cache.update_and_fetch(k, v, index_k)
        index_k = ops.dequantized_entries(index_k)
        lengths = (cache.key_lengths if cache is not None else None) or (index_k.shape[2],) * q.shape[0]
        key_positions = cache.key_positions(index_k.shape[2]) if cache is not None else 0
        mask = self._kept_keys(index_q, index_k, lengths, key_positions)
        return ops.scaled_dot_product_attention(q, k, v, self.scale, mask).transpose(0, 2, 1, 3)

    def _kept_keys(self, index_q: mx.array, index_k: mx.array, lengths, key_positions) -> mx.array:
        """[B, 1, T, S] booleans: the keys each query sees, row b's queries the last T of its lengths[b]
        keys; key_positions: where key 0 sits (an int), or every key's position [3, S]."""
        B, _, T, _ = index_q.shape
        S, C = index_k.shape[2], self.block
        blocks = S // C
        query_at = np.asarray(lengths).reshape(B, 1) - T + np.arange(T)  # each query's index among its keys
        complete = (query_at + 1) // C  # the complete blocks it sees [B, T]
        causal = np.arange(S) <= query_at[..., None]
        if complete.max() <= self.blocks_kept:
            return mx.array(causal)[:, None]  # every complete block kept
        pooled = index_k[:, 0, : blocks * C].astype(F32).reshape(B, blocks, C, -1).mean(axis=2).astype(index_k.dtype)
        starts = _block_positions(key_positions, C, blocks)
        pooled = ops.rope_at(
            self.k_layernorm(pooled)[:, None], self.rope_dims, self.rope_theta, starts, self.mrope_section
        )
        scores = mx.maximum(index_q.astype(F32) @ pooled.astype(F32).swapaxes(-1, -2), 0).sum(axis=1)  # [B, T, blocks]
        scores = mx.where(mx.array(np.arange(blocks) < complete[..., None]), scores, -mx.inf)
        best = mx.argsort(-scores, axis=-1)[..., : self.blocks_kept]  # [B, T, kept]
        chosen = (best[..., None] == mx.arange(blocks)).any(axis=-2)  # [B, T, blocks]
        # each key's block, the tail's (and the future's) counted as one more, always chosen
        block_of = np.minimum(np.arange(S) // C, blocks)
        chosen = mx.take(mx.concatenate([chosen, mx.ones((B, T, 1), mx.bool_)], axis=-1), mx.array(block_of), axis=-1)
        in_tail = np.arange(S) // C >= complete[..., None]
        return ((chosen | mx.array(in_tail)) & mx.array(causal))[:, None]


def _block_positions(key_positions, step: int, count: int) -> np.ndarray:
    """The rotary positions of blocks' first keys: [count] (key 0 at `key_positions`), or [3, count] from
    every key's positions [3, S]."""
    if isinstance(key_positions, (int, np.integer)):
        return key_positions + step * np.arange(count)
    return key_positions[:, : step * count : step]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.layer_type = args.layer_types[index]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(args, gate_activation=args.output_gate_type or "silu")
        else:
            self.self_attn = IndexedAttention(args)
        self.mlp = SparseMoE(args)
        if index + 1 in args.ple_layer_ids:
            self.ple = PLE(args, args.ple_layer_ids.index(index + 1))
        self.attn_hyper_connection = GatedResidual(args)
        self.mlp_hyper_connection = GatedResidual(args)

    @property
    def has_ple(self) -> bool:
        return "ple" in self

    def __call__(self, streams, cache: PassCache | None = None, ids=None):
        mixer_cache = cache
        if self.has_ple:
            mixer_cache = part_of(cache, attrgetter("mixer"))
            streams = streams + self.ple(streams, ids, part_of(cache, attrgetter("ple")))
        block_input, weights = self.attn_hyper_connection.mix(streams)
        mixer = self.linear_attn if self.layer_type == LINEAR else self.self_attn
        streams = GatedResidual.add(streams, mixer(block_input, mixer_cache), weights)
        block_input, weights = self.mlp_hyper_connection.mix(streams)
        return GatedResidual.add(streams, self.mlp(block_input), weights)


class MTPHead(nn.Module):
    """The multi-token-prediction block (`mtp.*`), wired as SGLang's `qwen4_exp_mtp` runs it: the trunk's
    streams h_t [B, T, n E] (after the last layer, before the mixer) normed as one vector and projected
    stream by stream, token t+1's embedding normed, projected and added to every stream; one
    indexed-attention decoder layer without PLE; its own mixer ahead of the LM head. A chained draft's
    h (the carry) is the layer's output streams."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.hidden_size
        self.count = args.hc_count
        self.enorm = RMSNorm(E, args.rms_norm_eps)
        self.hnorm = RMSNorm(self.count * E, args.rms_norm_eps)
        self.fc_embedding = Linear(E, E, bias=False)
        self.fc_hidden = Linear(E, E, bias=False)
        # a list, so that checkpoint names `mtp.layers.0.*` are the module paths
        self.layers = [DecoderLayer(replace(args, num_hidden_layers=1, layer_types=[FULL], ple_layer_ids=[]), 0)]
        self.norm = GatedResidual(args, inject=False)
        self.widest_product = widest_product(args)

    def __call__(self, hidden: mx.array, next_embeddings: mx.array, cache: PassCache | None = None):
        """(y, carry): y [B, T, E] for the LM head (the token after next), carry [B, T, n E]."""
        B, T, wide = hidden.shape
        streams = self.fc_hidden(self.hnorm(hidden).reshape(B, T, self.count, wide // self.count))
        streams = (streams + self.fc_embedding(self.enorm(next_embeddings))[:, :, None]).reshape(B, T, wide)
        carry = self.layers[0](streams, cache)
        ops.layer_built(carry, self.widest_product)
        return self.norm(carry), carry


class Model(HybridModel):
    def __init__(self, args: ModelArgs):
        args.validate()
        super().__init__(args, [DecoderLayer(args, i) for i in range(args.num_hidden_layers)])
        self.norm = GatedResidual(args, inject=False)  # the streams folded for the LM head
        if args.mtp_num_hidden_layers:
            self.mtp = MTPHead(args)
        if args.vision is not None:
            self.vision = VisionTower(args.vision)

    def shard(self, group, mode: str = TENSOR):
        raise ShardingError(
            "qwen4_exp models are not split over ranks yet (their hyper-connections and PLE layers have no split)"
        )

    @property
    def kv_features(self) -> tuple[int, ...]:
        return (self.args.head_dim, self.args.indexer_head_dim)

    @property
    def residual_width(self) -> int:
        return self.args.hc_count * self.args.hidden_size

    def residual_streams(self, h: mx.array) -> mx.array:
        return mx.tile(h, (1, 1, self.args.hc_count))

    def layer_inputs(self, ids: mx.array) -> dict:
        return {"ids": ids}

    def row_tables(self) -> dict:
        return {
            f"layers.{i}.ple.ple_embedding.ngram_embedding.shard_0": layer.ple.table
            for i, layer in enumerate(self.layers)
            if layer.has_ple and layer.ple.table is not None
        }

    def take_stored_values(self, weights: dict) -> dict:
        """Each PLE layer's stored hash values (`ple.hash.*`, `NGramHash.take_stored`)."""
        weights = dict(weights)
        for i, layer in enumerate(self.layers):
            prefix = f"layers.{i}.ple.hash."
            stored = {name[len(prefix) :]: weights.pop(name) for name in list(weights) if name.startswith(prefix)}
            if stored and layer.has_ple:
                try:
                    layer.ple.hash.take_stored(stored)
                except ValueError as e:
                    raise ValueError(f"layer {i}'s n-gram hash: {e}") from None
            elif stored:
                raise ValueError(f"layer {i} has no n-gram table, but the checkpoint stores its hash values")
        return weights

    def stored_values(self) -> dict:
        return {
            f"layers.{i}.ple.hash.{name}": mx.array(values)
            for i, layer in enumerate(self.layers) if layer.has_ple
            for name, values in layer.ple.hash.stored().items()
        }  # fmt: skip

    def take_row_tables(self, tables: dict):
        tables = dict(tables)  # what is left is refused below
        for i, layer in enumerate(self.layers):
            if not layer.has_ple:
                continue
            table = tables.pop(f"layers.{i}", None)
            if table is None:
                raise ValueError(f"layer {i}'s n-gram table is missing")
            if table.shape != layer.ple.table_shape:
                raise ValueError(f"layer {i}'s n-gram table has shape {table.shape}, expected {layer.ple.table_shape}")
            layer.ple.table = table
        super().take_row_tables(tables)

    def make_cache(self, kv_bits: int | None = None, kv_group_size: int = 64) -> list:
        caches = super().make_cache(kv_bits, kv_group_size)
        return [PLECache() if layer.has_ple else c for layer, c in zip(self.layers, caches)]
