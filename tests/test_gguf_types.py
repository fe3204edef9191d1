"""GGUF files of the types llama.cpp's `llama-quantize` writes (fixtures/gguf-types, made by
fixtures/make_gguf_types.py): loaded at about their size, computed as stored, against the same
file dequantized by gguf-py."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, assert_close_to_floor, cpu_kernel_tests
from mlx.utils import tree_flatten, tree_map

import mlx_hybrid
from mlx_hybrid import ops

pytestmark = cpu_kernel_tests()

TYPES = FIXTURES / "gguf-types"
FILES = sorted(p.name for p in TYPES.glob("*.gguf"))
# what a file takes loaded, against its size: every type as stored (the grid types as the file's
# blocks), the norms and the conv held in float32
HELD_RATIO = 1.1
PROMPT = mx.array([[(i * 37) % 500 + 5 for i in range(40)]])


def weight_bytes(model) -> int:
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


@pytest.mark.parametrize("name", FILES)
def test_every_type_is_held_at_about_its_file_size(name):
    """Weights after load against the file: the packed values as stored, scales as their codes
    and float16 factors (Q2_K's two 4-bit codes a byte; IQ4_XS's 6-bit codes take a byte, 3% of
    the file), the grid types' blocks as they are, 16-bit matrices in 16 bits; the norms and the
    conv held in float32 (the file's F32 tensors: at most 4% here)."""
    model, _ = mlx_hybrid.load(TYPES / name)
    assert weight_bytes(model) <= HELD_RATIO * (TYPES / name).stat().st_size


def float32_reference(path: Path):
    """The same file with every block dequantized by gguf-py and every matrix in float32,
    multiplied by MLX's float32 products."""
    model, _ = mlx_hybrid.load(path, dequantize=True)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    return model


@pytest.mark.parametrize("name", FILES)
def test_logits_match_the_file_dequantized_to_float32(name):
    # float32 activations: what the dequantized weights compute (a GGUF file's default, llama.cpp's
    # 8-bit activations, is checked against llama.cpp in test_int8_products.py)
    model, _ = mlx_hybrid.load(TYPES / name, cpu_activations="float32")
    kept = {p.dtype for _, p in tree_flatten(model.parameters())}
    assert mx.float32 in kept and len(kept) > 1  # something stayed as stored
    # the products differ in summation order only: the float32 floor at the logits' scale
    assert_close_to_floor(model(PROMPT), np.array(float32_reference(TYPES / name)(PROMPT)))


@pytest.mark.parametrize(
    "name",
    [
        "qwen35-Q2_K.gguf",
        "qwen35-IQ4_XS.gguf",
        "qwen35-IQ2_XXS.gguf",
        "qwen35-IQ2_XS.gguf",
        "qwen35-IQ1_M.gguf",
        "qwen35moe-Q2_K.gguf",
        "qwen35moe-IQ4_XS.gguf",
        "qwen35moe-MXFP4_MOE.gguf",
        "qwen35-TQ1_0.gguf",
        "qwen35-64-BF16.gguf",
    ],
)
def test_greedy_speculation_equals_plain_decoding(name):
    """A verify pass gives each position the bits a decode step gives it (each row's sums in one
    order whatever rows come with it), so MTP drafting changes no token."""
    model, tok = mlx_hybrid.load(TYPES / name)
    prompt = PROMPT[0, :12].tolist()
    plain = [r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=20, draft=None)]
    for k in (1, 3):
        spec = mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=20, draft="mtp", num_draft_tokens=k)
        assert [r.token for r in spec] == plain, k


def test_a_bfloat16_hf_checkpoint_is_held_in_16_bits(tmp_path):
    """Released HF checkpoints are bfloat16 safetensors: their matrices stay in 16 bits under
    the CPU's float32 compute (half the memory), norms and decay parameters in float32."""
    source = FIXTURES / "qwen35" / "hf"
    for part in source.iterdir():
        if part.suffix != ".safetensors":
            (tmp_path / part.name).write_bytes(part.read_bytes())
    tensors = mx.load(str(source / "model.safetensors"))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in tensors.items()})
    model, _ = mlx_hybrid.load(tmp_path)
    dtypes = dict(tree_flatten(tree_map(lambda p: p.dtype, model.parameters())))
    assert dtypes["layers.0.mlp.gate_proj.weight"] == mx.bfloat16
    assert dtypes["embed_tokens.weight"] == mx.bfloat16
    assert dtypes["norm.weight"] == mx.float32
    assert_close_to_floor(model(PROMPT), np.array(float32_reference(tmp_path)(PROMPT)))


def test_a_type_no_product_takes_is_named_at_load(caplog, monkeypatch):
    """On MLX's products alone (a GPU; here the forced reference) the types in groups of 16 and
    the table forms are dequantized: one warning a type, with its memory and the alternative.
    IQ3_S maps exactly onto MLX's 4-bit groups, Q4_K and Q5_K onto its affine groups, TQ1_0 onto
    its 2-bit groups, MXFP4 is its own mxfp4 mode: not named."""
    monkeypatch.setattr(ops.backend, "forced_by_environment", True)  # MLX_HYBRID_FORCE_REFERENCE=1
    for name, named in [
        ("qwen35-Q2_K.gguf", ["1 Q6_K", "16 Q2_K", "8 Q3_K"]),
        ("qwen35-IQ3_XXS.gguf", ["12 IQ3_XXS", "2 IQ2_S"]),
        ("qwen35-TQ1_0.gguf", ["1 Q6_K"]),
        ("qwen35moe-MXFP4_MOE.gguf", []),
    ]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="mlx_hybrid"):
            model, _ = mlx_hybrid.load(TYPES / name)
        lines = [r.getMessage() for r in caplog.records]
        assert sorted(line.split(" tensors")[0].split(": ")[-1] for line in lines) == named
        assert all("dequantized to float32" in line and "--compact" in line for line in lines)
        assert_close_to_floor(model(PROMPT), np.array(float32_reference(TYPES / name)(PROMPT)))
