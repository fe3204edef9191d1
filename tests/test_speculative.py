"""MTP and draft-model speculative decoding: exact logits, lossless output, exact rollback."""

import gc
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_hybrid
from benchmarks.oracle import OracleDrafter
from conftest import (
    FIXTURES,
    QWEN_FAMILIES,
    REFERENCE_TOL,
    assert_close_to_floor,
    load_fixture,
    reference,
    reference_processing,
)
from mlx_hybrid.cache import KVCache
from mlx_hybrid.drafting import Drafter, MTPDrafter, NgramDrafter
from mlx_hybrid.drafting.dflash import DFlashDrafter
from mlx_hybrid.engine import Engine, PrefixStore
from mlx_hybrid.api import prefill
from mlx_hybrid.models.dflash import load_drafter
from mlx_hybrid.sampling import Sampler, SamplingParams

_plain = {}


def one_row_engine(model, k, adaptive=False, store=None):
    """An engine for one sequence at a time, whose requests bring their own drafters."""
    return Engine(model, None, None, k, adaptive=adaptive, max_batch=1, prefix_store=store or PrefixStore(0))


def decode_with(model, prompt, drafter, k, n, adaptive=False):
    """n greedy tokens (no stop token) with `drafter` drafting up to k a round: (tokens, stats)."""
    engine = one_row_engine(model, k, adaptive)
    sequence = engine.submit(prompt, n, drafter=drafter, stop_tokens=())
    engine.run()
    return sequence.tokens, sequence.stats


def plain_greedy(family, source, n=128):
    """The first n (at most 128) tokens of plain greedy decoding from the fixture's prompt."""
    if (family, source) not in _plain:
        model, tok = load_fixture(family, source)
        prompt = reference(family)["prompt_ids"][0].tolist()
        _plain[family, source] = [
            r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=128, draft=None)
        ]
    return _plain[family, source][:n]


# MTP logits against transformers: the trunk's tolerance (conftest.REFERENCE_TOL); the head
# adds one layer on the trunk's state (measured at most 2.2e-4 here).
MTP_ATOL = REFERENCE_TOL


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_mtp_logits_match_reference(family, source):
    """Teacher-forced: the head reads the trunk's state after the final norm (post-norm)."""
    model, _ = load_fixture(family, source)
    ref = reference(family)
    got = np.array(model.mtp_logits(mx.array(ref["input_ids"])))
    np.testing.assert_allclose(got, ref["mtp_logits"], atol=MTP_ATOL, rtol=0)


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_mtp_drafter_chains_like_the_reference(family, source):
    """Three chained greedy drafts through the drafter itself: prefilled with the trunk's
    states, each draft after the first reads the previous one's output after mtp.norm."""
    model, _ = load_fixture(family, source)
    assert_mtp_chains_match(model, reference(family))


def assert_mtp_chains_match(model, ref):
    """From each of `ref`'s chain starts n, the drafter prefilled with ids[:n] and begun with ids[n]
    drafts `mtp_chain_ids`, its head computing `mtp_chain_logits`."""
    ids = ref["input_ids"][0].tolist()
    for n, want_ids, want_logits in zip(ref["mtp_chain_starts"], ref["mtp_chain_ids"], ref["mtp_chain_logits"]):
        drafter = MTPDrafter(model, draft_p_min=0.0)
        seen = []  # the logits the drafter's head computed, one [1, 1, V] per draft
        project = drafter.head.project
        drafter.head.project = lambda x: seen.append(project(x)) or seen[-1]
        cache = model.make_cache()
        drafter.prefill(ids[:n], prefill(model, ids[:n], cache))
        drafter.begin(ids[n])
        tokens, _ = drafter.draft(3, Sampler(0.0))
        assert [int(t) for t in tokens] == want_ids.tolist()
        got = np.stack([np.array(x)[0, 0] for x in seen])
        np.testing.assert_allclose(got, want_logits, atol=MTP_ATOL, rtol=0)


def _pre_norm_copy(family, tmp_path, value="pre_norm"):
    import json

    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / family / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    config["mtp_hidden"] = value
    (hf / "config.json").write_text(json.dumps(config))
    return hf


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_a_head_trained_pre_norm_is_declared_in_its_config(family, tmp_path):
    """`"mtp_hidden": "pre_norm"` in config.json: the head reads the states before the norms
    (reference: the same head wired that way in transformers), GGUF export keeps the setting,
    and drafting stays lossless."""
    model, tok = mlx_hybrid.load(_pre_norm_copy(family, tmp_path), dtype="float32")
    assert model.args.mtp_hidden == "pre_norm"
    ids = mx.array(reference(family)["input_ids"])
    got = np.array(model.mtp_logits(ids))
    np.testing.assert_allclose(got, reference(family)["mtp_logits_pre_norm"], atol=MTP_ATOL, rtol=0)
    if family != "qwen3next":  # GGUF export writes the qwen35 layouts
        from mlx_hybrid.export import save_gguf

        save_gguf(model, tok, tmp_path / "model.gguf", matrix_dtype=np.float32)
        exported, _ = mlx_hybrid.load(tmp_path / "model.gguf", dtype="float32")
        assert exported.args.mtp_hidden == "pre_norm"
        # the same float32 weights in another file: the same sums, the same bits
        assert np.array_equal(np.array(exported.mtp_logits(ids)), got)
    prompt = reference(family)["prompt_ids"][0].tolist()
    spec = mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=64, draft="mtp", num_draft_tokens=3, draft_p_min=0)
    assert [r.token for r in spec] == plain_greedy(family, "hf", 64)


