"""Tables a model only ever reads a few rows of (Qwen3.8-Flash-Next's n-gram embeddings, tens of GB):
left in their safetensors files, mapped, and read row by row as a step looks them up, so that they take
page cache, not the process's memory."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError

# safetensors dtype -> (numpy dtype of the stored bits, the MLX dtype they are)
_DTYPES = {"F32": (np.float32, mx.float32), "F16": (np.float16, mx.float16), "BF16": (np.uint16, mx.bfloat16)}


def safetensors_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise ModelLoadError(f"{path}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + length


class MappedRows:
    """Row shards [n_i, d] of one table, stacked in order, mapped from their files: `rows(ids)` reads the
    rows ids [...] name, [..., d], touching only their pages."""

    def __init__(self, shards: list[np.ndarray], dtype: mx.Dtype):
        self.shards, self.dtype = shards, dtype
        self.starts = np.cumsum([0] + [len(s) for s in shards])
        self.width = shards[0].shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.starts[-1]), self.width

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def rows(self, ids: np.ndarray) -> mx.array:
        flat = ids.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.starts[-1]):
            raise IndexError(f"row ids outside the table's {self.starts[-1]} rows")
        out = np.empty((flat.size, self.width), self.shards[0].dtype)
        shard_of = np.searchsorted(self.starts, flat, side="right") - 1
        for shard in np.unique(shard_of):
            at = shard_of == shard
            out[at] = self.shards[shard][flat[at] - self.starts[shard]]
        rows = mx.array(out)
        if self.dtype == mx.bfloat16:
            rows = rows.view(mx.bfloat16)
        return rows.reshape(*ids.shape, self.width)


def write_row_tables(path: Path, tables: dict[str, MappedRows], chunk_bytes: int = 1 << 26):
    """A safetensors file of tables (name -> MappedRows; each written as one tensor), copied from where
    they lie a chunk at a time, so that a table larger than memory is never held whole."""
    inverse = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16"}
    header, offset = {}, 0
    for name, table in tables.items():
        header[name] = {
            "dtype": inverse[table.dtype],
            "shape": list(table.shape),
            "data_offsets": [offset, offset + table.nbytes],
        }
        offset += table.nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data aligned to 8 bytes, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for table in tables.values():
            for shard in table.shards:
                rows = max(1, chunk_bytes // max(shard.strides[0], 1))
                for start in range(0, len(shard), rows):
                    f.write(np.ascontiguousarray(shard[start : start + rows]).tobytes())


def take_row_tables(tensors: dict, files: list[Path], pattern: str) -> dict[str, MappedRows]:
    """Take the tensors whose names match `pattern` (named groups `table` and `shard`) out of `tensors`
    (unread), as one MappedRows per table, by the table's name: its shards in order of `shard`."""
    compiled = re.compile(pattern)
    matches = {name: match for name in tensors if (match := compiled.fullmatch(name))}
    found: dict[str, dict[int, tuple[Path, dict, int]]] = {}
    for path in files if matches else ():
        header, start = safetensors_header(path)
        for name in matches.keys() & header.keys():
            found.setdefault(matches[name]["table"], {})[int(matches[name]["shard"])] = (path, header[name], start)
            del tensors[name]
    tables = {}
    for table, shards in found.items():
        if sorted(shards) != list(range(len(shards))):
            raise ModelLoadError(f"{table}: the table's shards are incomplete: found {sorted(shards)}")
        arrays, dtypes = [], set()
        for index in range(len(shards)):
            path, entry, start = shards[index]
            if entry["dtype"] not in _DTYPES or len(entry["shape"]) != 2:
                raise ModelLoadError(
                    f"{path}: {table} shard {index}: a {entry['dtype']} table of shape "
                    f"{entry['shape']} is not read (2-D float32, float16 or bfloat16)"
                )
            stored, dtype = _DTYPES[entry["dtype"]]
            begin, _ = entry["data_offsets"]
            arrays.append(np.memmap(path, stored, "r", offset=start + begin, shape=tuple(entry["shape"])))
            dtypes.add(dtype)
        if len(dtypes) != 1 or len({a.shape[1] for a in arrays}) != 1:
            raise ModelLoadError(f"{table}: its shards differ in dtype or width")
        tables[table] = MappedRows(arrays, dtypes.pop())
    return tables
