"""A quantized matrix in MLX's affine layout, as loaders produce it and models split it
(on the ground floor: the loaders, the models and `parallel` all use it)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx

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
    """

    groups_per_factor: int
    factor_count: int  # 1 or 2
    code_count: int  # 1 or 2
    bias_ratio: float = 0.0

    def expand(self, factors: mx.array, codes: mx.array) -> tuple[mx.array, mx.array]:
        """float32 scales and biases [..., rows, groups]."""
        lead = factors.shape[:-1]
        factors = factors.astype(mx.float32).reshape(*lead, -1, 1, self.factor_count)
        codes = codes.astype(mx.float32).reshape(*lead, factors.shape[-3], self.groups_per_factor, self.code_count)
        scales = factors[..., 0] * codes[..., 0]
        if self.factor_count == 2:
            biases = factors[..., 1] * codes[..., -1]
        else:
            biases = self.bias_ratio * scales
        return scales.reshape(*lead, -1), biases.reshape(*lead, -1)


@dataclass
class QuantizedTensor:
    """An affine-quantized matrix (or stack of matrices) in MLX's layout."""

    weight: mx.array  # uint32 [..., rows, cols * bits / 32]
    scales: mx.array  # float32 [..., rows, cols / group_size] (block form: the factors)
    biases: mx.array  # (block form: the codes)
    bits: int
    group_size: int = GROUP_SIZE
    block: BlockScales | None = None  # set: the block form (see BlockScales)

    @property
    def shape(self):
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)

    @property
    def groups_per_cut(self) -> int:
        """The fewest whole groups a cut along the columns may take (a block form's factor blocks)."""
        return self.block.groups_per_factor if self.block else 1

    def expanded(self) -> "QuantizedTensor":
        """The plain form: float32 scales and biases per group."""
        if self.block is None:
            return self
        return QuantizedTensor(self.weight, *self.block.expand(self.scales, self.biases), self.bits, self.group_size)

    def dequantize(self) -> mx.array:
        """The dense float32 matrix (float16 scales would round it to float16)."""
        plain = self.expanded()
        scales, biases = plain.scales.astype(mx.float32), plain.biases.astype(mx.float32)
        return mx.dequantize(self.weight, scales, biases, group_size=self.group_size, bits=self.bits)

    def map_columns(self, transform) -> "QuantizedTensor":
        """The tensor with transform(part, entries) applied to each part along its last axis, where
        `entries(groups)` counts the part's entries of that many groups (a block form's factors:
        whole multiples of `groups_per_cut` only)."""

        def counter(per_group):
            return lambda groups: round(groups * per_group)

        per_group = {"weight": self.bits * self.group_size // 32}  # packed words
        if self.block:
            per_group["scales"] = self.block.factor_count / self.block.groups_per_factor
            per_group["biases"] = self.block.code_count
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
        return QuantizedTensor(self.weight, *narrow, self.bits, self.group_size)
