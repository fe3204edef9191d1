"""A quantized KV cache (`kv_bits`; its attention kernel's tests are in test_cpu_attention.py): what
it holds, a model over it against the same model over a float32 cache of the entries MLX
dequantizes, and the engine's exactness kept with it: greedy speculation equals plain decoding,
batch rows their single runs, a resumed turn a fresh one, each in the same cache form."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, assert_close_to_floor, load_fixture
from test_engine import prompts_for

import mlx_hybrid
from mlx_hybrid.cache import KVCache, QuantizedKVCache
from mlx_hybrid.engine import Engine, PrefixStore, load_checkpoint, save_checkpoint
from mlx_hybrid.engine.prefix_store import capture
from mlx_hybrid.loaders.hf_config import kimi_args
from mlx_hybrid.models import kimi_linear
from mlx_hybrid.models.random_weights import initialise
from mlx_hybrid.prompt import prefill


def test_a_quantized_cache_holds_each_tokens_codes_whatever_tokens_come_with_it():
    """Entries appended in calls of 1 to 300 tokens (past the buffer's growth step) hold what
    mx.quantize makes of all of them at once; a quarter of float32's bytes and a group's scale
    and bias (8 bits, groups of 32: 1.25 bytes a value)."""
    rng = np.random.default_rng(0)
    entries = rng.standard_normal((1, 2, 420, 64)).astype(np.float32)
    cache = QuantizedKVCache(8, 32)
    start = 0
    for count in (1, 300, 7, 112):
        keys, values = cache.update_and_fetch(
            mx.array(entries[:, :, start : start + count]), mx.array(-entries[:, :, start : start + count])
        )
        start += count
    for got, want in zip((keys, values), (entries, -entries)):
        for held, whole in zip(got.arrays, mx.quantize(mx.array(want), group_size=32, bits=8)):
            assert mx.array_equal(held, whole)
    assert cache.nbytes == 2 * 420 * 2 * 64 * 1.25


class DequantizedKVCache(KVCache):
    """The reference: a float32 cache of what MLX's own dequantize makes of the quantized entries."""

    def __init__(self, bits, group):
        super().__init__()
        self.bits, self.group = bits, group

    def update_and_fetch(self, *entries):
        shrunk = [mx.dequantize(*mx.quantize(e, self.group, self.bits), self.group, self.bits) for e in entries]
        return super().update_and_fetch(*shrunk)


def kimi_with_wider_latents():
    """A random Kimi Linear model at the fixture's shape but latents of 64 and rope keys of 32 (the
    fixture's 32 + 8 take no group of 32), dense feed-forwards (so that no rounding moves a router's
    choice), with the fixture's tokenizer."""
    config = json.loads((FIXTURES / "kimilinear" / "hf" / "config.json").read_text())
    config |= {"kv_lora_rank": 64, "qk_rope_head_dim": 32, "first_k_dense_replace": config["num_hidden_layers"]}
    model = initialise(kimi_linear.Model(kimi_args(config, kimi_linear, has_mtp=False)), seed=3)
    return model, load_fixture("kimilinear", "hf")[1]


@pytest.mark.parametrize("name", ["qwen35", "kimi"])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_model_over_a_quantized_cache_equals_it_over_the_dequantized_entries(name, bits):
    models = {"qwen35": lambda: load_fixture("qwen35", "hf")[0], "kimi": lambda: kimi_with_wider_latents()[0]}
    assert_over_a_quantized_cache_as_over_the_dequantized_entries(models[name](), bits)


def assert_over_a_quantized_cache_as_over_the_dequantized_entries(model, bits):
    """A 300-token prompt (the prompt path), then 3 tokens one at a time (the per-row path): logits
    over the quantized cache against a float32 cache of mx.dequantize's values, to the float32 floor
    (our decode rounds once where MLX's rounds twice). Kimi's values are views of its latent's codes."""
    prompt = mx.array([prompts_for()[3] + prompts_for()[6]])[:, :300]
    got_cache = model.make_cache(kv_bits=bits, kv_group_size=32)
    want_cache = [DequantizedKVCache(bits, 32) if isinstance(c, KVCache) else c for c in model.make_cache()]
    assert any(isinstance(c, QuantizedKVCache) for c in got_cache)
    for ids in (prompt, mx.array([[5]]), mx.array([[9]]), mx.array([[300]])):
        assert_close_to_floor(model(ids, got_cache)[0, -1], model(ids, want_cache)[0, -1])


def greedy(model, tok, prompt, **settings):
    return [r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=24, **settings)]


