"""GGUF quantized blocks on MLX's quantized kernels, without re-quantization."""

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf.quants import dequantize

import mlx_hybrid
from conftest import FAMILIES, FIXTURES, reference
from mlx_hybrid.loaders.quantized import AFFINE_TYPES, from_gguf_blocks, pack
from mlx_hybrid.models.blocks import QuantizedSwitchLinear


def quantized_modules(model):
    return [
        p
        for p, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))
    ]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_quantized_files_run_quantized_and_match(family, quant):
    model, _ = mlx_hybrid.load(FIXTURES / family / f"model-{quant}.gguf", dtype="float32")
    names = quantized_modules(model)
    assert "layers.0.mlp.switch_mlp.gate_proj" in names or "layers.0.mlp.gate_proj" in names
    assert any(".self_attn." in n or ".linear_attn." in n for n in names)
    logits = np.array(model(mx.array(reference(family)["input_ids"])))
    np.testing.assert_allclose(logits, reference(family, "ref_dequant.npz")[f"logits_{quant}"], atol=3e-3, rtol=0)


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


@pytest.mark.parametrize("type_name", sorted(AFFINE_TYPES))
def test_random_blocks_of_every_affine_type_unpack_exactly(type_name):
    """Random bytes with finite float16 scales, against gguf's own dequantization."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(len(type_name))
    rows, blocks = 6, 512 // block_values
    raw = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    scale_bytes = 4 if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 2  # d (and m or dmin)
    raw[..., :scale_bytes] = rng.uniform(-2, 2, (rows, blocks, scale_bytes // 2)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    q = from_gguf_blocks(raw, type_name)
    np.testing.assert_array_equal(np.array(q.dequantize()), dequantize(raw, qtype))


@pytest.mark.parametrize("bits", [3, 4, 5, 6, 8])
def test_packing_is_mlx_layout(bits):
    q = np.random.default_rng(bits).integers(0, 2**bits, (3, 64)).astype(np.uint8)
    packed = mx.array(pack(q, bits))
    ones, zeros = mx.ones((3, 2)), mx.zeros((3, 2))
    np.testing.assert_array_equal(np.array(mx.dequantize(packed, ones, zeros, group_size=32, bits=bits)), q)


def test_speculative_decoding_on_a_quantized_model():
    model, tok = mlx_hybrid.load(FIXTURES / "qwen35moe" / "model-Q4_K_M.gguf")
    prompt = reference("qwen35moe")["prompt_ids"][0].tolist()
    plain = [r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=32)]
    spec = [
        r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=32, draft="mtp", num_draft_tokens=3)
    ]
    assert spec == plain
