"""The batch engine: batches equal single runs, joining and leaving, speculation per row,
sampled rows, cancellation, prefix checkpoints (exact, bounded, on disk), flat memory."""

import gc
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_hybrid
from conftest import FIXTURES, QWEN_FAMILIES, assert_close_to_floor, load_fixture
from mlx_hybrid.drafting import DraftModelDrafter, NgramDrafter, make_drafter
from mlx_hybrid.engine import Engine, PrefixStore, load_checkpoint, save_checkpoint
from mlx_hybrid.engine.prefix_store import capture, default_budget_bytes, restore
from mlx_hybrid.prompt import prefill

PROMPT_LENGTHS = (1, 5, 30, 200, 17, 2, 64, 120)
MAX_TOKENS = 24
_singles = {}


def prompts_for(n=len(PROMPT_LENGTHS), seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, length).tolist() for length in PROMPT_LENGTHS[:n]]


def single_greedy(family, source, prompt, max_tokens=MAX_TOKENS):
    """Plain greedy decoding of one prompt alone: the reference every batch row must equal."""
    key = (family, source, tuple(prompt), max_tokens)
    if key not in _singles:
        model, tok = load_fixture(family, source)
        _singles[key] = [
            r.token for r in mlx_hybrid.stream_generate(model, tok, prompt, max_tokens=max_tokens, draft=None)
        ]
    return _singles[key]


def engine_for(family, source, draft=None, **kwargs):
    model, tok = load_fixture(family, source)
    kwargs.setdefault("prefix_store", PrefixStore(0))
    return Engine(model, tok, make_drafter(model, tok, draft), **kwargs)


def drafts_for(family):
    return [None, "ngram"] + (["mtp"] if family in QWEN_FAMILIES else [])


def test_a_batch_mixes_drafters_of_every_kind():
    """Rows drafting with the engine's MTP head, with their own n-gram lookup and with their
    own draft model, in one batch: each drafts with its own, and each equals its single run."""
    model, tok = load_fixture("qwen35", "hf")
    engine = engine_for("qwen35", "hf", "mtp")
    prompts = prompts_for(3)
    own = [None, NgramDrafter(), DraftModelDrafter(load_fixture("qwen35", "model.gguf")[0], model)]
    sequences = [engine.submit(p, max_tokens=MAX_TOKENS, drafter=d) for p, d in zip(prompts, own)]
    engine.run()
    for prompt, sequence in zip(prompts, sequences):
        assert sequence.error is None and sequence.tokens == single_greedy("qwen35", "hf", prompt)
        assert sequence.stats.passes > 0


@pytest.mark.parametrize("draft", ["none", "ngram", "mtp"])
def test_batch_rows_equal_single_greedy_runs(family, source, draft):
    """8 prompts of 1 to 200 tokens, prefilled in interleaved chunks, decoded together."""
    if draft == "mtp" and family not in QWEN_FAMILIES:
        pytest.skip("Kimi Linear has no MTP head")
    engine = engine_for(family, source, draft, prefill_chunk=48)
    prompts = prompts_for()
    sequences = [engine.submit(p, max_tokens=MAX_TOKENS) for p in prompts]
    engine.run()
    for prompt, sequence in zip(prompts, sequences):
        assert sequence.tokens == single_greedy(family, source, prompt), len(prompt)
        assert sequence.finish_reason in ("stop", "length") and sequence.cached_tokens == 0


@pytest.mark.parametrize("family", ["qwen35", "kimilinear"])
def test_rows_join_mid_flight_and_finish_early(family):
    """A batch of 3 slots: requests wait, join as others leave, and some stop early."""
    source = "model.gguf"
    engine = engine_for(family, source, "ngram" if family == "kimilinear" else "mtp", max_batch=3, prefill_chunk=32)
    prompts = prompts_for()
    budgets = [MAX_TOKENS, 3, MAX_TOKENS, 1, 7, MAX_TOKENS, 2, MAX_TOKENS]
    sequences = [engine.submit(p, max_tokens=b) for p, b in zip(prompts[:4], budgets)]
    for _ in range(5):
        engine.step()
        assert len(engine.rows) <= 3
    sequences += [engine.submit(p, max_tokens=b) for p, b in zip(prompts[4:], budgets[4:])]
    engine.run()
    for prompt, budget, sequence in zip(prompts, budgets, sequences):
        assert sequence.tokens == single_greedy(family, source, prompt)[:budget]


