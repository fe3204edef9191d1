"""Qwen3.8-Flash-Next (`qwen4_exp`) against transformers' reference (fixtures/qwen4exp: 2 residual streams,
PLE on two linear layers, indexers that keep 2 blocks of 4 keys and the tail, 8 experts)."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_hybrid
from conftest import FIXTURES, REFERENCE_TOL, assert_close_to_floor, load_fixture, reference
from mlx_hybrid.api import prefill
from mlx_hybrid.engine import Engine, PrefixStore
from mlx_hybrid.export import _quantizable as quantized_by_convert
from mlx_hybrid.export import convert
from mlx_hybrid.models import ngram_embedding, qwen4_exp
from mlx_hybrid.models.layers import Linear, RMSNorm
from mlx_hybrid.parallel import ShardingError
from mlx_hybrid.sampling import Sampler, SamplingParams
from test_engine import prompts_for
from test_kv_bits import assert_over_a_quantized_cache_as_over_the_dequantized_entries
from test_speculative import UniformDrafter, _exact_distribution, assert_mtp_chains_match
from test_vision import logits_with_images, unexpanded

FAMILY = "qwen4exp"


def model_and_tokenizer():
    return load_fixture(FAMILY, "hf")


def plain(prompt, n=32):
    model, tok = model_and_tokenizer()
    return [r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=n, draft=None)]


def counted_kept_keys(monkeypatch) -> list:
    """Filled with each indexed-attention pass's kept keys per query [T] (row 0), in order."""
    kept = []
    choose = qwen4_exp.IndexedAttention._kept_keys

    def counted(self, *args):
        mask = choose(self, *args)
        kept.append(np.array(mask[0, 0].sum(-1)))
        return mask

    monkeypatch.setattr(qwen4_exp.IndexedAttention, "_kept_keys", counted)
    return kept


def test_logits_and_kept_keys_match_reference(monkeypatch):
    """The 48-token pass: logits, and how many keys each query of each indexed layer attended to
    (transformers' selection masks): 8 or more blocks of 4 complete, so 2 kept plus the tail."""
    model, _ = model_and_tokenizer()
    ref = reference(FAMILY)
    kept = counted_kept_keys(monkeypatch)
    logits = np.array(model(mx.array(ref["input_ids"])))
    np.testing.assert_allclose(logits, ref["logits"], atol=REFERENCE_TOL, rtol=0)
    np.testing.assert_array_equal(np.stack(kept), ref["kept_keys"])
    assert ref["kept_keys"][:, -1].tolist() == [8, 8]  # of 48


def test_mtp_head_matches_its_sglang_wiring(monkeypatch):
    """The MTP head against the fixture's transcription of SGLang's qwen4_exp_mtp (transformers' layer
    classes wired as it runs them; see make_qwen4exp.py): teacher-forced logits over the 48 tokens, the
    keys its own indexer kept for each of the 47 pairs (blocks dropped), and chained drafts through
    the drafter, each reading the streams the last came from."""
    model, _ = model_and_tokenizer()
    ref = reference(FAMILY)
    kept = counted_kept_keys(monkeypatch)
    logits = np.array(model.mtp_logits(mx.array(ref["input_ids"])))
    np.testing.assert_allclose(logits, ref["mtp_logits"], atol=REFERENCE_TOL, rtol=0)
    np.testing.assert_array_equal(kept[-1], ref["mtp_kept_keys"])
    assert ref["mtp_kept_keys"][-1] < 47
    assert_mtp_chains_match(model, ref)


def test_greedy_tokens_match_reference():
    ref = reference(FAMILY)
    prompt = ref["prompt_ids"][0].tolist()
    assert plain(prompt, 24) == ref["greedy_ids"][0, len(prompt) :].tolist()


