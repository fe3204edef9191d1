"""The models on a GPU's path, emulated: bfloat16 weights and activations, every decode step's and
verify pass's product and attention on the row-invariant kernels (through the g++ emulation, as
test_kernel_fallback runs the layer bodies), every linear-attention layer on its body.

What a GPU user is promised: a verify pass gives each token its decode step's logits to the bit, so
greedy speculation (MTP, n-gram, DFlash, a draft model) is plain decoding, and a batch row is its
sequence alone. Counting the kernels' launches against the models' product and attention calls shows
that none of a pass's products or attentions was left to MLX's own GPU kernels (which tile a pass of
several rows otherwise than one: not row-invariant).
"""

import shutil
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, reference

import mlx_hybrid
from mlx_hybrid import ops
from mlx_hybrid.engine import scheduler
from mlx_hybrid.loaders import load_draft_model
from mlx_hybrid.models import layers
from mlx_hybrid.ops import gpu_kernels, row_kernels

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the emulation")

_models = {}


def load_bfloat16(family: str, source: str):
    key = (family, source)
    if key not in _models:
        _models[key] = mlx_hybrid.load(FIXTURES / family / source, dtype="bfloat16")
    return _models[key]


# every way a model multiplies by a matrix (the trunk's, the experts', the output head's)
PRODUCT_CALLS = [
    (layers.Linear, "__call__"), (layers.QuantizedLinear, "__call__"), (layers.SwitchLinear, "__call__"),
    (layers.QuantizedSwitchLinear, "__call__"), (layers.Embedding, "as_linear"),
    (layers.QuantizedEmbedding, "as_linear"),
]  # fmt: skip


@pytest.fixture
def counted(emulated, monkeypatch):
    """Counts of the models' product and attention calls and of the row kernels' launches."""
    counts = Counter()

    def counting(name, function):
        def call(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return call

    for cls, method in PRODUCT_CALLS:
        monkeypatch.setattr(cls, method, counting("products", getattr(cls, method)))
    monkeypatch.setattr(ops, "scaled_dot_product_attention", counting("attentions", ops.scaled_dot_product_attention))
    run = gpu_kernels.RUNNERS["emulated"]
    monkeypatch.setitem(gpu_kernels.RUNNERS, "emulated", lambda spec, launch: counting(spec.name, run)(spec, launch))
    return counts


def prefill(model, prompt, cache):
    mx.eval(model(mx.array([prompt]), cache))


@pytest.mark.parametrize(
    "family, source",
    [("qwen35", "hf"), ("qwen35", "mlx-lm-4bit"), ("qwen35moe", "hf"), ("qwen35moe", "mlx-lm-4bit")],
)
def test_a_verify_pass_of_16_tokens_gives_each_its_decode_steps_logits_in_bfloat16(counted, family, source):
    model, _ = load_bfloat16(family, source)
    ids = reference(family)["input_ids"][0].tolist()
    prompt, tokens = ids[:24], ids[24:40]
    caches = model.make_cache(), model.make_cache(), model.make_cache()
    for cache in caches:
        prefill(model, prompt, cache)  # 24 tokens: a prompt, MLX's kernels
    for warm_up in ([tokens], [tokens[:1]]):  # the kernels' first-use checks (their own launches) done
        mx.eval(model(mx.array(warm_up), caches[2]))
    counted.clear()
    together = model(mx.array([tokens]), caches[0])[0]
    mx.eval(together)
    pass_counts = dict(counted)
    alone = mx.concatenate([model(mx.array([[token]]), caches[1])[0] for token in tokens])
    assert together.dtype == mx.bfloat16
    assert np.array_equal(np.array(together.astype(mx.float32)), np.array(alone.astype(mx.float32)))
    # every product and attention of the pass (and of the 16 steps: 17 passes in all) on a row kernel
    assert pass_counts[row_kernels.ROW_PRODUCT.name] == pass_counts["products"] > 0
    assert pass_counts[row_kernels.ROW_ATTENTION.name] == pass_counts["attentions"] > 0
    assert counted[row_kernels.ROW_PRODUCT.name] == counted["products"] == 17 * pass_counts["products"]
    assert counted[row_kernels.ROW_ATTENTION.name] == counted["attentions"]


def greedy(model, tokenizer, prompt, **settings) -> list[int]:
    return [r.token for r in mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=40, **settings)]


