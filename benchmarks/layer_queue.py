"""Decoding with each layer queued as it is built (`ops.layer_built`) against a pass queued whole, in
one run: plain decoding, the MTP head and the DFlash drafter through the Python API, greedy.

    python benchmarks/layer_queue.py                      # the bundled model, 3 alternated rounds
    python benchmarks/layer_queue.py --model DIR_OR_GGUF --rounds 5 --tokens 128
    python benchmarks/layer_queue.py --shape qwen3.5-0.8b --drafts none --tokens 32 --one-thread-weights 1e12

The passes queued whole are this tree's with `ops.layer_built` turned off. Prints tokens/s per round,
the medians and their ratio, and checks that both give the same tokens. --one-thread-weights moves
the bound under which a model's products count as running on one thread (`ops.schedule`): a large
value queues the layers of any model. --shape: random weights of a shape of benchmarks/shapes.py,
prompted with the bundled model's token ids.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library
from mlx_hybrid import ops
from mlx_hybrid.ops import schedule

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def decode(model, tokenizer, draft: str | None, tokens: int) -> tuple[float, tuple[int, ...]]:
    started, out = time.perf_counter(), []
    for response in mlx_hybrid.stream_generate(model, tokenizer, PROMPT, tokens, temp=0.0, draft=draft):
        out.append(response.token)
    return len(out) / (time.perf_counter() - started), tuple(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--shape", default=None, help="random weights of this shape (benchmarks/shapes.py)")
    p.add_argument("--drafts", nargs="+", default=["none", "mtp", "dflash"], help="none, mtp, ngram, dflash")
    p.add_argument("--one-thread-weights", type=float, default=None, help="see above")
    args = p.parse_args()
    if args.one_thread_weights is not None:
        schedule.ONE_THREAD_WEIGHTS = int(args.one_thread_weights)
    model, tokenizer = mlx_hybrid.load(args.model or mlx_hybrid.bundled_model_path())
    if args.shape:
        from shapes import SHAPES, random_model

        model = random_model(SHAPES[args.shape]())
    queued = ops.layer_built
    modes = {"whole": lambda *built: None, "by layer": queued}
    rates, outputs = {}, {}
    for draft in args.drafts:  # a first untimed run: kernel builds and checks
        decode(model, tokenizer, None if draft == "none" else draft, 8)
    for round_ in range(args.rounds):
        for mode, layer_built in modes.items():
            ops.layer_built = layer_built
            for draft in args.drafts:
                rate, tokens = decode(model, tokenizer, None if draft == "none" else draft, args.tokens)
                rates.setdefault((draft, mode), []).append(rate)
                outputs.setdefault(draft, set()).add(tokens)
    ops.layer_built = queued
    for draft in args.drafts:
        whole, by_layer = (statistics.median(rates[draft, mode]) for mode in modes)
        rounds = " ".join(f"{a:.3g}/{b:.3g}" for a, b in zip(rates[draft, "whole"], rates[draft, "by layer"]))
        same = "same tokens" if len(outputs[draft]) == 1 else "TOKENS DIFFER"
        print(f"{draft:7s} whole {whole:6.1f}  by layer {by_layer:6.1f} tok/s  {by_layer / whole:.2f}x  "
              f"(rounds {rounds}; {same})")  # fmt: skip


if __name__ == "__main__":
    main()
