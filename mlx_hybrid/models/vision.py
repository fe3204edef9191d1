"""The Qwen3.5 vision tower, and where image tokens sit for the text model's rotary embedding.

An image arrives as patches (`images.preprocess`): [N, C * 2 * P * P] rows, the temporal pair
of each P x P patch, ordered so that every 2 x 2 block of neighbours (one text token after
the merger) is consecutive. The tower embeds the patches, adds the learned position grid
resampled to the image's grid, runs bidirectional blocks with 2-D rotary attention, and
merges each 2 x 2 block into one vector of the text model's width.

In the text model an image's tokens take 3-D positions (temporal, row, column) starting
where the image starts; the text after it continues from the largest of them plus one
(`image_rope_positions`), so positions fall behind token indices by a fixed shift.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import ops
from ..cache import RotaryPositions
from .layers import F32, Linear


@dataclass
class VisionArgs:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def validate(self):
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError("the vision heads' size must be a multiple of 4 (two rotary axes)")
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError("num_position_embeddings must be a square (a learned position grid)")


class LayerNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.bias = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.layer_norm(x, self.weight, self.bias, self.eps)


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv = Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.proj = Linear(args.hidden_size, args.hidden_size, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """x [N, E] of one image, every patch attending to every other; cos, sin [N, D]."""
        N, E = x.shape
        q, k, v = (t.transpose(1, 0, 2)[None] for t in mx.split(self.qkv(x).reshape(N, 3 * self.num_heads, -1), 3, 1))
        q, k = _rotate_half(q, cos, sin).astype(x.dtype), _rotate_half(k, cos, sin).astype(x.dtype)
        out = ops.scaled_dot_product_attention(q, k, v, q.shape[-1] ** -0.5)
        return self.proj(out[0].transpose(1, 0, 2).reshape(N, E))


def _rotate_half(x, cos, sin):
    """Rotary embedding in float32 over the whole head: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x = x.astype(F32)
    x1, x2 = mx.split(x, 2, axis=-1)
    return x * cos + mx.concatenate([-x2, x1], axis=-1) * sin


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.linear_fc1 = Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.linear_fc2 = Linear(args.intermediate_size, args.hidden_size, bias=True)

    def __call__(self, x):
        return self.linear_fc2(ops.gelu_approx(self.linear_fc1(x)))  # the tanh approximation, as trained


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = LayerNorm(args.hidden_size, args.layer_norm_eps)
        self.norm2 = LayerNorm(args.hidden_size, args.layer_norm_eps)
        self.attn = VisionAttention(args)
        self.mlp = VisionMLP(args)

    def __call__(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm per patch, then each 2 x 2 block (consecutive rows) through a GELU MLP to the text width."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        merged = args.hidden_size * args.spatial_merge_size**2
        self.norm = LayerNorm(args.hidden_size, args.layer_norm_eps)
        self.linear_fc1 = Linear(merged, merged, bias=True)
        self.linear_fc2 = Linear(merged, args.out_hidden_size, bias=True)

    def __call__(self, x):
        merged = self.norm(x).reshape(-1, self.linear_fc1.weight.shape[1])
        return self.linear_fc2(nn.gelu(self.linear_fc1(merged)))


class VisionTower(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        args.validate()
        self.args = args
        # a convolution whose stride is its kernel: one linear map of each flattened patch
        self.patch_embed = Linear(args.patch_dim, args.hidden_size, bias=True)
        self.pos_embed = mx.zeros((args.num_position_embeddings, args.hidden_size))
        self.blocks = [VisionBlock(args) for _ in range(args.depth)]
        self.merger = PatchMerger(args)

    def __call__(self, patches: mx.array, grid: tuple[int, int, int]) -> mx.array:
        """One image's patches [N, patch_dim] on its grid (t, h, w) -> its tokens [N / 4, out_hidden_size]."""
        t, h, w = grid
        dtype = self.patch_embed.weight.dtype
        x = self.patch_embed(patches.astype(dtype))
        taps, weights = _position_grid_taps(h, w, self.args.num_position_embeddings, self.args.spatial_merge_size)
        table = self.pos_embed[mx.array(taps)].astype(F32)  # [h w, 4, E]
        x = x + mx.tile((table * mx.array(weights)[..., None]).sum(axis=1), (t, 1)).astype(dtype)
        cos, sin = _rotary_factors(h, w, t, self.args)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.merger(x)


def _merge_order(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each patch in the order patches come (2 x 2 blocks consecutive)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return rows.reshape(shape).transpose(0, 2, 1, 3).ravel(), cols.reshape(shape).transpose(0, 2, 1, 3).ravel()


def _position_grid_taps(h: int, w: int, num_positions: int, merge: int):
    """The learned square position grid resampled bilinearly (corners aligned) to h x w: for each
    patch, the 4 table rows it reads and their weights (float32 arithmetic, as transformers)."""
    side = round(num_positions**0.5)
    rows, cols = _merge_order(h, w, merge)

    def axis(index, size):
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        taps = floor.astype(np.int64)[:, None] + np.arange(2)
        return np.clip(taps, 0, side - 1), np.maximum(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0)

    row_taps, row_weights = axis(rows, h)
    col_taps, col_weights = axis(cols, w)
    taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4).astype(np.float32)
    return taps, weights


def _rotary_factors(h: int, w: int, t: int, args: VisionArgs):
    """cos, sin [t h w, D]: the first half of each head's frequencies turn with the patch's row,
    the second with its column (the same frequencies for both)."""
    head_dim = args.hidden_size // args.num_heads
    quarter = head_dim // 4
    inv_freq = 1.0 / args.rope_theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter))
    rows, cols = _merge_order(h, w, args.spatial_merge_size)
    angles = np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=-1).astype(np.float32)
    angles = np.tile(np.concatenate([angles, angles], axis=-1), (t, 1))
    return mx.array(np.cos(angles)), mx.array(np.sin(angles))


def image_rope_positions(num_tokens: int, image_spans, merge: int) -> RotaryPositions:
    """Rotary positions of a prompt of `num_tokens` tokens whose images sit at `image_spans`,
    (start, grid (t, h, w)) in order: text counts on from where the previous part ended; an
    image's tokens sit at (start + t, start + row, start + column) of its merged grid, and the
    text after it at start + max(h, w) / merge."""
    table = np.empty((3, num_tokens), np.int64)
    index = position = 0
    for start, (t, h, w) in list(image_spans) + [(num_tokens, (0, 0, 0))]:
        count = start - index
        table[:, index:start] = position + np.arange(count)
        position += count
        if start == num_tokens:
            break
        gh, gw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        table[:, start : start + t * gh * gw] = position + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        index = start + t * gh * gw
        position += max(gh, gw)
    return RotaryPositions(table)
