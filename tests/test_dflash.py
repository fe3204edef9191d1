"""DFlash block drafters (`models/dflash.py`) against z-lab's reference (`dflash` 0.1.0 on transformers,
float32): tiny drafters in z-lab's layout for the fixture targets (DFlash and DFlash2, some with a
sliding-window layer whose window the prompt already exceeds), three greedy rounds each
(`tests/fixtures/dflash/make_dflash_refs.py`): given the transformers target's hidden states at the
drafter's layer ids, our block logits through our target's head equal the reference's at the float32
floor, and our drafts (DFlash2's: the candidate selector's path) are the reference's, round after round
(the drafter's cache keeping the context and dropping each block)."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, assert_close_to_floor, load_fixture
from test_hub import add_to_cache, offline_hub  # noqa: F401  (a fixture)

import mlx_hybrid
from mlx_hybrid.drafting import make_drafter
from mlx_hybrid.engine import Engine, PrefixStore
from mlx_hybrid.errors import GenerationError, ModelLoadError
from mlx_hybrid.models.dflash import load_drafter

DRAFTERS = sorted(path for path in (FIXTURES / "dflash").iterdir() if path.is_dir())


@pytest.mark.parametrize("drafter_dir", DRAFTERS, ids=[path.name for path in DRAFTERS])
@pytest.mark.parametrize("source", ["hf", "model.gguf"])
def test_block_logits_equal_the_reference_round_after_round(drafter_dir, source):
    family = drafter_dir.name.split("-")[0]
    target, _ = load_fixture(family, source)
    drafter = load_drafter(drafter_dir)
    refs = np.load(drafter_dir / "refs.npz")
    cache = drafter.make_cache()
    for r in range(3):
        block = mx.array(refs[f"block_{r}"])[None]
        hidden = drafter.block_hidden(target.embed(block), mx.array(refs[f"context_{r}"]), cache)
        for layer_cache, layer in zip(cache, drafter.layers):
            # the context up to the block, no block entries; a sliding layer's, fewer than twice its window
            window = layer.self_attn.window
            assert layer_cache.rotary_span(1) == int(refs[f"start_{r}"])
            assert layer_cache.offset == int(refs[f"start_{r}"]) if window is None else layer_cache.offset < 2 * window
        assert_close_to_floor(drafter.block_logits(hidden, target.project)[0], refs[f"logits_{r}"])


@pytest.mark.parametrize("drafter_dir", DRAFTERS, ids=[path.name for path in DRAFTERS])
@pytest.mark.parametrize("source", ["hf", "model.gguf"])
def test_drafts_are_the_references_round_after_round(drafter_dir, source):
    """The drafting side (`drafting.DFlashDrafter`, greedy, over the whole vocabulary, on the HF and the
    GGUF target) fed each round's context and last token: its drafts are the reference's (DFlash2: the candidate selector's path, which
    the fixtures' drafters make differ from the argmax at 20-60% of the drafts)."""
    from mlx_hybrid.drafting.base import StateSpan
    from mlx_hybrid.sampling import Sampler

    family = drafter_dir.name.split("-")[0]
    target, tokenizer = load_fixture(family, source)
    model = load_drafter(drafter_dir)
    drafter = make_drafter(target, tokenizer, "dflash", model, draft_vocab=0, draft_p_min=0)
    refs = np.load(drafter_dir / "refs.npz")
    for r in range(3):
        context = mx.array(refs[f"context_{r}"])
        drafter.pending = [StateSpan(context, 0, context.shape[1])]
        drafter.begin(int(refs[f"block_{r}"][0]))
        drafts, _ = drafter.draft(model.args.block_size - 1, Sampler())
        assert [int(d.item()) for d in drafts] == refs[f"drafts_{r}"].tolist(), r


@pytest.mark.parametrize("drafter_name", ["qwen35-b16-l1", "qwen35-b8-s6-l0-2", "qwen35-dflash2-k4-t16-b16-s6-l1"])
def test_a_round_that_asks_for_fewer_drafts_drafts_a_block_that_long(drafter_name):
    """A round asking for k drafts (fewer than the block's) drafts a block of the last token and k masks:
    its drafts are the drafter's over that block alone, read from the context afresh (the model's pass
    with no cache; DFlash2: the candidate selector's path), and its full-attention layers' caches keep
    the context only. Tokens compared exactly: both sides run the same products over the same block."""
    from mlx_hybrid.drafting.base import StateSpan
    from mlx_hybrid.sampling import Sampler

    target, tokenizer = load_fixture("qwen35", "hf")
    model = load_drafter(FIXTURES / "dflash" / drafter_name)
    refs = np.load(FIXTURES / "dflash" / drafter_name / "refs.npz")
    context, token = mx.array(refs["context_0"]), int(refs["block_0"][0])
    for k in (1, 3, model.args.block_size - 2):
        drafter = make_drafter(target, tokenizer, "dflash", model, draft_vocab=0, draft_p_min=0)
        drafter.pending = [StateSpan(context, 0, context.shape[1])]
        drafter.begin(token)
        drafts, _ = drafter.draft(k, Sampler())
        block = mx.array([[token] + [model.args.mask_token_id] * k])
        hidden = model.block_hidden(target.embed(block), context, None)
        logits = model.block_logits(hidden, target.project)
        if model.args.dflash2:
            selector = model.candidate_selector
            unary, index = selector.candidates(logits.astype(mx.float32))
            expected, *_ = selector.greedy_path(
                unary, index, mx.array([token], dtype=mx.int32), selector.hidden_projection(hidden[:, 1:])
            )
            expected = expected[0]
        else:
            expected = mx.argmax(logits[0], axis=-1)
        assert [int(d.item()) for d in drafts] == expected.tolist(), k
        full = [c for c, layer in zip(drafter.cache, model.layers) if layer.self_attn.window is None]
        assert [c.offset for c in full] == [context.shape[1]] * len(full)


@pytest.mark.parametrize("drafter_dir", DRAFTERS, ids=[path.name for path in DRAFTERS])
@pytest.mark.parametrize("source", ["hf", "model.gguf"])
def test_the_target_hands_the_drafter_the_states_transformers_gives(drafter_dir, source):
    """Our target's pass over the prompt, its layers' outputs tapped: the drafter's context features
    equal those of the transformers target at the float32 floor (its hidden_states[id + 1])."""
    family = drafter_dir.name.split("-")[0]
    target, _ = load_fixture(family, source)
    refs, layer_ids = np.load(drafter_dir / "refs.npz"), load_drafter(drafter_dir).args.target_layer_ids
    taps = dict.fromkeys(layer_ids)
    target.hidden_states(mx.array(refs["prompt_ids"]), target.make_cache(), taps=taps)
    assert_close_to_floor(target.states_at(taps, layer_ids), refs["context_0"])


def test_a_drafter_config_it_cannot_compute_is_refused_by_name(tmp_path):
    source = DRAFTERS[0]
    for change, message in [
        ({"architectures": ["DFlash2DraftModel"]}, "lacks conv_kernel_size, conv_group_size, selector_rank, selector"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "not a DFlash drafter"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, "not one of full_attention or sliding_attention"),
        ({"layer_types": ["full_attention"]}, "for each of its 2 layers"),
        ({"dflash_config": {"block_size": 8}}, "lacks target_layer_ids, mask_token_id"),
        (
            {
                "architectures": ["DFlash2DraftModel"],
                "dflash_config": {
                    "block_size": 8,
                    "target_layer_ids": [0],
                    "mask_token_id": 1,
                    "conv_kernel_size": 2,
                    "conv_group_size": 24,
                    "selector_rank": 4,
                    "selector_top_k": 4,
                },
            },
            "conv_group_size 24 does not divide",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope scaling 'yarn'"),
    ]:
        shutil.copytree(source, tmp_path / "d", dirs_exist_ok=True)
        config = json.loads((source / "config.json").read_text()) | change
        (tmp_path / "d" / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelLoadError, match=message):
            load_drafter(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text((source / "config.json").read_text())
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no safetensors"):
        load_drafter(tmp_path / "d")


@pytest.mark.parametrize("drafter_dir", DRAFTERS, ids=[path.name for path in DRAFTERS])
def test_greedy_dflash_speculation_gives_plain_decoding_in_a_batch(drafter_dir):
    """Three prompts decoded together, each round a full block of drafts verified (random drafters:
    mostly rejected, each pass rolled back by snapshot): every row's tokens are its plain greedy
    decoding alone, the drafter fed the target's states at its layers from the prompt chunks and the
    verify passes."""
    family = drafter_dir.name.split("-")[0]
    target, tokenizer = load_fixture(family, "hf")
    model = load_drafter(drafter_dir)
    drafter = make_drafter(target, tokenizer, "dflash", model)
    engine = Engine(
        target,
        tokenizer,
        drafter,
        model.args.block_size - 1,
        adaptive=False,
        prefix_store=PrefixStore(0),
        prefill_chunk=16,
    )
    prompts = [[5, 9, 14] * 7, [300, 2, 77], list(range(40, 80))]
    sequences = [engine.submit(prompt, max_tokens=20, stop_tokens=[]) for prompt in prompts]
    engine.run()
    for prompt, sequence in zip(prompts, sequences):
        plain = mlx_hybrid.stream_generate(target, tokenizer, prompt, max_tokens=20, draft=None, stop_tokens=[])
        assert sequence.tokens == [response.token for response in plain]
        assert sequence.stats.drafted > 0


@pytest.mark.parametrize("drafter_name", ["qwen35-b16-l1", "qwen35-dflash2-k4-t16-b16-s6-l1"])
def test_the_api_drafts_a_block_by_default_and_keeps_a_grammar_and_a_quantized_cache(drafter_name):
    """stream_generate(draft="dflash", draft_model=): the block less one drafts a round by default (at
    most 7 where each token verified costs its arithmetic); with a JSON schema and with the attention
    layers' cache in 8 bits, the tokens those settings give without speculation (a DFlash drafter; a
    DFlash2 one with a sliding layer)."""
    from mlx_hybrid.loaders import load_draft_model

    target, tokenizer = load_fixture("qwen35", "model.gguf")
    drafter = load_draft_model(FIXTURES / "dflash" / drafter_name)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for settings in [
        {},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        {"kv_bits": 8, "kv_group_size": 32},
    ]:
        plain = mlx_hybrid.stream_generate(target, tokenizer, "def f(", max_tokens=24, draft=None, **settings)
        spec = list(
            mlx_hybrid.stream_generate(
                target,
                tokenizer,
                "def f(",
                max_tokens=24,
                draft="dflash",
                draft_model=drafter,
                draft_p_min=0,
                **settings,
            )
        )
        assert [r.token for r in spec] == [r.token for r in plain], settings
    engine = Engine.speculating(target, tokenizer, mlx_hybrid.drafting.SpeculationSettings("dflash", drafter))
    # the block less one, at most 7 where each token verified costs its arithmetic (this fixture, on the CPU)
    whole = drafter.args.block_size - 1
    fewer = mlx_hybrid.ops.verified_tokens_cost_arithmetic(target.widest_product)
    assert engine.num_draft_tokens == (min(whole, 7) if fewer else whole)
    # over a reduced vocabulary (the target's head's first rows by the tokenizer's ranking): still plain decoding
    plain = mlx_hybrid.stream_generate(target, tokenizer, "def f(", max_tokens=24, draft=None)
    reduced = mlx_hybrid.stream_generate(
        target, tokenizer, "def f(", max_tokens=24, draft="dflash", draft_model=drafter, draft_vocab=64, draft_p_min=0
    )
    assert [r.token for r in reduced] == [r.token for r in plain]


def test_more_drafts_a_round_than_the_block_holds_are_refused_by_name():
    """num_draft_tokens past a DFlash drafter's block less one: one error naming both counts, before any
    generation (a block longer than the drafter was trained on is not drafted), the engine's drafter
    and a request's own alike."""
    from mlx_hybrid.drafting.dflash import DFlashDrafter
    from mlx_hybrid.engine import Engine
    from mlx_hybrid.loaders import load_draft_model

    target, tokenizer = load_fixture("qwen35", "hf")
    drafter = load_draft_model(FIXTURES / "dflash" / "qwen35-b8-l0-2")  # blocks of 8
    with pytest.raises(GenerationError, match="num_draft_tokens must be at most 7 with this drafter.*got 8"):
        mlx_hybrid.generate(target, tokenizer, "def f(", max_tokens=8, draft_model=drafter, num_draft_tokens=8)
    assert mlx_hybrid.generate(target, tokenizer, "def f(", max_tokens=8, draft_model=drafter, num_draft_tokens=7)
    engine = Engine(target, tokenizer, num_draft_tokens=8)
    with pytest.raises(GenerationError, match="num_draft_tokens must be at most 7 with this drafter.*got 8"):
        engine.submit("def f(", 8, drafter=DFlashDrafter(target, drafter))


def test_a_drafter_for_another_target_is_refused_naming_what_differs():
    target, tokenizer = load_fixture("kimilinear", "hf")  # hidden size 64 too, 4 layers
    model = load_drafter(DRAFTERS[0])
    model.args.target_layer_ids = [1, 7]
    with pytest.raises(GenerationError, match=r"reads target layers \[1, 7\], but the target has 4"):
        make_drafter(target, tokenizer, "dflash", model)
    model = load_drafter(DRAFTERS[0])
    model.args.hidden_size = 32
    with pytest.raises(GenerationError, match=r"hidden size \(32\) differs from the target's \(64\)"):
        make_drafter(target, tokenizer, "dflash", model)
    model = load_drafter(FIXTURES / "dflash" / "qwen35-dflash2-k2-t4-b8-l0-2")
    model.args.vocab_size = 256
    with pytest.raises(GenerationError, match=r"codebooks hold 256 tokens, fewer than the target's vocabulary \(512\)"):
        make_drafter(target, tokenizer, "dflash", model)
    with pytest.raises(GenerationError, match="needs draft_model="):
        make_drafter(target, tokenizer, "dflash")


@pytest.mark.parametrize("drafter_name", ["qwen35-b8-l0-2", "qwen35-dflash2-k4-t16-b16-s6-l1"])
def test_rows_drafting_together_draft_what_each_drafts_alone(drafter_name):
    """Three rows at other context lengths draft their blocks in one pass of the drafter (their caches
    one batch, each row's unread context gathered from the passes it came from): each row's block
    logits are those it gets alone, in the first round (empty caches, prompts of 21, 3 and 40) and the
    next two (new contexts of 3, 1 and 5 positions, then 2, 8 and 1), and its cache holds as many
    entries. The float32 floor: a row's products of more than 16 rows go through the BLAS's tiles, which
    round by the number of rows (the drafts are proposals: the verify pass keeps the tokens exact)."""
    from mlx_hybrid.drafting.base import StateSpan
    from mlx_hybrid.drafting.dflash import DFlashDrafter

    target, tokenizer = load_fixture("qwen35", "hf")
    model = load_drafter(FIXTURES / "dflash" / drafter_name)  # the second: a sliding layer of window 6
    prompts = [[5, 9, 14] * 7, [300, 2, 77], list(range(40, 80))]
    layers = tuple(model.args.target_layer_ids)

    def states(ids: list[int]) -> mx.array:  # the target's tapped states over ids, as a pass gives them
        taps = dict.fromkeys(layers)
        target.hidden_states(mx.array([ids]), taps=taps)
        return target.states_at(taps, layers)

    def started(prompt):
        drafter = make_drafter(target, tokenizer, "dflash", model)
        drafter.prefill(prompt, StateSpan(states(prompt), 0, len(prompt)))
        drafter.begin(prompt[-1])
        return drafter

    together, alone = [started(p) for p in prompts], [started(p) for p in prompts]
    for accepted_counts in [(3, 1, 5), (2, 8, 1), None]:
        logits = DFlashDrafter.block_logits(together)
        for row, drafter in enumerate(alone):
            assert_close_to_floor(logits[row], DFlashDrafter.block_logits([drafter])[0])
        assert [d.cache[0].offset for d in together] == [d.cache[0].offset for d in alone]
        assert [d.cache[0].rotary_span(1) for d in together] == [d.cache[0].rotary_span(1) for d in alone]
        if accepted_counts is None:
            break
        # a verify pass of the three rows packed: each row reads its accepted positions of the one array
        feeds = [[d.token] + mx.argmax(logits[r], axis=-1).tolist() for r, d in enumerate(together)]
        passes = [states(feed) for feed in feeds]
        packed, start = mx.concatenate(passes, axis=1), 0
        for row, (count, feed) in enumerate(zip(accepted_counts, feeds)):
            together[row].update(StateSpan(packed, start, start + len(feed)), feed[1 : count + 1])
            alone[row].update(StateSpan(passes[row], 0, len(feed)), feed[1 : count + 1])
            start += len(feed)


@pytest.mark.parametrize("drafter_name", ["qwen35-b8-l0-2", "qwen35-dflash2-k4-t16-b16-s6-l1"])
def test_a_saved_drafter_loads_as_it_was_in_z_labs_layout(tmp_path, drafter_name):
    """save_drafter (what examples/train_dflash.py writes): the config keys z-lab's directories have where
    the drafter reads them (DFlash2's and a sliding window's too), and weights that load back to the same
    block logits."""
    from mlx_hybrid.models.dflash import save_drafter

    target, _ = load_fixture("qwen35", "hf")
    source = FIXTURES / "dflash" / drafter_name
    model = load_drafter(source)
    save_drafter(model, tmp_path / "d", num_target_layers=len(target.layers), dtype=mx.float32)
    theirs, ours = (json.loads((path / "config.json").read_text()) for path in (source, tmp_path / "d"))
    assert ours["dflash_config"] == theirs["dflash_config"]
    for key in (
        "architectures",
        "model_type",
        "layer_types",
        "rope_parameters",
        "num_target_layers",
        "head_dim",
        "max_position_embeddings",
        "sliding_window",
        "use_sliding_window",
    ):
        # (a window's settings absent where transformers writes null and false)
        assert ours.get(key) == theirs[key] or not (ours.get(key) or theirs[key]), key
    again = load_drafter(tmp_path / "d")
    features = len(model.args.target_layer_ids) * model.args.hidden_size
    block, context = mx.array([[7] + [model.args.mask_token_id] * 7]), mx.random.normal((1, 5, features))
    logits = [
        m.block_logits(m.block_hidden(target.embed(block), context, None), target.project) for m in (model, again)
    ]
    assert mx.array_equal(*logits)


def test_block_rows_verify_as_many_drafts_as_their_rounds_accept():
    """A block drafter's adaptive rows (`DraftingPolicy(adaptive_length=True)`): the first round asks for
    the whole block; a round that accepts part of what it asked for is followed by one asking for two
    more than it accepted (never fewer than 2), one that accepts all by one asking for twice as many (up
    to the block); rows with exactly k drafts a round (adaptive off) ask for k every round."""
    from mlx_hybrid.speculative import DraftingPolicy

    policy = DraftingPolicy(15, adaptive=True, adaptive_length=True)
    asked = []
    for accepted_share in [1 / 15, 1.0, 1.0, 0.5, 0.0, 1.0, 1.0, 1.0]:
        k = policy.plan()
        asked.append(k)
        accepted = round(k * accepted_share)
        policy.record(k, accepted, k, declines_cost=True)
    assert asked == [15, 3, 6, 12, 8, 2, 4, 8]
    assert policy.plan(max_new=3) == 2  # within the tokens still allowed
    fixed = DraftingPolicy(15, adaptive=False, adaptive_length=False)
    for _ in range(3):
        assert fixed.plan() == 15
        fixed.record(15, 1, 15, declines_cost=True)


def test_draft_model_takes_a_path_a_hub_name_or_refuses_by_name(tmp_path, offline_hub):
    """stream_generate(draft_model=) with a DFlash2 drafter's directory, a draft model's GGUF file and a hub
    name (an offline cache laid out as huggingface_hub lays it): plain decoding's tokens; anything else
    one error naming what it got."""
    target, tokenizer = load_fixture("qwen35", "hf")
    drafter_dir = FIXTURES / "dflash" / "qwen35-dflash2-k2-t4-b8-l0-2"
    plain = [r.token for r in mlx_hybrid.stream_generate(target, tokenizer, "def f(", max_tokens=16, draft=None)]
    add_to_cache(offline_hub, "test-org/Tiny-DFlash2", {f.name: f for f in drafter_dir.iterdir()})
    for draft_model in [str(drafter_dir), drafter_dir, FIXTURES / "qwen35" / "model.gguf", "test-org/Tiny-DFlash2"]:
        spec = mlx_hybrid.stream_generate(
            target, tokenizer, "def f(", max_tokens=16, draft_model=draft_model, draft_p_min=0
        )
        assert [r.token for r in spec] == plain, draft_model
    with pytest.raises(GenerationError, match="draft_model= takes a loaded model .*; not a int"):
        mlx_hybrid.generate(target, tokenizer, "def f(", max_tokens=4, draft_model=42)
    with pytest.raises(ModelLoadError):
        mlx_hybrid.generate(target, tokenizer, "def f(", max_tokens=4, draft_model=str(tmp_path / "missing"))


def test_a_sliding_dflash2_drafter_resumes_from_a_prefix_checkpoint():
    """A prompt's checkpoint taken with a DFlash2 drafter whose sliding layer's window (6) the prompt
    exceeds (its cache has dropped entries, and counts them): a later request resuming from it decodes
    plain decoding's tokens, as the first did."""
    target, tokenizer = load_fixture("qwen35", "hf")
    model = load_drafter(FIXTURES / "dflash" / "qwen35-dflash2-k4-t16-b16-s6-l1")
    drafter = make_drafter(target, tokenizer, "dflash", model, draft_p_min=0)
    engine = Engine(target, tokenizer, drafter, 15, adaptive=False, prefix_store=PrefixStore(1 << 30))
    prompt = list(range(40, 70))
    plain = [
        r.token
        for r in mlx_hybrid.stream_generate(target, tokenizer, prompt, max_tokens=20, draft=None, stop_tokens=[])
    ]
    first = engine.submit(prompt, max_tokens=20, stop_tokens=[], checkpoint_at=[len(prompt)])
    engine.run()
    again = engine.submit(prompt + [5], max_tokens=20, stop_tokens=[])
    engine.run()
    assert first.tokens == plain
    assert again.cached_tokens == len(prompt)
    again_plain = mlx_hybrid.stream_generate(target, tokenizer, prompt + [5], max_tokens=20, draft=None, stop_tokens=[])
    assert again.tokens == [r.token for r in again_plain]