@pytest.mark.parametrize("source", ["hf", "mlx-lm-4bit"])
def test_greedy_speculation_is_plain_decoding_in_bfloat16(counted, source):
    """MTP (where the file keeps the head: mlx-lm's conversion drops it), n-gram and DFlash drafts on the
    dense fixture, a draft model for the MoE one: the tokens of plain decoding, their verify passes on
    the row gpu_kernels."""
    model, tokenizer = load_bfloat16("qwen35", source)
    prompt = reference("qwen35")["prompt_ids"][0].tolist()
    plain = greedy(model, tokenizer, prompt)
    drafter = load_draft_model(FIXTURES / "dflash" / "qwen35-b16-l1", dtype="bfloat16")
    drafts = [{"draft": "ngram", "num_draft_tokens": 4}, {"draft": "dflash", "draft_model": drafter}]
    if source == "hf":
        drafts.append({"draft": "mtp", "num_draft_tokens": 3})
    for settings in drafts:
        assert greedy(model, tokenizer, prompt, **settings) == plain, settings
    target, tokenizer = load_bfloat16("qwen35moe", source)
    prompt = reference("qwen35moe")["prompt_ids"][0].tolist()
    assert greedy(target, tokenizer, prompt, draft_model=model, num_draft_tokens=3) == greedy(target, tokenizer, prompt)
    assert counted[row_kernels.ROW_PRODUCT.name] > 0 and counted[row_kernels.ROW_ATTENTION.name] > 0


def test_eight_batch_rows_are_each_their_sequence_alone_in_bfloat16(counted, monkeypatch):
    """Eight prompts decoded together, plain and with MTP drafts, four at a time: rows join as others
    finish, their prompts (130-144 tokens) read beside rows that decode. Each row's text is its prompt's
    alone; every pass that decodes rows holds at most ROW_KERNEL_PASS_TOKENS tokens (a prompt that does
    not fit waits for a pass of its own) and runs every product on the row kernel."""
    model, tokenizer = load_bfloat16("qwen35moe", "hf")
    ids = reference("qwen35moe")["input_ids"][0].tolist() * 4
    prompts = [ids[i : i + 130 + 2 * i] for i in range(8)]
    passes = []  # (tokens, decodes rows, reads a prompt, products, their row-kernel launches) of each pass
    run_model = scheduler.run_model

    def counted_pass(model, batch, *args):
        before = Counter(counted)
        hidden = run_model(model, batch, *args)
        new = counted - before
        decodes, reads = (any(row.prefilling == prompt for row in batch.rows) for prompt in (False, True))
        passes.append((sum(batch.lengths), decodes, reads, new["products"], new[row_kernels.ROW_PRODUCT.name]))
        return hidden

    monkeypatch.setattr(scheduler, "run_model", counted_pass)
    # each prompt alone, plain: the text the rows together give with the default drafts and with 2 a round
    alone = [mlx_hybrid.generate(model, tokenizer, prompt, max_tokens=12, draft=None) for prompt in prompts]
    for settings in ({}, {"draft": "mtp", "num_draft_tokens": 2}):
        together = mlx_hybrid.batch_generate(model, tokenizer, prompts, max_tokens=12, max_batch=4, **settings)
        assert together == alone, settings
    decoding = [p for p in passes if p[1]]
    assert all(
        tokens <= row_kernels.ROW_KERNEL_PASS_TOKENS and products == launches
        for tokens, _, _, products, launches in decoding
    ), decoding
    # prompts read beside decoding rows, and prompts held back for a pass of their own
    assert any(reads for _, _, reads, *_ in decoding)
    assert any(tokens > row_kernels.ROW_KERNEL_PASS_TOKENS for tokens, decodes, *_ in passes if not decodes)
