"""GGUF quantized blocks as MLX affine groups, without re-quantization.

MLX's affine format: per group of `group_size` values along a row, w = scale * q + bias
with q an unsigned `bits`-bit integer, q's packed as a little-endian bit stream into
uint32 words. These GGUF block types are exactly that, per group of 32 (Q6_K, Q3_K, Q2_K: 16):

| type | bits | scale | bias |
| --- | --- | --- | --- |
| Q8_0 | 8 | d | -128 d |
| Q4_0 / Q5_0 | 4 / 5 | d | -8 d / -16 d |
| Q4_1 / Q5_1 | 4 / 5 | d | m |
| Q4_K / Q5_K | 4 / 5 | d * sc_j | -dmin * m_j (sub-block j of 32 in a super-block of 256) |
| Q6_K | 6 | d * sc_j | -32 d * sc_j (sub-block j of 16, sc_j a signed 8-bit integer) |
| Q3_K | 3 | d * (sc_j - 32) | -4 d * (sc_j - 32) (sc_j 6 bits; q's third bit from hmask) |
| Q2_K | 2 | d * sc_j | -dmin * m_j (sc_j, m_j the nibbles of one byte) |
| IQ4_NL / IQ4_XS | 4 (indices) | d (* (ls_j - 32)) | -128 d (* (ls_j - 32)), values from a table |
| MXFP4 | 4 (indices) | 2^(e - 127) / 2 | -128 times the scale, values from a table |
| TQ2_0 / TQ1_0 | 2 | d | -d (one d a block of 256; TQ1_0's values read from base 3) |

IQ4's 4-bit values index IQ4_NL's 16 values: held with the table plus 128 (unsigned) and a
bias of -128 times the scale (`BlockScales.table`); only our CPU kernels take them. MXFP4's
index E2M1 values (`quantized_tensor.MXFP4`), with an E8M0 exponent e a group: held as MLX's
"mxfp4" mode holds them (its packed weight and its uint8 scales, the file's size), which MLX's
products take too.

The grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M: indices into grids of
magnitudes, sign bits or deltas, 3- or 4-bit scale codes) and TQ1_0 (ternary values, five a byte
in base 3) are kept as the file's blocks where our CPU kernels compute (`GridBlocks`: they decode
the blocks as they multiply). Elsewhere IQ3_S's grid, odd integers in
[-15, 15], is 2 q - 15 for a 4-bit q: it is held as MLX's 4-bit groups of 32 (scale
2 d (1 + 2 s), bias -15 d (1 + 2 s)), exact, at 4.31 bits a weight against the file's 3.44, and
TQ1_0 as MLX's 2-bit groups (as TQ2_0); the others are dequantized there.

Where our CPU kernels compute (`ops.computes_block_scales`), the scales stay as the file
stores them (`BlockScales`: integer codes per group times float16 factors per block), which
is exact and takes about the file's size: Q4_K 4.63 bits a weight against the file's 4.5,
Q6_K 6.56, Q8_0 8.75 against 8.5, Q2_K 2.63 as the file. Elsewhere the affine ones are
expanded to float32, where every one of them is exact (a float16 times an 8-bit integer needs
19 significant bits). MLX's own products take groups of 32 or more: the types in groups of 16
and the other IQ types are dequantized there.

Compact loading, where a type is not held as stored, trades exactness for memory: scales and
biases in 16 bits (float16, a relative error of at most 2^-11 on each; bfloat16 when that
is the compute dtype, so that products stay in it), and the types MLX's groups do not hold
re-quantized to MLX's groups of 32 instead of dequantized (REQUANTIZED_BITS).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .. import ops
from ..quantized_tensor import GRID_TYPES, GROUP_SIZE, GridBlocks, QuantizedTensor
from .gguf_blocks import BLOCK_TYPES, block_form, block_form_parts


def block_type_name(bits: int, group_size: int, block) -> str:
    """The GGML type a quantized tensor in this form holds (or "MLX's affine groups" for none)."""
    if isinstance(block, GridBlocks):
        return block.type_name
    held = (bits, group_size, block)
    return next(
        (name for name, (*layout, _, form) in BLOCK_TYPES.items() if (*layout, form) == held), "MLX's affine groups"
    )


# Compact loading: types with no exact form in MLX's affine groups (of 32 or more) that are
# re-quantized to them instead of dequantized, with this many bits: the file's, or one more
# where its groups of 16 or its nonlinear values carry more than MLX's groups of 32 would.
REQUANTIZED_BITS = {
    "Q6_K": 6, "Q3_K": 4, "Q2_K": 3, "IQ4_NL": 5, "IQ4_XS": 5,
    "IQ3_XXS": 4, "IQ2_S": 3, "IQ2_XS": 3, "IQ2_XXS": 3,
}  # fmt: skip


def from_gguf_blocks(raw: np.ndarray, type_name: str, compact_scales=None) -> QuantizedTensor | None:
    """raw: the tensor's bytes as the gguf reader gives them, [..., rows, bytes per row].

    The block form where our kernels compute it (exact, and compact); else float32 scales and
    biases, or with compact_scales (their 16-bit dtype) rounded to it. None where the type
    stays dense (dequantized by the caller).
    """
    form = held_form(type_name, compact_scales is not None)
    if form == BLOCK:
        grid = GRID_TYPES.get(type_name)
        return GridBlocks.tensor(mx.array(raw), grid) if grid else block_form(raw, type_name)
    if form == REQUANTIZED:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        dense = mx.array(dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32))
        bits = REQUANTIZED_BITS[type_name]
        tensor = QuantizedTensor(*mx.quantize(dense, group_size=GROUP_SIZE, bits=bits), bits)
    elif form == PLAIN:
        tensor = block_form(raw, type_name).expanded()
    else:
        return None
    return tensor.with_scales_in(compact_scales) if compact_scales is not None else tensor


# How a GGML type is held here (held_form)
BLOCK, PLAIN, REQUANTIZED = "as stored", "with float32 scales", "re-quantized"


def held_form(type_name: str, compact: bool) -> str | None:
    """BLOCK where our kernels (or MLX's, in a mode of its own) multiply the type as stored;
    REQUANTIZED where compact loading re-quantizes it; PLAIN where MLX's affine groups hold it
    exactly; None: dequantized."""
    grid = GRID_TYPES.get(type_name)
    if grid and ops.computes_block_scales(GridBlocks.BITS, GridBlocks.VALUES, grid):
        return BLOCK
    known = BLOCK_TYPES.get(type_name)
    if known and (known[3].mlx_mode or ops.computes_block_scales(known[0], known[1], known[3])):
        return BLOCK
    if compact and type_name in REQUANTIZED_BITS:
        return REQUANTIZED
    if known and not known[3].nonlinear and ops.computes_quantized(known[0], known[1]):
        return PLAIN
    return None


def held_bytes(type_name: str, elements: int, stored: int, dtype, compact: bool, keep_quantized: bool = True) -> int:
    """The bytes a GGUF tensor of `elements` values (`stored` bytes in the file) takes once loaded, as
    `held_form` holds it (float tensors: the fewer of the file's bytes and the compute dtype's; without
    keep_quantized, or a type no form holds: dequantized to dtype)."""
    if type_name in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"):
        return min(stored, elements * dtype.size)
    form = held_form(type_name, compact) if keep_quantized else None
    if form == BLOCK and type_name in GRID_TYPES:
        return stored
    if form == BLOCK:
        return sum(math.prod(shape) * dtype.size for shape, dtype in block_form_parts(type_name, 1, elements))
    scale_bytes = 2 if compact else 4  # a scale and a bias a group of 32
    if form == REQUANTIZED:
        return elements * REQUANTIZED_BITS[type_name] // 8 + elements // GROUP_SIZE * 2 * scale_bytes
    if form == PLAIN:
        bits, group_size = BLOCK_TYPES[type_name][:2]
        return elements * bits // 8 + elements // group_size * 2 * scale_bytes
    return elements * dtype.size  # dequantized


def dequantized_notice(tensors, dtype, compact: bool) -> list[str]:
    """One line for each quantized type the loader will dequantize: its tensors' bytes in the
    file and in memory, and what would hold it smaller. tensors: (GGML type name, elements,
    bytes in the file) of each tensor."""
    totals = {}
    for type_name, elements, stored in tensors:
        if type_name in ("F32", "F16", "BF16") or held_form(type_name, compact):
            continue
        count, size, file_size = totals.get(type_name, (0, 0, 0))
        totals[type_name] = (count + 1, size + elements * dtype.size, file_size + stored)
    lines = []
    dtype_name = str(dtype).rsplit(".", 1)[-1]
    for type_name, (count, size, file_size) in sorted(totals.items()):
        bits = REQUANTIZED_BITS.get(type_name)
        instead = f"--compact re-quantizes it to MLX's {bits}-bit groups, or " if bits and not compact else ""
        lines.append(
            f"{count} {type_name} tensors ({size_text(file_size)} in the file) are dequantized to {dtype_name}, "
            f"{size_text(size)}: no product here takes {type_name} as stored ({instead}a Q4_K_M or Q8_0 file stays "
            "quantized)"
        )
    return lines


def size_text(count: int) -> str:
    """Bytes as people read them: GB from a tenth of one, else MB."""
    return f"{count / 1e9:.2f} GB" if count >= 1e8 else f"{count / 1e6:.1f} MB"
