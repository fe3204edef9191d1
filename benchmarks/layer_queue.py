"""How the CPU schedules a pass of a model whose products each run on one thread (the bundled
model), each decision of `ops.schedule` added in turn, in one run: plain decoding, the MTP head and
the DFlash drafter through the Python API, greedy.

    python benchmarks/layer_queue.py                      # the bundled model, 3 alternated rounds
    python benchmarks/layer_queue.py --model DIR_OR_GGUF --rounds 5 --tokens 128
    python benchmarks/layer_queue.py --shape qwen3.5-0.8b --drafts none --tokens 32 --one-thread-weights 1e12
    python benchmarks/layer_queue.py --held-out 8 --tokens 128    # examples/eval_tiny.py's prompts

The modes, each with the decisions of the one before it: "whole" queues passes whole and steps in
turn, with the kernels on every core and the drafts' verdicts read before the verify pass; "by
layer" queues each layer as it is built (`ops.layer_built`); "steps ahead" queues plain decoding's
next step before reading this one's tokens (`ops.overlap_decode_steps`); "one thread" keeps the
queued layers' kernels on MLX's thread (`cpu_kernels.keep_to_one_thread`); "one wait" reads a
speculative pass's verdicts with its tokens (`ops.read_draft_verdicts_first`); "opened with the pass"
takes a greedy round's first MTP head step while the verify pass before it computes
(`ops.open_drafting_with_pass`); "no p-min floor" lets drafters propose every draft by default, rather
than stop below p-min 0.1 (`ops.drafts_stop_below_p_min`): this tree's decisions.
Prints tokens/s per round, the medians and their ratios to "whole", each drafter's to plain
decoding in each mode (the median of the rounds' ratios), and checks that every mode gives
the same tokens. --one-thread-weights moves the bound under which a model's products count as
running on one thread (`ops.schedule`): a large value queues the layers of any model. --shape: random
weights of a shape of benchmarks/shapes.py, prompted with the bundled model's token ids. --held-out N:
the first 64 tokens of N held-out files (those examples/eval_tiny.py generates from), each decoded for
--tokens, in place of the one prompt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library
import mlx.core as mx  # noqa: I001
from mlx_hybrid import ops
from mlx_hybrid.ops import cpu_kernels, schedule

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def decode(model, tokenizer, draft: str | None, tokens: int, prompts) -> tuple[float, tuple[int, ...]]:
    started, out = time.perf_counter(), []
    for prompt in prompts:
        for response in mlx_hybrid.stream_generate(model, tokenizer, prompt, tokens, temp=0.0, draft=draft):
            out.append(response.token)
    return len(out) / (time.perf_counter() - started), tuple(out)


def held_out_prompts(tokenizer, count: int, length: int = 64) -> list[list[int]]:
    """examples/eval_tiny.py's prompts: the first `length` tokens of the first `count` held-out files."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from train_tiny import corpus_files, opening_tokens, read

    return opening_tokens((tokenizer.encode(read(f)) for f in corpus_files()[1]), count, length)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--shape", default=None, help="random weights of this shape (benchmarks/shapes.py)")
    p.add_argument("--drafts", nargs="+", default=["none", "mtp", "dflash"], help="none, mtp, ngram, dflash")
    p.add_argument("--one-thread-weights", type=float, default=None, help="see above")
    p.add_argument("--held-out", type=int, default=0, metavar="N", help="see above")
    args = p.parse_args()
    if args.one_thread_weights is not None:
        schedule.ONE_THREAD_WEIGHTS = int(args.one_thread_weights)
    model, tokenizer = mlx_hybrid.load(args.model or mlx_hybrid.bundled_model_path())
    if args.shape:
        from shapes import SHAPES, random_model

        model = random_model(SHAPES[args.shape]())
    prompts = held_out_prompts(tokenizer, args.held_out) if args.held_out else [PROMPT]
    decided = {
        name: getattr(ops, name)
        for name in (
            "layer_built", "overlap_decode_steps", "read_draft_verdicts_first", "open_drafting_with_pass",
            "drafts_stop_below_p_min",
        )
    }  # fmt: skip
    keep_to_one_thread = cpu_kernels.keep_to_one_thread

    def whole_passes(output, widest_product, evaluate=False):
        keep_to_one_thread(False)
        if evaluate:
            mx.eval(output)

    # each mode: (layers queued, plain steps ahead, kernels kept to one thread, one wait a speculative pass,
    # the head's first step with the pass, no p-min floor by default)
    modes = {
        "whole": (False, False, False, False, False, False),
        "by layer": (True, False, False, False, False, False),
        "steps ahead": (True, True, False, False, False, False),
        "one thread": (True, True, True, False, False, False),
        "one wait": (True, True, True, True, False, False),
        "opened with the pass": (True, True, True, True, True, False),
        "no p-min floor": (True, True, True, True, True, True),
    }

    def decide(queued, ahead, one_thread, one_wait, opened, no_floor):
        ops.layer_built = decided["layer_built"] if queued else whole_passes
        ops.overlap_decode_steps = decided["overlap_decode_steps"] if ahead else (lambda widest: False)
        cpu_kernels.keep_to_one_thread = keep_to_one_thread if one_thread else (lambda value: keep_to_one_thread(False))
        ops.read_draft_verdicts_first = decided["read_draft_verdicts_first"] if one_wait else (lambda widest: True)
        ops.open_drafting_with_pass = decided["open_drafting_with_pass"] if opened else (lambda widest: False)
        ops.drafts_stop_below_p_min = decided["drafts_stop_below_p_min"] if no_floor else (lambda widest: True)

    rates, outputs = {}, {}
    for draft in args.drafts:  # a first untimed run: kernel builds and checks
        decode(model, tokenizer, None if draft == "none" else draft, 8, prompts[:1])
    for round_ in range(args.rounds):
        for mode, decisions in modes.items():
            decide(*decisions)
            for draft in args.drafts:
                rate, tokens = decode(model, tokenizer, None if draft == "none" else draft, args.tokens, prompts)
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
    if "none" in args.drafts:  # each round's drafter against that round's plain decoding, the same mode
        for draft in [d for d in args.drafts if d != "none"]:
            ratios = {
                mode: statistics.median(a / b for a, b in zip(rates[draft, mode], rates["none", mode]))
                for mode in modes
            }
            print(f"{draft} against plain decoding, the median of the rounds: "
                  + ", ".join(f"{mode} {ratio:.2f}x" for mode, ratio in ratios.items()))  # fmt: skip


if __name__ == "__main__":
    main()