def test_token_steps_and_chunks_equal_one_pass():
    model, _ = model_and_tokenizer()
    ids = mx.array(reference(FAMILY)["input_ids"])
    whole = model(ids)
    cache = mlx_hybrid.make_cache(model)
    steps = mx.concatenate([model(ids[:, t : t + 1], cache=cache) for t in range(ids.shape[1])], axis=1)
    cache = mlx_hybrid.make_cache(model)
    chunks = mx.concatenate([model(ids[:, a:b], cache=cache) for a, b in ((0, 17), (17, 37), (37, 48))], axis=1)
    # single steps, chunks and one pass multiply through different kernels: other summation orders
    assert_close_to_floor(steps, whole)
    assert_close_to_floor(chunks, whole)


def test_batch_rows_equal_single_rows():
    model, tok = model_and_tokenizer()
    ids = reference(FAMILY)["input_ids"][0].tolist()
    prompts = [ids[:12], ids[5:30], ids[20:28] + ids[:6]]  # the second holds the end token: segments restart
    together = mlx_hybrid.batch_generate(model, tok, prompts, max_tokens=20, draft=None)
    assert together == [tok.decode(plain(p, 20)) for p in prompts]


def test_a_rollback_across_ple_and_indexed_layers_equals_a_rerun():
    """A verify pass of 6 tokens kept to 2: every state (delta rule, the PLE's tokens and convolution,
    the indexer's keys) as if only those 2 had come."""
    model, _ = model_and_tokenizer()
    ids = reference(FAMILY)["input_ids"][0].tolist()
    prompt, verified = ids[:30], ids[30:36]
    cache, fresh = model.make_cache(), model.make_cache()
    prefill(model, prompt, cache)
    prefill(model, prompt + verified[:2], fresh)
    mlx_hybrid.cache.record_snapshots(cache, True)
    model(mx.array([verified]), cache)
    mlx_hybrid.cache.record_snapshots(cache, False)
    mlx_hybrid.cache.rollback(cache, 2, len(verified))
    following = mx.array([ids[40:44]])
    assert_close_to_floor(model(following, cache), model(following, fresh))


@pytest.mark.parametrize("draft", ["mtp", "ngram", "self", "qwen35"])
def test_greedy_speculation_equals_plain_decoding(draft):
    """The model's MTP head, n-gram drafts (from a prompt that repeats), the model drafting for itself
    (every draft accepted) and the dense fixture drafting (same tokenizer; its drafts rejected: rolled
    back)."""
    model, tok = model_and_tokenizer()
    ids = reference(FAMILY)["input_ids"][0].tolist()
    prompt = ids[:10] * 3 if draft == "ngram" else ids[:12]
    settings = {
        "mtp": dict(draft="mtp"),
        "ngram": dict(draft="ngram"),
        "self": dict(draft_model=model, draft_p_min=0, draft_vocab=0),
        "qwen35": dict(draft_model=load_fixture("qwen35", "hf")[0], draft_vocab=0),
    }[draft]
    responses = list(mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=32, num_draft_tokens=3, **settings))
    assert [r.token for r in responses] == plain(prompt)
    assert responses[-1].acceptance_rate == 1.0 if draft == "self" else responses[-1].acceptance_rate is not None


def test_a_prefix_checkpoint_resumes_as_a_fresh_run():
    model, tok = model_and_tokenizer()
    engine = Engine(model, tok, None, prefix_store=PrefixStore(1 << 30))
    ids = reference(FAMILY)["input_ids"][0].tolist()
    first = engine.submit(ids[:20], max_tokens=8, checkpoint_at=[20])
    engine.run()
    second_prompt = ids[:20] + first.tokens + ids[20:26]
    second = engine.submit(second_prompt, max_tokens=16)
    engine.run()
    assert second.cached_tokens >= 20
    assert second.tokens == plain(second_prompt, 16)


