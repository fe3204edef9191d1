"""Bad input gives one clear message: a typed exception from the API, exit 2 from the CLI."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_hybrid
from conftest import FIXTURES, load_fixture

QWEN35 = FIXTURES / "qwen35"


def generate_command(*args) -> list[str]:
    return [sys.executable, "-m", "mlx_hybrid.generate", *args]


def run_cli(*args, stdin=""):
    return subprocess.run(
        generate_command(*args),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_usage_error(result, fragment):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert fragment in lines[0]
    assert result.stdout == ""


def hf_copy(tmp_path, edit_tensors=None, edit_config=None):
    """A copy of the qwen35 HF checkpoint with its tensors or config edited."""
    target = tmp_path / "hf"
    shutil.copytree(QWEN35 / "hf", target)
    if edit_tensors:
        tensors = mx.load(str(target / "model.safetensors"))
        edit_tensors(tensors)
        mx.save_safetensors(str(target / "model.safetensors"), tensors)
    if edit_config:
        config = json.loads((target / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


def truncated_gguf(tmp_path, keep=0.5):
    data = (QWEN35 / "model.gguf").read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def gguf_of_architecture(tmp_path, arch):
    import gguf

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def wrong_shape(tensors):
    name = "model.language_model.layers.0.linear_attn.in_proj_z.weight"
    tensors[name] = tensors[name][:, :32]


def missing_tensor(tensors):
    del tensors["model.language_model.layers.3.self_attn.k_proj.weight"]


BAD_MODELS = {
    "missing path": (lambda tmp: tmp / "nowhere.gguf", "no such file"),
    "truncated gguf": (lambda tmp: truncated_gguf(tmp, 0.5), "bytes, tensor data runs to"),
    "truncated gguf header": (lambda tmp: truncated_gguf(tmp, 0.001), "truncated or corrupt GGUF file"),
    "truncated gguf tail": (lambda tmp: truncated_gguf(tmp, 0.999), "truncated"),
    "not a gguf": (lambda tmp: (tmp / "x.gguf").write_text("hello") and tmp / "x.gguf", "not a GGUF file"),
    "unknown gguf architecture": (
        lambda tmp: gguf_of_architecture(tmp, "llama"),
        "unsupported GGUF architecture 'llama'",
    ),
    "unknown hf architecture": (
        lambda tmp: hf_copy(tmp, edit_config=lambda c: c.update(model_type="llama")),
        "unsupported architecture 'llama'",
    ),
    "tensor of the wrong shape": (
        lambda tmp: hf_copy(tmp, edit_tensors=wrong_shape),
        "has shape (64, 32), expected (64, 64)",
    ),
    "missing tensor": (
        lambda tmp: hf_copy(tmp, edit_tensors=missing_tensor),
        "missing tensors: layers.3.self_attn.k_proj",
    ),
    "directory without config": (lambda tmp: tmp, "no config.json"),
    "not a model file": (
        lambda tmp: (tmp / "notes.txt").write_text("x") and tmp / "notes.txt",
        "expected a .gguf file",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
def test_bad_model_raises_model_load_error(case, tmp_path):
    make, fragment = BAD_MODELS[case]
    with pytest.raises(mlx_hybrid.ModelLoadError) as info:
        mlx_hybrid.load(make(tmp_path))
    assert fragment in str(info.value)


def test_truncated_safetensors(tmp_path):
    target = hf_copy(tmp_path)
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(mlx_hybrid.ModelLoadError, match="unreadable safetensors"):
        mlx_hybrid.load(target)


@pytest.mark.parametrize(
    "case", ["missing path", "truncated gguf", "unknown gguf architecture", "tensor of the wrong shape"]
)
def test_cli_reports_bad_model_in_one_line(case, tmp_path):
    make, fragment = BAD_MODELS[case]
    assert_usage_error(run_cli("--model", str(make(tmp_path)), "--prompt", "hi"), fragment)


def test_empty_prompt():
    model, tokenizer = load_fixture("qwen35", "model.gguf")
    with pytest.raises(mlx_hybrid.GenerationError, match="empty"):
        mlx_hybrid.generate(model, tokenizer, "")
    with pytest.raises(mlx_hybrid.GenerationError, match="empty"):
        mlx_hybrid.generate(model, tokenizer, [])
    assert_usage_error(run_cli("--model", str(QWEN35 / "model.gguf"), "--prompt", "-", stdin="  \n"), "empty")


def test_prompt_longer_than_context():
    model, tokenizer = load_fixture("qwen35", "model.gguf")
    too_long = [5] * model.args.max_position_embeddings
    with pytest.raises(mlx_hybrid.ContextOverflowError, match="context is 4096 tokens"):
        mlx_hybrid.generate(model, tokenizer, too_long)
    result = run_cli("--model", str(QWEN35 / "model.gguf"), "--prompt", "x = 1\n" * 3000)
    assert_usage_error(result, "context is 4096 tokens")


def test_generation_stops_at_the_context_end():
    model, tokenizer = load_fixture("qwen35", "model.gguf")
    prompt = [5] * (model.args.max_position_embeddings - 3)
    responses = list(mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=50))
    assert len(responses) <= 3 and responses[-1].finish_reason in ("length", "stop")


def test_bad_sampling_settings():
    model, tokenizer = load_fixture("qwen35", "model.gguf")
    for setting in ({"temp": -1.0}, {"top_p": 0.0}, {"top_k": -2}, {"min_p": 2.0}):
        with pytest.raises(mlx_hybrid.GenerationError):
            mlx_hybrid.generate(model, tokenizer, "x", **setting)
    with pytest.raises(mlx_hybrid.GenerationError, match="out of range"):
        mlx_hybrid.generate(model, tokenizer, [1, 99999])
    with pytest.raises(mlx_hybrid.GenerationError, match="num_draft_tokens"):
        mlx_hybrid.generate(model, tokenizer, "x", draft="mtp", num_draft_tokens=0)
    with pytest.raises(mlx_hybrid.GenerationError, match="unknown draft"):
        mlx_hybrid.generate(model, tokenizer, "x", draft="eagle")
    for seed in (-3, 2**64, 1.5):
        with pytest.raises(mlx_hybrid.GenerationError, match="seed"):
            mlx_hybrid.generate(model, tokenizer, "x", temp=1.0, seed=seed)


# Command lines a user gets wrong: each is one line naming the flag, exit status 2, before
# any model loads or anything is generated. Add a row to test another.
BAD_COMMAND_LINES = [
    (["--seed", "-3"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--seed", "x"], "--seed"),
    (["--mtp", "--no-mtp"], "--no-mtp: not allowed with argument --mtp"),
    (["--draft", "none", "--draft-model", "x.gguf"], "--draft none and --draft-model contradict each other"),
    (["--draft", "eagle"], "--draft: invalid choice"),
    (["--max-tokens", "many"], "--max-tokens"),
    (["--prompt-cache-file", "/nonexistent-dir/cache.safetensors"], "--prompt-cache-file"),
    (["--prompt-cache-file", "/tmp"], "--prompt-cache-file /tmp: is a directory"),
    (["--system", "be brief"], "--system needs --chat"),
    (["--regex", "[a-"], "--regex: invalid regex grammar"),
    (["--json-schema", "/nonexistent.json"], "--json-schema: cannot read"),
    (["--json-schema", __file__], "is not JSON"),
    (["--grammar", __file__], "--grammar: invalid lark grammar"),
    (["--presence-penalty", "5"], "presence_penalty must be in [-2, 2]"),
    (["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["--repetition-context-size", "0"], "--repetition-context-size"),
]


@pytest.mark.parametrize("args,fragment", BAD_COMMAND_LINES, ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES])
def test_bad_command_lines_are_one_line_usage_errors(args, fragment):
    assert_usage_error(run_cli("--model", str(QWEN35 / "model.gguf"), "--prompt", "hi", *args), fragment)


def test_output_into_a_reader_that_leaves_early_ends_quietly():
    """`mlx_hybrid.generate ... | head -c 5`: the closed pipe ends the command, no traceback."""
    command = generate_command("--model", str(QWEN35 / "model.gguf"), "--prompt", "def f(", "--max-tokens", "200")
    generator = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = generator.stdout.read(5)
    generator.stdout.close()  # the reader leaves
    _, stderr = generator.communicate(timeout=120)
    assert len(head) == 5 and b"Traceback" not in stderr and b"BrokenPipe" not in stderr, stderr
    assert generator.returncode == 141  # as a process that SIGPIPE ended


def test_cli_says_when_the_context_ends_generation():
    model, tokenizer = load_fixture("qwen35", "model.gguf")
    context = model.args.max_position_embeddings
    prompt = "x" * 4000  # tokens short of the 4096-token context
    room = context - len(tokenizer.encode(prompt))
    assert 0 < room < 200
    result = run_cli("--model", str(QWEN35 / "model.gguf"), "--prompt", prompt, "--max-tokens", "100000000", "--no-mtp")
    assert result.returncode == 0, result.stderr
    assert f"stopped at the model's context of {context} tokens" in result.stderr


def test_ctrl_c_stops_generation_with_its_statistics():
    import signal

    command = generate_command("--model", str(QWEN35 / "model.gguf"), "--prompt", "def f(", "--max-tokens", "3000")
    generator = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    shown = generator.stdout.read(20)  # it is generating
    generator.send_signal(signal.SIGINT)
    rest, stderr = generator.communicate(timeout=120)
    assert generator.returncode == 130 and "Traceback" not in stderr, stderr
    assert "stopped by Ctrl-C after" in stderr and "generation:" in stderr
    assert len(shown + rest) > 20