@pytest.mark.parametrize("family, bits", [("qwen35", 4), ("qwen35", 8), ("qwen35moe", 8), ("qwen3next", 4)])
def test_greedy_mtp_speculation_over_a_quantized_cache_equals_plain_decoding_over_it(family, bits):
    model, tok = load_fixture(family, "hf")
    prompt = prompts_for()[4]
    plain = greedy(model, tok, prompt, draft=None, kv_bits=bits, kv_group_size=32)
    for k in (1, 3):
        assert greedy(model, tok, prompt, draft="mtp", num_draft_tokens=k, kv_bits=bits, kv_group_size=32) == plain


def test_greedy_ngram_speculation_and_batch_rows_over_a_quantized_kimi_cache():
    model, tok = kimi_with_wider_latents()
    prompts = prompts_for(4)
    prompts[1] = prompts[1] * 3  # repeats for the n-gram drafts to find
    alone = [greedy(model, tok, p, draft=None, kv_bits=4, kv_group_size=32) for p in prompts]
    assert [greedy(model, tok, p, draft="ngram", kv_bits=4, kv_group_size=32) for p in prompts] == alone
    engine = Engine(model, tok, prefix_store=PrefixStore(0), prefill_chunk=48, kv_bits=4, kv_group_size=32)
    sequences = [engine.submit(p, max_tokens=24) for p in prompts]
    engine.run()
    assert [s.tokens for s in sequences] == alone


def test_a_second_turn_over_a_quantized_cache_resumes_from_a_checkpoint_of_its_own_form(tmp_path):
    """The second turn reads only what is new and gives what a fresh run gives; a checkpoint of a
    float32 cache is not taken by an engine of 8-bit caches (nor its file)."""
    model, tok = load_fixture("qwen3next", "hf")
    engine = Engine(model, tok, prefix_store=PrefixStore(1 << 30), kv_bits=8, kv_group_size=32)
    first_prompt = prompts_for()[2]
    first = engine.submit(first_prompt, max_tokens=24)
    engine.run()
    second_prompt = first_prompt + first.tokens + [7, 8, 9]
    second = engine.submit(second_prompt, max_tokens=24)
    engine.run()
    assert second.cached_tokens == len(first_prompt) + len(first.tokens) - 1
    assert second.tokens == greedy(model, tok, second_prompt, draft=None, kv_bits=8, kv_group_size=32)

    float_cache = model.make_cache()
    hidden = prefill(model, first_prompt, float_cache)
    checkpoint = capture(model, float_cache, first_prompt, hidden[:, -1:])
    store = PrefixStore(1 << 30)
    store.save(checkpoint)
    quantized_engine = Engine(model, tok, prefix_store=store, kv_bits=8, kv_group_size=32)
    resumed = quantized_engine.submit(first_prompt + [4], max_tokens=4)
    quantized_engine.run()
    assert resumed.cached_tokens == 0 and resumed.error is None
    save_checkpoint(tmp_path / "float.safetensors", checkpoint)
    with pytest.raises(mlx_hybrid.GenerationError, match="cache form"):
        load_checkpoint(tmp_path / "float.safetensors", model, quantized_engine.make_cache())


def test_settings_a_model_cannot_take_are_refused_by_name():
    model, tok = load_fixture("qwen35", "hf")  # heads of 32 features
    for settings, message in [
        ({"kv_bits": 3}, "kv_bits must be one of 4, 8, got 3"),
        ({"kv_bits": 8, "kv_group_size": 48}, "kv_group_size must be one of 32, 64, 128"),
        ({"kv_bits": 8, "kv_group_size": 64}, r"kv_group_size 64 does not divide .*\(32 features\): use 32"),
    ]:
        with pytest.raises(mlx_hybrid.GenerationError, match=message):
            mlx_hybrid.generate(model, tok, "hi", max_tokens=2, **settings)
    kimi, _ = load_fixture("kimilinear", "hf")  # a latent of 32 and rope keys of 8
    with pytest.raises(mlx_hybrid.GenerationError, match="this model takes no quantized KV cache"):
        Engine(kimi, tok, kv_bits=8, kv_group_size=32)