def test_an_unknown_mtp_hidden_setting_is_refused(tmp_path):
    with pytest.raises(mlx_hybrid.ModelLoadError, match="mtp_hidden"):
        mlx_hybrid.load(_pre_norm_copy("qwen35", tmp_path, "after_norm"))


# default settings (adaptive length, the whole 512-token vocabulary), and exactly k drafts
# a round over the 64 most frequent tokens
DRAFT_SETTINGS = {"adaptive": {}, "fixed-k-subset": {"draft_p_min": 0, "draft_vocab": 64}}


def assert_speculative_greedy_is_lossless(family, source, draft, k, settings):
    model, tok = load_fixture(family, source)
    prompt = reference(family)["prompt_ids"][0].tolist()
    responses = list(
        mlx_hybrid.stream_generate(
            model, tok, prompt, max_tokens=128, draft=draft, num_draft_tokens=k, **DRAFT_SETTINGS[settings]
        )
    )
    assert [r.token for r in responses] == plain_greedy(family, source)
    assert responses[-1].tokens_per_pass >= 1.0 and responses[-1].acceptance_rate is not None


@pytest.mark.parametrize("family", QWEN_FAMILIES)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("settings", sorted(DRAFT_SETTINGS))
def test_mtp_speculative_greedy_is_lossless(family, source, k, settings):
    assert_speculative_greedy_is_lossless(family, source, "mtp", k, settings)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("settings", sorted(DRAFT_SETTINGS))
def test_ngram_speculative_greedy_is_lossless(family, source, k, settings):
    """Prompt lookup drafts for every family, Kimi Linear included."""
    assert_speculative_greedy_is_lossless(family, source, "ngram", k, settings)


@pytest.mark.parametrize(
    "family, source",
    [("qwen35", "hf"), ("qwen35", "model-Q4_K_M.gguf"), ("qwen35moe", "model-Q4_K_M.gguf"), ("kimilinear", "hf")],
)
def test_a_verify_pass_of_16_tokens_gives_each_its_decode_steps_logits(family, source):
    """1 + 15 drafts through the trunk at once (every product, expert, attention and recurrent
    layer over 16 rows) give each token the logits its own decode step gives it, to the bit: greedy
    speculation with up to 15 drafts reproduces plain decoding (float32 and quantized weights)."""
    model, _ = load_fixture(family, source)
    ids = reference(family)["input_ids"][0].tolist()
    prompt, tokens = ids[:24], ids[24:40]
    caches = model.make_cache(), model.make_cache()
    for cache in caches:
        prefill(model, prompt, cache)
    together = model(mx.array([tokens]), caches[0])[0]
    alone = mx.concatenate([model(mx.array([[token]]), caches[1])[0] for token in tokens])
    assert np.array_equal(np.array(together), np.array(alone))


@pytest.mark.parametrize("family", QWEN_FAMILIES)
@pytest.mark.parametrize("acceptance", [0.25, 0.5, 1.0])
def test_oracle_drafts_are_lossless_through_many_accepts(family, acceptance):
    """Rounds that accept several drafts (the random fixtures' own MTP heads rarely agree)."""
    model, tok = load_fixture(family, "model.gguf")
    prompt = reference(family)["prompt_ids"][0].tolist()
    plain = plain_greedy(family, "model.gguf")
    drafter = OracleDrafter(plain, acceptance, model.args.vocab_size, inner=MTPDrafter(model))
    tokens, stats = decode_with(model, prompt, drafter, 4, len(plain))
    assert tokens == plain
    assert stats.acceptance_rate == pytest.approx(acceptance, abs=0.02)
    # a full round of 4 drafts has exactly 4 * acceptance correct ones, then a wrong one (only
    # the last rounds, cut short by the length, differ)
    correct = round(4 * acceptance)
    want = [1.0] * correct + [0.0] * (4 - correct)
    assert stats.acceptance_by_position == pytest.approx(want, abs=0.05)


def _feed_pending(mtp: MTPDrafter):
    """Bring the MTP head's cache up to date: feed it the (state, next token) pairs it holds
    back until its next draft."""
    mtp._step_from_trunk(mtp.pending_hidden, mx.array(mtp.pending_next)[None], mtp.cache)


def _layer_arrays(cache):
    arrays = []
    for c in cache:
        arrays += list(c.state)
    return arrays


