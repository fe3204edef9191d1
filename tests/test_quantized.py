"""GGUF quantized blocks on MLX's quantized kernels, without re-quantization."""

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf.quants import dequantize

import mlx_hybrid
from conftest import FAMILIES, FIXTURES, REFERENCE_TOL, assert_close_to_floor, reference
from mlx_hybrid import ops
from mlx_hybrid.loaders import gguf_blocks
from mlx_hybrid.loaders.gguf_blocks import BLOCK_TYPES
from mlx_hybrid.loaders.quantized import from_gguf_blocks
from mlx_hybrid.ops.llama_reference import random_block_weights, random_grid_weights
from mlx_hybrid.quantized_tensor import GRID_TYPES, BlockScales, pack
from mlx_hybrid.models.layers import Embedding, Linear, QuantizedSwitchLinear


def quantized_modules(model):
    return [
        p
        for p, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))
    ]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_quantized_files_run_quantized_and_match(family, quant):
    # float32 activations: what the dequantized weights compute (llama.cpp's 8-bit ones, the default, are
    # checked against llama.cpp in test_int8_products.py)
    model, _ = mlx_hybrid.load(FIXTURES / family / f"model-{quant}.gguf", dtype="float32", cpu_activations="float32")
    names = quantized_modules(model)
    assert "layers.0.mlp.switch_mlp.gate_proj" in names or "layers.0.mlp.gate_proj" in names
    assert any(".self_attn." in n or ".linear_attn." in n for n in names)
    logits = np.array(model(mx.array(reference(family)["input_ids"])))
    # transformers on the exactly dequantized weights: the reference's own tolerance
    np.testing.assert_allclose(
        logits, reference(family, "ref_dequant.npz")[f"logits_{quant}"], atol=REFERENCE_TOL, rtol=0
    )


def test_dequantize_option_gives_dense_modules():
    model, _ = mlx_hybrid.load(FIXTURES / "qwen35" / "model-Q8_0.gguf", dequantize=True)
    assert quantized_modules(model) == []


def test_every_affine_block_in_the_fixtures_unpacks_exactly():
    seen = set()
    for path in FIXTURES.glob("*/model-Q*.gguf"):
        for t in gguf.GGUFReader(str(path)).tensors:
            q = from_gguf_blocks(np.asarray(t.data), t.tensor_type.name)
            if q is not None:
                seen.add(t.tensor_type.name)
                np.testing.assert_array_equal(np.array(q.dequantize()), dequantize(t.data, t.tensor_type))
    assert {"Q8_0", "Q5_0", "Q5_1"} <= seen


def random_raw(type_name, rows, cols, seed):
    """Random blocks of a GGML type with finite float16 scales, as the gguf reader gives them."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = cols // block_values
    raw = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    if type_name == "MXFP4":  # an E8M0 exponent: 2^-20 to 2^2
        raw[..., 0] = rng.integers(107, 130, (rows, blocks), dtype=np.uint8)
        return raw.reshape(rows, -1), qtype
    if type_name in ("Q6_K", "Q3_K", "Q2_K", "TQ2_0", "TQ1_0"):  # d (and dmin) come last
        scale_fields = slice(block_bytes - (4 if type_name == "Q2_K" else 2), block_bytes)
    else:
        scale_fields = slice(0, 4 if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 2)  # d (and m or dmin)
    count = (scale_fields.stop - scale_fields.start) // 2
    raw[..., scale_fields] = rng.uniform(-2, 2, (rows, blocks, count)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1), qtype


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
def test_random_blocks_of_every_affine_type_unpack_exactly(type_name):
    """Random bytes with finite float16 scales, against gguf's own dequantization."""
    raw, qtype = random_raw(type_name, 6, 512, len(type_name))
    q = from_gguf_blocks(raw, type_name)
    if q is None:  # Q6_K's groups of 16 where no product here takes them: the loader dequantizes
        assert not ops.computes_quantized(*BLOCK_TYPES[type_name][:2])
        return
    np.testing.assert_array_equal(np.array(q.dequantize()), dequantize(raw, qtype))


