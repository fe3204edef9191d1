"""The layer-cache interface (`cache.LayerCache`), on every family's caches (KV, absorbed MLA,
recurrent): rolling back, rewinding to a mark, checkpointing, and what they hold."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_hybrid
from conftest import FAMILIES, assert_close_to_floor, load_fixture, reference
from mlx_hybrid.cache import (
    KVCache,
    LayerCache,
    RotaryPositions,
    WindowKVCache,
    marks,
    record_snapshots,
    rewind,
    rollback,
)
from mlx_hybrid.row_caches import KVRowsPass


def _prompt(family):
    return mx.array([reference(family)["prompt_ids"][0].tolist()])


def _continued(model, cache, tokens):
    return model(mx.array([tokens]), cache)[0, -1]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_cache_rolls_back_rewinds_and_restores(family):
    model, _ = load_fixture(family, "model.gguf")
    cache = mlx_hybrid.make_cache(model)
    assert all(isinstance(c, LayerCache) for c in cache)
    model(_prompt(family), cache)
    after_prompt = marks(cache)
    want = _continued(model, cache, [7])  # the reference: the prompt, then token 7
    rewind(cache, after_prompt)

    # a recorded call of 4 tokens rolled back to its first: the state after the prompt and 7
    record_snapshots(cache, True)
    model(mx.array([[7, 8, 9, 10]]), cache)
    record_snapshots(cache, False)
    rollback(cache, keep=1, recorded=4)
    got_rolled = _continued(model, cache, [11])

    # rewinding to a mark forgets what came after it
    rewind(cache, after_prompt)
    model(mx.array([[7, 3, 3]]), cache)
    rewind(cache, after_prompt)
    assert mx.array_equal(_continued(model, cache, [7]), want)  # the same sums: the same bits

    # a checkpoint restored into fresh caches continues as the original does
    rewind(cache, after_prompt)
    saved = [c.checkpoint() for c in cache]
    fresh = mlx_hybrid.make_cache(model)
    for c, entries in zip(fresh, saved):
        c.restore(entries)
    assert mx.array_equal(_continued(model, fresh, [7]), want)
    assert sum(c.nbytes for c in fresh) == sum(a.nbytes for c in fresh for a in c.arrays) > 0

    # the rolled-back caches, continued with 11, equal the prompt, 7, then 11 read one at a time
    plain = mlx_hybrid.make_cache(model)
    model(_prompt(family), plain)
    _continued(model, plain, [7])
    assert_close_to_floor(got_rolled, _continued(model, plain, [11]))  # 4 rows against single steps


@pytest.mark.parametrize("family", FAMILIES)
def test_a_long_call_leaves_its_caches_holding_only_their_state(family):
    """After a long prefill chunk, the memory in use is the model, the output and the caches' own
    arrays: no layer's state keeps (as a view or as a lazy graph) the chunk's inputs alive."""
    import gc

    model, _ = load_fixture(family, "model.gguf")
    ids = mx.array([[(i * 7) % 50 + 3 for i in range(512)]])
    mx.eval(model.hidden_states(ids, mlx_hybrid.make_cache(model)))  # what a first call of a length makes once
    cache = mlx_hybrid.make_cache(model)
    gc.collect()
    before = mx.get_active_memory()
    hidden = model.hidden_states(ids, cache)
    mx.eval(hidden)
    gc.collect()
    held = mx.get_active_memory() - before
    own = hidden.nbytes + sum(a.nbytes for c in cache for a in c.arrays)
    # a chunk's inputs a layer are 512 rows; the states a few: 10% over covers MLX's rounding of
    # small buffers, not one layer's 512-row input
    assert held <= 1.1 * own + 64 * 1024, (held, own)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pass_evaluated_layer_by_layer_gives_the_same_bits(family):
    """`evaluate_each_layer` (prefill chunks) changes when the work is evaluated, not what it
    computes: the hidden states and every cache array after a prompt in two chunks are equal."""
    model, _ = load_fixture(family, "model.gguf")
    ids = _prompt(family)
    half = ids.shape[1] // 2
    results = []
    for each in (False, True):
        cache = mlx_hybrid.make_cache(model)
        chunks = [model.hidden_states(ids[:, :half], cache, evaluate_each_layer=each)]
        chunks.append(model.hidden_states(ids[:, half:], cache, evaluate_each_layer=each))
        results.append([mx.concatenate(chunks, axis=1)] + [a for c in cache for a in c.arrays])
    for whole, layer_by_layer in zip(*results):
        assert mx.array_equal(whole, layer_by_layer).item()


@pytest.mark.parametrize("family, kv_bits", [("qwen35", None), ("kimilinear", None), ("qwen35", 8)])
def test_rows_kept_as_a_batch_give_what_each_row_gives_alone(family, kv_bits):
    """Packed passes whose layers keep the rows' caches as one batch (linear layers' states in
    `RowStates`, attention layers' entries in `KVRows`, each row at its own length): all rows
    decoding; rows 0 and 2 verifying 4 tokens while 1 and 3 decode (batches of rows that are not
    neighbours), rolled back to different tokens; all decoding again; row 1 leaving; three rows
    verifying and keeping the same token's state; a row's checkpoint taken from the batch and
    decoded alone. Each row's logits equal, to the bit, those of the same calls on the row alone."""
    from mlx_hybrid.row_caches import KVRows, RowStates, batch_of, packed

    model, _ = load_fixture(family, "model.gguf")
    prompts = [[5 + row] * (6 + row) for row in range(4)]
    alone, together = ([mlx_hybrid.make_cache(model, kv_bits, 32) for _ in prompts] for _ in range(2))
    for prompt, one, batch_row in zip(prompts, alone, together):
        model(mx.array([prompt]), one)
        model(mx.array([prompt]), batch_row)

    def step(feeds: dict[int, list[int]], keeps: dict[int, int] = {}):
        rows = sorted(feeds)
        want = []
        for row in rows:
            verify = len(feeds[row]) > 1
            record_snapshots(alone[row], verify)
            want.append(model(mx.array([feeds[row]]), alone[row])[0])
            record_snapshots(alone[row], False)
            if verify:
                rollback(alone[row], keep=keeps[row], recorded=len(feeds[row]))
        for row in rows:
            record_snapshots(together[row], len(feeds[row]) > 1)
        got = model(
            mx.array([sum((feeds[r] for r in rows), [])]),
            packed([together[r] for r in rows], [len(feeds[r]) for r in rows]),
        )[0]
        for row in rows:
            record_snapshots(together[row], False)
            if len(feeds[row]) > 1:
                rollback(together[row], keep=keeps[row], recorded=len(feeds[row]))
        assert mx.array_equal(got, mx.concatenate(want)), feeds

    step({0: [3], 1: [4], 2: [5], 3: [6]})
    step({0: [3], 1: [4], 2: [5], 3: [6]})
    step({0: [7, 8, 9, 10], 1: [4], 2: [11, 12, 13, 14], 3: [6]}, keeps={0: 2, 2: 4})
    step({0: [9], 1: [4], 2: [15], 3: [6]})
    step({0: [9], 2: [15], 3: [6]})
    step({0: [1, 2, 3], 2: [4, 5, 6], 3: [7, 8, 9]}, keeps={0: 2, 2: 2, 3: 2})  # all keep the same token's
    step({0: [1], 2: [2], 3: [3]})
    kinds = {type(batch_of(c)) for c in together[0]}
    assert kinds == {KVRows, RowStates}, "the rows ran as batches"
    resumed = mlx_hybrid.make_cache(model, kv_bits, 32)
    for layer, checkpoint in zip(resumed, [c.checkpoint() for c in together[2]]):
        layer.restore(checkpoint)
    assert mx.array_equal(model(mx.array([[8, 9]]), resumed)[0], model(mx.array([[8, 9]]), alone[2])[0]).item()


def test_an_attention_reads_where_its_cached_keys_sit():
    """`key_positions` (what an indexer rotating blocks of keys reads), through the one interface of
    one sequence's cache and of rows run together."""
    plain, imaged = KVCache(), KVCache()
    # a prompt whose tokens 2-4 are an image's, at 2-D positions (temporal, row, column)
    table = np.array([[0, 1, 2, 2, 2, 5], [0, 1, 2, 2, 3, 5], [0, 1, 2, 3, 2, 5]])
    imaged.positions = RotaryPositions(table)
    assert plain.key_positions(6) == 0
    assert np.array_equal(imaged.key_positions(6), table)

    window = WindowKVCache(2)
    for _ in range(5):
        window.update_and_fetch(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))
    window.trim(0)  # holding twice its window: it keeps the last window - 1 keys, the one at index 4
    assert (window.offset, window.key_positions(1)) == (1, 4)

    assert KVRowsPass([plain, KVCache()]).key_positions(6) == 0
    with pytest.raises(ValueError, match="image positions"):
        KVRowsPass([plain, imaged]).key_positions(6)