@pytest.mark.parametrize("family", QWEN_FAMILIES)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_rollback_leaves_the_cache_of_plain_decoding(family, k):
    model, _ = load_fixture(family, "hf")
    prompt = reference(family)["prompt_ids"][0].tolist()
    greedy = plain_greedy(family, "hf")
    for a in range(k + 1):
        mtp = MTPDrafter(model)
        engine = one_row_engine(model, k)
        drafter = OracleDrafter(greedy, a / k, model.args.vocab_size, inner=mtp)
        sequence = engine.submit(prompt, len(greedy), drafter=drafter, stop_tokens=())
        engine.step()  # the prompt, and the first token
        assert sequence.tokens == greedy[:1]
        engine.step()  # one round: k drafts, a of them accepted, then the model's own token
        assert sequence.tokens == greedy[: a + 2]
        cache = engine.rows[0].cache

        # plain decoding of the same tokens: prefill, then one token at a time
        plain = model.make_cache()
        prefill(model, prompt, plain)
        for token in greedy[: a + 1]:
            model(mx.array([[token]]), cache=plain)
        for got, want in zip(_layer_arrays(cache), _layer_arrays(plain)):
            assert got.shape == want.shape
            assert_close_to_floor(got, want)  # a verify pass of a + 1 rows against single steps

        # the MTP cache, brought up to date, equals teacher-forced MTP over the sequence: one
        # pass of many rows against steps of a few sums in other orders (other BLAS kernels).
        # Measured for entries up to 4: 3.5e-5 (OpenBLAS, AVX2), 1.25e-4 (AVX-512, reported
        # with pre-norm states), 0 (reference BLAS): within the float32 floor
        _feed_pending(mtp)
        sequence = prompt + greedy[: a + 1]
        hidden = model.mtp_input(model.hidden_states(mx.array([sequence])))
        forced = KVCache()
        model.mtp(hidden, model.embed_tokens(mx.array([sequence[1:] + [greedy[a + 1]]])), forced)
        for got, want in zip(mtp.cache.state, forced.state):
            assert_close_to_floor(got, want)

        next_token = mx.array([[greedy[a + 1]]])
        assert_close_to_floor(model(next_token, cache=cache), model(next_token, cache=plain))


def test_draft_model_is_lossless():
    """The dense fixture drafting for the MoE one (same tokenizer), both hybrid."""
    target, tok = load_fixture("qwen35moe", "model.gguf")
    draft, _ = load_fixture("qwen35", "model.gguf")
    prompt = reference("qwen35moe")["prompt_ids"][0].tolist()
    for k in (1, 3):
        responses = list(
            mlx_hybrid.stream_generate(target, tok, prompt, max_tokens=128, draft_model=draft, num_draft_tokens=k)
        )
        assert [r.token for r in responses] == plain_greedy("qwen35moe", "model.gguf")


def test_draft_model_rolls_back_after_accepts():
    """A model drafting for itself accepts everything: exercises keeping drafts in its cache."""
    model, tok = load_fixture("qwen3next", "hf")
    prompt = reference("qwen3next")["prompt_ids"][0].tolist()
    responses = list(
        mlx_hybrid.stream_generate(
            model, tok, prompt, max_tokens=64, draft_model=model, num_draft_tokens=3, draft_vocab=0, draft_p_min=0
        )
    )
    assert [r.token for r in responses] == plain_greedy("qwen3next", "hf")[:64]
    assert responses[-1].acceptance_rate == 1.0 and responses[-1].tokens_per_pass > 3.5


@pytest.mark.parametrize("head_source", ["hf", "model.gguf"])
def test_a_head_from_the_original_checkpoint_drafts_as_the_original(head_source, tmp_path):
    """A checkpoint that lost its MTP head (as mlx-lm's conversions do), given the head from the one it
    came from (`load(..., mtp=)`, the HF directory or the GGUF file): the original's tokens with MTP
    drafting, at the original's acceptance, having read only the head's tensors of it."""
    target = tmp_path / "headless"
    shutil.copytree(FIXTURES / "qwen35" / "hf", target)
    tensors = {k: v for k, v in mx.load(str(target / "model.safetensors")).items() if not k.startswith("mtp.")}
    mx.save_safetensors(str(target / "model.safetensors"), tensors)
    model, tok = mlx_hybrid.load(target, dtype="float32", mtp=FIXTURES / "qwen35" / head_source)
    original, _ = mlx_hybrid.load(FIXTURES / "qwen35" / "hf", dtype="float32")
    prompt = reference("qwen35")["prompt_ids"][0].tolist()

    def drafted(m):
        responses = list(mlx_hybrid.stream_generate(m, tok, prompt, max_tokens=24, draft="mtp", draft_p_min=0.0))
        return [r.token for r in responses], responses[-1].acceptance_rate

    assert model.has_mtp and drafted(model) == drafted(original)


def test_a_head_for_another_model_is_refused(tmp_path):
    """A head of another shape or family, a checkpoint without one, a model with its own: one clear error."""
    headless = tmp_path / "headless"
    shutil.copytree(FIXTURES / "qwen35" / "hf", headless)
    tensors = {k: v for k, v in mx.load(str(headless / "model.safetensors")).items() if not k.startswith("mtp.")}
    mx.save_safetensors(str(headless / "model.safetensors"), tensors)
    cases = {
        FIXTURES / "qwen35moe" / "hf": "for another model: model_type 'qwen3_5_moe'",
        FIXTURES / "kimilinear" / "hf": "has no MTP head",
        tmp_path / "missing": "no such file or directory",
    }
    for source, message in cases.items():
        with pytest.raises(mlx_hybrid.ModelLoadError, match=message):
            mlx_hybrid.load(headless, dtype="float32", mtp=source)
    with pytest.raises(mlx_hybrid.ModelLoadError, match="has an MTP head of its own"):
        mlx_hybrid.load(FIXTURES / "qwen35" / "hf", dtype="float32", mtp=FIXTURES / "qwen35" / "hf")


