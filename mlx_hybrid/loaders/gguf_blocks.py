"""A GGUF tensor's blocks unpacked into the block form (`quantized_tensor.BlockScales`: packed values,
factors, codes): by csrc/gguf_blocks.c at memory speed, split over the cores, where a C compiler builds
it; else by the numpy parsers here, which are its reference. `BLOCK_TYPES` gives each type's layout
(what the forms mean: `quantized`)."""

from __future__ import annotations

import ctypes
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import ops
from ..native import BuildError, build_once, compiler
from ..quantized_tensor import (
    D_AND_M,
    IQ4_NL,
    IQ4_XS,
    K_QUANT,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q5_0,
    Q6_K,
    Q8_0,
    TERNARY,
    BlockScales,
    QuantizedTensor,
    pack,
)


def _f16(block_bytes: np.ndarray) -> np.ndarray:
    """A float16 field of each block, as stored: [..., 1]."""
    return block_bytes.copy().view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(field: np.ndarray, count: int | None = None) -> np.ndarray:
    """Bit i of a little-endian bit field (the last axis's bytes), for i < count."""
    bits = np.unpackbits(field, axis=-1, bitorder="little")
    return bits[..., :count]


def _fields(field: np.ndarray, width: int) -> np.ndarray:
    """Each byte's fields of `width` bits (2 or 4), the lowest first: [..., bytes * 8 / width]."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)
    return ((field[..., None] >> shifts) & ((1 << width) - 1)).reshape(*field.shape[:-1], -1)


def _two_bit_runs(qs: np.ndarray) -> np.ndarray:
    """Q2_K's and Q3_K's low bits: two halves of 128 values, 32 bytes each, bit pairs 0-1, 2-3,
    4-5, 6-7 of a byte the values of runs 0..3 of 32; as 16 groups of 16."""
    runs = qs.reshape(*qs.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    return (runs & 3).reshape(*qs.shape[:-1], 16, 16)


# Each parser: blocks [..., bytes] -> (q [..., groups, group_size] unsigned, factors float16
# [..., factor_count], codes int8 [..., groups, code bytes]), one factor block per GGUF block.


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
    q = _nibbles(b[..., 6:22]) | (_bits(b[..., 2:6], 32) << 4)
    return q[..., None, :], _f16(b[..., 0:2]), _ones(b)


def _q5_1(b):
    q = _nibbles(b[..., 8:24]) | (_bits(b[..., 4:8], 32) << 4)
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


def _q2_k(b):
    # scales[16]: a group's code in the low nibble, its min in the high one, kept so
    codes = b[..., 0:16].view(np.int8)[..., None]
    return _two_bit_runs(b[..., 16:80]), _f16(b[..., 80:84]) * np.array([1, -1], np.float16), codes


def _q3_k(b):
    # values as Q2_K's, plus a third bit from hmask (bit j of byte i: value i of runs j); signed
    # 6-bit codes (a low nibble of 8 bytes, two high bits of 4), offset by 32
    hmask, packed = b[..., 0:32], b[..., 96:108]
    low = _two_bit_runs(b[..., 32:96])
    high = ((hmask[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(*b.shape[:-1], 16, 16)
    low_codes = _nibbles(packed[..., 0:8])
    high_codes = ((packed[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).swapaxes(-1, -2)
    codes = (low_codes | (high_codes.reshape(*b.shape[:-1], 16) << 4)).astype(np.int16) - 32
    return low | (high << 2), _f16(b[..., 108:110]), codes.astype(np.int8)[..., None]


def _iq4_nl(b):
    return _q4_0(b)  # the same layout: indices into the value table instead of values


def _iq4_xs(b):
    # 8 groups of 32, each 16 bytes as Q4_0's; 6-bit codes offset by 32: low nibbles in
    # scales_l[4], two high bits each in the 16-bit scales_h
    qs = b[..., 8:136].reshape(*b.shape[:-1], 8, 16)
    low = _fields(b[..., 4:8], 4)
    scales_h = b[..., 2:4].copy().view(np.uint16)
    high = (scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3
    codes = (low | (high << 4)).astype(np.int16) - 32
    return _nibbles(qs), _f16(b[..., 0:2]), codes.astype(np.int8)[..., None]


def _mxfp4(b):
    # an E8M0 exponent, then 16 bytes of 4-bit values as Q4_0's
    return _nibbles(b[..., 1:17])[..., None, :], b[..., 0:1].copy(), _no_codes(b, 1)


def _tq2_0(b):
    # ternary values q - 1 (q 0..2) in Q2_K's runs of 32 of 2-bit fields, then a float16 d
    return _two_bit_runs(b[..., 0:64]).reshape(*b.shape[:-1], 8, 32), _f16(b[..., 64:66]), _no_codes(b, 8)


def _tq1_0(b):
    # the same values five a byte in base 3: value i of byte c is ((c 3^i mod 256) 3) >> 8; the first
    # 32 bytes hold 160 values, the next 16 bytes 80, the 4 bytes of qh 16; d last
    powers = np.array([1, 3, 9, 27, 81], np.uint8)

    def trits(field, count):  # [..., bytes] -> [..., count * bytes], value i of every byte in turn
        wrapped = field[..., None, :] * powers[:count, None]  # (uint8: mod 256)
        return ((wrapped.astype(np.uint16) * 3) >> 8).astype(np.uint8).reshape(*field.shape[:-1], -1)

    q = np.concatenate([trits(b[..., 0:32], 5), trits(b[..., 32:48], 5), trits(b[..., 48:52], 4)], axis=-1)
    return q.reshape(*b.shape[:-1], 8, 32), _f16(b[..., 52:54]), _no_codes(b, 8)


def _no_codes(b, groups):
    return np.zeros((*b.shape[:-1], groups, 0), np.int8)


def _iq3_s(b):
    # 64 entries of a 512-entry grid of 4 magnitudes (1, 3, ..., 15): 8-bit indices in qs, their
    # ninth bits in qh; a sign bit a value; a 4-bit code s a group of 32, w = d (1 + 2 s) g sign.
    # Every value is an odd integer in [-15, 15]: 2 q - 15 for a 4-bit q, so the group is affine
    # (scale 2 d (1 + 2 s), bias -15 d (1 + 2 s)), exact in MLX's 4-bit layout.
    from gguf.quants import IQ3_S

    IQ3_S.init_grid()
    lead = b.shape[:-1]
    qs, qh, signs, scales = b[..., 2:66], b[..., 66:74], b[..., 74:106], b[..., 106:110]
    high = _bits(qh).astype(np.uint16)
    magnitudes = IQ3_S.grid.reshape(512, 4)[qs.astype(np.uint16) | (high << 8)].reshape(*lead, 256)
    negative = _bits(signs)
    q = ((np.where(negative, -magnitudes, magnitudes) + 15) / 2).astype(np.uint8).reshape(*lead, 8, 32)
    codes = _fields(scales, 4).astype(np.int8)
    return q, _f16(b[..., 0:2]), (2 * (1 + 2 * codes))[..., None]


# GGML type name -> (bits, values per group, block parser, the block form's scales)
BLOCK_TYPES = {
    "Q8_0": (8, 32, _q8_0, Q8_0),
    "Q4_0": (4, 32, _q4_0, Q4_0),
    "Q4_1": (4, 32, _q4_1, D_AND_M),
    "Q5_0": (5, 32, _q5_0, Q5_0),
    "Q5_1": (5, 32, _q5_1, D_AND_M),
    "Q4_K": (4, 32, _q4_k, K_QUANT),
    "Q5_K": (5, 32, _q5_k, K_QUANT),
    "Q6_K": (6, 16, _q6_k, Q6_K),
    "Q2_K": (2, 16, _q2_k, Q2_K),
    "Q3_K": (3, 16, _q3_k, Q3_K),
    "IQ4_NL": (4, 32, _iq4_nl, IQ4_NL),
    "IQ4_XS": (4, 32, _iq4_xs, IQ4_XS),
    "IQ3_S": (4, 32, _iq3_s, BlockScales(8, 1, 1, -7.5)),
    "MXFP4": (4, 32, _mxfp4, MXFP4),
    "TQ2_0": (2, 32, _tq2_0, TERNARY),
    "TQ1_0": (2, 32, _tq1_0, TERNARY),  # (GRID_TYPES' blocks where our kernels compute)
}


def block_form_parts(type_name: str, rows: int, cols: int) -> list[tuple[tuple[int, int], mx.Dtype]]:
    """The shapes and dtypes of a block form's weight, factors and codes for rows x cols values."""
    bits, group_size, _, block = BLOCK_TYPES[type_name]
    groups = cols // group_size
    return [
        ((rows, cols * bits // 32), mx.uint32),
        (
            (rows, groups // block.groups_per_factor * block.factor_count),
            mx.uint8 if block.exponent_factors else mx.float16,
        ),
        ((rows, round(groups * block.code_bytes)), mx.int8),
    ]


def block_form(raw: np.ndarray, type_name: str) -> QuantizedTensor:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    bits, group_size, parse, block = BLOCK_TYPES[type_name]
    per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, raw.shape[-1] // block_bytes, block_bytes)
    cols = blocks.shape[1] * per_block
    shapes, dtypes = zip(*block_form_parts(type_name, len(blocks), cols))
    # written where they will live where the CPU computes, MLX's arrays (a copy of a whole model's
    # arrays would take longer than the unpacking); else numpy's, copied to MLX's
    parts = [ops.writable_array(shape, dtype) for shape, dtype in zip(shapes, dtypes)]
    if parts[0] is None:
        views = [np.empty(shape, np.dtype(str(dtype).rsplit(".", 1)[-1])) for shape, dtype in zip(shapes, dtypes)]
    else:
        views = [np.array(part, copy=False) for part in parts]
    unpack = _native_unpack() if type_name in NATIVE_TYPES else None
    if unpack:
        _unpack_in_threads(unpack, GGMLQuantizationType[type_name].value, blocks, per_block, bits, *views)
    else:
        weight, factors, codes = views
        # rows a few million values at a time: the unpacked values take 8 bytes each while packed
        step = max(1, (1 << 22) // cols)
        for start in range(0, len(blocks), step):
            part = blocks[start : start + step]
            q, factors_part, codes_part = parse(part)  # q [rows, blocks, groups, group_size]
            rows = slice(start, start + len(part))
            weight[rows] = pack(q.reshape(-1, cols), bits)
            factors[rows], codes[rows] = (
                p.reshape(len(part), -1) if p.size else p.reshape(len(part), 0) for p in (factors_part, codes_part)
            )
    if parts[0] is None:
        parts = [mx.array(view) for view in views]
    return QuantizedTensor(*(part.reshape(*lead, part.shape[-1]) for part in parts), bits, group_size, block)


# The types csrc/gguf_blocks.c unpacks (the parsers above are its reference, and its fallback)
NATIVE_TYPES = (
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q2_K",
    "Q3_K",
    "IQ4_NL",
    "IQ4_XS",
    "MXFP4",
    "TQ2_0",
    "TQ1_0",
)
_UNPACK_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "gguf_blocks.c"
_log = logging.getLogger("mlx_hybrid")


@lru_cache(maxsize=None)
def _native_unpack():
    """csrc/gguf_blocks.c's function, built on first use; None where no C compiler builds it (the
    numpy parsers then unpack, about 50 times slower: one warning says so)."""
    cc = compiler("c")
    try:
        if cc is None:
            raise BuildError("no C compiler was found (set CC)")
        source = str(_UNPACK_SOURCE)
        path = build_once(
            "gguf_blocks",
            [_UNPACK_SOURCE],
            lambda out: [cc, "-O3", "-shared", "-fPIC", "-o", str(out), source],
            timeout=60,
        )
        function = ctypes.CDLL(str(path)).mlx_hybrid_unpack_blocks
    except (BuildError, OSError, AttributeError) as e:
        _log.warning("mlx_hybrid: GGUF blocks are unpacked by numpy, slowly (%s)", e)
        return None
    pointer, count = ctypes.c_void_p, ctypes.c_int
    function.argtypes = [count, pointer, ctypes.c_int64, count, count, count, pointer, pointer, count, pointer, count]
    function.restype = ctypes.c_int
    return function


@lru_cache(maxsize=None)
def _threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="mlx_hybrid-unpack")


def _unpack_in_threads(unpack, type_number: int, blocks: np.ndarray, values: int, bits: int, weight, factors, codes):
    """Every block of blocks [rows, blocks, bytes] into weight, factors and codes (writable
    row-major arrays), split over the machine's cores (the C function runs without the GIL)."""
    if not all(part.flags.c_contiguous and part.flags.writeable for part in (weight, factors, codes)):
        raise ValueError("the unpacked parts must be writable row-major arrays")
    blocks = np.ascontiguousarray(blocks)
    count, block_bytes = blocks.shape[0] * blocks.shape[1], blocks.shape[2]
    outputs = [(part, part.nbytes // max(count, 1)) for part in (weight, factors, codes)]
    pieces = max(1, min(os.cpu_count() or 1, count // 4096))  # (small tensors in one call)
    bounds = [count * i // pieces for i in range(pieces + 1)]

    def run(start, end):
        at = [part.ctypes.data + start * size for part, size in outputs]
        return unpack(
            type_number,
            blocks.ctypes.data + start * block_bytes,
            end - start,
            block_bytes,
            values,
            bits,
            at[0],
            at[1],
            outputs[1][1],
            at[2],
            outputs[2][1],
        )

    if any(list(_threads().map(run, bounds[:-1], bounds[1:]))):
        raise ValueError(f"csrc/gguf_blocks.c does not know GGML type {type_number}")
