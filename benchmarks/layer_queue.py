"""Decoding with each layer queued as it is built (`ops.layer_built`), and with plain decoding's next
step queued before this one's tokens are read (`ops.overlap_decode_steps`), against passes queued
whole and stepped in turn, in one run: plain decoding, the MTP head and the DFlash drafter through the
Python API, greedy.

    python benchmarks/layer_queue.py                      # the bundled model, 3 alternated rounds
    python benchmarks/layer_queue.py --model DIR_OR_GGUF --rounds 5 --tokens 128
    python benchmarks/layer_queue.py --shape qwen3.5-0.8b --drafts none --tokens 32 --one-thread-weights 1e12

Each mode is this tree's with those decisions set: "whole" queues neither, "by layer" the layers,
"steps ahead" both. Prints tokens/s per round, the medians and their ratios to "whole", and checks
that every mode gives the same tokens. --one-thread-weights moves
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
    modes = {"whole": (lambda *built: None, False), "by layer": (queued, False), "steps ahead": (queued, True)}
    rates, outputs = {}, {}
    for draft in args.drafts:  # a first untimed run: kernel builds and checks
        decode(model, tokenizer, None if draft == "none" else draft, 8)
    for round_ in range(args.rounds):
        for mode, (layer_built, overlap) in modes.items():
            ops.layer_built, ops.overlap_decode_steps = layer_built, lambda widest, overlap=overlap: overlap
            for draft in args.drafts:
                rate, tokens = decode(model, tokenizer, None if draft == "none" else draft, args.tokens)
                rates.setdefault((draft, mode), []).append(rate)
                outputs.setdefault(draft, set()).add(tokens)
    for draft in args.drafts:
        whole = statistics.median(rates[draft, "whole"])
        line = [f"{draft:7s} whole {whole:6.1f}"]
        for mode in list(modes)[1:]:
            median = statistics.median(rates[draft, mode])
            line.append(f"{mode} {median:6.1f} ({median / whole:.2f}x)")
        rounds = " ".join("/".join(f"{rates[draft, mode][r]:.3g}" for mode in modes) for r in range(args.rounds))
        same = "same tokens" if len(outputs[draft]) == 1 else "TOKENS DIFFER"
        print(", ".join(line) + f" tok/s (rounds {rounds}; {same})")


if __name__ == "__main__":
    main()
