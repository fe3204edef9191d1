"""Matrix products, plain and over chosen experts: float matrices (16-bit weights are kept as stored
under float32 activations), MLX's affine quantized layouts, and the GGUF block forms.

Where a product runs is decided here. On a GPU, decode steps and verify passes take the row-invariant
kernels (`row_kernels`). On the CPU, our kernels take what they compute. Everything else goes to MLX's
ops, or, as a last resort, to the dequantized matrix."""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from ..quantized_tensor import INT8_TYPES, BlockScales, QuantizedTensor, no_codes
from . import backend, cpu_quantized, row_kernels, selfcheck
from .backend import cpu_kernel_passed, path_key
from .cpu_extension import INT8_PRODUCTS, QUANTIZED
from .gpu_kernels import run
from .row_kernels import ROW_PRODUCT

SIXTEEN_BITS = (mx.bfloat16, mx.float16)

# The matrices whose products compute as llama.cpp computes them on the CPU (a GGUF file's, with its
# 8-bit activations, F16's and BF16's 16-bit ones): the loader names them, each product asks here
# (`activations_of`), and the models never carry the choice. By the array's id, with a weak reference
# that drops the entry when the matrix goes; each with the most rows a product of it keeps every row's
# bits (None: any), and whether it is held interleaved (`cpu_quantized.interleave_eights`).
_LLAMA_CPP_MATRICES: dict[int, tuple[weakref.ref, int | None, bool]] = {}

# `activations_of` a matrix held interleaved, which only the 8-bit products read
INT8_INTERLEAVED = "int8, interleaved"


def compute_as_llama_cpp(matrix: mx.array, rows_alike: int | None, interleaved: bool = False):
    """From here on, `matrix`'s products take llama.cpp's activations where they compute (see
    `int8_activations`); rows_alike: the most rows a product of it keeps each row's bits; interleaved:
    its packed codes are `cpu_quantized.interleave_eights`'s, which no other product reads."""
    key = id(matrix)
    _LLAMA_CPP_MATRICES[key] = (weakref.ref(matrix, lambda _: _LLAMA_CPP_MATRICES.pop(key, None)), rows_alike,
                                interleaved)  # fmt: skip


def _named(matrix: mx.array) -> tuple | None:
    """The matrix's entry, where it is this matrix's (an id may be another's once its matrix is gone)."""
    entry = _LLAMA_CPP_MATRICES.get(id(matrix))
    return entry if entry is not None and entry[0]() is matrix else None


def compute_like(matrix: mx.array, source: mx.array):
    """`matrix` (rows cut from `source`, say) computes as `source` does."""
    if (entry := _named(source)) is not None:
        if entry[2]:
            raise ValueError("rows cut from a matrix held interleaved are not its rows")
        compute_as_llama_cpp(matrix, entry[1])


def activations_of(matrix: mx.array) -> str:
    """ "int8" where the matrix's products compute as llama.cpp computes them (`INT8_INTERLEAVED` where it
    is held interleaved), else "float32"."""
    entry = _named(matrix)
    return "float32" if entry is None else INT8_INTERLEAVED if entry[2] else "int8"


def llama_cpp_row_limits(matrices) -> list[int | None]:
    """The row limits of those of `matrices` that compute as llama.cpp computes them."""
    return [entry[1] for entry in map(_named, matrices) if entry is not None]


def keeps_16bit_weights(stored, compute) -> bool:
    """Whether matrices stored in 16 bits stay so under this compute dtype (our CPU kernels
    multiply them as stored, in float32: half the memory of float32 weights, and MLX's own
    CPU products in bfloat16 are about twenty times slower than in float32)."""
    return (
        stored in SIXTEEN_BITS
        and compute == mx.float32
        and cpu_kernel_passed(QUANTIZED, cpu_quantized.small_case_16bit, stored)
    )


def row_product(x, w, scales=None, biases=None, indices=None, *, bits: int = 0, group_size: int = 0):
    """x @ W^T on a GPU's row-invariant product (`row_kernels.product_form`'s arguments), or None where it
    does not compute this one (the CPU, a prompt, a dtype, a variant that failed its first-use check)."""
    platform = backend.kernel_platform()
    if platform is None:
        return None
    form = row_kernels.product_form(x.shape, x.dtype, w.shape, w.dtype, bits, group_size,
                                    None if indices is None else indices.shape)  # fmt: skip
    if form is None or not selfcheck.passed(ROW_PRODUCT, row_kernels.small_product_case, platform, *form.variant):
        return None
    return run(ROW_PRODUCT, row_kernels.form_launch(form, x, w, scales, biases, indices), platform)[0]


