"""The bundled default model: real, small, trained with its MTP head (examples/train_tiny.py)."""

import mlx.core as mx
import pytest

import mlx_hybrid
from mlx_hybrid.export import convert
from mlx_hybrid.export import save_hf
from conftest import assert_close_to_floor
from test_errors import run_cli

PROMPT = "def parse_args(argv=None):\n    parser = argparse.ArgumentParser("


@pytest.fixture(scope="module")
def bundled():
    # float32 where a GPU's default is bfloat16: the comparisons below hold to the float32 floor
    return mlx_hybrid.load(mlx_hybrid.bundled_model_path(), dtype="float32")


def test_bundled_model_is_small_real_and_has_mtp(bundled):
    model, tokenizer = bundled
    assert model.has_mtp and model.model_type == "qwen3_5"
    assert mlx_hybrid.bundled_model_path().stat().st_size <= 25 * 1024**2
    params = sum(p.size for _, p in __import__("mlx.utils").utils.tree_flatten(model.parameters()))
    assert 5e6 <= params <= 20e6
    # trained: it continues Python code with Python
    text = mlx_hybrid.generate(model, tokenizer, PROMPT, max_tokens=24)
    assert any(word in text for word in (")", "add_argument", "parser", "=", "\n"))


def test_gguf_and_hf_export_agree(bundled, tmp_path):
    model, tokenizer = bundled
    save_hf(model, tokenizer, tmp_path / "hf")
    exported, exported_tokenizer = mlx_hybrid.load(tmp_path / "hf", dtype="float32")
    # the GGUF file with float activations, as the export computes (by default its F16 products take
    # llama.cpp's 16-bit activations)
    model, _ = mlx_hybrid.load(mlx_hybrid.bundled_model_path(), cpu_activations="float32")
    ids = mx.array([tokenizer.encode(PROMPT)])
    assert_close_to_floor(exported(ids), model(ids))  # norms stored as w, not 1 + w: an ulp per weight
    assert exported_tokenizer.encode(PROMPT) == tokenizer.encode(PROMPT)
    assert mlx_hybrid.generate(exported, exported_tokenizer, PROMPT, max_tokens=48) == mlx_hybrid.generate(
        model, tokenizer, PROMPT, max_tokens=48
    )


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_output_equals_plain_output(bundled, k):
    model, tokenizer = bundled
    plain = mlx_hybrid.generate(model, tokenizer, PROMPT, max_tokens=96, draft=None)
    responses = list(
        mlx_hybrid.stream_generate(model, tokenizer, PROMPT, max_tokens=96, draft="mtp", num_draft_tokens=k)
    )
    assert "".join(r.text for r in responses) == plain
    assert responses[-1].acceptance_rate > 0.2  # a trained head drafts tokens the trunk accepts


def test_the_bundled_dflash_drafter_keeps_the_output_and_drafts_what_the_model_accepts(bundled):
    """draft="dflash" with no drafter named: the one shipped beside the bundled model
    (examples/train_dflash.py), at its default settings (blocks as long as each round asks); the text
    plain decoding gives, alone and in a batch of rows drafting together."""
    model, tokenizer = bundled
    plain = mlx_hybrid.generate(model, tokenizer, PROMPT, max_tokens=96, draft=None)
    responses = list(mlx_hybrid.stream_generate(model, tokenizer, PROMPT, max_tokens=96, draft="dflash"))
    assert "".join(r.text for r in responses) == plain
    assert responses[-1].tokens_per_pass > 1.5  # a trained drafter: its blocks are accepted in part
    prompts = [PROMPT, "import os\n", "class Config:\n    def __init__(self"]
    alone = [mlx_hybrid.generate(model, tokenizer, prompt, max_tokens=48, draft=None) for prompt in prompts]
    assert mlx_hybrid.batch_generate(model, tokenizer, prompts, max_tokens=48, draft="dflash") == alone


def test_readme_command_runs_the_bundled_model_with_mtp():
    plain = run_cli("--prompt", "def parse_args(", "--max-tokens", "40", "--no-mtp")
    spec = run_cli("--prompt", "def parse_args(", "--max-tokens", "40")  # MTP is on by default
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "of drafts accepted" in spec.stderr


def test_mlx_community_conversion_keeps_the_greedy_tokens(bundled, tmp_path):
    """8-bit conversion of a trained model: the unquantized model's greedy tokens."""
    model, tokenizer = bundled
    save_hf(model, tokenizer, tmp_path / "hf")
    quantized, qtok = mlx_hybrid.load(convert(tmp_path / "hf", tmp_path / "q8", bits=8, group_size=32))
    prompt = tokenizer.encode(PROMPT)
    want = [r.token for r in mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=24, draft=None)]
    assert [r.token for r in mlx_hybrid.stream_generate(quantized, qtok, prompt, max_tokens=24)] == want


QUOTED = '''def merge_intervals(intervals):
    """Merge overlapping intervals given as (start, end) pairs."""
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1] = (result[-1][0], max(result[-1][1], end))
        else:
            result.append((start, end))
    return result


# The same function again, copied exactly:
def merge_intervals(intervals):
'''


def test_ngram_drafting_on_a_quoted_code_block(bundled):
    """A prompt that quotes a code block and asks for it again: n-gram drafts get long
    accepted runs, and the output is plain decoding's. (The small bundled model does not
    reproduce the block; its runs come from lookups in its own, repetitive, output.)"""
    model, tokenizer = bundled
    plain = mlx_hybrid.generate(model, tokenizer, QUOTED, max_tokens=64, draft=None)
    responses = list(
        mlx_hybrid.stream_generate(model, tokenizer, QUOTED, max_tokens=64, draft="ngram", num_draft_tokens=4)
    )
    assert "".join(r.text for r in responses) == plain
    assert responses[-1].tokens_per_pass >= 2.0, responses[-1].tokens_per_pass
