"""A quantized matrix in MLX's affine layout, as loaders produce it and models split it
(on the ground floor: the loaders, the models and `parallel` all use it)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

GROUP_SIZE = 32


@dataclass
class QuantizedTensor:
    """An affine-quantized matrix (or stack of matrices) in MLX's layout."""

    weight: mx.array  # uint32 [..., rows, cols * bits / 32]
    scales: mx.array  # float32 [..., rows, cols / 32]
    biases: mx.array
    bits: int
    group_size: int = GROUP_SIZE

    @property
    def shape(self):
        return (*self.weight.shape[:-1], self.scales.shape[-1] * self.group_size)

    def dequantize(self) -> mx.array:
        """The dense float32 matrix (float16 scales would round it to float16)."""
        scales, biases = self.scales.astype(mx.float32), self.biases.astype(mx.float32)
        return mx.dequantize(self.weight, scales, biases, group_size=self.group_size, bits=self.bits)

    def with_scales_in(self, dtype) -> "QuantizedTensor":
        """Scales and biases rounded to dtype, unless one of them would overflow it."""
        narrow = [part.astype(dtype) for part in (self.scales, self.biases)]
        if not all(mx.isfinite(part).all().item() for part in narrow):
            return self
        return QuantizedTensor(self.weight, *narrow, self.bits, self.group_size)
