"""Attention over a KV cache, float or quantized (--kv-bits), of one sequence or of a batch of rows
whose caches hold different numbers of keys (`key_lengths`): where each backend computes it."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from . import backend, cpu_kernels, gpu_kernels, reference, row_kernels, selfcheck
from .cpu_extension import ATTENTION
from .reference import QuantizedEntries

# A quantized KV cache's (--kv-bits) forms: mx.quantize's affine groups, in these sizes
KV_BITS, KV_GROUP_SIZES = (4, 8), (32, 64, 128)


def scaled_dot_product_attention(
    q, k, v, scale: float, mask: str | mx.array | None = None, key_lengths=None, window: int | None = None
) -> mx.array:
    """mx.fast.scaled_dot_product_attention with mask None, "causal" or booleans [B, 1, T, S]: q [B, H, T, Dk] over
    k [B, Hkv, S, Dk], v [B, Hkv, S, Dv] -> [B, H, T, Dv]; k and v may be a quantized cache's
    `QuantizedEntries`. key_lengths (host ints, one a batch row): row b holds only its first
    key_lengths[b] keys, the causal mask aligned to its last. window: a sliding-window layer's, the
    queries being a row's last T keys: a query sees only keys fewer than `window` places from it.

    On the CPU our kernel: for a few query tokens (decode steps, verify passes) one node where MLX's
    op makes about 15, each query row's bits the same whatever rows come with it (a verify pass
    reproduces its decode steps, a batch row its sequence alone); for more (prompts, images), the
    BLAS's products with our exponentials between them, 2.9x MLX's op for a prompt chunk over a long
    cache, 5x for a vision tower's (benchmarks/cpu_attention.py). A quantized cache's entries are
    decoded a few rows at a time and take the float32 path's arithmetic. Elsewhere MLX's ops: one
    call for a whole batch where a GPU computes, its rows' lengths as a mask, but a GPU's decode steps
    and verify passes on our row-invariant kernel (`row_kernels`: each query token's bits whatever
    tokens, rows or keys come with it)."""
    if isinstance(mask, mx.array):  # a layer's own choice of keys (an indexer's): MLX's op
        return _mlx_attention(q, k, v, scale, mask)
    if window is not None and window < _keys(k):  # (a tiny drafter's layers: MLX's op, with a mask array)
        lengths = tuple(key_lengths) if key_lengths is not None else (_keys(k),) * q.shape[0]
        return _mlx_attention(q, k, v, scale, _rows_mask(lengths, q.shape[2], _keys(k), mask == "causal", window))
    if mask in (None, "causal") and (out := _row_attention(q, k, v, scale, mask == "causal", key_lengths)) is not None:
        return out
    if _kernel_runs(q, k, v):
        lengths = None if key_lengths is None else mx.array(key_lengths, mx.int32)
        if isinstance(k, QuantizedEntries):
            return cpu_kernels.quantized_attention(q, k, v, scale, mask == "causal", lengths)
        return cpu_kernels.attention(q, k, v, scale, mask == "causal", lengths)
    if key_lengths is None:
        return _mlx_attention(q, k, v, scale, mask)
    if backend.gpu_computes():
        return _mlx_attention(q, k, v, scale, _rows_mask(tuple(key_lengths), q.shape[2], _keys(k), mask == "causal"))
    # MLX's ops on the CPU: each row over its own keys, as it computes alone
    rows = [
        _mlx_attention(q[b : b + 1], _rows(k, b, n), _rows(v, b, n), scale, mask) for b, n in enumerate(key_lengths)
    ]
    return mx.concatenate(rows, axis=0)


def _row_attention(q, k, v, scale: float, causal: bool, key_lengths):
    """The attention on a GPU's row-invariant kernel, or None where it does not compute this one (the
    CPU, a prompt, a form it does not read, a variant that failed its first-use check)."""
    platform = backend.kernel_platform()
    if platform is None:
        return None
    form = row_kernels.attention_form(q.shape, q.dtype, *row_kernels.entries_of(k, v), causal)
    if form is None or not selfcheck.passed(
        row_kernels.ROW_ATTENTION, row_kernels.small_attention_case, platform, *form.variant
    ):
        return None
    launch = row_kernels.attention_form_launch(form, q, k, v, scale, row_kernels.key_counts_of(q, k, key_lengths))
    return gpu_kernels.run(row_kernels.ROW_ATTENTION, launch, platform)[0]


def _kernel_runs(q, k, v) -> bool:
    if isinstance(k, QuantizedEntries):
        float32 = q.dtype == k.scales.dtype == v.scales.dtype == mx.float32
        variant = (k.bits, k.group_size)
        return float32 and backend.cpu_kernel_passed(ATTENTION, selfcheck.small_quantized_attention_case, *variant)
    float32 = q.dtype == k.dtype == v.dtype == mx.float32
    return float32 and backend.cpu_kernel_passed(ATTENTION, selfcheck.small_attention_case)


def _mlx_attention(q, k, v, scale: float, mask):
    if isinstance(k, QuantizedEntries):
        return reference.quantized_attention(q, k, v, scale, mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _keys(entries) -> int:
    return (entries.codes if isinstance(entries, QuantizedEntries) else entries).shape[2]


def _rows(entries, b: int, keys: int):
    """Batch row b's first `keys` entries."""
    if isinstance(entries, QuantizedEntries):
        return entries._replace(**{name: a[b : b + 1, :, :keys] for name, a in zip(entries._fields, entries.arrays)})
    return entries[b : b + 1, :, :keys]


@lru_cache(maxsize=8)
def _rows_mask(
    key_lengths: tuple[int, ...], tokens: int, keys: int, causal: bool, window: int | None = None
) -> mx.array:
    """[B, 1, T, S] booleans: the keys each row's query token sees, the queries a row's last T keys (a
    pass's layers share it; made on the host, so it launches nothing)."""
    lengths = np.asarray(key_lengths).reshape(-1, 1, 1, 1)
    query = lengths - tokens + np.arange(tokens).reshape(1, 1, -1, 1)  # each query's place among its row's keys
    key = np.arange(keys).reshape(1, 1, 1, -1)
    seen = (key < lengths) & ((key <= query) if causal else True)
    if window is not None:
        seen &= np.abs(query - key) < window
    return mx.array(seen)


def quantize_entries(x: mx.array, bits: int, group_size: int) -> QuantizedEntries:
    """Keys or values [B, H, T, D] as a quantized KV cache holds them: each token's D features in
    groups of `group_size`, a scale and bias each (mx.quantize), so a token's codes are the same
    whatever tokens come with it."""
    return QuantizedEntries(*mx.quantize(x, group_size=group_size, bits=bits), bits, group_size)


def dequantized_entries(entries) -> mx.array:
    """Cached entries [B, H, S, D] as an array, a quantized cache's decoded."""
    if not isinstance(entries, QuantizedEntries):
        return entries
    return mx.dequantize(*entries.arrays, group_size=entries.group_size, bits=entries.bits)


def leading_features(entries, features: int):
    """The first `features` of each cached entry [B, H, S, D], of an array or of `QuantizedEntries`."""
    return entries.leading(features) if isinstance(entries, QuantizedEntries) else entries[..., :features]
