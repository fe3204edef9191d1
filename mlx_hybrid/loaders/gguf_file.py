"""GGUF files: the header's key-value metadata read into Python values, the tensors mapped from
the file's pages and loaded one by one (as MLX arrays, or kept in their blocks where a kernel
multiplies them), our block names for llama.cpp's `blk.N`. What the tensors mean per architecture
is `gguf_architectures`; the vision projector's file, `gguf_projector`.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError
from .quantized import from_gguf_blocks

# GGUF's own reader (gguf.GGUFReader) keeps two numpy views per string of a string array:
# seconds and half a gigabyte for a 248k-token vocabulary before the first weight (docs/formats.md).
# This one reads the header into Python values and maps the tensor data.

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SIZE = struct.Struct("<Q")  # a string's length


class _Header:
    """Reads GGUF's little-endian header values (struct formats) from a buffer; struct.error
    or IndexError past its end."""

    def __init__(self, buffer, at: int):
        self.buffer, self.at = buffer, at

    def number(self, form: str):
        (value,) = struct.unpack_from(form, self.buffer, self.at)
        self.at += struct.calcsize(form)
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings one after another (a vocabulary's, its merges'), in one loop of locals (a
        file with a 248k-token vocabulary opened in 114-170 ms, against 203-290 through string())."""
        buffer, at, end, size_of = self.buffer, self.at, len(self.buffer), _SIZE.unpack_from
        texts = []
        for _ in range(count):
            (size,) = size_of(buffer, at)
            at += 8
            if at + size > end:
                raise IndexError("a string runs past the end of the file")
            texts.append(str(buffer[at : at + size], "utf-8"))
            at += size
        self.at = at
        return texts

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.number(_SCALARS[kind])
        item, count = self.number("<I"), self.number("<Q")
        if item == _STRING:
            return self.strings(count)
        if item == _ARRAY:
            return [self.value(item) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item])
        if self.at + count * dtype.itemsize > len(self.buffer):
            raise IndexError("an array runs past the end of the file")
        values = np.frombuffer(self.buffer, dtype, count, self.at).tolist()
        self.at += count * dtype.itemsize
        return values


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: fastest dimension first
    tensor_type: object  # gguf.GGMLQuantizationType
    data_offset: int
    n_bytes: int
    mapping: mmap.mmap

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes in the file's pages, shaped as gguf.quants.dequantize takes them."""
        from gguf import GGMLQuantizationType as T
        from gguf.quants import quant_shape_to_byte_shape

        plain = {
            T.F32: np.float32,
            T.F16: np.float16,
            T.F64: np.float64,
            T.I8: np.int8,
            T.I16: np.int16,
            T.I32: np.int32,
            T.I64: np.int64,
        }
        shape, dtype = tuple(reversed(self.shape)), plain.get(self.tensor_type)
        if dtype is None:  # blocks: bytes, a row's blocks along the last axis
            shape, dtype = quant_shape_to_byte_shape(shape, self.tensor_type), np.uint8
        count = self.n_bytes // np.dtype(dtype).itemsize
        return np.frombuffer(self.mapping, dtype, count, self.data_offset).reshape(shape)


