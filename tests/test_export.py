"""Writing GGUF and HF files: what llama.cpp's converter writes, and loads back unchanged."""

import gguf
import mlx.core as mx
import numpy as np

import mlx_hybrid
from conftest import FIXTURES, assert_close_to_floor, load_fixture, reference
from mlx_hybrid.export import save_gguf, save_hf


def test_gguf_export_matches_llama_cpp_converter(tmp_path):
    """From the HF checkpoint, the same tensors (names, tiled heads, 1 + w norms) as convert_hf_to_gguf.py."""
    model, tokenizer = load_fixture("qwen35", "hf")
    save_gguf(model, tokenizer, tmp_path / "out.gguf", matrix_dtype=np.float32)
    ours = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(tmp_path / "out.gguf")).tensors}
    theirs = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(FIXTURES / "qwen35" / "model.gguf")).tensors}
    assert set(ours) == set(theirs)
    for name in theirs:
        # tensors computed from the same float32 values: 1 + w and A_log round once (1e-6 is an ulp at 8)
        np.testing.assert_allclose(ours[name].reshape(theirs[name].shape), theirs[name], atol=1e-6, err_msg=name)


def test_gguf_export_writes_the_rope_sections_llama_cpp_reads(tmp_path):
    """The HF checkpoint's MRoPE sections as llama.cpp's converter writes them, and for a model with plain
    rotary positions (the bundled one) sections that reach every rotary pair (llama.cpp rotates a pair no
    section reaches by position 0: [d, 0, 0] left two pairs in three unrotated, and llama.cpp's logits
    of the bundled model 0.4 from ours)."""

    def sections(path):
        reader = gguf.GGUFReader(str(path))
        field = next(f for name, f in reader.fields.items() if name.endswith("rope.dimension_sections"))
        return [int(field.parts[i][0]) for i in field.data]

    model, tokenizer = load_fixture("qwen35", "hf")
    save_gguf(model, tokenizer, tmp_path / "out.gguf")
    assert sections(tmp_path / "out.gguf") == sections(FIXTURES / "qwen35" / "model.gguf") == [2, 1, 1, 0]
    bundled, bundled_tokenizer = mlx_hybrid.load(mlx_hybrid.bundled_model_path())
    assert bundled.args.partial_rotary_factor * bundled.args.head_dim == 16  # 8 rotary pairs
    assert sections(mlx_hybrid.bundled_model_path()) == [3, 3, 2, 0]
    save_gguf(bundled, bundled_tokenizer, tmp_path / "bundled.gguf")
    assert sections(tmp_path / "bundled.gguf") == [3, 3, 2, 0]


def test_gguf_export_in_float16_keeps_what_llama_cpp_computes_in_float32(tmp_path):
    """Matrices in float16, but the conv's weight, norms and decay parameters in float32, as llama.cpp's
    converter writes them: its ssm_conv op refuses a float16 weight (it aborted loading such a file)."""
    model, tokenizer = load_fixture("qwen35", "hf")
    save_gguf(model, tokenizer, tmp_path / "out.gguf")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "out.gguf")).tensors}
    kept = {name for name, kind in types.items() if kind == gguf.GGMLQuantizationType.F32}
    assert {name for name in types if name.endswith(("ssm_conv1d.weight", "norm.weight", "ssm_a"))} <= kept
    assert types["blk.0.attn_qkv.weight"] == gguf.GGMLQuantizationType.F16


def test_exports_load_back_to_the_same_model(tmp_path):
    model, tokenizer = load_fixture("qwen35", "model.gguf")
    ids = mx.array(reference("qwen35")["input_ids"])
    save_gguf(model, tokenizer, tmp_path / "out.gguf", matrix_dtype=np.float32)
    save_hf(model, tokenizer, tmp_path / "hf")
    text = "def parse_args(argv):\n    return {'é': 1}  # ünïcode\n"
    for path in (tmp_path / "out.gguf", tmp_path / "hf"):
        loaded, loaded_tokenizer = mlx_hybrid.load(path, dtype="float32")
        # GGUF: the same float32 weights (measured 0). HF stores norms as w where GGUF stores
        # 1 + w, an ulp per weight (measured 4.5e-5 on logits of scale 16.5): the float32 floor
        assert_close_to_floor(loaded(ids), model(ids))
        assert_close_to_floor(loaded.mtp_logits(ids), model.mtp_logits(ids))
        assert loaded_tokenizer.encode(text) == tokenizer.encode(text)
        assert loaded_tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}]
        ) == tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