def test_speculative_sampling_follows_the_target_distribution():
    """Sampled (x_P, x_P+1, x_P+2) with 2 drafts a round from a poor drafter, against the exact law:
    total variation below 0.05 over 3000 draws (seeds fixed). Measured: 0.018 over 12000 draws, as
    plain sampling's spread predicts; over 3000, 0.031-0.034 for plain sampling and 0.037-0.054 with
    drafts, as their seeds fall (these seeds: 0.037)."""
    model, _ = model_and_tokenizer()
    prompt = reference(FAMILY)["prompt_ids"][0].tolist()
    settings = dict(temp=1.0, top_k=3)
    exact = _exact_distribution(model, prompt, Sampler(**settings), depth=3)
    support = sorted({t for outcome in exact for t in outcome})
    rows, draws, counts = 50, 3000, {}
    engine = Engine(model, None, None, 2, max_batch=rows, prefix_store=PrefixStore(1 << 30))
    for start in range(100_000, 100_000 + draws, rows):
        sequences = [
            engine.submit(prompt, params=SamplingParams(max_tokens=4, seed=i, stop_tokens=(), **settings),
                          drafter=UniformDrafter(support[:2] + [7], model.args.vocab_size, seed=i),
                          checkpoint_at=[len(prompt)])
            for i in range(start, start + rows)
        ]  # fmt: skip
        engine.run()
        for sequence in sequences:
            counts[tuple(sequence.tokens[:3])] = counts.get(tuple(sequence.tokens[:3]), 0) + 1
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(o, 0) / draws - p) for o, p in exact.items())
    assert tv < 0.05, tv


def test_batch_rows_drafting_with_the_mtp_head_equal_single_rows():
    model, tok = model_and_tokenizer()
    ids = reference(FAMILY)["input_ids"][0].tolist()
    prompts = [ids[:12], ids[5:30], ids[20:28] + ids[:6]]
    together = mlx_hybrid.batch_generate(model, tok, prompts, max_tokens=20, draft="mtp", num_draft_tokens=3)
    assert together == [tok.decode(plain(p, 20)) for p in prompts]


def test_a_head_from_the_original_checkpoint_is_the_original_head(tmp_path):
    """A copy without its `mtp.*` tensors (as conversions drop them), given the head from the original
    (`load(..., mtp=)`): the original's MTP logits."""
    target = tmp_path / "headless"
    shutil.copytree(FIXTURES / FAMILY / "hf", target)
    tensors = {k: v for k, v in mx.load(str(target / "model.safetensors")).items() if not k.startswith("mtp.")}
    mx.save_safetensors(str(target / "model.safetensors"), tensors)
    headless, _ = mlx_hybrid.load(target, dtype="float32")
    assert not headless.has_mtp
    model, _ = mlx_hybrid.load(target, dtype="float32", mtp=FIXTURES / FAMILY / "hf")
    ids = mx.array(reference(FAMILY)["input_ids"])
    np.testing.assert_array_equal(np.array(model.mtp_logits(ids)), np.array(model_and_tokenizer()[0].mtp_logits(ids)))


def test_a_dflash_drafter_is_refused_by_name():
    """DFlash drafters read one hidden state per token; none is published that reads several streams."""
    model, tok = model_and_tokenizer()
    with pytest.raises(mlx_hybrid.GenerationError, match="carry 2 residual streams"):
        mlx_hybrid.generate(model, tok, [5, 6, 7], max_tokens=4, draft_model=FIXTURES / "dflash" / "qwen35-b8-l0-2")


@pytest.mark.parametrize("key", ["one", "two"])
def test_logits_and_greedy_tokens_with_images_match_reference(key):
    """Prompts with one and two images (qwen4expvl: the model with Qwen3.5's vision tower): one pass's
    logits, the indexers choosing blocks over the images' keys at their 3-D positions, and 24 greedy
    tokens, plain, with n-gram drafts and with the MTP head's."""
    model, tokenizer = load_fixture("qwen4expvl", "hf")
    ref = reference("qwen4expvl")
    ids = ref[f"ids_{key}"][0].tolist()
    pad = tokenizer.token_to_id("<|image_pad|>")
    paths = [FIXTURES / "qwen35vl" / name for name in ("image_a.png", "image_b.png")][: {"one": 1, "two": 2}[key]]
    prompt = unexpanded(ids, pad)
    logits = logits_with_images(model, tokenizer, prompt, paths, ids)
    np.testing.assert_allclose(logits, ref[f"logits_{key}"], atol=REFERENCE_TOL, rtol=0)
    for draft in (None, "ngram", "mtp"):
        responses = mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=24, images=paths, draft=draft)
        assert [r.token for r in responses] == ref[f"greedy_{key}"][0, len(ids) :].tolist()


