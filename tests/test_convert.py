"""MLX-community quantized checkpoints: ours from mlx_hybrid.convert, and mlx-lm's own."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_hybrid
from conftest import FAMILIES, FIXTURES, QWEN_FAMILIES, assert_close_to_floor, reference
from mlx_hybrid import ops
from mlx_hybrid.export import _quantizable as quantized_by_convert
from mlx_hybrid.export import convert
from mlx_hybrid.prompt import chat_prompt
from test_quantized import quantized_modules


def run_convert(*args, timeout=300):
    """`python -m mlx_hybrid.convert ARGS`, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_hybrid.convert", *args], capture_output=True, text=True, timeout=timeout
    )


def convert_paths(tmp_path, family: str = "qwen35") -> list[str]:
    """The arguments that convert a fixture's checkpoint (ours or mlx-lm's command) into tmp_path / "q"."""
    return ["--hf-path", str(FIXTURES / family / "hf"), "--mlx-path", str(tmp_path / "q")]


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_converted_checkpoint_is_the_quantized_model_with_its_mtp_head(family, tmp_path):
    """Loading the converted directory gives the in-memory quantized model.

    Up to float rounding: the format stores A_log, so A = -exp(A_log) goes through
    log and exp once (an ulp), which the random fixtures amplify to ~1e-4.
    """
    out = convert(FIXTURES / family / "hf", tmp_path / "q", bits=4, group_size=32)
    loaded, _ = mlx_hybrid.load(out, dtype="float32")  # a GPU's default is bfloat16
    assert loaded.has_mtp and quantized_modules(loaded)
    expected, _ = mlx_hybrid.load(FIXTURES / family / "hf", dtype="float32")
    nn.quantize(expected, 32, 4, class_predicate=lambda path, m: quantized_by_convert(path, m, 32))
    ids = mx.array(reference(family)["input_ids"])
    assert_close_to_floor(loaded(ids), expected(ids))
    assert_close_to_floor(loaded.mtp_logits(ids), expected.mtp_logits(ids))


@pytest.mark.parametrize("family", ["qwen35vl", "qwen35moevl"])
def test_converted_vision_checkpoint_sees_images_as_the_quantized_model(family, tmp_path):
    """A checkpoint with a vision tower converts with it (unquantized, under mlx-vlm's names): the
    tower's output and greedy decoding about two images are the in-memory quantized model's."""
    out = convert(FIXTURES / family / "hf", tmp_path / "q", bits=4, group_size=32)
    loaded, tokenizer = mlx_hybrid.load(out, dtype="float32")
    expected, _ = mlx_hybrid.load(FIXTURES / family / "hf", dtype="float32")
    nn.quantize(expected, 32, 4, class_predicate=lambda path, m: quantized_by_convert(path, m, 32))
    assert loaded.has_vision and quantized_modules(loaded)
    assert not any(path.startswith("vision.") for path in quantized_modules(loaded))
    ref = reference(family)
    pixels, grid = mx.array(ref["pixel_values_one"]), tuple(ref["grid_thw_one"][0].tolist())
    assert_close_to_floor(loaded.vision(pixels, grid), expected.vision(pixels, grid))
    images = [FIXTURES / family / "image_a.png", FIXTURES / family / "image_b.png"]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "def"}]}]

    def greedy(model):
        prompt = chat_prompt(tokenizer, messages).ids
        responses = mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=12, images=images, draft=None)
        return [r.token for r in responses]

    assert greedy(loaded) == greedy(expected)


# what mlx-lm quantizes and convert leaves in float: Kimi's unembed_out (a per-head product of
# mlx-lm's own, QuantizedMultiLinear, where ours is a plain array)
MLX_LM_ONLY_QUANTIZED = ("self_attn.unembed_out",)


# each family's conversion by the tool MLX community repositories of it are made with
PEER_CONVERSIONS = (
    [(family, "mlx-lm-4bit") for family in FAMILIES]
    + [(family, "mlx-vlm-4bit") for family in ("qwen35vl", "qwen35moevl")]
    + [(family, "mlx-lm-mxfp4") for family in ("qwen35", "qwen35moe")]
)


