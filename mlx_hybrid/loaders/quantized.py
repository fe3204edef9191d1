"""GGUF quantized blocks as MLX affine groups, without re-quantization.

MLX's affine format: per group of `group_size` values along a row, w = scale * q + bias
with q an unsigned `bits`-bit integer, q's packed as a little-endian bit stream into
uint32 words. These GGUF block types are exactly that, per group of 32 (Q6_K: 16):

| type | bits | scale | bias |
| --- | --- | --- | --- |
| Q8_0 | 8 | d | -128 d |
| Q4_0 / Q5_0 | 4 / 5 | d | -8 d / -16 d |
| Q4_1 / Q5_1 | 4 / 5 | d | m |
| Q4_K / Q5_K | 4 / 5 | d * sc_j | -dmin * m_j (sub-block j of 32 in a super-block of 256) |
| Q6_K | 6 | d * sc_j | -32 d * sc_j (sub-block j of 16, sc_j a signed 8-bit integer) |

Where our CPU kernels compute (`ops.computes_block_scales`), the scales stay as the file
stores them (`BlockScales`: integer codes per group times float16 factors per block), which
is exact and takes about the file's size: Q4_K 4.63 bits a weight against the file's 4.5,
Q6_K 6.56, Q8_0 8.75 against 8.5. Elsewhere they are expanded to float32, where every one
of them is exact (a float16 times an 8-bit integer needs 19 significant bits). MLX's own
products take groups of 32 or more: Q6_K stays quantized where ours compute
(`ops.computes_quantized`), else it is dequantized, as are the types with no exact affine
form (Q2_K/Q3_K, the IQ types, ...).

Compact loading, where the scales are expanded, trades exactness for memory: scales and
biases in 16 bits (float16, a relative error of at most 2^-11 on each; bfloat16 when that
is the compute dtype, so that products stay in it), and Q6_K re-quantized to MLX's 6-bit
groups of 32 instead of dequantized (Q4_K 5 bits a weight, Q5_K 6, Q6_K 7).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import ops
from ..quantized_tensor import GROUP_SIZE, BlockScales, QuantizedTensor


def _f16(block_bytes: np.ndarray) -> np.ndarray:
    """A float16 field of each block, as stored: [..., 1]."""
    return block_bytes.copy().view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of a little-endian bit field, for i < count."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits[..., :count]


# Each parser: blocks [..., bytes] -> (q [..., groups, group_size] unsigned, factors float16
# [..., factor_count], codes int8 [..., groups, code_count]), one factor block per GGUF block.


def _ones(b):
    """A code of 1 for the one group of each block (its scale and bias are float16 as stored)."""
    return np.ones((*b.shape[:-1], 1, 1), np.int8)


def _q8_0(b):
    q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q[..., None, :], _f16(b[..., 0:2]), _ones(b)


def _q4_0(b):
    return _nibbles(b[..., 2:18])[..., None, :], _f16(b[..., 0:2]), _ones(b)


def _q4_1(b):
    return _nibbles(b[..., 4:20])[..., None, :], _f16(b[..., 0:4]), _ones(b)


def _q5_0(b):
    q = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6], 32) << 4)
    return q[..., None, :], _f16(b[..., 0:2]), _ones(b)


def _q5_1(b):
    q = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8], 32) << 4)
    return q[..., None, :], _f16(b[..., 0:4]), _ones(b)


def _k_factors_and_codes(b):
    """Q4_K/Q5_K: factors (d, -dmin), codes (sc_j, m_j) of the 8 sub-blocks."""
    from gguf.quants import Q4_K

    factors = _f16(b[..., 0:4]) * np.array([1, -1], np.float16)
    sc, m = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
    codes = np.stack([sc.reshape(*b.shape[:-1], 8), m.reshape(*b.shape[:-1], 8)], axis=-1).astype(np.int8)
    return factors, codes


def _q4_k(b):
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # 4 chunks of 64 values
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    return q, *_k_factors_and_codes(b)


def _q5_k(b):
    qh = b[..., 16:48]  # bit j of byte i: high bit of value i of sub-block j
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return low | (high << 4), *_k_factors_and_codes(b)


def _q6_k(b):
    ql, qh = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32), b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    # each half of 128 values: four runs of 32, low nibbles of ql's two runs then high ones,
    # with bit pairs 0-1, 2-3, 4-5, 6-7 of qh
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    q = (low | (high << 4)).reshape(*b.shape[:-1], 16, 16)
    return q, _f16(b[..., 208:210]), b[..., 192:208].view(np.int8)[..., None]


# GGML type name -> (bits, values per group, block parser, the block form's scales)
AFFINE_TYPES = {
    "Q8_0": (8, 32, _q8_0, BlockScales(1, 1, 1, -128.0)),
    "Q4_0": (4, 32, _q4_0, BlockScales(1, 1, 1, -8.0)),
    "Q4_1": (4, 32, _q4_1, BlockScales(1, 2, 1)),
    "Q5_0": (5, 32, _q5_0, BlockScales(1, 1, 1, -16.0)),
    "Q5_1": (5, 32, _q5_1, BlockScales(1, 2, 1)),
    "Q4_K": (4, 32, _q4_k, BlockScales(8, 2, 2)),
    "Q5_K": (5, 32, _q5_k, BlockScales(8, 2, 2)),
    "Q6_K": (6, 16, _q6_k, BlockScales(16, 1, 1, -32.0)),
}


# Compact loading: types with no exact affine form that are re-quantized to MLX affine
# groups of 32 with this many bits, instead of dequantized.
REQUANTIZED_BITS = {"Q6_K": 6}


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned bits-bit integers [..., n] (n a multiple of 32) -> MLX's little-endian bit stream
    as uint32 [..., n * bits / 32]: each 8 values fill `bits` bytes."""
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    words = np.bitwise_or.reduce(q.reshape(*q.shape[:-1], -1, 8).astype(np.uint64) << shifts, axis=-1)
    packed = words[..., None].view(np.uint8)[..., :bits]  # little-endian words: their low bytes
    return np.ascontiguousarray(packed).reshape(*q.shape[:-1], -1).view(np.uint32)