def test_a_batch_mixing_images_and_text_equals_each_alone():
    """Rows with images (their keys at 3-D positions, which the indexer rotates blocks at) beside a row
    without, prefill chunks splitting an image: each gives its tokens alone."""
    model, tokenizer = load_fixture("qwen4expvl", "hf")
    ref = reference("qwen4expvl")
    pad = tokenizer.token_to_id("<|image_pad|>")
    images = [FIXTURES / "qwen35vl" / name for name in ("image_a.png", "image_b.png")]
    text = ref["ids_one"][0, -12:].tolist()
    engine = Engine(model, tokenizer, None, prefill_chunk=20)
    sequences = [
        engine.submit(unexpanded(ref["ids_two"][0].tolist(), pad), 24, images=images),
        engine.submit(text, 24),
        engine.submit(unexpanded(ref["ids_one"][0].tolist(), pad), 24, images=images[:1]),
    ]
    engine.run()
    assert sequences[0].tokens == ref["greedy_two"][0, ref["ids_two"].shape[1] :].tolist()
    assert sequences[1].tokens == [r.token for r in mlx_hybrid.stream_generate(model, tokenizer, text, max_tokens=24)]
    assert sequences[2].tokens == ref["greedy_one"][0, ref["ids_one"].shape[1] :].tolist()


def test_a_split_over_ranks_is_refused_by_name():
    model, _ = mlx_hybrid.load(FIXTURES / FAMILY / "hf", dtype="float32")
    with pytest.raises(ShardingError, match="qwen4_exp models are not split over ranks yet"):
        model.shard(mx.distributed.init())


def test_the_hash_buffers_in_the_checkpoint_are_what_the_config_gives():
    """The n-gram multipliers, prime slice sizes and offsets transformers saved beside each table are
    those computed from the config (what a checkpoint without them hashes with)."""
    model, _ = model_and_tokenizer()
    stored = mx.load(str(FIXTURES / FAMILY / "hf" / "model.safetensors"))
    for i, layer in enumerate(model.layers):
        if not layer.has_ple:
            continue
        computed = ngram_embedding.NGramHash(model.args, model.args.ple_layer_ids.index(i + 1))
        prefix = f"model.language_model.layers.{i}.ple.ple_embedding."
        np.testing.assert_array_equal(computed.multipliers, np.array(stored[prefix + "layer_multipliers"]))
        np.testing.assert_array_equal(computed.sizes, np.array(stored[prefix + "ngram_heads_vocab_sizes"]))
        np.testing.assert_array_equal(computed.offsets, np.array(stored[prefix + "ngram_heads_offsets"]))


def _with_stored(tmp_path, change):
    """A copy of the fixture's HF directory with its stored tensors changed by `change(tensors)`."""
    copy = tmp_path / "hf"
    shutil.copytree(FIXTURES / FAMILY / "hf", copy)
    tensors = mx.load(str(copy / "model.safetensors"))
    change(tensors)
    mx.save_safetensors(str(copy / "model.safetensors"), tensors, metadata={"format": "pt"})
    return copy


