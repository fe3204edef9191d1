"""A quantized KV cache (--kv-bits) at long contexts: its memory, the decode step's time over it, and
what it changes in a trained model's predictions.

    python benchmarks/kv_bits.py                              # Qwen3.5-0.8B shape, 8k and 32k tokens
    python benchmarks/kv_bits.py --contexts 32768 131072      # where the memory allows

Speed and memory, per context and cache form (float32; 8 and 4 bits in groups of 64), on a model of
--shape's widths with random weights (in --weight-bits, default 4, as such models are run: a step
is then not all the reading of float32 weights): every attention layer's cache filled with that
many tokens' keys and values (random: the time does not depend on them; the recurrent layers'
state is the same size whatever the context), then greedy decode steps of one token over it, each
evaluated, the median of --steps. Reported: the attention layers' cache bytes, the step's
milliseconds and its ratio to the float32 cache's in the same run.

What it changes (--quality, the bundled model, trained): its perplexity over the first
--quality-tokens tokens of a text (default: Python's own `argparse.py`, which it was trained
beside), read in chunks of 512 over each cache form, and how many of its top-1 predictions equal
the float32 cache's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx_hybrid  # noqa: F401  (first: on Linux it loads OpenBLAS before MLX's library)

import mlx.core as mx  # noqa: I001
import mlx.nn as nn
import numpy as np

from mlx_hybrid.cache import KVCache

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES, random_model  # noqa: E402

FORMS = [None, 8, 4]  # float32, then the --kv-bits settings
GROUP = 64
FILL_CHUNK = 4096


def form_name(bits) -> str:
    return "float32" if bits is None else f"{bits} bits"


def filled_cache(model, bits, tokens: int, seed: int = 0) -> list:
    """The model's caches with `tokens` tokens of random keys and values in every attention layer."""
    cache = model.make_cache(bits, GROUP)
    rng = np.random.default_rng(seed)
    heads, width = model.args.num_key_value_heads, model.args.head_dim
    for layer_cache in cache:
        if not isinstance(layer_cache, KVCache):
            continue
        for start in range(0, tokens, FILL_CHUNK):
            count = min(FILL_CHUNK, tokens - start)
            keys, values = (mx.array(rng.standard_normal((1, heads, count, width), np.float32)) for _ in range(2))
            layer_cache.update_and_fetch(keys, values)
            mx.eval(layer_cache.arrays)
    return cache


def decode_ms(model, cache, steps: int) -> float:
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        mx.eval(model(mx.array([[11 + i]]), cache))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3  # the first step builds what later ones reuse


def speed_table(args):
    model = random_model(SHAPES[args.shape]())
    if args.weight_bits:
        nn.quantize(model, group_size=64, bits=args.weight_bits)
    weights = f"{args.weight_bits}-bit" if args.weight_bits else "float32"
    print(f"{args.shape} shape, random {weights} weights; caches in groups of {GROUP}\n")
    print("| context | cache | attention layers' cache MB | decode ms a token | float32 / this |")
    print("| --- | --- | --- | --- | --- |")
    for tokens in args.contexts:
        baseline = None
        for bits in FORMS:
            cache = filled_cache(model, bits, tokens)
            held = sum(c.nbytes for c in cache if isinstance(c, KVCache))
            ms = decode_ms(model, cache, args.steps)
            baseline = baseline or ms
            print(f"| {tokens} | {form_name(bits)} | {held / 1e6:.0f} | {ms:.1f} | {baseline / ms:.2f}x |", flush=True)
            del cache
            mx.clear_cache()


def quality_table(args):
    model, tokenizer = mlx_hybrid.load(mlx_hybrid.bundled_model_path())
    text = Path(args.quality_text).read_text()
    ids = tokenizer.encode(text)[: min(args.quality_tokens, model.args.max_position_embeddings)]
    targets = np.array(ids[1:])
    print(f"\nthe bundled model over the first {len(ids)} tokens of {args.quality_text}, in chunks of 512\n")
    print("| cache | perplexity | top-1 as float32's | largest logit change |")
    print("| --- | --- | --- | --- |")
    baseline = None
    for bits in FORMS:
        cache = model.make_cache(bits, GROUP)
        chunks = [model(mx.array([ids[s : s + 512]]), cache)[0] for s in range(0, len(ids), 512)]
        logits = np.array(mx.concatenate(chunks).astype(mx.float32))[:-1]
        shifted = logits - logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        perplexity = float(np.exp(-log_probs[np.arange(len(targets)), targets].mean()))
        baseline = logits if baseline is None else baseline
        agree = (logits.argmax(-1) == baseline.argmax(-1)).mean()
        change = np.abs(logits - baseline).max()
        print(f"| {form_name(bits)} | {perplexity:.3f} | {agree:.2%} | {change:.3f} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="qwen3.5-0.8b")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--weight-bits", type=int, choices=[0, 4, 8], default=4, help="0: float32 weights")
    p.add_argument("--quality", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--quality-text", default=argparse.__file__)
    p.add_argument("--quality-tokens", type=int, default=4096)
    args = p.parse_args()
    speed_table(args)
    if args.quality:
        quality_table(args)


if __name__ == "__main__":
    main()
