"""Per-layer n-gram embeddings (PLE, Qwen3.8-Flash-Next's): each token's 2- .. n-grams, restarting after
the end token, hashed into prime-sized slices of a large table read row by row (the loader's `table`,
left in its files), projected, gated by each residual stream's normed state, and a dilated depthwise
convolution over them. The state a step carries, the last tokens and the convolution's tail, rides with
the layer's recurrent state (`PLECache`)."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache import LayerCache, RecurrentCache
from ..row_caches import PassCache, RecurrentStep, recurrent
from .layers import Linear, RMSNorm, group_rms_norm

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2, _PRIME = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def ngram_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Each n-gram position's odd hash multiplier for the `ple_index`-th PLE layer, as the checkpoints
    were trained with (a token times one stays below 2^63)."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _PRIME * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    return n == 2 or (n > 2 and n % 2 == 1 and all(n % d for d in range(3, math.isqrt(n) + 1, 2)))


def ngram_head_sizes(base: int, ple_index: int, heads: int) -> list[int]:
    """The table slice of each hashed head of the `ple_index`-th PLE layer: the primes after `base - 1`,
    each layer's heads taking the next ones."""
    sizes, prime = [], base - 1
    for index in range(ple_index * heads + heads):
        prime += 1
        while not _is_prime(prime):
            prime += 1
        if index >= ple_index * heads:
            sizes.append(prime)
    return sizes