@pytest.mark.parametrize("writes_in_place", [True, False], ids=["in-place", "copied"])
@pytest.mark.parametrize("type_name", gguf_blocks.NATIVE_TYPES)
def test_native_unpacking_equals_the_numpy_parsers(type_name, writes_in_place, monkeypatch):
    """csrc/gguf_blocks.c against the numpy parsers it replaces, byte for byte: the packed values,
    the factors and the codes, over enough blocks that the machine's threads each take a part (an
    uneven count: the parts differ in size). "copied": where a GPU computes, numpy's arrays copied
    to MLX's."""
    if not writes_in_place:
        monkeypatch.setattr(ops, "writable_array", lambda shape, dtype: None)
    values = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
    raw, _ = random_raw(type_name, 257, 32 * values, 3)  # 8224 blocks
    if gguf_blocks._native_unpack() is None:
        pytest.skip("no C compiler builds csrc/gguf_blocks.c here")
    native = from_gguf_blocks(raw, type_name)
    monkeypatch.setattr(gguf_blocks, "NATIVE_TYPES", ())
    parsed = from_gguf_blocks(raw, type_name)
    if native is None:  # dequantized where no product here takes it: the same for both
        assert parsed is None
        return
    for part in ("weight", "scales", "biases"):
        got, want = getattr(native, part), getattr(parsed, part)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.array(got).view(np.uint8), np.array(want).view(np.uint8))


def set_quantized(module, q):
    """What the loader does: a module's parts (and a block form's layout) from a QuantizedTensor."""
    module.weight, module.scales, module.biases, module.block = q.weight, q.scales, q.biases, q.block


@pytest.mark.parametrize("forced_reference", [False, True])
@pytest.mark.parametrize(
    "type_name, block_form",
    [
        ("Q6_K", True),
        ("Q6_K", False),
        ("Q2_K", True),
        ("Q3_K", False),
        ("IQ4_NL", True),
        ("IQ4_XS", True),
        ("IQ2_XXS", True),
        ("IQ3_S", True),
        ("MXFP4", True),
        ("TQ2_0", True),
        ("TQ1_0", True),
    ],
)
def test_kernel_only_types_in_modules_match_float64(type_name, block_form, forced_reference, monkeypatch):
    """Types MLX's products do not take (groups of 16: Q6_K, the LM head of a Q4_K_M file, and
    Q2_K, Q3_K; IQ4's nonlinear values; the grid types' and TQ1_0's blocks; scales without codes:
    TQ2_0's, MXFP4's E8M0 exponents), their scales as stored (the block form) or expanded to
    float32: linear layers, the embedding's rows and experts, against gguf's dequantization in
    float64. Without our kernels (forced reference) the products dequantize (MXFP4: MLX's own
    mxfp4 products)."""
    raw, qtype = random_raw(type_name, 40, 512, 3)
    q = from_gguf_blocks(raw, type_name)
    if q is None or q.block is None:
        pytest.skip(f"no product here takes {type_name}'s scales as stored")
    q = q if block_form else q.expanded()
    bits, group_size = q.bits, q.group_size
    dense = dequantize(raw, qtype).astype(np.float64)
    if forced_reference:
        monkeypatch.setattr(ops.backend, "forced_by_environment", True)  # MLX_HYBRID_FORCE_REFERENCE=1
    linear = Linear(512, 40, bias=False).to_quantized(group_size=group_size, bits=bits)
    embedding = Embedding(40, 512).to_quantized(group_size=group_size, bits=bits)
    for module in (linear, embedding):
        set_quantized(module, q)
    x = mx.random.normal((9, 512), key=mx.random.key(0))
    for rows in (x[:1], x):  # a decode step, a prefill
        want = np.array(rows, np.float64) @ dense.T
        assert_close_to_floor(linear(rows), want)
        assert_close_to_floor(embedding.as_linear(rows), want)
    np.testing.assert_array_equal(np.array(embedding(mx.array([3, 0, 39]))), dense[[3, 0, 39]].astype(np.float32))
    experts = QuantizedSwitchLinear((2, 20, 512), group_size, bits)
    set_quantized(experts, q.map_columns(lambda part, _: part.reshape(2, 20, -1)))
    indices = mx.array([[1, 0], [0, 1]], dtype=mx.uint32)
    got = experts(x[:2, None, None], indices)
    want = np.einsum("tk,tenk->ten", np.array(x[:2], np.float64), dense.reshape(2, 20, 512)[np.array(indices)])
    assert_close_to_floor(got[:, :, 0], want)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_block_form_is_exact_and_near_the_file_size(type_name):
    """Where our kernels compute, the scales stay as stored, with or without compact loading."""
    raw, qtype = random_raw(type_name, 8, 1024, 7)
    for compact_scales in (None, mx.float16):
        q = from_gguf_blocks(raw, type_name, compact_scales=compact_scales)
        if q is None or q.block is None:  # None: MLX's ops compute, and they take no Q6_K
            pytest.skip("our kernels do not compute here")
        # Q8_0's code of 1 a group: 8.75 bits a weight against the file's 8.5; K-quants' codes
        # take a byte each (the file packs them in 6 bits): Q4_K 4.63 against 4.5
        assert q.weight.nbytes + q.scales.nbytes + q.biases.nbytes <= 1.03 * raw.nbytes
        np.testing.assert_array_equal(np.array(q.dequantize()), dequantize(raw, qtype))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_compact_blocks_stay_near_the_file_size_and_close_to_exact(type_name, monkeypatch):
    """Compact loading where the scales are expanded (here: MLX's ops forced, as on a Mac)."""
    monkeypatch.setattr(ops.backend, "forced_by_environment", True)  # MLX_HYBRID_FORCE_REFERENCE=1
    raw, qtype = random_raw(type_name, 8, 1024, 7)
    q = from_gguf_blocks(raw, type_name, compact_scales=mx.float16)
    assert q.scales.dtype == q.biases.dtype == mx.float16 and q.group_size == 32
    assert q.weight.nbytes + q.scales.nbytes + q.biases.nbytes <= 1.15 * raw.nbytes
    exact = dequantize(raw, qtype).astype(np.float64).reshape(8, -1, 32)  # groups of 32
    error = np.abs(np.array(q.dequantize(), dtype=np.float64).reshape(exact.shape) - exact)
    low, spread = exact.min(axis=-1, keepdims=True), np.ptp(exact, axis=-1, keepdims=True)
    if type_name == "Q6_K":  # re-quantized: a step of the new 6-bit grid (MLX nudges it to keep an edge exact)
        bound = spread / 63 + 2.0**-11 * (spread + np.abs(low))
    else:  # the exact scale s and bias b, each rounded to float16: 2^-11 (|s| q_max + |b|)
        exact_form = from_gguf_blocks(raw, type_name)
        assert exact_form.block is None  # expanded: float32 scales and biases
        s, b = (np.array(part, dtype=np.float64)[..., None] for part in (exact_form.scales, exact_form.biases))
        bound = 2.0**-11 * (np.abs(s) * (2**q.bits - 1) + np.abs(b))
    assert (error <= bound).all(), float((error / np.maximum(bound, 1e-30)).max())