@pytest.mark.parametrize("family,peer", PEER_CONVERSIONS)
def test_conversions_are_in_the_peers_layout(family, peer, tmp_path):
    """convert writes model.safetensors as mlx-lm's own convert does (mlx-vlm's for a checkpoint with a
    vision tower; the fixtures they made): the same tensors, names, shapes and values (MoE routers in
    8 bits, the tower unquantized, as they keep them), but what MLX_LM_ONLY_QUANTIZED names; the MTP
    head beside them in mtp.safetensors, which mlx-lm does not read."""
    mode = "mxfp4" if peer.endswith("mxfp4") else "affine"
    out = convert(FIXTURES / family / "hf", tmp_path / "q", bits=4, group_size=32, mode=mode)
    ours = mx.load(str(out / "model.safetensors"))
    theirs = mx.load(str(FIXTURES / family / peer / "model.safetensors"))
    differ = {
        name
        for name in ours.keys() | theirs.keys()
        if name not in ours or name not in theirs or ours[name].shape != theirs[name].shape
    }
    assert all(any(part in name for part in MLX_LM_ONLY_QUANTIZED) for name in differ), sorted(differ)
    for name in ours.keys() & theirs.keys() - differ:  # the same quantization of the same weights: the same bits
        if name.endswith("A_log"):  # held as A = -exp(A_log), as GGUF files hold it: back within an ulp or two
            np.testing.assert_allclose(np.array(ours[name]), np.array(theirs[name]), rtol=2.0**-22, err_msg=name)
        else:
            np.testing.assert_array_equal(np.array(ours[name]), np.array(theirs[name]), err_msg=name)
    head = mx.load(str(out / "mtp.safetensors")) if (out / "mtp.safetensors").exists() else {}
    assert all(name.startswith("mtp.") for name in head) and bool(head) == (family != "kimilinear")


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_lm_loads_our_conversions(family, tmp_path):
    """mlx-lm loads what convert writes, every family, and computes our numbers (the MoE's random
    routing flips experts at near-ties between the two summation orders: its tokens are compared)."""
    mlx_lm = pytest.importorskip("mlx_lm")
    from mlx_lm.generate import generate_step

    out = convert(FIXTURES / family / "hf", tmp_path / "q", bits=4, group_size=32)
    ours, tokenizer = mlx_hybrid.load(out, dtype="float32")
    theirs, _ = mlx_lm.load(str(out))
    ref = reference(family)
    if family != "qwen35moe":
        ids = mx.array(ref["input_ids"])
        assert_close_to_floor(ours(ids), theirs(ids))
    prompt = ref["prompt_ids"][0].tolist()
    expected = [token for token, _ in generate_step(mx.array(prompt), theirs, max_tokens=12)]
    tokens = [r.token for r in mlx_hybrid.stream_generate(ours, tokenizer, prompt, max_tokens=12, draft=None)]
    assert tokens == expected[: len(tokens)]  # generate_step does not stop at an end token
    assert len(tokens) == len(expected) or tokens[-1] in tokenizer.eos_token_ids


def test_kimi_linear_converts_to_the_quantized_model(tmp_path):
    """Kimi Linear converts (from its Hugging Face directory, whose config.json it keeps): the result is
    the in-memory quantized model; from a GGUF file it is refused by name."""
    out = convert(FIXTURES / "kimilinear" / "hf", tmp_path / "q", bits=4, group_size=32)
    loaded, _ = mlx_hybrid.load(out, dtype="float32")
    expected, _ = mlx_hybrid.load(FIXTURES / "kimilinear" / "hf", dtype="float32")
    nn.quantize(expected, 32, 4, class_predicate=lambda path, m: quantized_by_convert(path, m, 32))
    assert quantized_modules(loaded)
    ids = mx.array(reference("kimilinear")["input_ids"])
    assert_close_to_floor(loaded(ids), expected(ids))
    with pytest.raises(mlx_hybrid.MlxHybridError, match="kimi_linear from its Hugging Face directory"):
        convert(FIXTURES / "kimilinear" / "model.gguf", tmp_path / "g", bits=4, group_size=32)
    assert not (tmp_path / "g").exists()


def test_a_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    """A conversion that fails while writing leaves neither its directory nor a partial one."""
    write = mlx_hybrid.export.save_mlx

    def write_then_fail(*args, **kwargs):
        write(*args, **kwargs)
        raise OSError("no space left on device")

    monkeypatch.setattr(mlx_hybrid.export, "save_mlx", write_then_fail)
    with pytest.raises(OSError):
        convert(FIXTURES / "qwen35" / "hf", tmp_path / "q", bits=4, group_size=32)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("config_dtype", ["float32", "bfloat16"])