def rows_alike_pass_tokens(model) -> int | None:
    """The most tokens that a pass of `model` which decodes rows may hold, so that each row computes
    what it computes alone; None where the compute path sets no bound.

    On a GPU the row-invariant products take passes of up to `row_kernels.ROW_KERNEL_PASS_TOKENS`;
    beyond that, MLX's own products tile the rows. On the CPU, a matrix computed as llama.cpp computes
    it (`compute_as_llama_cpp`) takes llama.cpp's activations up to its row limit and the float32 path
    beyond, so the bound is the smallest such limit. The CPU's float products set no bound
    (docs/speculative.md)."""
    if backend.kernel_platform():
        return row_kernels.ROW_KERNEL_PASS_TOKENS
    limits = llama_cpp_row_limits(array for _, array in tree_flatten(model.parameters()))
    return min((limit for limit in limits if limit is not None), default=None)


def takes_16bit_activations(x: mx.array, weight: mx.array, activations: str, any_rows: bool = False) -> bool:
    """Whether a product of a 16-bit matrix takes llama.cpp's 16-bit activations (`half_matmul`).

    It does when the matrix computes as llama.cpp computes it (activations "int8"), x is float32 with
    at most `HALF_ROWS` rows (any number for an expert product: any_rows), and our kernels run here
    (`int8_activations_computed`)."""
    return (any_rows or rows_within(x, HALF_ROWS)) and _16bit_activations(x.dtype, weight, activations)


def rows_within(x: mx.array, limit: int | None) -> bool:
    """Whether x [..., K] has at most `limit` rows (None: any number): the most rows of x a product with
    llama.cpp's activations takes, each row then computing as it does alone."""
    return limit is None or x.size // max(x.shape[-1], 1) <= limit


def _16bit_activations(dtype, weight: mx.array, activations: str) -> bool:
    """`takes_16bit_activations` for x of any rows in `dtype`."""
    return (
        activations == "int8" and weight.dtype in SIXTEEN_BITS and dtype == mx.float32 and int8_activations_computed()
    )


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x [..., K] @ weight^T (+ bias), in x's dtype, for weight [N, K].

    A GGUF file's F16 and BF16 matrices compute as llama.cpp computes them (`takes_16bit_activations`).
    Other 16-bit weights under float32 x stay 16-bit (`keeps_16bit_weights`). Where none of our kernels
    applies, this is nn.Linear's arithmetic."""
    if takes_16bit_activations(x, weight, activations_of(weight)):
        out = cpu_quantized.half_matmul(x, weight)
        return out if bias is None else out + bias.astype(out.dtype)
    out = row_product(x, weight)
    if out is None and weight.dtype != x.dtype and keeps_16bit_weights(weight.dtype, x.dtype):
        out = cpu_quantized.matmul_16bit(x, weight)
    if out is None:
        if bias is not None and weight.dtype == x.dtype:
            return mx.addmm(bias, x, weight.T)
        out = x @ weight.astype(x.dtype).T
    return out if bias is None else out + bias.astype(out.dtype)


def gather_matmul(x: mx.array, weight: mx.array, indices: mx.array) -> mx.array:
    """x [..., 1, 1, D] @ weight[indices]^T ([E, out, D] stacked experts) -> [..., k, 1, out] (as `linear`;
    expert products of any number of tokens)."""
    if takes_16bit_activations(x, weight, activations_of(weight), any_rows=True):
        return _on_token_rows(lambda rows, flat: cpu_quantized.half_gather_matmul(rows, weight, flat), x, indices)
    if (out := row_product(x, weight, indices=indices)) is not None:
        return out
    if weight.dtype != x.dtype and keeps_16bit_weights(weight.dtype, x.dtype):
        return _on_token_rows(lambda rows, flat: cpu_quantized.gather_matmul_16bit(rows, weight, flat), x, indices)
    weight_t = weight.swapaxes(-1, -2)
    if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
        # MLX's CPU gather_mm is float32-only
        return mx.gather_mm(x.astype(mx.float32), weight_t.astype(mx.float32), rhs_indices=indices).astype(x.dtype)
    return mx.gather_mm(x, weight_t, rhs_indices=indices)


def _on_token_rows(product, x: mx.array, indices: mx.array) -> mx.array:
    """A CPU kernel's gathered product, product(rows [T, 1 or k, K], indices [T, k]) -> [T, k, N],
    for x [..., 1 or k, 1, K] and indices [..., k]: [..., k, 1, N]."""
    lead, k = indices.shape[:-1], indices.shape[-1]
    out = product(x.reshape(-1, x.shape[-3], x.shape[-1]), indices.reshape(-1, k))
    return out.reshape(*lead, k, 1, out.shape[-1])