class GGUFFile:
    """A GGUF file's key-value metadata (Python values) and its tensors (views of its pages)."""

    def __init__(self, path: Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            self.mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header = _Header(self.mapping, 4)  # after the magic number
        version = header.number("<I")
        if version not in (2, 3):
            swapped = "a big-endian file, which this reader does not take" if version & 0xFFFF == 0 else "unknown"
            raise ModelLoadError(f"{path}: GGUF version {version} ({swapped}; versions 2 and 3 are read)")
        tensor_count, field_count = header.number("<Q"), header.number("<Q")
        self.metadata = {}
        for _ in range(field_count):
            key = header.string()
            self.metadata[key] = header.value(header.number("<I"))
        table = []
        for _ in range(tensor_count):
            name = header.string()
            shape = tuple(header.number("<Q") for _ in range(header.number("<I")))
            table.append((name, shape, GGMLQuantizationType(header.number("<I")), header.number("<Q")))
        alignment = self.metadata.get("general.alignment", 32)
        start = -(-header.at // alignment) * alignment
        self.tensors = []
        for name, shape, kind, offset in table:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            n_bytes = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
            self.tensors.append(GGUFTensor(name, shape, kind, start + offset, n_bytes, self.mapping))


def open_gguf(path: Path) -> GGUFFile:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic number)")
    try:
        reader = GGUFFile(path)
    except (struct.error, IndexError, ValueError, KeyError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({e})") from None
    size = path.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(f"{path}: truncated ({size} bytes, tensor data runs to {end})")
    return reader


def tensor_shapes(reader) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in numpy order (GGUF lists dimensions fastest first)."""
    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}


def gguf_block_name(name: str, n_layer: int) -> str:
    """Our block path -> `blk.N` (MTP blocks follow the trunk's)."""
    m = re.match(r"(mtp\.)?layers\.(\d+)\.", name)
    if not m:
        return name
    index = int(m.group(2)) + (n_layer if m.group(1) else 0)
    return f"blk.{index}." + name[m.end() :]


def block_names(reader, n_layer: int, keep_quantized: bool = True, compact_scales=None, whole_blocks: bool = False):
    """Source tensors with `blk.N.` renamed to our block paths (MTP blocks come after the trunk).

    Each comes with a loader giving an mx.array, or a QuantizedTensor where the block
    type maps exactly onto MLX's affine groups (and keep_quantized), or, when compact
    (compact_scales: a dtype), where `quantized.from_gguf_blocks` re-quantizes it.
    whole_blocks: the tensors' products compute over the file's blocks as llama.cpp's do (8-bit
    activations), so their columns are never cut apart (`QuantizedTensor.whole_blocks`).
    """
    from gguf.quants import dequantize

    def loader(t):
        if keep_quantized:
            quantized = from_gguf_blocks(np.asarray(t.data), t.tensor_type.name, compact_scales)
            if quantized is not None:
                return replace(quantized, whole_blocks=True) if whole_blocks else quantized
        if t.tensor_type.name in ("F16", "BF16") and len(t.shape) > 1:
            # matrices as stored (the model's loader casts what it does not keep in 16 bits)
            raw = np.asarray(t.data)
            if t.tensor_type.name == "F16":
                return mx.array(raw)
            return mx.array(raw.view(np.uint16)).view(mx.bfloat16)
        # as float32 without a numpy copy where it is one (mx.array copies it from the file's pages)
        return mx.array(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))

    def renamed(name):
        m = re.match(r"blk\.(\d+)\.", name)
        if not m:
            return name
        i = int(m.group(1))
        block = f"layers.{i}" if i < n_layer else f"mtp.layers.{i - n_layer}"
        return block + name[m.end() - 1 :]

    def loaded_and_released(t):
        tensor = loader(t)  # a copy: the file's pages it read are no longer needed
        release_pages(reader, t.data_offset, t.n_bytes)
        return tensor

    for t in reader.tensors:
        yield renamed(t.name), (lambda t=t: loaded_and_released(t))


def release_pages(reader, offset: int, length: int):
    """Let the kernel drop the file's pages a tensor was read from: they count as the process's
    resident memory until then (a whole file's worth by the end of a load)."""
    mapping = reader.mapping
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    # whole pages only: the next tensor's may start in the last one
    end = min(offset + length, len(mapping)) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


class Metadata:
    """Typed access to a GGUF file's key-value fields."""

    def __init__(self, reader: GGUFFile):
        self.reader = reader
        self.arch = self.get("general.architecture")

    def get(self, key, default=None):
        return self.reader.metadata.get(key, default)

    def arch_value(self, key, default=None):
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key):
        value = self.arch_value(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {self.arch}.{key}")
        return value