def test_the_checkpoint_dtype_is_written_whatever_the_machine_computes_in(config_dtype, tmp_path, monkeypatch):
    """A conversion keeps the checkpoint's dtype (its config's, as mlx-lm's convert), not the
    machine's compute dtype: a GPU's bfloat16 would round a float32 checkpoint before quantizing."""
    source = tmp_path / "hf"
    shutil.copytree(FIXTURES / "qwen35" / "hf", source)
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = config_dtype
    (source / "config.json").write_text(json.dumps(config))
    machine_dtype = mx.float32 if config_dtype == "bfloat16" else mx.bfloat16
    monkeypatch.setattr(ops, "default_dtype", lambda: machine_dtype)
    written = mx.load(str(convert(source, tmp_path / "q", bits=4, group_size=32) / "model.safetensors"))
    assert {str(v.dtype) for k, v in written.items() if k.endswith((".scales", "norm.weight"))} == {
        f"mlx.core.{config_dtype}"
    }


def test_speculative_decoding_from_a_converted_checkpoint(tmp_path):
    model, tok = mlx_hybrid.load(convert(FIXTURES / "qwen35moe" / "hf", tmp_path / "q", bits=8, group_size=32))
    prompt = reference("qwen35moe")["prompt_ids"][0].tolist()
    plain = [r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=48, draft=None)]
    assert [r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=48, draft="mtp")] == plain


def test_a_quantized_gguf_converts_from_its_exactly_dequantized_weights(tmp_path):
    """Every module in the directory's one layout (its blocks are not carried over as they are),
    and a directory already quantized is refused, not quantized twice."""
    source = FIXTURES / "qwen35" / "model-Q4_K_M.gguf"
    loaded, _ = mlx_hybrid.load(convert(source, tmp_path / "q", bits=8, group_size=32), dtype="float32")
    assert {(m.bits, m.group_size) for _, m in loaded.named_modules() if hasattr(m, "scales")} == {(8, 32)}
    expected, _ = mlx_hybrid.load(source, dequantize=True, dtype="float32")  # a GPU's default: bfloat16
    nn.quantize(
        expected, 32, 8, class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0
    )
    ids = mx.array(reference("qwen35")["input_ids"])
    assert_close_to_floor(loaded(ids), expected(ids))
    with pytest.raises(mlx_hybrid.MlxHybridError, match="already quantized"):
        convert(tmp_path / "q", tmp_path / "twice")


def test_convert_command(tmp_path):
    result = run_convert(*convert_paths(tmp_path), "--q-bits", "8", "--q-group-size", "32")
    assert result.returncode == 0, result.stderr
    assert "8-bit, groups of 32" in result.stderr and "model.safetensors" in result.stderr  # what it wrote
    model, tok = mlx_hybrid.load(tmp_path / "q")
    assert tok.encode("def f(x):") == mlx_hybrid.load(FIXTURES / "qwen35" / "hf")[1].encode("def f(x):")


def test_convert_command_in_mxfp4(tmp_path):
    """--q-mode mxfp4 as mlx-lm's: 4 bits in groups of 32 unless told otherwise, and a conflicting
    group size refused by name (exit 2, nothing written); the result decodes, greedy, what the same
    checkpoint converted by mlx-lm in mxfp4 decodes."""
    command = [*convert_paths(tmp_path), "--q-mode", "mxfp4"]
    refused = run_convert(*command, "--q-group-size", "64")
    assert refused.returncode == 2 and "--q-mode mxfp4 takes 4 bits in groups of 32" in refused.stderr
    assert not (tmp_path / "q").exists()
    result = run_convert(*command)
    assert result.returncode == 0, result.stderr
    assert "4-bit mxfp4, groups of 32" in result.stderr
    record = json.loads((FIXTURES / "qwen35" / "mlx-lm-mxfp4" / "mlx_lm_greedy.json").read_text())
    model, tokenizer = mlx_hybrid.load(tmp_path / "q", dtype="float32")
    responses = mlx_hybrid.stream_generate(model, tokenizer, record["prompt_ids"], max_tokens=12, draft=None)
    assert [r.token for r in responses] == record["greedy_ids"][:12]


