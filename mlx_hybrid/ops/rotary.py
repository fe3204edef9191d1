"""Rotary embeddings in pure MLX (rotate-half layout, and Qwen3.5's multimodal sections): the
factors computed on the host in float64, applied by one compiled op (or by `ops`' choice of it)."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

F32 = mx.float32


# Positions a block of factors holds: the few tokens of a decode step or a verify pass fall in one, and
# read it as a view instead of computing their own (about 20 us of host time a call, 2 us a view).
FACTOR_BLOCK = 256


@lru_cache(maxsize=4)
def _rope_factors(positions: range, head_dim: int, dims: int, base: float):
    """Per-feature factors c, s [T, head_dim] with rope(x) = x c + x[partner] s.

    Angles are computed in float64 on the host (the same for a position whichever call
    it comes in). Features past `dims` get c = 1, s = 0: they pass through unchanged.
    """
    block, at = divmod(positions.start, FACTOR_BLOCK)
    if at + len(positions) > FACTOR_BLOCK:
        return _factors_at(positions, head_dim, dims, base)
    c, s = _factor_block(block, head_dim, dims, base)
    return c[at : at + len(positions)], s[at : at + len(positions)]


@lru_cache(maxsize=8)
def _factor_block(block: int, head_dim: int, dims: int, base: float):
    """The factors of positions block * FACTOR_BLOCK and on, `FACTOR_BLOCK` of them."""
    start = block * FACTOR_BLOCK
    return _factors_at(range(start, start + FACTOR_BLOCK), head_dim, dims, base)


def _factors_at(positions, head_dim: int, dims: int, base: float):
    """c, s [T, head_dim] of tokens at positions [T] (any, in any order)."""
    return _factors(np.asarray(positions, dtype=np.float64)[:, None] * _inverse_frequencies(dims, base), head_dim)


def _inverse_frequencies(dims: int, base: float) -> np.ndarray:
    half = dims // 2
    return base ** (-np.arange(half) / half)


@lru_cache(maxsize=4)
def _rows_rope_factors(offsets: tuple[int, ...], tokens: int, head_dim: int, dims: int, base: float):
    """Factors c, s [B, T, head_dim] of batch rows whose tokens start at their own offsets: each
    position's as `_rope_factors` gives it (a pass's attention layers share them)."""
    positions = np.add.outer(np.asarray(offsets, np.float64), np.arange(tokens, dtype=np.float64))
    return _factors(positions[..., None] * _inverse_frequencies(dims, base), head_dim)


def _factors(angles: np.ndarray, head_dim: int):
    """c, s [..., head_dim] for angles [..., dims / 2] (see `_rope_factors`)."""
    half = angles.shape[-1]
    c = np.ones((*angles.shape[:-1], head_dim), np.float32)
    s = np.zeros((*angles.shape[:-1], head_dim), np.float32)
    c[..., :half] = c[..., half : 2 * half] = np.cos(angles)
    s[..., :half], s[..., half : 2 * half] = -np.sin(angles), np.sin(angles)
    return mx.array(c), mx.array(s)


def _mrope_axes(half: int, sections: tuple[int, int, int]) -> np.ndarray:
    """The axis (0 temporal, 1 row, 2 column) each frequency turns with, interleaved: T H W T H W ...,
    rows and columns for as many frequencies as their sections give, the temporal axis the rest."""
    axes = np.zeros(half, np.int64)
    for axis in (1, 2):
        axes[axis : 3 * sections[axis] : 3] = axis
    return axes


@lru_cache(maxsize=None)
def _rope_partners(head_dim: int, dims: int) -> mx.array:
    """The feature each one rotates with: x2 for x1 and x1 for x2 (itself past `dims`)."""
    half = dims // 2
    partner = np.arange(head_dim)
    partner[:half], partner[half:dims] = np.arange(half, dims), np.arange(half)
    return mx.array(partner)


@mx.compile
def _rotate(x, partner, c, s):
    return (x.astype(F32) * c + partner.astype(F32) * s).astype(x.dtype)


def rotate(x: mx.array, c: mx.array, s: mx.array, dims: int) -> mx.array:
    """x c + x[partner] s for factors c, s [T, D] (see `_rope_factors`), or [B, T, D] for each
    batch row of x [B, H, T, D], partners as `_rope_partners` gives them."""
    if c.ndim == 3:
        c, s = c[:, None], s[:, None]
    return _rotate(x, mx.take(x, _rope_partners(x.shape[-1], dims), axis=-1), c, s)


def rope(x: mx.array, dims: int, base: float, offset: int | tuple[int, ...], *, rotate=rotate) -> mx.array:
    """Rotary embedding, rotate-half layout (x1, x2 halves of the first `dims` features:
    x1 cos - x2 sin, x2 cos + x1 sin), of x [B, H, T, D] at positions offset + t (offset: one for
    all, or each batch row's). rotate: the op that applies the factors (this pure-MLX form, or
    `ops`' choice)."""
    if isinstance(offset, tuple):
        c, s = _rows_rope_factors(offset, x.shape[-2], x.shape[-1], dims, float(base))
    else:
        c, s = _rope_factors(range(offset, offset + x.shape[-2]), x.shape[-1], dims, float(base))
    return rotate(x, c, s, dims)


def rope_at(x: mx.array, dims: int, base: float, positions: np.ndarray, *, rotate=rotate) -> mx.array:
    """Rotary embedding of x [B, H, T, D] with token t at positions[t] (any positions, in any order)."""
    c, s = _factors_at(positions, x.shape[-1], dims, float(base))
    return rotate(x, c, s, dims)


def mrope(x: mx.array, dims: int, base: float, positions: np.ndarray, sections, *, rotate=rotate) -> mx.array:
    """Multimodal rotary embedding (interleaved sections) of x [B, H, T, D] at 3-D positions [3, T]:
    frequency j turns with the axis `_mrope_axes` gives it."""
    half = dims // 2
    along = positions[_mrope_axes(half, tuple(sections))].T.astype(np.float64)  # [T, half]
    c, s = _factors(along * _inverse_frequencies(dims, float(base)), x.shape[-1])
    return rotate(x, c, s, dims)