def test_compact_load_runs_quantized_and_matches():
    """The fixtures' block types (Q8_0, Q5_0, Q5_1) have float16 scales: compact is exact for them."""
    model, _ = mlx_hybrid.load(
        FIXTURES / "qwen35" / "model-Q4_K_M.gguf", dtype="float32", compact=True, cpu_activations="float32"
    )  # (the dequantized weights' arithmetic, as the reference's)
    scales = {p: m.scales.dtype for p, m in model.named_modules() if isinstance(m, nn.QuantizedEmbedding)}
    assert scales == {"embed_tokens": mx.float16}
    logits = model(mx.array(reference("qwen35")["input_ids"]))
    assert logits.dtype == mx.float32
    np.testing.assert_allclose(
        np.array(logits), reference("qwen35", "ref_dequant.npz")["logits_Q4_K_M"], atol=REFERENCE_TOL
    )


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("family", ["qwen35", "qwen35moe", "kimilinear"])
def test_bfloat16_models_on_quantized_modules_compute_in_bfloat16(family, compact):
    """float32 scales (exact) would promote every product after the first to float32;
    compact loading keeps bfloat16 scales for a bfloat16 model."""
    model, _ = mlx_hybrid.load(FIXTURES / family / "model-Q4_K_M.gguf", dtype="bfloat16", compact=compact)
    if compact:  # 16-bit scales where they are expanded; else as stored (float16 factors)
        assert {
            m.block is None and m.scales.dtype for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)
        } in ({mx.bfloat16}, {False})
    hidden = model.hidden_states(mx.array(reference(family)["input_ids"]))
    assert hidden.dtype == mx.bfloat16 and model.logits_from_hidden(hidden).dtype == mx.bfloat16


def test_compact_is_for_gguf_files():
    with pytest.raises(mlx_hybrid.ModelLoadError, match="GGUF"):
        mlx_hybrid.load(FIXTURES / "qwen35" / "hf", compact=True)


@pytest.mark.parametrize("bits", [3, 4, 5, 6, 8])
def test_packing_is_mlx_layout(bits):
    q = np.random.default_rng(bits).integers(0, 2**bits, (3, 64)).astype(np.uint8)
    packed = mx.array(pack(q, bits))
    ones, zeros = mx.ones((3, 2)), mx.zeros((3, 2))
    np.testing.assert_array_equal(np.array(mx.dequantize(packed, ones, zeros, group_size=32, bits=bits)), q)