def test_events_stream_each_rows_tokens_in_order():
    engine = engine_for("qwen35", "hf", "mtp")
    prompts = prompts_for(3)
    sequences = [engine.submit(p, max_tokens=MAX_TOKENS) for p in prompts]
    engine.run()
    for prompt, sequence in zip(prompts, sequences):
        events = list(sequence.stream(timeout=1))
        assert [t for e in events for t in e.tokens] == single_greedy("qwen35", "hf", prompt)
        assert events[-1].finish_reason == sequence.finish_reason and all(e.finish_reason is None for e in events[:-1])


def test_an_engine_on_its_thread_streams_single_run_tokens_restarts_and_lets_its_process_exit():
    # The process must end by itself right after `stop`: MLX frees a thread's compile cache
    # at the thread's exit, which once aborted a finalizing interpreter ("terminate called").
    script = f"""
import mlx_hybrid
from mlx_hybrid.engine import Engine
model, tokenizer = mlx_hybrid.load({str(FIXTURES / "qwen35" / "hf")!r}, dtype="float32")
engine = Engine(model, tokenizer, mlx_hybrid.drafting.make_drafter(model, tokenizer, "mtp"))
for _ in range(2):  # and again after a stop
    engine.start()
    print([t for event in engine.submit({prompts_for(1)[0]!r}, max_tokens={MAX_TOKENS}).stream() for t in event.tokens])
    engine.stop()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"{single_greedy('qwen35', 'hf', prompts_for(1)[0])}\n" * 2


@pytest.mark.parametrize("draft", [None, "mtp"])
def test_sampled_rows_draw_what_a_single_run_with_their_seed_draws(draft):
    """Each row has its own seed stream: in a batch it samples exactly what it samples alone
    (so a speculative row keeps the target's distribution, as the single decoder does)."""
    model, tok = load_fixture("qwen3next", "model.gguf")
    prompts = prompts_for(4)
    settings = dict(temp=0.9, top_p=0.95, max_tokens=MAX_TOKENS)
    alone = [  # (the engine's k, which the API's default for a model this small is not)
        [
            r.token
            for r in mlx_hybrid.stream_generate(model, tok, p, seed=10 + i, draft=draft, num_draft_tokens=3, **settings)
        ]
        for i, p in enumerate(prompts)
    ]
    engine = engine_for("qwen3next", "model.gguf", draft)
    sequences = [engine.submit(p, seed=10 + i, **settings) for i, p in enumerate(prompts)]
    greedy_neighbour = engine.submit(prompts[0], max_tokens=MAX_TOKENS)
    engine.run()
    assert [s.tokens for s in sequences] == alone
    assert greedy_neighbour.tokens == single_greedy("qwen3next", "model.gguf", prompts[0])


@pytest.mark.parametrize("draft", [None, "mtp"])
def test_sampling_rows_add_no_launches_per_row(draft):
    """A step of rows that sample launches what the same rows launch greedy plus a fixed number for the
    sampling (counted on the GPU path, as `benchmarks/engine_step.py` counts): the rows' settings, random
    keys, drafts' distributions and acceptance tests go through each op together, whatever the rows.
    Once each row built its own (8 rows drafting with MTP: 2611 launches, against 716 for one). (A
    DFlash drafter's sampling rows still draft alone: together, their drafts would round otherwise than
    alone, and a sampling row is to draw what it draws alone.)"""
    from benchmarks.engine_step import gpu_path_graph, launches

    model, tokenizer = load_fixture("qwen35", "model.gguf")
    with gpu_path_graph():
        counts = {(r, t): launches(model, tokenizer, r, draft, t)[0] for r in (1, 4) for t in (0.0, 0.8)}
    assert counts[4, 0.8] - counts[4, 0.0] == counts[1, 0.8] - counts[1, 0.0], counts


def test_batch_generate_returns_each_prompts_text():
    model, tok = load_fixture("qwen35", "hf")
    prompts = ["def add(a, b):", "import os\n", "class Point:"]
    texts = mlx_hybrid.batch_generate(model, tok, prompts, max_tokens=16, draft="mtp")
    assert texts == [mlx_hybrid.generate(model, tok, p, max_tokens=16, draft=None) for p in prompts]
    with pytest.raises(mlx_hybrid.GenerationError, match="non-empty list"):
        mlx_hybrid.batch_generate(model, tok, [])
    with pytest.raises(mlx_hybrid.GenerationError, match="empty"):
        mlx_hybrid.batch_generate(model, tok, ["x", ""])


def test_cancelled_rows_leave_and_the_others_go_on():
    engine = engine_for("qwen35moe", "model.gguf", "mtp")
    prompts = prompts_for(3)
    sequences = [engine.submit(p, max_tokens=MAX_TOKENS) for p in prompts]
    engine.step()
    engine.step()
    sequences[1].cancel()
    waiting = engine.submit(prompts[0], max_tokens=5)
    waiting.cancel()
    engine.run()
    assert sequences[1].finish_reason == "cancelled" and waiting.finish_reason == "cancelled"
    assert len(sequences[1].tokens) < MAX_TOKENS and waiting.tokens == []
    for i in (0, 2):
        assert sequences[i].tokens == single_greedy("qwen35moe", "model.gguf", prompts[i])
    assert engine.rows == []


def _overlap_scenario(family, overlap):
    """Rows that sample, are cancelled, join late (while a sampled row runs), stop early, and
    a second turn that resumes from a first one's checkpoint."""
    source = "model.gguf"
    engine = engine_for(family, source, max_batch=3, overlap=overlap, prefix_store=PrefixStore(1 << 30))
    prompts = prompts_for(5)
    early_stop = single_greedy(family, source, prompts[3])[6]
    sequences = [
        engine.submit(prompts[0], max_tokens=MAX_TOKENS, logprobs=2),
        engine.submit(prompts[1], max_tokens=MAX_TOKENS, temp=0.8, seed=5),
        engine.submit(prompts[2], max_tokens=MAX_TOKENS),
    ]
    for _ in range(6):
        engine.step()
    sequences[2].cancel()
    sequences.append(engine.submit(prompts[3], max_tokens=MAX_TOKENS, stop_tokens=[early_stop]))
    sequences.append(engine.submit(prompts[4], max_tokens=3))
    engine.run()
    second_prompt = prompts[0] + sequences[0].tokens + [7, 8]
    sequences.append(engine.submit(second_prompt, max_tokens=MAX_TOKENS))
    engine.run()
    return sequences


@pytest.mark.parametrize("family", ["qwen35", "kimilinear"])
def test_overlapped_plain_passes_give_what_stepping_in_turn_gives(family):
    """Where a GPU computes, plain rows queue the next pass before their tokens are read
    (forced on here). Rows joining, stopping early, cancelled, sampled or resumed get the
    tokens, finish reasons and checkpoints they get stepping in turn, and their single
    run's tokens."""
    stepped, overlapped = _overlap_scenario(family, False), _overlap_scenario(family, True)
    for want, got in zip(stepped, overlapped):
        assert got.tokens == want.tokens
        assert (got.finish_reason, got.cached_tokens) == (want.finish_reason, want.cached_tokens)
    assert overlapped[2].finish_reason == "cancelled" and overlapped[3].finish_reason == "stop"
    assert overlapped[-1].cached_tokens == len(overlapped[-1].prompt) - 3  # the first turn's checkpoint
    assert overlapped[0].tokens == single_greedy(family, "model.gguf", overlapped[0].prompt)
    assert overlapped[-1].tokens == single_greedy(family, "model.gguf", overlapped[-1].prompt)
    # the same logits, packed with other rows in the other order of passes: the float32 floor
    got = [[t.logprob for t in event] for event in _logprobs(overlapped[0])]
    want = [[t.logprob for t in event] for event in _logprobs(stepped[0])]
    assert_close_to_floor(mx.array(got), mx.array(want))


def _logprobs(sequence):
    events = []
    while not sequence.events.empty():
        event = sequence.events.get()
        events += [event.logprobs] if event.logprobs else []
    return events


# -- prefix checkpoints


def _fresh_logits(model, tokens):
    return model(mx.array(tokens)[None], model.make_cache())[0, -1]


def _continue(model, cache, tokens):
    return model(mx.array(tokens)[None], cache)[0, -1]


@pytest.mark.parametrize("family", ["qwen35", "kimilinear"])
def test_continuing_from_a_checkpoint_equals_a_fresh_prefill(family, tmp_path):
    model, _ = load_fixture(family, "hf")
    tokens = prompts_for()[3]  # 200
    for split in (1, 50, 150):
        fresh = model.make_cache()
        hidden = prefill(model, tokens[:split], fresh)
        checkpoint = capture(model, fresh, tokens[:split], hidden[:, -1:])
        path = tmp_path / f"{split}.safetensors"
        save_checkpoint(path, checkpoint)
        want = _continue(model, fresh, tokens[split:])
        for saved in (checkpoint, load_checkpoint(path, model)):
            cache = model.make_cache()
            restore(saved, cache)
            # the same state and the same sums: the same bits
            assert mx.array_equal(_continue(model, cache, tokens[split:]), want), split
            at_end = model.logits_from_hidden(saved.last_hidden)[0, -1]
            assert_close_to_floor(at_end, _fresh_logits(model, tokens[:split]))  # prefill and one call: other sums


@pytest.mark.parametrize("family", ["qwen35", "kimilinear"])
def test_the_engine_checkpoints_where_asked_and_at_the_end(family):
    """The engine computes in 32-token chunks packed with other rows, so its states round
    differently from one fresh call's: the float32 floor."""
    model, _ = load_fixture(family, "hf")
    prompt = prompts_for()[7]  # 120 tokens
    engine = engine_for(family, "hf", prefix_store=PrefixStore(1 << 30), prefill_chunk=32)
    sequence = engine.submit(prompt, max_tokens=MAX_TOKENS, checkpoint_at=[50, 80, 500])
    engine.submit(prompts_for()[4], max_tokens=MAX_TOKENS)  # a neighbour in the batch
    engine.run()
    # the named positions, the whole of each sequence but its last token (sampled, never fed)
    everything = prompt + sequence.tokens
    assert tuple(prompt[:50]) in engine.store.entries and tuple(prompt[:80]) in engine.store.entries
    assert tuple(everything[:-1]) in engine.store.entries and len(engine.store) == 4
    for key in (prompt[:50], prompt[:80], everything[:-1]):
        cache = model.make_cache()
        restore(engine.store.entries[tuple(key)], cache)
        fresh = model.make_cache()
        prefill(model, key, fresh)
        got, want = _continue(model, cache, everything[len(key) :]), _continue(model, fresh, everything[len(key) :])
        assert_close_to_floor(got, want)


@pytest.mark.parametrize("draft", ["none", "mtp", "ngram"])
def test_a_second_turn_resumes_from_the_first_turns_checkpoint(draft):
    family, source = "qwen3next", "hf"
    engine = engine_for(family, source, draft, prefix_store=PrefixStore(1 << 30))
    first_prompt = prompts_for()[2]
    first = engine.submit(first_prompt, max_tokens=MAX_TOKENS)
    engine.run()
    second_prompt = first_prompt + first.tokens + [7, 8, 9]
    second = engine.submit(second_prompt, max_tokens=MAX_TOKENS)
    engine.run()
    assert second.cached_tokens == len(first_prompt) + len(first.tokens) - 1
    assert second.tokens == single_greedy(family, source, second_prompt)
    # the exact prompt of a checkpoint: its first token comes from the saved hidden state
    again = engine.submit(first_prompt, max_tokens=MAX_TOKENS, checkpoint_at=[len(first_prompt)])
    engine.run()
    third = engine.submit(first_prompt, max_tokens=MAX_TOKENS)
    engine.run()
    assert again.tokens == third.tokens == first.tokens
    assert third.cached_tokens == len(first_prompt)


@pytest.mark.parametrize("draft", ["none", "mtp"])
def test_a_cancelled_sequence_keeps_its_tokens_and_a_checkpoint_to_resume_from(draft):
    """A chat's stopped answer: the next turn reads only what is new."""
    family, source = "qwen3next", "hf"
    engine = engine_for(family, source, draft, prefix_store=PrefixStore(1 << 30))
    first_prompt = prompts_for()[2]
    first = engine.submit(first_prompt, max_tokens=MAX_TOKENS)
    for _ in range(3):  # the prompt, then two rounds
        engine.step()
    first.cancel()
    engine.run()
    assert first.finish_reason == "cancelled" and 0 < len(first.tokens) < MAX_TOKENS
    assert first.tokens == single_greedy(family, source, first_prompt)[: len(first.tokens)]
    second_prompt = first_prompt + first.tokens + [7, 8, 9]
    second = engine.submit(second_prompt, max_tokens=MAX_TOKENS)
    engine.run()
    assert second.cached_tokens == len(first_prompt) + len(first.tokens) - 1
    assert second.tokens == single_greedy(family, source, second_prompt)


@pytest.mark.parametrize("ending", ["length", "cancelled"])
def test_a_budget_for_one_checkpoint_keeps_the_prompts_over_the_answers(ending):
    """A long session's checkpoint is GBs (3.7 at 128k tokens of Qwen3.5-0.8B), so a budget may hold one. The
    answer's end must not evict the prompt's: a reply cut by max_tokens (or a thinking model's, under Qwen's
    templates) comes back re-rendered, so the next turn shares the prompt with this one, not the answer."""
    family, source = "qwen3next", "hf"
    prompt = prompts_for()[3]  # 200 tokens
    sizes = engine_for(family, source, prefix_store=PrefixStore(1 << 30))
    sizes.submit(prompt, max_tokens=MAX_TOKENS, checkpoint_at=[len(prompt)])
    sizes.run()
    prompt_end, answer_end = sorted((c.nbytes for c in sizes.store.entries.values()))
    engine = engine_for(family, source, prefix_store=PrefixStore(answer_end + prompt_end // 2))  # holds one
    first = engine.submit(prompt, max_tokens=MAX_TOKENS, checkpoint_at=[len(prompt)])
    if ending == "cancelled":
        for _ in range(3):  # the prompt, then two tokens
            engine.step()
        first.cancel()
    engine.run()
    assert first.finish_reason == ending and list(engine.store.entries) == [tuple(prompt)]
    # the next turn: the answer rendered otherwise, then a new message
    second_prompt = prompt + [11, 12, 13] + [7, 8, 9]
    second = engine.submit(second_prompt, max_tokens=MAX_TOKENS, checkpoint_at=[len(second_prompt)])
    engine.run()
    assert second.cached_tokens == len(prompt)
    assert second.tokens == single_greedy(family, source, second_prompt)
    assert list(engine.store.entries) == [tuple(second_prompt)]  # the session's newest prompt


def test_the_store_keeps_its_byte_budget_and_evicts_the_least_recently_used(tmp_path):
    model, _ = load_fixture("qwen35", "model.gguf")
    prompts = prompts_for(4, seed=3)
    checkpoints = []
    for prompt in prompts:
        cache = model.make_cache()
        hidden = prefill(model, prompt, cache)
        checkpoints.append(capture(model, cache, prompt, hidden[:, -1:]))
    sizes = [c.nbytes for c in checkpoints]
    budget = sizes[0] + sizes[2] + sizes[3] + 1  # room for three of these
    store = PrefixStore(budget, directory=tmp_path / "spill")
    for c in checkpoints[:3]:
        store.save(c)
    assert store.longest_prefix(prompts[0] + [5]) is checkpoints[0]  # used: now the most recent
    store.save(checkpoints[3])
    assert store.nbytes <= budget and store.nbytes == sum(c.nbytes for c in store.entries.values())
    assert set(store.entries) == {tuple(prompts[i]) for i in (0, 2, 3)}  # 1 was the least recently used
    # the evicted one went to disk, and a new store on the same directory finds it
    reopened = PrefixStore(budget, directory=tmp_path / "spill")
    found = reopened.longest_prefix(prompts[1] + [9, 9])
    assert found is not None and found.tokens == tuple(prompts[1])
    cache = model.make_cache()
    restore(found, cache)
    got = model(mx.array([[9, 9]]), cache)[0, -1]
    assert_close_to_floor(got, _fresh_logits(model, prompts[1] + [9, 9]))  # a cache, then 2 tokens: other sums
    assert PrefixStore(0).longest_prefix(prompts[0]) is None
    # a store whose memory budget holds nothing still resumes from its directory
    from_disk = PrefixStore(0, directory=tmp_path / "spill").longest_prefix(prompts[1])
    assert from_disk is not None and from_disk.tokens == tuple(prompts[1])


def test_a_checkpoint_over_the_whole_budget_is_not_kept_and_says_so_once(caplog):
    """A long session's checkpoint outgrows the budget (at 128k tokens of Qwen3.5-0.8B a float32 attention
    cache alone is 3.2 GB): it is not kept, counted, and the log names the flags that help, once."""
    model, _ = load_fixture("qwen35", "model.gguf")
    checkpoints = []
    for prompt in prompts_for(2, seed=4):
        cache = model.make_cache()
        checkpoints.append(capture(model, cache, prompt, prefill(model, prompt, cache)[:, -1:]))
    store = PrefixStore(min(c.nbytes for c in checkpoints) - 1)
    with caplog.at_level("WARNING", logger="mlx_hybrid"):
        for c in checkpoints:
            store.save(c)
    assert len(store) == 0 and store.nbytes == 0 and store.over_budget == 2
    (record,) = caplog.records
    assert "--prefix-cache-bytes" in record.getMessage() and "--kv-bits" in record.getMessage()
    # the default budget: a quarter of the machine's memory, at most 8 GiB (MemTotal, read the other way)
    if Path("/proc/meminfo").exists():
        total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
        assert abs(default_budget_bytes() - min(total // 4, 8 << 30)) < 64 << 20  # page rounding


def test_the_store_copies_a_checkpoint_only_to_keep_it_and_after_making_room():
    """A checkpoint's copy is a long session's whole attention cache (3.2 GB at 128k tokens of Qwen3.5-0.8B):
    one the store will not keep is never copied, and one it keeps is copied after the evicted ones are freed,
    so memory peaks at one checkpoint, not two (MLX's peak memory, around each save)."""
    model, _ = load_fixture("qwen35", "model.gguf")

    def sequence(seed):  # a cache after a 400-token prompt, and its last hidden state
        prompt = np.random.default_rng(seed).integers(3, 500, 400).tolist()
        cache = model.make_cache()
        return prompt, cache, prefill(model, prompt, cache)[:, -1:]

    first, second = sequence(5), sequence(6)
    size = capture(model, first[1], first[0], first[2]).nbytes

    def peak_of_saving(store, state) -> int:
        gc.collect()
        mx.eval(state[2])
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        store.save(capture(model, state[1], state[0], state[2]))
        return mx.get_peak_memory() - before

    # a quarter of a checkpoint: room for the allocator's rounding, far below a copy (the KV entries are
    # nearly all of it; the recurrent states are the live cache's own arrays, shared, not copied)
    assert peak_of_saving(PrefixStore(size // 2), first) < size // 4  # not kept: not copied
    store = PrefixStore(size + size // 2)  # room for one
    assert size - size // 4 < peak_of_saving(store, first) < size + size // 4  # kept: one copy
    assert peak_of_saving(store, second) < size // 4  # the first freed before the second's copy
    assert list(store.entries) == [tuple(second[0])]


def test_a_prompt_cache_from_another_model_is_refused(tmp_path):
    model, _ = load_fixture("qwen35", "model.gguf")
    other, _ = load_fixture("kimilinear", "model.gguf")
    cache = model.make_cache()
    hidden = prefill(model, [5, 6, 7], cache)
    save_checkpoint(tmp_path / "c.safetensors", capture(model, cache, [5, 6, 7], hidden[:, -1:]))
    with pytest.raises(mlx_hybrid.GenerationError, match="another model"):
        load_checkpoint(tmp_path / "c.safetensors", other)
    (tmp_path / "bad.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(mlx_hybrid.GenerationError, match="cannot read"):
        load_checkpoint(tmp_path / "bad.safetensors", model)


def test_500_requests_leave_active_memory_flat():
    model, tok = load_fixture("qwen35", "model.gguf")
    engine = Engine(model, tok, make_drafter(model, tok, "mtp"), prefix_store=PrefixStore(1 << 20))
    rng = np.random.default_rng(0)

    def burst(n):
        for _ in range(n):
            engine.submit(rng.integers(3, 500, int(rng.integers(1, 40))).tolist(), max_tokens=int(rng.integers(1, 8)))
        engine.run()
        gc.collect()
        return mx.get_active_memory()

    burst(50)
    after_warmup = burst(50)
    after_all = burst(400)
    # the store is full from the first burst on (1 MB); requests leave nothing else behind
    assert after_all - after_warmup < 256 * 1024, (after_warmup, after_all)
    assert engine.store.nbytes <= 1 << 20 and engine.rows == []


def test_a_step_in_its_parts():
    """A pass's first three parts on their own (engine.step): the batch packs each row's prompt up to
    the prefill budget, and the pass gives each row, at its prompt's last position, the logits of the
    model run on that prompt alone; a decoding row's round then accepts, greedy, the model's argmax."""
    from mlx_hybrid.engine.step import build_batch, choose_tokens, run_model
    from mlx_hybrid.sampling import SamplingParams

    model, tok = load_fixture("qwen35", "hf")
    engine = Engine(model, tok, prefix_store=PrefixStore(0))
    prompts = prompts_for(3)[1:]  # 5 and 30 tokens
    rows = [engine.new_row(p, SamplingParams(max_tokens=4), (), None, None) for p in prompts]
    assert build_batch(rows, prefill_chunk=3).rows == rows[:1]  # the budget: three tokens of the first
    batch = build_batch(rows, prefill_chunk=sum(map(len, prompts)))
    assert batch.lengths == [5, 30] and batch.spans == [(0, 5), (5, 35)]
    hidden = run_model(model, batch)
    choices = choose_tokens(model, batch, hidden)
    for prompt, choice in zip(prompts, choices):
        alone = model(mx.array([prompt]), cache=model.make_cache())[0, -1:]
        assert choice.accepted is None
        assert_close_to_floor(choice.logits, alone)  # packed rows against one row alone

    row = rows[0]
    row.fed, row.last_hidden = list(prompts[0]), hidden[:, 4:5]
    row.begin(int(mx.argmax(choices[0].logits[-1])))
    batch = build_batch([row], prefill_chunk=8)  # a plain round: the row's token alone
    choice = choose_tokens(model, batch, run_model(model, batch))[0]
    alone = model(mx.array([prompts[0] + [row.token]]), cache=model.make_cache())[0, -1]
    assert choice.accepted == [int(mx.argmax(alone))] and choice.drafted == 0
