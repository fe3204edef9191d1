"""Running one model over the ranks of an `mx.distributed` group (several Macs, `mlx.launch`).

Two splits:
- **tensor parallel**: every layer on every rank, each rank with its share of the heads
  (linear-attention key heads with their value heads, attention heads, MLA heads),
  feed-forward columns and expert columns; one all-sum after each mixer and each MLP;
- **pipeline**: consecutive layers per rank, the hidden state sent on from rank to rank.

In both, the embedding and the LM head are split by vocabulary rows (an all-sum of the
looked-up rows, an all-gather of the logits), so every rank ends up with the same
logits and takes the same decisions: sampling, accepting drafts, rolling back.

A model splits itself (`HybridModel.shard`), returning for each split parameter the
`Split` that cuts a rank's part from a whole tensor; the loaders cut checkpoint tensors
with the same `Split`s as they read them, so no rank ever holds the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx

from .errors import ModelLoadError

TENSOR, PIPELINE = "tensor", "pipeline"


class ShardingError(ModelLoadError):
    """A model cannot be split this way over this many ranks."""


@dataclass(frozen=True)
class Parallel:
    """How a model is split: over which group, and how."""

    group: mx.distributed.Group
    mode: str  # TENSOR or PIPELINE

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def describe(self) -> str:
        return f"{'tensor parallel' if self.mode == TENSOR else 'pipeline'} over {self.size} ranks"


def launched_group() -> mx.distributed.Group | None:
    """The group of an `mlx.launch` (or MPI) run of several processes, else None."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def require(condition: bool, message: str):
    if not condition:
        raise ShardingError(message)


@dataclass(frozen=True)
class Split:
    """Which part of a tensor a rank holds, along `axis` (negative, counted from the end, so
    that one Split fits a stacked expert tensor and each expert's matrix alike).

    segments: sizes of the fused parts along the axis (a `[q | k | v]` projection), each
    split on its own; empty: the whole axis is one part. units: heads per segment, when
    ranks may outnumber them: ranks then share a head (KV heads). Parts are equal but for
    the last, which may be short (vocabulary rows).
    """

    axis: int
    segments: tuple[int, ...] = ()
    units: int = 0

    def bounds(self, length: int, rank: int, size: int) -> list[tuple[int, int]]:
        """[start, end) along the axis of each of the rank's pieces."""
        pieces, offset = [], 0
        for segment in self.segments or (length,):
            parts = min(size, self.units) if self.units else size
            index, chunk = rank * parts // size, -(-segment // parts)
            pieces.append((offset + min(index * chunk, segment), offset + min((index + 1) * chunk, segment)))
            offset += segment
        return pieces

    def take(self, tensor, rank: int, size: int):
        """The rank's part of an mx.array, or of a `quantized_tensor.QuantizedTensor`."""
        if not hasattr(tensor, "scales"):
            return self._take(tensor, self.axis, self.bounds(tensor.shape[self.axis], rank, size))
        if self.axis != -1:  # rows: every part of a quantized tensor has them
            parts = {k: self.take(getattr(tensor, k), rank, size) for k in ("weight", "scales", "biases")}
            return replace(tensor, **parts)
        group_size = tensor.group_size
        columns = self.bounds(tensor.shape[-1], rank, size)
        cuttable = tensor.cut_at([b for piece in columns for b in piece])
        if cuttable is None:  # the cut falls inside a quantization group
            return self._take(tensor.dequantize(), -1, columns)
        groups = [(a // group_size, b // group_size) for a, b in columns]
        return cuttable.map_columns(
            lambda part, entries: self._take(part, -1, [(entries(a), entries(b)) for a, b in groups])
        )

    @staticmethod
    def _take(array: mx.array, axis: int, pieces) -> mx.array:
        index = [slice(None)] * array.ndim
        parts = []
        for start, end in pieces:
            index[axis] = slice(start, end)
            parts.append(array[tuple(index)])
        # a copy, so that the whole tensor it came from can be freed
        return mx.contiguous(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis))


ROWS, COLUMNS, VECTOR = Split(-2), Split(-1), Split(-1)


def layer_range(num_layers: int, rank: int, size: int) -> range:
    """The consecutive layers a rank runs in a pipeline; earlier ranks take one more when
    they do not divide evenly."""
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


# -- collectives -------------------------------------------------------------------


def all_sum(x: mx.array, group) -> mx.array:
    """The sum over the group's ranks of each rank's partial x (x itself without a group)."""
    return x if group is None else mx.distributed.all_sum(x, group=group)


def gather_last_axis(x: mx.array, group, length: int) -> mx.array:
    """Each rank's consecutive part of the last axis [..., n_r] -> the whole [..., length]
    (parts of ceil(length / size), the last possibly short)."""
    width = -(-length // group.size())
    if x.shape[-1] < width:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    gathered = mx.distributed.all_gather(mx.moveaxis(x, -1, 0), group=group)  # along axis 0
    return mx.moveaxis(gathered[:length], 0, -1)


def agreed_max(value: int, group) -> int:
    """The largest of the ranks' values (sizes measured per rank, for decisions all must share)."""
    if group is None:
        return value
    return mx.distributed.all_max(mx.array([value], dtype=mx.int64), group=group).item()