def _cpu_quantized_kernels(bits: int, group_size: int, scales_form) -> bool:
    """Whether our CPU kernels compute this quantized product (else MLX's op). scales_form:
    the scales' dtype, the BlockScales of a block form, or a grid type's GridBlocks."""
    return cpu_quantized.supports(bits, group_size, scales_form) and cpu_kernel_passed(
        QUANTIZED, cpu_quantized.small_case, bits, group_size, scales_form
    )


# the group sizes MLX's quantized products take (its CPU op refuses groups of 16)
MLX_GROUP_SIZES = (32, 64, 128)


def computes_quantized(bits: int, group_size: int) -> bool:
    """Whether products in this affine layout run here without dequantizing the matrix:
    MLX's groups, and on the CPU also what our kernels take (groups of 16: GGUF's Q6_K)."""
    return group_size in MLX_GROUP_SIZES or _cpu_quantized_kernels(bits, group_size, mx.float32)


def computes_block_scales(bits: int, group_size: int, block: BlockScales) -> bool:
    """Whether products with these block-form scales (or a grid type's blocks) run here as they
    are stored (our CPU kernels)."""
    return _cpu_quantized_kernels(bits, group_size, block)


def quantized_matmul(x, w, scales, biases, *, group_size: int, bits: int, block: BlockScales | None = None):
    """x [..., K] @ W^T for W [N, K] in MLX's affine layout: with scales and biases, or with a block
    form's factors and codes (no biases in MLX's float modes).

    The result is in x's dtype. (Exact GGUF scales are float32, and MLX would otherwise promote a
    16-bit model's products, and everything after them, to float32.) On the CPU a GGUF block form's
    products compute as llama.cpp computes them where the matrix was named so (`compute_as_llama_cpp`,
    `int8_activations`)."""
    product = quantized_product_path(x.dtype, bits, group_size, block, scales.dtype, activations_of(w), *path_key())
    return product(x, w, scales, biases)


# The most rows a product takes 8-bit activations for, where asked (decode steps, verify passes,
# batches); longer ones (prompts) keep the float32 path, whose dequantized tiles and BLAS multiply
# many rows faster. Each type's: the most rows of 32, 64, 128 or any at which its 8-bit product was no
# slower than the float32 path (within the runs' 5%) with AVX2 and AVX-512 builds alike
# (`benchmarks/gguf_types.py --kernels --rows R`, docs/benchmarks.md); None: any number (Q4_K, Q6_K:
# within 7% either way at 512 rows; Q4_0; and every type's expert products, 1.2-3.3x faster than
# the float32 path's from 16 to 512 tokens). Each 8-bit row is computed alone, so a pass within
# the limit (a batch's verify pass of 8 rows of 4) gives each row its decode step's bits.
INT8_ROW_LIMITS = {"Q4_K": None, "Q6_K": None, "Q4_0": None,
                   "Q2_K": 128, "Q3_K": 128, "IQ4_NL": 128, "IQ4_XS": 128, "MXFP4": 128, "TQ2_0": 128,
                   "TQ1_0": 128,
                   "Q8_0": 64, "Q4_1": 64, "Q5_0": 64, "Q5_1": 64, "Q5_K": 64, "IQ2_XXS": 64}  # fmt: skip
INT8_ROWS = 32  # the other types' (the grid types')
# F16's and BF16's with 16-bit activations (`half_matmul`), measured as the others' (64 rows: 1.0-1.17x
# the float32 path's speed, 128: 0.73-0.84x)
HALF_ROWS = 64


def int8_row_limit(bits: int, group_size: int, block) -> int | None:
    """The most rows a product of the GGUF type held in this layout takes 8-bit activations for (None:
    any number)."""
    return INT8_ROW_LIMITS.get(list(INT8_TYPES)[int8_type(bits, group_size, block)], INT8_ROWS)


@lru_cache(maxsize=None)  # (asked on every expert product with 8-bit activations)
def int8_type(bits: int, group_size: int, block) -> int | None:
    """The CPU kernel's number of the GGUF type held in this layout, where it takes 8-bit activations."""
    return next((i for i, held in enumerate(INT8_TYPES.values()) if held == (bits, group_size, block)), None)