def from_gguf_blocks(raw: np.ndarray, type_name: str, compact_scales=None) -> QuantizedTensor | None:
    """raw: the tensor's bytes as the gguf reader gives them, [..., rows, bytes per row].

    The block form where our kernels compute it (exact, and compact); else float32 scales and
    biases, or with compact_scales (their 16-bit dtype) rounded to it. None where the type
    stays dense (dequantized by the caller).
    """
    affine = AFFINE_TYPES.get(type_name)
    if affine and ops.computes_block_scales(affine[0], affine[1], affine[3]):
        return _block_form(raw, type_name)
    compact = compact_scales is not None
    if compact and type_name in REQUANTIZED_BITS:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        dense = mx.array(dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32))
        bits = REQUANTIZED_BITS[type_name]
        tensor = QuantizedTensor(*mx.quantize(dense, group_size=GROUP_SIZE, bits=bits), bits)
    elif affine and ops.computes_quantized(affine[0], affine[1]):
        tensor = _block_form(raw, type_name).expanded()
    else:
        return None
    return tensor.with_scales_in(compact_scales) if compact else tensor


def _block_form(raw: np.ndarray, type_name: str) -> QuantizedTensor:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    bits, group_size, parse, block = AFFINE_TYPES[type_name]
    per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, raw.shape[-1] // block_bytes, block_bytes)
    cols = blocks.shape[1] * per_block
    weight = np.empty((len(blocks), cols * bits // 32), np.uint32)
    factors = np.empty((len(blocks), blocks.shape[1] * block.factor_count), np.float16)
    codes = np.empty((len(blocks), cols // group_size * block.code_count), np.int8)
    # rows a few million values at a time: the unpacked values take 8 bytes each while packed
    step = max(1, (1 << 22) // cols)
    for start in range(0, len(blocks), step):
        rows = slice(start, start + step)
        q, factors_part, codes_part = parse(blocks[rows])  # q [rows, blocks, groups, group_size]
        weight[rows] = pack(q.reshape(-1, cols), bits)
        factors[rows], codes[rows] = factors_part.reshape(-1, factors.shape[1]), codes_part.reshape(-1, codes.shape[1])
    parts = (mx.array(part.reshape(*lead, part.shape[-1])) for part in (weight, factors, codes))
    return QuantizedTensor(*parts, bits, group_size, block)