def test_a_checkpoints_own_hash_values_are_the_ones_hashed_with(tmp_path):
    """A checkpoint whose stored multipliers of a PLE layer are not its config's: the model hashes with
    the stored ones, as transformers does (it loads them as a buffer); its logits are transformers' over
    that checkpoint (within the fixtures' tolerance; the config's multipliers move them by 1.7). A stored
    value of the wrong shape is refused, naming it."""
    ref = reference(FAMILY)
    layer = next(i for i, layer in enumerate(model_and_tokenizer()[0].layers) if layer.has_ple)
    name = f"model.language_model.layers.{layer}.ple.ple_embedding.layer_multipliers"

    def multipliers(tensors):
        tensors[name] = mx.array(ref["stored_multipliers"])

    model, _ = mlx_hybrid.load(_with_stored(tmp_path / "a", multipliers), dtype="float32")
    np.testing.assert_array_equal(model.layers[layer].ple.hash.multipliers, ref["stored_multipliers"])
    logits = np.array(model(mx.array(ref["input_ids"])))
    np.testing.assert_allclose(logits, ref["stored_multipliers_logits"], atol=REFERENCE_TOL, rtol=0)
    # a conversion keeps them (int64, exact: the config's are near 2**54)
    converted, _ = mlx_hybrid.load(convert(tmp_path / "a" / "hf", tmp_path / "q", bits=8, group_size=32))
    for ours, theirs in zip(model.layers, converted.layers):
        if ours.has_ple:
            for stored, values in ours.ple.hash.stored().items():
                np.testing.assert_array_equal(theirs.ple.hash.stored()[stored], values)

    def wrong_shape(tensors):
        tensors[name] = tensors[name][:1]

    with pytest.raises(mlx_hybrid.ModelLoadError, match=f"layer {layer}'s n-gram hash: layer_multipliers has shape"):
        mlx_hybrid.load(_with_stored(tmp_path / "b", wrong_shape), dtype="float32")


# A copy of the fixture whose n-gram tables are large (sparse files: only the rows read take pages)
RESIDENT_GROWTH = """
import sys
import mlx_hybrid
def kb(key):  # of this process (VmHWM: its peak resident memory since it started)
    return int(next(line for line in open("/proc/self/status") if line.startswith(key + ":")).split()[1])
before = kb("VmRSS")
model, tok = mlx_hybrid.load(sys.argv[1], dtype="float32")
text = mlx_hybrid.generate(model, tok, list(range(3, 40)), max_tokens=16, draft=None)
print(model.mapped_nbytes, kb("VmHWM") - before)
"""


def test_the_ngram_tables_stay_in_their_files(tmp_path):
    """Tables of 2 x 4.35 GB (8 heads of 34M rows a table): the process grows by far less than one of
    them through load and generation (measured 52 MB), and reports them as mapped."""
    target = tmp_path / "large"
    shutil.copytree(FIXTURES / FAMILY / "hf", target)
    config = json.loads((target / "config.json").read_text())
    config["text_config"]["ngram_vocab_size_base"] = 34_000_000
    (target / "config.json").write_text(json.dumps(config))
    # the tables go to their own file; the stored hash values go too (this config's differ: it computes them)
    tensors = {k: v for k, v in mx.load(str(target / "model.safetensors")).items() if "ple_embedding" not in k}
    mx.save_safetensors(str(target / "model.safetensors"), tensors)
    table_bytes = _write_sparse_tables(target / "ngram-tables.safetensors", config["text_config"])
    assert table_bytes > 2e9
    report = subprocess.run(
        [sys.executable, "-c", RESIDENT_GROWTH, str(target)], capture_output=True, text=True, check=True
    ).stdout.split()
    mapped, grown_kb = map(int, report[-2:])
    assert mapped == table_bytes
    # the fixture model itself is 3 MB; MLX's and the package's buffers add some tens of MB. (The
    # kernel's peak, VmHWM, not getrusage's: that one keeps the forking test process's peak.)
    assert grown_kb * 1024 < 0.05 * table_bytes / 2, grown_kb