def held_interleaved(matrix: mx.array, bits: int, group_size: int, block, rows_alike: int | None) -> mx.array:
    """What to hold for `matrix` (packed codes [..., N, K / 8]) whose products take llama.cpp's 8-bit
    activations (`compute_as_llama_cpp`, here too): a Q4_K, Q4_0, IQ4_NL or MXFP4 matrix of rows in
    eights (`cpu_quantized.interleaved_unit`) interleaved as llama.cpp's x86 build repacks them
    (`cpu_quantized.interleave_eights`: a decode step's 3584 x 1024 Q4_K product from memory on an AMD
    EPYC (Zen 4) 150-170 -> 91-100 us on one thread, 94-111 -> 78 on two), not yet evaluated: where the
    caller holds `matrix` no more when it evaluates it, in matrix's own buffer; any other the matrix
    itself. Only the 8-bit products read an interleaved matrix as held, its rows not to be cut or gathered;
    past a type's row limit its product reads the rows as stored (`cpu_quantized.rows_as_stored`)."""
    held_type = int8_type(bits, group_size, block)
    if held_type is None or not cpu_quantized.interleaved_unit(held_type, *matrix.shape[-2:]):
        compute_as_llama_cpp(matrix, rows_alike)
        return matrix
    interleaved = cpu_quantized.interleave_eights(matrix, held_type)
    compute_as_llama_cpp(interleaved, rows_alike, interleaved=True)
    return interleaved


def int8_activations_computed() -> bool:
    """Whether products with llama.cpp's 8-bit activations compute in this process (the CPU, with our
    kernels built and checked)."""
    return cpu_kernel_passed(INT8_PRODUCTS, cpu_quantized.small_case_int8)


def half_activations() -> str | None:
    """Why products of F16 and BF16 matrices cannot take llama.cpp's 16-bit activations here, or None
    where they can (our CPU kernels, built and checked)."""
    if backend.gpu_computes():
        return "they are computed where the CPU computes, and this process computes on the GPU"
    if not int8_activations_computed():
        return "they need this package's CPU kernels (x86-64 with AVX2), which do not run here"
    return None


def int8_activations(bits: int, group_size: int, block) -> str | None:
    """Why products in this layout cannot take llama.cpp's 8-bit activations here, or None where they
    can (a type with an int8 kernel; `half_activations`' conditions)."""
    if int8_type(bits, group_size, block) is None:
        return "llama.cpp's 8-bit activations are computed for GGUF's types (" + ", ".join(INT8_TYPES) + ")"
    return half_activations()


def _refuse_interleaved(dtype, bits: int, group_size: int, block):
    """Raises for a matrix held interleaved whose 8-bit products do not compute here (only they read it)."""
    if reason := int8_activations(bits, group_size, block) or (dtype != mx.float32 and "x is not float32"):
        raise ValueError(
            f"a matrix held for the CPU's 8-bit products cannot be computed ({reason}): load "
            "the model again where it computes (`load(..., cpu_activations='float32')` holds it "
            "for every product)"
        )


class Int8Path:
    """`quantized_product_path`'s 8-bit product of a GGUF type (x @ W^T as llama.cpp computes it), and the
    float32 path for more rows than its limit."""

    def __init__(self, held_type: int, grid, limit: int | None, interleaved: bool, float_path: Callable):
        self.held_type, self.grid, self.limit, self.interleaved = held_type, grid, limit, interleaved
        self.float_path = float_path

    def operands(self, w, scales, biases) -> tuple:
        """What `cpu_quantized.int8_matmul` takes of the matrix after x."""
        codes = no_codes(scales) if biases is None else biases  # (none in MLX's mxfp4 mode)
        return w, scales, codes, self.held_type, self.grid, self.interleaved

    def __call__(self, x, w, scales, biases):
        if not rows_within(x, self.limit):
            # (a prompt's chunk: the copy of its rows as stored was within the spread of a 512-token pass)
            rows = cpu_quantized.rows_as_stored(w, self.held_type) if self.interleaved else w
            return self.float_path(x, rows, scales, biases)
        return cpu_quantized.int8_matmul(x, *self.operands(w, scales, biases))


def llama_cpp_operands(dtype, weight: mx.array, path: Callable | None = None, scales=None, biases=None):
    """(what `llama_cpp_products` takes of a matrix, the most rows of x it takes them for: None, any) where
    the matrix's products of x in `dtype` compute as llama.cpp computes them (an F16 or BF16 matrix's
    `takes_16bit_activations`; a quantized one's `Int8Path`, its product's path given), else None."""
    if path is None and _16bit_activations(dtype, weight, activations_of(weight)):
        return (weight, None, None, 0, None, False), HALF_ROWS
    return (path.operands(weight, scales, biases), path.limit) if isinstance(path, Int8Path) else None