def ngram_table_rows(head_sizes, divisor: int) -> int:
    """A PLE layer's table rows: its heads' slices, padded to a multiple of `divisor`."""
    return -(-int(sum(head_sizes)) // divisor) * divisor


# a checkpoint's names of the hash's values -> NGramHash's
STORED_NAMES = {
    "layer_multipliers": "multipliers",
    "ngram_heads_vocab_sizes": "sizes",
    "ngram_heads_offsets": "offsets",
}


class NGramHash:
    """Token n-grams (2 .. ngram_size tokens) -> rows of one PLE layer's table, on the host: the
    n-grams of a token read the tokens before it back to the last end token (earlier ones read as the
    end token), hashed by xor of token x multiplier, each order into `heads_per_ngram` prime-sized
    slices."""

    def __init__(self, args, ple_index: int):
        self.ngram_size, self.eos = args.ngram_size, args.eos_token_id
        self.heads = (args.ngram_size - 1) * args.heads_per_ngram
        self.multipliers = np.array(ngram_multipliers(args.vocab_size, args.ngram_size, ple_index, args.seed), np.int64)
        self.sizes = np.array(ngram_head_sizes(args.ngram_vocab_size_base, ple_index, self.heads), np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.per_order = args.heads_per_ngram
        self.divisor = args.make_ngram_vocab_size_divisible_by
        self.rows = ngram_table_rows(self.sizes, self.divisor)

    def take_stored(self, stored: dict):
        """The multipliers, slice sizes and offsets a checkpoint stores beside its table (transformers'
        `layer_multipliers`, `ngram_heads_vocab_sizes`, `ngram_heads_offsets`), in place of those computed
        from the config: the model hashes as the checkpoint was trained. A wrong shape is a ValueError."""
        for name, value in stored.items():
            value = np.array(value).astype(np.int64)
            mine = getattr(self, STORED_NAMES[name])
            if value.shape != mine.shape:
                raise ValueError(f"{name} has shape {value.shape}, expected {mine.shape}")
            setattr(self, STORED_NAMES[name], value)
        self.rows = ngram_table_rows(self.sizes, self.divisor)

    def stored(self) -> dict[str, np.ndarray]:
        """The values `take_stored` takes, by the checkpoint's names (int64, as transformers saves them)."""
        return {name: getattr(self, attribute) for name, attribute in STORED_NAMES.items()}

    def __call__(self, history: np.ndarray, count: int) -> np.ndarray:
        """Table rows [B, count, heads] of the last `count` tokens of history [B, ngram_size - 1 + count]."""
        n, eos = self.ngram_size, self.eos
        end = history.shape[1]
        shifted = []
        for shift in range(n):
            tokens = history[:, end - count - shift : end - shift]
            if shift:  # an end token among the `shift` tokens before: the n-gram reaches past its segment
                crossed = np.zeros(tokens.shape, bool)
                for back in range(1, shift + 1):
                    crossed |= history[:, end - count - back : end - back] == eos
                tokens = np.where(crossed, eos, tokens)
            shifted.append(tokens.astype(np.int64) * self.multipliers[shift])
        blocks, mixed = [], shifted[0]
        for order in range(2, n + 1):
            mixed = mixed ^ shifted[order - 1]
            heads = slice((order - 2) * self.per_order, (order - 1) * self.per_order)
            blocks.append(mixed[..., None] % self.sizes[heads] + self.offsets[heads])
        return np.concatenate(blocks, axis=-1)


class PLECache(LayerCache):
    """A PLE layer's caches: the linear-attention mixer's (`mixer`) and the PLE's own (`ple`: a
    RecurrentCache of `PLE.step`'s state), rolled back and checkpointed together."""

    def __init__(self):
        self.mixer, self.ple = RecurrentCache(), RecurrentCache()

    @property
    def parts(self):
        return (self.mixer, self.ple)

    @property
    def record_snapshots(self):
        return self.mixer.record_snapshots

    @record_snapshots.setter
    def record_snapshots(self, on: bool):
        for part in self.parts:
            part.record_snapshots = on

    def rollback(self, keep: int, recorded: int):
        for part in self.parts:
            part.rollback(keep, recorded)

    def mark(self):
        return tuple(part.mark() for part in self.parts)

    def rewind(self, mark):
        for part, m in zip(self.parts, mark):
            part.rewind(m)

    def checkpoint(self) -> tuple:
        mixer, ple = self.mixer.checkpoint(), self.ple.checkpoint()
        return (*mixer, *ple) if mixer and ple else ()

    def restore(self, entries: tuple):
        self.mixer.restore(entries[:2])
        self.ple.restore(entries[2:])

    @property
    def arrays(self) -> list[mx.array]:
        return self.mixer.arrays + self.ple.arrays

    @property
    def step_nbytes(self) -> int:
        return self.mixer.step_nbytes + self.ple.step_nbytes


class PLE(nn.Module):
    """Per-layer n-gram embeddings added to every stream (see the module's docstring). The table is not
    a parameter: the loader gives it (`table`: rows(ids [..]) -> [.., d], read where it lies)."""

    def __init__(self, args, ple_index: int):
        super().__init__()
        self.count, self.width, self.eps = args.hc_count, args.hidden_size, args.rms_norm_eps
        wide = self.count * self.width
        self.hash = NGramHash(args, ple_index)
        self.history = args.ngram_size - 1
        self.dilation, self.kernel = args.ngram_size, args.ple_conv_kernel_size
        self.key_proj = Linear(args.ple_embed_dim, wide, bias=False)
        self.value_proj = Linear(args.ple_embed_dim, self.width, bias=False)
        self.norm_key = RMSNorm(wide, args.rms_norm_eps)
        self.norm_query = RMSNorm(wide, args.rms_norm_eps)
        self.norm_conv = RMSNorm(wide, args.rms_norm_eps)
        self.conv1d_weight = mx.zeros((wide, self.kernel))
        self.table = None  # set by the loader
        self.row_width = args.ple_embed_dim // self.hash.heads

    @property
    def table_shape(self) -> tuple[int, int]:
        """What the loader's table must be."""
        return self.hash.rows, self.row_width

    @property
    def conv_tail(self) -> int:
        return (self.kernel - 1) * self.dilation

    def __call__(self, streams: mx.array, ids: mx.array, cache: PassCache | None) -> mx.array:
        """What the layer adds to the streams [B, T, n E] for the tokens ids [B, T]."""
        return recurrent(self.step, cache, streams, ids)

    def step(self, streams: mx.array, ids: mx.array, state: tuple | None, record: bool) -> RecurrentStep:
        """The layer as a recurrent step: its state is the last ngram_size - 1 tokens [B, n - 1] (int32)
        and the convolution's tail [B, (K - 1) dilation, n E]. The hash and the table's rows are read on
        the host: tokens still being computed (a sampled token, device drafts) are waited for here."""
        B, T, wide = streams.shape
        tokens = np.array(ids, np.int64)
        if state is None:
            history = np.full((B, self.history), self.hash.eos, np.int64)
            tail = mx.zeros((B, self.conv_tail, wide), streams.dtype)
        else:
            history, tail = np.array(state[0], np.int64), state[1]
        history = np.concatenate([history, tokens], axis=1)
        rows = self.table.rows(self.hash(history, T))  # [B, T, heads, d]
        embedding = rows.reshape(B, T, -1).astype(streams.dtype)
        split = (B, T, self.count, self.width)
        key = group_rms_norm(self.key_proj(embedding), self.norm_key.weight, self.eps, self.width).reshape(split)
        query = group_rms_norm(streams, self.norm_query.weight, self.eps, self.width).reshape(split)
        gate = (key * query).sum(axis=-1, keepdims=True) / math.sqrt(self.width)
        gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6)) * mx.sign(gate)
        gated = (mx.sigmoid(gate) * self.value_proj(embedding)[:, :, None, :]).reshape(B, T, wide)
        normed = group_rms_norm(gated, self.norm_conv.weight, self.eps, self.width)
        padded = mx.concatenate([tail, normed], axis=1)
        S = self.conv_tail
        conv = sum(
            padded[:, S - (self.kernel - 1 - j) * self.dilation :][:, :T] * self.conv1d_weight[:, j]
            for j in range(self.kernel)
        )
        kept = mx.array(history[:, -self.history :].astype(np.int32))
        snapshots = None
        if record:
            snapshots = (
                [mx.array(history[:, t + 1 : t + 1 + self.history].astype(np.int32)) for t in range(T)],
                [padded[:, t + 1 : t + 1 + S] for t in range(T)],
            )
        return RecurrentStep(gated + nn.silu(conv), (kept, padded[:, T:]), snapshots)