def _write_sparse_tables(path, text: dict) -> int:
    """Each PLE layer's table as one zero-filled shard, its data a hole in the file; their bytes."""
    heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
    width, divisor = text["ple_embed_dim"] // heads, text["make_ngram_vocab_size_divisible_by"]
    header, offset = {}, 0
    for index, layer in enumerate(sorted(text["ple_layer_ids"])):
        sizes = ngram_embedding.ngram_head_sizes(text["ngram_vocab_size_base"], index, heads)
        rows = ngram_embedding.ngram_table_rows(sizes, divisor)
        name = f"model.language_model.layers.{layer - 1}.ple.ple_embedding.ngram_embedding.shard_0.weight"
        header[name] = {"dtype": "F32", "shape": [rows, width], "data_offsets": [offset, offset + rows * width * 4]}
        offset += rows * width * 4
    encoded = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        f.truncate(8 + len(encoded) + offset)
    return offset


def test_converts_to_a_4_bit_mlx_directory_that_loads_as_the_quantized_model(tmp_path):
    """mlx_hybrid.convert's MLX directory: the config kept, the tables written as stored (the same rows),
    and loading it gives the model quantized in memory."""
    out = convert(FIXTURES / FAMILY / "hf", tmp_path / "q", bits=4, group_size=32)
    loaded, _ = mlx_hybrid.load(out, dtype="float32")
    expected, _ = mlx_hybrid.load(FIXTURES / FAMILY / "hf", dtype="float32")
    nn.quantize(expected, 32, 4, class_predicate=lambda path, m: quantized_by_convert(path, m, 32))
    assert isinstance(loaded.layers[0].ple.key_proj, nn.QuantizedLinear)
    for got, want in zip(loaded.row_tables().values(), expected.row_tables().values()):
        ids = np.arange(want.shape[0])
        np.testing.assert_array_equal(np.array(got.rows(ids)), np.array(want.rows(ids)))
    ids = mx.array(reference(FAMILY)["input_ids"])
    assert_close_to_floor(loaded(ids), expected(ids))
    assert isinstance(loaded.mtp.fc_hidden, nn.QuantizedLinear)
    assert_close_to_floor(loaded.mtp_logits(ids), expected.mtp_logits(ids))


def with_wider_index_keys():
    """The fixture with index keys of 32 features (the fixture's 16 take no group of 32, which a
    quantized cache needs): each indexed layer's (the MTP head's too) index projection and norms drawn
    at random, with the fixture's tokenizer."""
    model, tokenizer = mlx_hybrid.load(FIXTURES / FAMILY / "hf", dtype="float32")  # (changed: not the shared one)
    model.args.indexer_head_dim = width = 32
    attentions = [m for _, m in model.named_modules() if isinstance(m, qwen4_exp.IndexedAttention)]
    for i, attention in enumerate(attentions):
        attention.index_dim = width
        projection = Linear(model.args.hidden_size, (attention.index_heads + 1) * width, bias=False)
        projection.weight = 0.2 * mx.random.normal(projection.weight.shape, key=mx.random.key(i))
        attention.index_qk_proj = projection
        attention.q_layernorm, attention.k_layernorm = (RMSNorm(width, model.args.rms_norm_eps) for _ in range(2))
    return model, tokenizer


@pytest.mark.parametrize("bits", [4, 8])
def test_over_a_quantized_cache_as_over_its_dequantized_entries(bits):
    """As test_kv_bits's families; the indexed layers hold their index keys quantized too."""
    assert_over_a_quantized_cache_as_over_the_dequantized_entries(with_wider_index_keys()[0], bits)


def test_greedy_mtp_speculation_over_a_quantized_cache_equals_plain_decoding_over_it():
    model, tok = with_wider_index_keys()
    prompt = prompts_for()[4]
    settings = dict(max_tokens=24, kv_bits=4, kv_group_size=32)
    plain = [r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, draft=None, **settings)]
    drafted = mlx_hybrid.stream_generate(model, tok, prompt, draft="mtp", num_draft_tokens=3, **settings)
    assert [r.token for r in drafted] == plain
