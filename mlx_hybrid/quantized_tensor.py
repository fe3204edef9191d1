"""A quantized matrix in MLX's affine layout, as loaders produce it and models split it
(on the ground floor: the loaders, the models and `parallel` all use it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

GROUP_SIZE = 32


@dataclass(frozen=True)
class BlockScales:
    """GGUF's two-level scales kept as stored: each group's scale and bias are small integer
    codes times float16 factors shared by `groups_per_factor` groups. Exact, and about a quarter
    of the bytes of float32 scales and biases (a Q4_K weight: 4.63 bits against 6).

    In this form a tensor's `scales` holds the factors, float16 [..., rows, factor blocks *
    factor_count], and its `biases` the codes, int8 [..., rows, groups * code_count]. Group g
    of factor block f = g // groups_per_factor, codes c:
        scale = factor[f, 0] * c[0]
        bias  = factor[f, 1] * c[code_count - 1]    with two factors
              = bias_ratio * scale                  with one

    With `code_bits` 4, a group's two codes are the unsigned nibbles of one byte (low first), as
    Q2_K stores them; with `code_count` 0 there are none (each is 1: `biases` is empty). With a
    `table` (16 unsigned bytes), a 4-bit value q stands for table[q] instead of q:
    w = scale * table[q] + bias (IQ4_NL's values plus 128, with bias = -128 scale, are affine in
    the table's entries though not in q). With `exponent_factors` the factors are uint8 E8M0
    exponents e, each standing for 2^(e - 127) (e = 0: 2^-127), as MXFP4 stores its scales.
    `mlx_mode`: the quantization mode in which MLX's own products take the tensor as it is held
    (its weight, and its factors as scales).
    """

    groups_per_factor: int
    factor_count: int  # 1 or 2
    code_count: int  # 0, 1 or 2
    bias_ratio: float = 0.0
    table: tuple[int, ...] = ()
    factor_scale: float = 1.0  # a power of two the factors are multiplied by (exact)
    code_bits: int = 8  # 8, or 4 with two codes
    exponent_factors: bool = False
    mlx_mode: str = ""

    @property
    def nonlinear(self) -> bool:
        return bool(self.table)

    @property
    def code_bytes(self) -> float:
        """Bytes of codes a group."""
        return self.code_count * self.code_bits / 8

    def expand(self, factors: mx.array, codes: mx.array) -> tuple[mx.array, mx.array]:
        """float32 scales and biases [..., rows, groups]."""
        lead = factors.shape[:-1]
        if self.exponent_factors:  # 2^(e - 127): e as a float32's exponent field
            exponents = factors.astype(mx.uint32)
            factors = mx.where(exponents == 0, 1 << 22, exponents << 23).astype(mx.uint32).view(mx.float32)
        factors = factors.astype(mx.float32).reshape(*lead, -1, 1, self.factor_count)
        if self.code_count == 0:
            codes = mx.ones((*lead, factors.shape[-3] * self.groups_per_factor), mx.int8)
        elif self.code_bits == 4:
            nibbles = codes.view(mx.uint8)[..., None]
            codes = mx.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
        codes = codes.astype(mx.float32).reshape(
            *lead, factors.shape[-3], self.groups_per_factor, max(self.code_count, 1)
        )
        factors = factors * self.factor_scale
        scales = factors[..., 0] * codes[..., 0]
        if self.factor_count == 2:
            biases = factors[..., 1] * codes[..., -1]
        else:
            biases = self.bias_ratio * scales
        return scales.reshape(*lead, -1), biases.reshape(*lead, -1)


# MXFP4 (OCP's microscaling format; GGUF's MXFP4, MLX's "mxfp4" mode): groups of 32 4-bit E2M1
# values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) times an E8M0 power of two. As a table:
# twice the E2M1 values plus 128, scale 2^(e - 127) / 2, bias -128 scale.
MXFP4 = BlockScales(
    1,
    1,
    0,
    -128.0,
    table=(128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116),
    factor_scale=0.5,
    exponent_factors=True,
    mlx_mode="mxfp4",
)


# GGUF's Q8_0: 8-bit codes q + 128 a group of 32, one float16 d a group (code 1), bias -128 d
Q8_0 = BlockScales(1, 1, 1, -128.0)
# GGUF's Q5_0: 5-bit values a group of 32, d a group (code 1), bias -16 d
Q5_0 = BlockScales(1, 1, 1, -16.0)
# GGUF's Q4_1 and Q5_1: float16 d and m a group (codes 1)
D_AND_M = BlockScales(1, 2, 1)
# GGUF's Q4_0: 4-bit values a group of 32, d a group (code 1), bias -8 d
Q4_0 = BlockScales(1, 1, 1, -8.0)
# IQ4_NL's 16 values (ggml's kvalues_iq4nl) plus 128: unsigned bytes, and the group affine in
# them (bias -128 times the scale)
IQ4_NL_TABLE = (1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241)
# GGUF's IQ4_NL: 4-bit indices into those values, d a group (code 1)
IQ4_NL = BlockScales(1, 1, 1, -128.0, table=IQ4_NL_TABLE)
# GGUF's IQ4_XS: likewise, d a block of 8 groups, codes ls_j - 32 a group
IQ4_XS = BlockScales(8, 1, 1, -128.0, table=IQ4_NL_TABLE)
# GGUF's Q4_K and Q5_K: float16 d and -dmin a block of 8 groups, codes sc_j and m_j a group of 32
K_QUANT = BlockScales(8, 2, 2)
# GGUF's Q6_K: one float16 d a block of 16 groups of 16, a signed code sc_j a group, bias -32 d sc_j
Q6_K = BlockScales(16, 1, 1, -32.0)
# GGUF's Q3_K: likewise with 3-bit values, codes sc_j - 32, bias -4 d (sc_j - 32)
Q3_K = BlockScales(16, 1, 1, -4.0)
# GGUF's Q2_K: float16 d and -dmin a block of 16 groups of 16, codes sc_j and m_j the nibbles of a byte
Q2_K = BlockScales(16, 2, 2, code_bits=4)
# GGUF's TQ2_0 (and TQ1_0 where it is not held as the file's blocks): 2-bit values q a group of 32, one
# float16 d a block of 8 groups, no codes, bias -d (q - 1: ternary)
TERNARY = BlockScales(8, 1, 0, -1.0)

# MLX's quantization modes held as block forms (MLX's weight and scales, no biases), besides
# affine: mode -> (bits, group size, form)
FLOAT_MODES = {"mxfp4": (4, 32, MXFP4)}


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned bits-bit integers [..., n] (n a multiple of 32) -> MLX's little-endian bit stream
    as uint32 [..., n * bits / 32]: each 8 values fill `bits` bytes."""
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    words = np.bitwise_or.reduce(q.reshape(*q.shape[:-1], -1, 8).astype(np.uint64) << shifts, axis=-1)
    packed = words[..., None].view(np.uint8)[..., :bits]  # little-endian words: their low bytes
    return np.ascontiguousarray(packed).reshape(*q.shape[:-1], -1).view(np.uint32)


def no_codes(scales: mx.array) -> mx.array:
    """A block form's codes where it has none (`code_count` 0: MXFP4's; MLX's modules in its float
    modes hold no biases): int8 [..., rows, 0]."""
    return mx.zeros((*scales.shape[:-1], 0), mx.int8)


def mode_refused(mode: str) -> str | None:
    """Why MLX's quantization mode `mode` is not taken here; None where it is."""
    if mode == "affine" or mode in FLOAT_MODES:
        return None
    return f"quantization mode {mode!r} is not taken (taken: affine, {', '.join(FLOAT_MODES)})"


@dataclass(frozen=True)
class GridBlocks:
    """One of GGUF's grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M), or TQ1_0,
    kept as the file stores it: a tensor's `weight` holds the blocks, uint8 [..., rows, blocks *
    block_bytes], each block 256 values (the tensor's group): a float16 d, indices into the type's
    grid of magnitudes, sign bits (IQ1: a delta a group) and 3- or 4-bit scale codes (TQ1_0:
    ternary values in base 3, no grid). `scales` and `biases` are empty. Our CPU kernels decode
    the blocks as they multiply (csrc/quantized_matmul.cpp); MLX's products do not take them."""

    type_name: str
    block_bytes: int

    VALUES = 256  # a block's values: the tensor's group
    BITS = 8  # the tensor's `bits`: its weight is bytes
    nonlinear = True  # (as BlockScales': no plain form)
    mlx_mode = ""  # (as BlockScales': no mode of MLX's takes it)
    groups_per_factor, factor_count, code_bytes = 1, 0, 0  # cut at whole blocks; nothing beside them

    @staticmethod
    def tensor(blocks: mx.array, grid: "GridBlocks") -> "QuantizedTensor":
        """The tensor of blocks uint8 [..., rows, bytes]."""
        empty = mx.zeros((*blocks.shape[:-1], 0), mx.float16)
        return QuantizedTensor(blocks, empty, empty.astype(mx.int8), GridBlocks.BITS, GridBlocks.VALUES, grid)

    def dequantize(self, blocks: mx.array) -> mx.array:
        """The float32 values of blocks [..., bytes] (gguf-py's dequantization)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return mx.array(dequantize(np.array(blocks), GGMLQuantizationType[self.type_name]).astype(np.float32))


# GGML type name -> its blocks as stored, where our kernels multiply them (loaders/quantized.py: else
# gguf_blocks.BLOCK_TYPES' form, or dequantized)
GRID_TYPES = {
    name: GridBlocks(name, size)
    for name, size in [
        ("IQ2_XXS", 66),
        ("IQ2_XS", 74),
        ("IQ2_S", 82),
        ("IQ3_XXS", 98),
        ("IQ3_S", 110),
        ("IQ1_S", 50),
        ("IQ1_M", 56),
        ("TQ1_0", 54),
    ]
}

# How a GGUF file's products compute where the CPU computes (`load(cpu_activations=)`): with float32
# activations (what the file's dequantized weights compute), or as llama.cpp computes them, each row
# of activations quantized to 8 bits and multiplied in integers
CPU_ACTIVATIONS = ("float32", "int8")
# the types whose products take 8-bit activations so far: name -> (bits, group size, block form), in
# the order of the CPU kernel's type numbers
INT8_TYPES = {
    "Q8_0": (8, 32, Q8_0),
    "Q4_K": (4, 32, K_QUANT),
    "Q6_K": (6, 16, Q6_K),
    "Q5_0": (5, 32, Q5_0),
    "Q5_1": (5, 32, D_AND_M),
    "Q4_0": (4, 32, Q4_0),
    "Q4_1": (4, 32, D_AND_M),
    "IQ4_NL": (4, 32, IQ4_NL),
    "Q5_K": (5, 32, K_QUANT),
    "Q3_K": (3, 16, Q3_K),
    "Q2_K": (2, 16, Q2_K),
    "IQ4_XS": (4, 32, IQ4_XS),
    **{
        name: (GridBlocks.BITS, GridBlocks.VALUES, GRID_TYPES[name])
        for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0")
    },
    "TQ2_0": (2, 32, TERNARY),
    "MXFP4": (4, 32, MXFP4),
}


def int8_number(type_name: str) -> int:
    """The CPU kernel's number of a type: its place in INT8_TYPES (csrc/int8_products.cpp's `enum Type`,
    which tests/test_int8_products.py checks against this table)."""
    return list(INT8_TYPES).index(type_name)


@dataclass
class QuantizedTensor:
    """An affine-quantized matrix (or stack of matrices) in MLX's layout."""

    weight: mx.array  # uint32 [..., rows, cols * bits / 32]
    scales: mx.array  # float32 [..., rows, cols / group_size] (block form: the factors)
    biases: mx.array  # (block form: the codes)
    bits: int
    group_size: int = GROUP_SIZE
    block: BlockScales | GridBlocks | None = None  # set: the block form (see BlockScales), or a grid type's blocks
    # set: column p holds the matrix's column column_order[p] (products take x[..., column_order])
    column_order: mx.array | None = None
    # its products compute over the file's blocks as they are (llama.cpp's 8-bit activations): a
    # reordering of its columns takes its inputs reordered (`column_order`), never a cut per group
    whole_blocks: bool = False

    @property
    def grid(self) -> bool:
        return isinstance(self.block, GridBlocks)

    @staticmethod
    def of_module(module) -> "QuantizedTensor":
        """The tensor a quantized module holds (no biases in a mode of MLX's without them: empty)."""
        biases = module.get("biases")
        biases = no_codes(module.scales) if biases is None else biases
        order = getattr(module, "input_order", None)
        return QuantizedTensor(
            module.weight, module.scales, biases, module.bits, module.group_size, module.block, order
        )

    def module_parameters(self) -> dict:
        """A module's parameters holding it: weight, scales and biases (none in a mode of MLX's)."""
        parts = {"weight": self.weight, "scales": self.scales}
        if not (self.block and self.block.mlx_mode):
            parts["biases"] = self.biases
        return parts

    @property
    def shape(self):
        if self.grid:
            return (*self.weight.shape[:-1], self.weight.shape[-1] // self.block.block_bytes * GridBlocks.VALUES)
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)

    @property
    def groups_per_cut(self) -> int:
        """The fewest whole groups a cut along the columns may take: whole packed words (3-bit
        groups of 16 fill one and a half), and a block form's whole factor blocks."""
        word = 32 // math.gcd(self.bits * self.group_size, 32)
        return math.lcm(word, self.block.groups_per_factor if self.block else 1)

    def cut_at(self, columns) -> "QuantizedTensor | None":
        """The tensor in a form that `map_columns` can cut at these column offsets: itself, else
        its `per_group` form; None where a cut falls inside a group or a packed word."""
        if self.column_order is not None:  # a cut of its columns is not one of the matrix's
            return None
        for form in (self,) if self.whole_blocks else (self, self.per_group()):
            if all(c % (self.group_size * form.groups_per_cut) == 0 for c in columns):
                return form
        return None

    @property
    def affine(self) -> bool:
        """Whether MLX's affine layout holds it once its scales are expanded (not a nonlinear form)."""
        return not (self.block and self.block.nonlinear)

    def expanded(self) -> "QuantizedTensor":
        """The plain form: float32 scales and biases per group (an affine tensor's only)."""
        if self.block is None:
            return self
        if not self.affine:
            raise ValueError("a nonlinear form has no plain form: dequantize it")
        scales, biases = self.block.expand(self.scales, self.biases)
        return replace(self, scales=scales, biases=biases, block=None)

    def per_group(self) -> "QuantizedTensor":
        """The tensor in a form whose groups can be cut apart: the plain form of an affine one; a
        nonlinear one (no plain form) with its factors repeated for each group, still exact; a grid
        type's blocks as they are (a block is its group)."""
        if self.affine:
            return self.expanded()
        if self.grid:
            return self
        block = self.block
        repeated = self.scales.reshape(*self.scales.shape[:-1], -1, 1, block.factor_count)
        repeated = mx.repeat(repeated, block.groups_per_factor, axis=-2).reshape(*self.scales.shape[:-1], -1)
        return replace(self, scales=repeated, block=replace(block, groups_per_factor=1))

    def dequantize(self) -> mx.array:
        """The dense float32 matrix (float16 scales would round it to float16)."""
        dense = dequantize(self.weight, self.scales, self.biases, self.bits, self.group_size, self.block)
        return dense if self.column_order is None else dense[..., mx.argsort(self.column_order)]

    def map_columns(self, transform) -> "QuantizedTensor":
        """The tensor with transform(part, entries) applied to each part along its last axis, where
        `entries(groups)` counts the part's entries of that many groups (a block form's factors:
        whole multiples of `groups_per_cut` only)."""
        if self.column_order is not None:
            raise ValueError("the columns of a tensor in another column order do not cut as the matrix's")

        def counter(per_group):
            return lambda groups: round(groups * per_group)

        # packed words, or a grid type's bytes
        per_group = {"weight": self.block.block_bytes if self.grid else self.bits * self.group_size / 32}
        if self.block:
            per_group["scales"] = self.block.factor_count / self.block.groups_per_factor
            per_group["biases"] = self.block.code_bytes
        else:
            per_group["scales"] = per_group["biases"] = 1
        return replace(self, **{name: transform(getattr(self, name), counter(n)) for name, n in per_group.items()})

    def with_scales_in(self, dtype) -> "QuantizedTensor":
        """Scales and biases rounded to dtype, unless one of them would overflow it (a block
        form stays as it is: already compact, and exact)."""
        if self.block:
            return self
        narrow = [part.astype(dtype) for part in (self.scales, self.biases)]
        if not all(mx.isfinite(part).all().item() for part in narrow):
            return self
        return replace(self, scales=narrow[0], biases=narrow[1])


def dequantize(weight, scales, biases, bits: int, group_size: int, block: BlockScales | None = None) -> mx.array:
    """The dense float32 matrix of a quantized tensor's parts (any form)."""
    if isinstance(block, GridBlocks):
        return block.dequantize(weight)
    if block and block.mlx_mode:
        return mx.dequantize(
            weight, scales, None, group_size=group_size, bits=bits, mode=block.mlx_mode, dtype=mx.float32
        )
    if block:
        scales, biases = block.expand(scales, biases)
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    if not (block and block.nonlinear):
        return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)
    ones = mx.ones(scales.shape, mx.float32)
    indices = mx.dequantize(weight, ones, mx.zeros_like(ones), group_size=group_size, bits=bits).astype(mx.uint32)
    values = mx.array(block.table, mx.float32)[indices]
    grouped = values.reshape(*scales.shape, group_size)
    return (grouped * scales[..., None] + biases[..., None]).reshape(values.shape)