def llama_cpp_products(x: mx.array, operands: list) -> list:
    """x @ W^T for each matrix of `operands` (`llama_cpp_operands`' each), the bits of a product each, as
    one node: a layer's projections of one input."""
    return cpu_quantized.int8_matmuls(x, operands)


@lru_cache(maxsize=None)
def quantized_product_path(dtype, bits: int, group_size: int, block, scales_dtype, activations, *key) -> Callable:
    """`quantized_matmul`'s path for inputs of `dtype` in this layout, decided once per
    `backend.path_key`: a function (x, w, scales, biases) -> x @ W^T in dtype that calls the kernel
    directly. Deciding on every call cost each product two more Python calls on the host."""
    affine = group_size in MLX_GROUP_SIZES and block is None
    interleaved = activations == INT8_INTERLEAVED
    if activations != "float32" and dtype == mx.float32 and int8_activations(bits, group_size, block) is None:
        float_path = quantized_product_path(dtype, bits, group_size, block, scales_dtype, "float32", *key)
        return Int8Path(int8_type(bits, group_size, block), cpu_quantized.int8_grid(block),
                        int8_row_limit(bits, group_size, block), interleaved, float_path)  # fmt: skip
    if interleaved:
        _refuse_interleaved(dtype, bits, group_size, block)

    def mlx_product(x, w, scales, biases):
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits).astype(dtype)

    if affine and key and key[0]:  # key[0]: path_key's GPU kernel platform

        def product(x, w, scales, biases):
            out = row_product(x, w, scales, biases, bits=bits, group_size=group_size)
            return mlx_product(x, w, scales, biases) if out is None else out

        return product
    if _cpu_quantized_kernels(bits, group_size, block or scales_dtype):
        return cpu_quantized.bound_product(group_size, bits, block, dtype)
    if affine:
        return mlx_product
    if block is not None and block.mlx_mode:
        return lambda x, w, scales, biases: mx.quantized_matmul(
            x, w, scales, None, transpose=True, group_size=group_size, bits=bits, mode=block.mlx_mode
        ).astype(dtype)

    def dequantized(x, w, scales, biases):
        matrix = QuantizedTensor(w, scales, no_codes(scales) if biases is None else biases, bits, group_size, block)
        return (x @ matrix.dequantize().T.astype(dtype)).astype(dtype)

    return dequantized


def gather_quantized_matmul(x, w, scales, biases, indices, *, group_size: int, bits: int, block=None) -> mx.array:
    """x [..., 1 or k, 1, K] against the experts of w [E, N, ...] chosen by indices [..., k]:
    [..., k, 1, N], in x's dtype (as `quantized_matmul`)."""
    biases = no_codes(scales) if biases is None else biases  # (none in MLX's float modes)
    activations = activations_of(w)
    interleaved = activations == INT8_INTERLEAVED
    if activations != "float32" and x.dtype == mx.float32 and int8_activations(bits, group_size, block) is None:
        held_type, grid = int8_type(bits, group_size, block), cpu_quantized.int8_grid(block)
        return _on_token_rows(lambda rows, flat: cpu_quantized.int8_gather_matmul(rows, w, scales, biases, flat,
                                                                                   held_type, grid, interleaved),
                              x, indices)  # fmt: skip
    if interleaved:
        _refuse_interleaved(x.dtype, bits, group_size, block)
    out = None if block is not None else row_product(x, w, scales, biases, indices, bits=bits, group_size=group_size)
    if out is not None:
        return out
    if _cpu_quantized_kernels(bits, group_size, block or scales.dtype):
        out = _on_token_rows(
            lambda rows, flat: cpu_quantized.gather_quantized_matmul(
                rows, w, scales, biases, flat, group_size, bits, block
            ),
            x, indices,
        )  # fmt: skip
    elif group_size in MLX_GROUP_SIZES and block is None:
        out = mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True, group_size=group_size, bits=bits)
    elif block is not None and block.mlx_mode:
        out = mx.gather_qmm(
            x, w, scales, None, rhs_indices=indices, transpose=True, group_size=group_size, bits=bits,
            mode=block.mlx_mode,
        )  # fmt: skip
    else:
        experts = QuantizedTensor(w, scales, biases, bits, group_size, block).dequantize().astype(x.dtype)
        out = gather_matmul(x, experts, indices)
    return out.astype(x.dtype)