def gguf_without_block(source: Path, target: Path, block: int):
    """A copy of a GGUF file, its metadata as it was, less the tensors of one block."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for tensor in reader.tensors:
        if not tensor.name.startswith(f"blk.{block}."):
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@pytest.mark.parametrize("source", ["hf", "model.gguf"])
def test_model_without_mtp_tensors_loads_and_says_so(source, tmp_path):
    """A checkpoint whose config (or GGUF metadata: its nextn block) names an MTP head it does not
    hold: the model without it, as it computes, and a clear error where MTP is asked for."""
    if source == "hf":
        target = tmp_path / "hf"
        shutil.copytree(FIXTURES / "qwen35" / "hf", target)
        tensors = {k: v for k, v in mx.load(str(target / "model.safetensors")).items() if not k.startswith("mtp.")}
        mx.save_safetensors(str(target / "model.safetensors"), tensors)
    else:  # the fixture's 4 layers, then the MTP block
        target = gguf_without_block(FIXTURES / "qwen35" / "model.gguf", tmp_path / "model.gguf", 4)
    model, tok = mlx_hybrid.load(target, dtype="float32")  # float32 on a GPU too, for the reference's tolerance
    assert not model.has_mtp
    ref = reference("qwen35")
    np.testing.assert_allclose(np.array(model(mx.array(ref["input_ids"]))), ref["logits"], atol=REFERENCE_TOL, rtol=0)
    with pytest.raises(mlx_hybrid.GenerationError, match="no MTP head"):
        mlx_hybrid.generate(model, tok, "x", draft="mtp")


class UniformDrafter(Drafter):
    """A deliberately poor drafter: uniform over a few tokens, with its distribution."""

    def __init__(self, pool, vocab_size, seed=0):
        self.pool = mx.array(pool)
        in_pool = (mx.arange(vocab_size)[:, None] == self.pool[None]).any(axis=1)
        self.logprobs = mx.where(in_pool, -np.log(len(pool)), -mx.inf)
        self.key = mx.random.key(seed)

    def prefill(self, *args):
        pass

    def begin(self, *args):
        pass

    def draft(self, k, sampler):
        self.key, key = mx.random.split(self.key)
        picks = mx.random.randint(0, self.pool.size, (k,), key=key)
        return [self.pool[i] for i in picks.tolist()], [self.logprobs] * k

    def update(self, *args):
        pass


def _exact_distribution(model, prompt, sampler, depth, processing=None):
    """P(x_P, ..., x_{P+depth-1}) under the sampler (after the processors' reference formulas),
    by enumerating the support."""
    table = {}

    def walk(prefix, prob):
        if len(prefix) == depth:
            table[tuple(prefix)] = prob
            return
        logits = model(mx.array([prompt + prefix]))[0, -1]
        if processing:
            logits = mx.array(reference_processing(np.array(logits), prompt, prefix, **processing))
        p = np.exp(np.array(sampler.log_probs(logits)))
        for token in np.nonzero(p > 0)[0]:
            walk(prefix + [int(token)], prob * p[token])

    walk([], 1.0)
    return table


@pytest.mark.parametrize(
    "drafter_kind, processed",
    [
        ("uniform", False),
        ("point-mass", False),
        pytest.param("uniform", True, id="processed"),
        ("dflash", False),
        ("dflash2", False),
    ],
)
def test_speculative_sampling_follows_the_target_distribution(drafter_kind, processed):
    """Sampled (x_P, x_P+1, x_P+2) with k=2 against the exact target law (with processors:
    the law of the processed logits, by the reference formulas).

    Bound: total variation below 0.05 over 3000 draws (its standard error here is
    about 0.02); the fixed seed makes the test deterministic.
    """
    model, _ = load_fixture("qwen35", "model.gguf")
    prompt = reference("qwen35")["prompt_ids"][0].tolist()
    settings = dict(temp=1.0, top_k=3)
    exact = _exact_distribution(model, prompt, Sampler(**settings), depth=3)
    if processed:
        # the likeliest first token pushed down, the prompt's last pushed up into the top 3,
        # where the repetition penalty (over the prompt) and, once drawn, the others act on it
        first = max(exact, key=exact.get)[0]
        processing = dict(
            logit_bias={first: -2.0, prompt[-1]: 4.0},
            presence_penalty=0.8,
            frequency_penalty=0.5,
            repetition_penalty=1.4,
            repetition_context_size=8,
        )
        unprocessed, exact = exact, _exact_distribution(model, prompt, Sampler(**settings), 3, processing)
        moved = sum(abs(exact.get(o, 0.0) - unprocessed.get(o, 0.0)) for o in exact.keys() | unprocessed.keys())
        assert moved > 0.5, moved  # the processors change the law
        settings |= processing
    # draws 50 rows at a time (each row's law is its own); later rows resume from the prompt's checkpoint
    rows = 50
    # DFlash2: its drafts drawn from the candidate selector's distribution over 4 candidates a position
    block_drafter = {"dflash": "qwen35-b8-l0-2", "dflash2": "qwen35-dflash2-k2-t4-b8-l0-2"}.get(drafter_kind)
    block_drafter = block_drafter and load_drafter(FIXTURES / "dflash" / block_drafter)
    engine = Engine(model, None, None, 2, max_batch=rows, prefix_store=PrefixStore(1 << 30))
    support = sorted({t for outcome in exact for t in outcome})
    counts = {}
    draws = 3000
    for start in range(0, draws, rows):
        sequences = []
        for i in range(start, start + rows):
            if drafter_kind == "uniform":
                drafter = UniformDrafter(support[:2] + [7], model.args.vocab_size, seed=i)
            elif block_drafter:  # its block's distributions, cut at p-min, resumed from checkpoints
                drafter = DFlashDrafter(model, block_drafter, draft_p_min=0.1)
            else:
                drafter = OracleDrafter([support[0]] * 4, 0.5, model.args.vocab_size, seed=i)
            # 4 tokens: the first, then a round of 2 drafts (the limit shortens no earlier round)
            params = SamplingParams(max_tokens=4, seed=i, stop_tokens=(), **settings)
            sequences.append(engine.submit(prompt, params=params, drafter=drafter, checkpoint_at=[len(prompt)]))
        engine.run()
        for sequence in sequences:
            outcome = tuple(sequence.tokens[:3])
            counts[outcome] = counts.get(outcome, 0) + 1
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(o, 0) / draws - p) for o, p in exact.items())
    print(f"total variation {tv:.4f}")
    assert tv < 0.05, tv


def test_kimi_has_no_mtp_but_drafts_with_a_draft_model():
    """KDA states roll back by snapshot and MLA latent caches by trimming, through the same loop."""
    model, tok = load_fixture("kimilinear", "hf")
    draft, _ = load_fixture("kimilinear", "model.gguf")
    assert not model.has_mtp
    prompt = reference("kimilinear")["prompt_ids"][0].tolist()
    for k in (1, 3):
        responses = list(
            mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=64, draft_model=draft, num_draft_tokens=k)
        )
        assert [r.token for r in responses] == plain_greedy("kimilinear", "hf", 64)


def test_snapshot_memory_does_not_grow_with_rounds():
    """Snapshot buffers are sized by k once: active memory does not grow from round to round."""
    model, _ = load_fixture("qwen35", "model.gguf")
    prompt = reference("qwen35")["prompt_ids"][0].tolist()
    greedy = plain_greedy("qwen35", "model.gguf")
    mtp = MTPDrafter(model)
    engine = one_row_engine(model, 4)
    # a quarter of the drafts right: rounds accept 0 to 4 of them (48 rounds take ~95 of the 128
    # tokens: the last rounds, which draft fewer, stay out of the measurement)
    drafter = OracleDrafter(greedy, 0.25, model.args.vocab_size, inner=mtp)
    engine.submit(prompt, len(greedy), drafter=drafter, stop_tokens=())
    engine.step()  # the prompt
    cache = engine.rows[0].cache
    gc.collect()  # arrays left by earlier tests must not be freed mid-measurement
    used = []
    for _ in range(48):
        engine.step()
        # what the next round reads: every layer's cache and the MTP head's
        mx.eval(_layer_arrays(cache), mtp.cache.arrays, mtp.pending_hidden)
        used.append(mx.get_active_memory())
    assert engine.rows, "the sequence ended before the last round measured"
    # Compare the floors of an early and a late window of rounds. Above its floor a round's
    # active memory varies by up to ~10 KB from run to run (measured here, with and without
    # the CPU kernels): MLX's CPU stream decides whether an op reuses its input's buffer
    # while queued work may still hold that buffer, so which buffers outlive a round is a
    # matter of timing. The floor recurs every few rounds; measured floors moved by -1.5 to
    # +2 KB (a logits row over this fixture's 512-token vocabulary outliving its round or not). A leak
    # raises it: one fixture hidden row (256 bytes) a round by ~7.8 KB across the ~30 rounds
    # between the windows (tried), a round's snapshots (~60 KB) by far more.
    assert min(used[-16:]) - min(used[4:20]) < 4096, used


def test_adaptive_drafting_backs_off_after_misses_and_keeps_k_while_accepting():
    """Misses cost little; rounds that accept keep drafting k."""
    model, _ = load_fixture("qwen35", "model.gguf")
    prompt = reference("qwen35")["prompt_ids"][0].tolist()
    plain = plain_greedy("qwen35", "model.gguf")
    V = model.args.vocab_size
    # every draft wrong: after 3 misses, plain rounds (1, 2, 4, ... 64) between tries, so
    # over 128 tokens 9 rounds draft
    tokens, stats = decode_with(model, prompt, OracleDrafter(plain, 0.0, V), 4, len(plain), adaptive=True)
    assert tokens == plain
    assert stats.accepted == 0 and stats.drafted <= 4 * 9, stats
    fixed_tokens, fixed = decode_with(model, prompt, OracleDrafter(plain, 0.0, V), 4, len(plain), adaptive=False)
    assert fixed_tokens == plain and fixed.drafted >= 4 * (len(plain) - 8), fixed
    # every draft right: the length stays at k
    tokens, stats = decode_with(model, prompt, OracleDrafter(plain, 1.0, V), 4, len(plain), adaptive=True)
    assert tokens == plain and stats.tokens_per_pass > 4.5, stats


def test_a_row_whose_drafts_keep_missing_steps_ahead_as_plain_decoding_does(monkeypatch):
    """Once a row's policy has backed off (drafts that never land: an oracle at 0%), its plain rounds
    are queued a step ahead as plain decoding's are (`Engine._overlapped_pass`), and the round after
    them drafts again. Its tokens are plain decoding's, beside a row without a drafter too; sampling,
    it draws the tokens it draws stepping in turn."""
    from mlx_hybrid.loaders import BUNDLED_MODEL

    model, tokenizer = mlx_hybrid.load(BUNDLED_MODEL)
    prompts = [tokenizer.encode("def parse_args("), tokenizer.encode("import os\n")]

    def decode(drafters, overlap=True, temp=0.0):
        engine = Engine(model, tokenizer, None, 3, adaptive=True, overlap=overlap, prefix_store=PrefixStore(0))
        sequences = [
            engine.submit(p, 48, drafter=d, stop_tokens=(), temp=temp, seed=7) for p, d in zip(prompts, drafters)
        ]
        engine.run()
        return sequences

    plain = [s.tokens for s in decode([None, None])]
    overlapped = []
    step_ahead = Engine._overlapped_pass
    monkeypatch.setattr(Engine, "_overlapped_pass", lambda engine: overlapped.append(1) or step_ahead(engine))
    missing, beside = decode([OracleDrafter(plain[0], 0.0, model.args.vocab_size), None])
    assert missing.tokens == plain[0] and beside.tokens == plain[1]
    # 48 tokens: rounds 1-3, 5, 8, 13, 22 and 39 draft, the 40 others step plainly, most of them ahead
    assert missing.stats.drafted == 3 * 8 and missing.stats.accepted == 0, missing.stats
    assert len(overlapped) >= 30, len(overlapped)
    # sampling rows draw the same tokens stepping ahead as stepping in turn
    ahead, in_turn = (
        decode([OracleDrafter(plain[0], 0.0, model.args.vocab_size), None], overlap, temp=0.8)
        for overlap in (True, False)
    )
    assert [s.tokens for s in ahead] == [s.tokens for s in in_turn]


def test_p_min_stops_drafting_below_the_confidence():
    """p-min 1 never drafts (no distribution is a point mass); p-min 0 always drafts k."""
    model, tok = load_fixture("qwen35", "hf")
    prompt = reference("qwen35")["prompt_ids"][0].tolist()
    plain = plain_greedy("qwen35", "hf")
    never, never_stats = decode_with(model, prompt, MTPDrafter(model, draft_p_min=1.0), 3, len(plain), adaptive=True)
    always, always_stats = decode_with(model, prompt, MTPDrafter(model, draft_p_min=0.0), 3, len(plain), adaptive=False)
    assert never == always == plain
    assert never_stats.drafted == 0 and always_stats.drafted >= 3 * (always_stats.passes - 2)  # the last: shorter


@pytest.mark.parametrize("verdicts_first", [False, True])
def test_mtp_drafting_stops_at_the_first_unsure_draft_where_verdicts_are_read_first(verdicts_first, monkeypatch):
    """Drafting in lockstep runs the head k times a round whatever the verdicts (the verify pass cuts
    the drafts); where the engine reads the verdicts before verifying, a row stops drafting at its
    first unsure draft, so a round whose drafts keep missing costs one head step. Either way the
    tokens are plain decoding's. A p-min of 0.8 leaves the bundled model's head unsure about as often
    as not."""
    from mlx_hybrid.loaders import BUNDLED_MODEL

    model, tokenizer = mlx_hybrid.load(BUNDLED_MODEL)
    fed = []
    feed = MTPDrafter._feed
    monkeypatch.setattr(
        MTPDrafter, "_feed", staticmethod(lambda drafters, tokens: fed.append(1) or feed(drafters, tokens))
    )
    drafter = MTPDrafter(model, draft_p_min=0.8)
    engine = Engine(model, tokenizer, drafter, 3, adaptive=False, prefix_store=PrefixStore(0))  # every round drafts
    engine.verdicts_first = verdicts_first  # (the model's size decides it: both ways here)
    sequence = engine.submit("def parse_args(", max_tokens=60)
    while any(row.prefilling for row in engine.rows) or not engine.rows:
        engine.step()
    passes = []  # (sure drafts verified, head steps fed a draft) of each pass
    while engine.rows:
        fed.clear()
        drafted = sequence.stats.drafted
        engine.step()
        passes.append((sequence.stats.drafted - drafted, len(fed)))
    if verdicts_first:
        assert all(feeds <= drafted for drafted, feeds in passes), passes  # a draft is fed only if sure
    else:
        assert any(feeds > drafted for drafted, feeds in passes), passes  # the lockstep ran past unsure drafts
    assert any(drafted == 0 for drafted, _ in passes) and any(drafted > 0 for drafted, _ in passes), passes
    plain = mlx_hybrid.stream_generate(model, tokenizer, "def parse_args(", max_tokens=60, draft=None)
    assert sequence.tokens == [response.token for response in plain]


def _latest_continuation(history, k, sizes=(4, 3, 2)):
    """What followed the latest earlier occurrence of the longest matching suffix, by scanning."""
    for n in sizes:
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


def test_ngram_drafter_proposes_what_followed_the_latest_occurrence():
    rng = np.random.default_rng(0)
    block = rng.integers(0, 50, 40).tolist()
    drafter = NgramDrafter()
    history = block + [7, 7, 7] + block[:6]  # the block quoted, then its start again
    drafter.start(history[:-1], None, history[-1])
    drafted, logprobs = drafter.draft(4, Sampler(0.0))
    assert [int(t) for t in drafted] == block[6:10] == _latest_continuation(history, 4)
    assert logprobs == [None] * 4  # point masses
    # as tokens are accepted it keeps following the block; a fresh random history agrees with the scan
    drafter.update(None, block[6:8])
    history += block[6:8]
    assert [int(t) for t in drafter.draft(4, Sampler(0.0))[0]] == block[8:12]
    for seed in range(20):
        history = np.random.default_rng(seed).integers(0, 6, 60).tolist()
        drafter = drafter.fork()  # a fresh sequence
        drafter.start(history[:-1], None, history[-1])
        assert [int(t) for t in drafter.draft(3, Sampler(0.0))[0]] == _latest_continuation(history, 3), seed


@pytest.mark.parametrize(
    "rows, temp, verdicts_first", [(1, 0.0, False), (3, 0.0, False), (3, 0.8, False), (3, 0.0, True)]
)
def test_an_mtp_pass_with_the_default_p_min_reads_the_device_once(rows, temp, verdicts_first):
    """With the default p-min where drafts stop below one (`DEFAULT_DRAFT_P_MIN`, named here: the
    bundled model's own default is none). The bundled model's head drafts confidently, so deciding
    p-min while drafting read the device after every draft (7 reads a pass at k=3), and sampling rows
    read it again for every draft's acceptance test; the verdicts and the speculative sampling rule
    now stay on the device until the verify pass reads its tokens: one read a pass, whatever the
    rows. Where the engine reads the verdicts before it verifies (`ops.read_draft_verdicts_first`),
    drafting reads after each draft, to stop at the first unsure one, then the pass reads the drafts
    and its tokens: k + 2. Each row's tokens are those it gives alone, and greedy, those of plain
    decoding."""
    from benchmarks.engine_step import DeviceUse
    from mlx_hybrid.drafting import DEFAULT_DRAFT_P_MIN, make_drafter
    from mlx_hybrid.loaders import BUNDLED_MODEL

    model, tokenizer = mlx_hybrid.load(BUNDLED_MODEL)
    drafter = make_drafter(model, tokenizer, "mtp", draft_p_min=DEFAULT_DRAFT_P_MIN)
    engine = Engine(model, tokenizer, drafter, 3, prefix_store=PrefixStore(0))
    engine.verdicts_first = verdicts_first  # (the model's size decides it: both ways here)
    prompts = ["def parse_args(", "import os\n", "class Parser:"][:rows]
    sequences = [engine.submit(prompt, max_tokens=40, temp=temp, seed=i) for i, prompt in enumerate(prompts)]
    while any(row.prefilling for row in engine.rows) or not engine.rows:
        engine.step()
    reads = []
    while engine.rows:
        use = DeviceUse(graphs=False)
        with use.counting():
            engine.step()
        reads.append(use.waits)
    # a pass that drafts nothing reads once; reading verdicts first, one that drafts reads 1 to 3 times
    # while drafting (until its rows stop), then once for its drafts and once for its tokens
    assert set(reads) <= ({1, 3, 4, 5} if verdicts_first else {1}) and max(reads) == (5 if verdicts_first else 1)
    assert all(s.stats.drafted > 0 for s in sequences)
    for i, (prompt, sequence) in enumerate(zip(prompts, sequences)):
        alone = mlx_hybrid.stream_generate(
            model, tokenizer, prompt, max_tokens=40, temp=temp, seed=i, num_draft_tokens=3,
            draft_p_min=DEFAULT_DRAFT_P_MIN,
        )  # fmt: skip
        assert sequence.tokens == [response.token for response in alone]
        if temp == 0:
            plain = mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=40, draft=None)
            assert sequence.tokens == [response.token for response in plain]


@pytest.mark.parametrize("rows, adaptive, p_min", [(1, False, 0.5), (3, False, 0.5), (1, True, 0.95)])
def test_a_round_whose_first_step_is_taken_with_the_verify_pass_drafts_as_before(rows, adaptive, p_min, monkeypatch):
    """Where the engine takes the MTP head's first step of a greedy round while the verify pass before it
    computes (`ops.open_drafting_with_pass`: over every position verified, each with the token the pass
    chose there), each pass verifies the same drafts with the same p-min verdicts as where the round
    takes that step itself, and drafting runs one head step fewer a round. So do rounds after plain
    ones (a p-min of 0.95 leaves the head unsure often enough to back off), and a conversation's next
    turn, resumed from the checkpoint each row leaves."""
    from mlx_hybrid.engine import scheduler
    from mlx_hybrid.loaders import BUNDLED_MODEL

    model, tokenizer = mlx_hybrid.load(BUNDLED_MODEL)
    prompts = [tokenizer.encode(p) for p in ["def parse_args(", "import os\n", "class Parser:"][:rows]]
    drafting, head_steps, verified = [False], [], []
    step, build_batch, run_model = MTPDrafter._step, scheduler.build_batch, scheduler.run_model
    plain_round_ahead = scheduler.plain_round_ahead

    def counted_step(self, *args):
        head_steps[-1] += drafting[0]
        return step(self, *args)

    def drafts_built(*args, **kwargs):
        drafting[0] = True
        try:
            return build_batch(*args, **kwargs)
        finally:
            drafting[0] = False

    def pass_read(model, batch, *args):
        prompt = any(row.prefilling for row in batch.rows)
        verified[-1].append(("prompt" if prompt else "drafts" if batch.marked.size > len(batch.rows) else "plain",
                             batch.marked.tolist()))  # fmt: skip
        return run_model(model, batch, *args)

    def plain_ahead(*args):
        verified[-1].append(("plain", None))
        return plain_round_ahead(*args)

    monkeypatch.setattr(MTPDrafter, "_step", counted_step)
    monkeypatch.setattr(scheduler, "plain_round_ahead", plain_ahead)
    monkeypatch.setattr(scheduler, "build_batch", drafts_built)
    monkeypatch.setattr(scheduler, "run_model", pass_read)
    outputs = []
    for with_pass in (False, True):
        head_steps.append(0)
        verified.append([])
        engine = Engine(model, tokenizer, MTPDrafter(model, draft_p_min=p_min), 3, adaptive=adaptive,
                        prefix_store=PrefixStore(1 << 30))  # fmt: skip
        engine.open_drafting = with_pass  # (the model's size decides it: both ways here)
        first = [engine.submit(prompt, max_tokens=40) for prompt in prompts]
        engine.run()
        resumed = [
            engine.submit(p + s.tokens + tokenizer.encode("\n# next"), max_tokens=24) for p, s in zip(prompts, first)
        ]
        engine.run()
        assert all(s.cached_tokens > len(p) for p, s in zip(prompts, resumed))  # from the first turn's checkpoints
        outputs.append([s.tokens for s in first + resumed])
    assert verified[0] == verified[1] and outputs[0] == outputs[1]
    # a round whose rows all verified drafts in the pass before takes no head step to open while drafting
    kinds = [kind for kind, _ in verified[0]]
    opened_with_pass = sum(1 for before, now in zip(kinds, kinds[1:]) if before == now == "drafts")
    assert opened_with_pass > (0 if adaptive else 10) and head_steps[1] == head_steps[0] - opened_with_pass
    assert (("plain", "drafts") in set(zip(kinds, kinds[1:]))) == adaptive  # a round opened after plain ones


def test_the_mtp_head_drafts_two_a_round_by_default_where_each_verified_token_costs_its_arithmetic(monkeypatch):
    """The bundled model on the CPU: each product runs on one thread and computes rather than waits on its
    weights (`ops.verified_tokens_cost_arithmetic`), so the MTP head asks for 2 drafts a round unless the
    request names a number; where products run on every core (the bound moved below the model's), 3."""
    from mlx_hybrid.drafting import SpeculationSettings
    from mlx_hybrid.loaders import BUNDLED_MODEL
    from mlx_hybrid.ops import schedule

    model, tokenizer = mlx_hybrid.load(BUNDLED_MODEL)
    settings, named = SpeculationSettings(), SpeculationSettings(num_draft_tokens=3)
    assert settings.draft_tokens_for(settings.drafter(model, tokenizer)) == 2
    assert named.draft_tokens_for(named.drafter(model, tokenizer)) == 3
    for k, options in ((2, {}), (3, {"num_draft_tokens": 3})):
        *_, last = mlx_hybrid.stream_generate(model, tokenizer, "def parse_args(", max_tokens=40, **options)
        assert len(last.acceptance_by_position) == k
    monkeypatch.setattr(schedule, "ONE_THREAD_WEIGHTS", 1)
    assert settings.draft_tokens_for(settings.drafter(model, tokenizer)) == 3


def test_drafts_are_not_cut_below_p_min_by_default_where_the_pass_verifies_every_draft(monkeypatch):
    """The bundled model on the CPU: its verify passes verify every draft whatever its p-min verdict
    (`ops.drafts_stop_below_p_min`), so by default no floor cuts drafts the pass would accept; rows still
    back off after misses, and a p-min the request names is kept. Where products run on every core (the
    bound moved below the model's), the default floor is back."""
    from mlx_hybrid.drafting import DEFAULT_DRAFT_P_MIN, SpeculationSettings
    from mlx_hybrid.loaders import BUNDLED_MODEL
    from mlx_hybrid.ops import schedule

    model, tokenizer = mlx_hybrid.load(BUNDLED_MODEL)
    default, floored, exact = (
        SpeculationSettings(),
        SpeculationSettings(draft_p_min=0.5),
        SpeculationSettings(draft_p_min=0),
    )
    assert default.drafter(model, tokenizer).draft_p_min == 0 and default.adaptive
    assert floored.drafter(model, tokenizer).draft_p_min == 0.5 and floored.adaptive and not exact.adaptive
    prompt, n = "def parse_args(", 64
    plain = [r.token for r in mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=n, draft=None)]
    runs = [
        list(mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=n, **o))
        for o in ({}, {"draft_p_min": 0.5})
    ]
    assert all([r.token for r in run] == plain for run in runs)
    # a floor of 0.5 leaves the head unsure often enough to cut drafts the pass accepted without it
    assert runs[0][-1].tokens_per_pass > runs[1][-1].tokens_per_pass
    monkeypatch.setattr(schedule, "ONE_THREAD_WEIGHTS", 1)
    assert default.drafter(model, tokenizer).draft_p_min == DEFAULT_DRAFT_P_MIN