def test_speculative_decoding_on_a_quantized_model():
    model, tok = mlx_hybrid.load(FIXTURES / "qwen35moe" / "model-Q4_K_M.gguf")
    prompt = reference("qwen35moe")["prompt_ids"][0].tolist()
    plain = [r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=32, draft=None)]
    spec = [
        r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=32, draft="mtp", num_draft_tokens=3)
    ]
    assert spec == plain


def test_value_head_columns_move_as_whole_groups():
    """GGUF's tiled value heads reorder out_proj's columns; heads of whole groups stay quantized."""
    from types import SimpleNamespace

    from mlx_hybrid.loaders.common import apply_transform
    from mlx_hybrid.loaders.gguf_architectures import _head_transforms
    from mlx_hybrid.loaders.quantized import QuantizedTensor

    value_columns = _head_transforms(to_gguf=False)[3]
    args = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=6, linear_value_head_dim=64)
    dense = mx.random.normal((16, 6 * 64), key=mx.random.key(0))
    for bits in (4, 6):
        q = QuantizedTensor(*mx.quantize(dense, group_size=32, bits=bits), bits)
        moved = apply_transform(value_columns, q, args)
        assert isinstance(moved, QuantizedTensor)
        np.testing.assert_array_equal(np.array(moved.dequantize()), np.array(value_columns(q.dequantize(), args)))
    # block forms: heads of whole factor blocks move as they are, others with expanded scales
    for groups_per_factor in (2, 4):
        q = random_block_weights((16, 6 * 64), 4, 32, BlockScales(groups_per_factor, 2, 2))
        moved = apply_transform(value_columns, q, args)
        assert isinstance(moved, QuantizedTensor) and (moved.block is None) == (groups_per_factor == 4)
        np.testing.assert_array_equal(np.array(moved.dequantize()), np.array(value_columns(q.dequantize(), args)))
    # heads smaller than a group (16 of 32; 64 of a grid type's 256): the columns stay where they
    # are and a linear layer takes its inputs in their order
    narrow = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_value_head_dim=16)
    q = QuantizedTensor(*mx.quantize(dense[:, :64], group_size=32, bits=4), 4)
    grid = random_grid_weights((16, 256), GRID_TYPES["IQ2_XXS"])
    x = mx.random.normal((3, 256), key=mx.random.key(1))
    for tensor, args in [(q, narrow), (grid, SimpleNamespace(**{**vars(narrow), "linear_value_head_dim": 64}))]:
        moved = apply_transform(value_columns, tensor, args)
        assert moved.weight is tensor.weight and moved.column_order is not None
        want = np.array(value_columns(tensor.dequantize(), args))
        np.testing.assert_array_equal(np.array(moved.dequantize()), want)
        linear = Linear(tensor.shape[1], 16, bias=False).to_quantized(group_size=tensor.group_size, bits=tensor.bits)
        set_quantized(linear, moved)
        linear.take_inputs_in(moved.column_order)
        rows = x[:, : tensor.shape[1]]
        assert_close_to_floor(linear(rows), np.array(rows, np.float64) @ want.astype(np.float64).T)


@pytest.mark.parametrize("mode", ["mxfp4", "affine"])
def test_quantized_layers_compute_what_mlx_layers_compute(mode):
    """Our quantized linear and embedding layers (affine: through ops) against MLX's own."""
    group_size = 32 if mode == "mxfp4" else 64
    linear = Linear(128, 24, bias=False).to_quantized(group_size=group_size, bits=4, mode=mode)
    embedding = Embedding(24, 128).to_quantized(group_size=group_size, bits=4, mode=mode)
    x = mx.random.normal((3, 128), key=mx.random.key(5))
    assert_close_to_floor(linear(x), nn.QuantizedLinear.__call__(linear, x))
    assert_close_to_floor(embedding.as_linear(x), nn.QuantizedEmbedding.as_linear(embedding, x))


def test_column_splits_of_a_block_form_keep_or_expand_its_scales():
    """A rank's columns of a block form: cuts on factor blocks keep it, cuts inside them expand
    its scales to float32, each equal to the same columns of the dequantized matrix."""
    from mlx_hybrid.parallel import Split

    q = random_block_weights((6, 1024), 4, 32, BlockScales(8, 2, 2))
    dense = np.array(q.dequantize())
    for size, kept in ((2, True), (4, True), (8, False)):  # 512, 256, 128 columns a rank: blocks of 256
        for rank in range(size):
            part = Split(-1).take(q, rank, size)
            assert (part.block is not None) == kept
            width = 1024 // size
            np.testing.assert_array_equal(np.array(part.dequantize()), dense[:, rank * width : (rank + 1) * width])
