"""Output heads over a subset of the vocabulary (what the draft heads project onto), whole
or split by vocabulary rows over a group's ranks."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from ..parallel import (
    ROWS,
    Parallel,
    gather_last_axis,
)
from .layers import quantized_product


class VocabularySubsetHead(nn.Module):
    """An output projection restricted to some rows of the vocabulary (for drafting).

    Takes the rows of a (possibly quantized) LM head or tied embedding once; the logits
    it gives are over `ids`, in their order.
    """

    def __init__(self, projection: nn.Module, ids: mx.array):
        super().__init__()
        self.ids = ids
        self.weight = projection["weight"][ids]
        self.quantized = "scales" in projection
        if self.quantized:
            self.scales = projection["scales"][ids]
            self.biases = projection["biases"][ids] if "biases" in projection else None
            self.group_size, self.bits = projection.group_size, projection.bits
            self.block = getattr(projection, "block", None)
        mx.eval(self.parameters())
        ops.compute_like(self.weight, projection["weight"])  # the head's products compute as its

    def __call__(self, x: mx.array) -> mx.array:
        if self.quantized:
            return quantized_product(x, self)
        return ops.linear(x, self.weight)


class SplitVocabularySubsetHead(nn.Module):
    """`VocabularySubsetHead` of a head split by vocabulary rows: each rank projects onto the
    subset's tokens it holds, and the parts are gathered back into the subset's order."""

    def __init__(self, projection: nn.Module, ids: mx.array, parallel: Parallel, vocab_size: int):
        super().__init__()
        ranges = [ROWS.bounds(vocab_size, r, parallel.size)[0] for r in range(parallel.size)]
        wanted = ids.tolist()
        held = [[i - start for i in wanted if start <= i < end] for start, end in ranges]
        self.width = max(1, max(len(h) for h in held))
        self.count = len(held[parallel.rank])
        # a rank holding none of the subset still takes part in the gather (with one row)
        self.local = VocabularySubsetHead(projection, mx.array(held[parallel.rank] or [0]))
        self.order = mx.array([r * self.width + j for r, h in enumerate(held) for j in range(len(h))])
        self.group = parallel.group

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.local(x)[..., : self.count]
        return gather_last_axis(logits, self.group, self.width * self.group.size())[..., self.order]