def test_convert_never_writes_over_an_existing_path(tmp_path):
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "notes.txt").write_text("mine")
    result = run_convert(*convert_paths(tmp_path))
    assert result.returncode == 2 and "already exists" in result.stderr and "Traceback" not in result.stderr
    assert [f.name for f in (tmp_path / "q").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("family", ["qwen35", "qwen35moe"])
def test_checkpoints_converted_by_mlx_lm_load_identically(family, tmp_path):
    """The leading MLX runner's own conversion: our forward agrees with its forward."""
    mlx_lm = pytest.importorskip("mlx_lm")
    quantized = ["-q", "--q-bits", "4", "--q-group-size", "32"]
    command = [sys.executable, "-m", "mlx_lm", "convert", *convert_paths(tmp_path, family), *quantized]
    subprocess.run(command, capture_output=True, check=True, timeout=300)
    ours, _ = mlx_hybrid.load(tmp_path / "q")
    theirs, _ = mlx_lm.load(str(tmp_path / "q"))
    ids = mx.array(reference(family)["input_ids"])
    # the two order the delta rule's products differently (observed 1.3e-4, 1.7e-4): the float32 floor
    assert_close_to_floor(ours(ids), theirs(ids))


# directories as mlx-lm's convert wrote them (tests/fixtures/make_mlx_lm_conversions.py)
MLX_LM_CONVERSIONS = (
    [("kimilinear", "mlx-lm")]
    + [(family, "mlx-lm-4bit") for family in FAMILIES]
    + [(family, "mlx-lm-mxfp4") for family in ("qwen35", "qwen35moe")]
)


@pytest.mark.parametrize("family,layout", MLX_LM_CONVERSIONS)
def test_mlx_lm_conversions_decode_as_mlx_lm_does(family, layout):
    """mlx-lm's conversions load and decode, greedy, the tokens mlx-lm itself decoded on the same
    directory when it made them (`mlx_lm_greedy.json`); the unquantized one also transformers' tokens."""
    directory = FIXTURES / family / layout
    record = json.loads((directory / "mlx_lm_greedy.json").read_text())
    model, tokenizer = mlx_hybrid.load(directory, dtype="float32")
    prompt, expected = record["prompt_ids"], record["greedy_ids"]
    responses = mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=len(expected), draft=None)
    tokens = [response.token for response in responses]
    assert tokens == expected
    if layout == "mlx-lm":
        assert tokens == reference(family)["greedy_ids"][0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "family,peer", [("qwen35moe", "mlx-lm-4bit"), ("qwen35", "mlx-lm-mxfp4"), ("qwen35moe", "mlx-lm-mxfp4")]
)
def test_a_head_taken_for_a_conversion_is_quantized_as_convert_quantizes_it(family, peer, tmp_path):
    """mlx-lm's conversions drop the MTP head; taken from the checkpoint they were made from
    (`load(mtp=)`), it is quantized as the trunk is, module by module (experts in 4 bits or mxfp4,
    routers in 8 bits, as the trunk's): the same bits as the head our convert writes from that
    checkpoint in the same mode."""
    mode = "mxfp4" if peer.endswith("mxfp4") else "affine"
    out = convert(FIXTURES / family / "hf", tmp_path / "q", bits=4, group_size=32, mode=mode)
    written = {name[len("mtp.") :]: t for name, t in mx.load(str(out / "mtp.safetensors")).items()}
    model, _ = mlx_hybrid.load(FIXTURES / family / peer, dtype="float32", mtp=FIXTURES / family / "hf")
    taken = dict(tree_flatten(model.mtp.parameters()))
    quantized = [name for name in written if name.endswith(".scales")]
    assert quantized and any("switch_mlp" in name for name in quantized) == (family == "qwen35moe")
    for scales in quantized:
        for part in ("weight", "scales", "biases"):
            name = scales[: -len("scales")] + part
            assert (name in written) == (name in taken), name
            if name in written:
                np.testing.assert_array_equal(np.array(taken[name]), np.array(written[name]), err_msg=name)


def test_a_quantization_mode_not_taken_is_refused_by_name(tmp_path):
    """mlx-lm's other modes (nvfp4, mxfp8) are not held here: loading says which mode, and which are."""
    shutil.copytree(FIXTURES / "qwen35" / "mlx-lm-mxfp4", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization"]["mode"] = config["quantization_config"]["mode"] = "nvfp4"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        mlx_hybrid.MlxHybridError, match=r"quantization mode 'nvfp4' is not taken \(taken: affine, mxfp4"
    ):
        mlx_hybrid.load(tmp_path / "m")


def test_help_example_converts_the_bundled_model(tmp_path):
    """`mlx_hybrid.convert --mlx-path DIR` (the example in its --help): the bundled GGUF,
    quantized, then generating from it gives text, and its help shows that example."""
    help_text = run_convert("--help", timeout=60).stdout
    assert "mlx_hybrid.convert --mlx-path ./tiny-q4" in help_text
    done = run_convert("--mlx-path", str(tmp_path / "tiny-q4"))
    assert done.returncode == 0, done.stderr
    model, tok = mlx_hybrid.load(tmp_path / "tiny-q4")
    bundled_tok = mlx_hybrid.load(mlx_hybrid.bundled_model_path())[1]
    assert model.has_mtp and tok.encode("def parse_args(") == bundled_tok.encode("def parse_args(")
    assert quantized_modules(model) and mlx_hybrid.generate(model, tok, "def parse_args(", max_tokens=8)
