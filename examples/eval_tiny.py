"""Measure the bundled model on held-out standard-library files (not seen in training).

    python examples/eval_tiny.py                      # the bundled GGUF
    python examples/eval_tiny.py --model runs/tiny/tiny-qwen35.gguf

Reports, teacher-forced over windows of held-out code: the trunk's next-token
accuracy, and how often the MTP head's first draft equals the trunk's own greedy
next token (what speculative decoding accepts), and the share of the vocabulary that
covers 99% of the held-out tokens. Then, generating greedily from held-out prompts
through the Python API with no set-up call (as an app would): mean tokens per trunk
pass and acceptance by draft position (mean over the prompts) for k = 1..4 and the
wall-clock speedup over plain decoding measured in this run,
drafting over the whole vocabulary and over the `--draft-vocab` most frequent tokens
(1/8 of the 2048, as 32k is of Qwen3.5's 248k), both with exactly k drafts a round,
then with the default (adaptive) settings; then the same for the model's DFlash drafter
(the bundled one, examples/train_dflash.py, or --draft-model) at k = 3, 7 and its block
less one: exactly k drafts a round from a block of k + 1 (p-min 0; the whole block at its size less
one), then the default settings. --rounds N runs them all N times in turn, each round against a plain
run before and after it, and gives the medians of the speedups and tokens/s.

    python examples/eval_tiny.py --draft-model runs/dflash/drafter   # a drafter not installed yet
    python examples/eval_tiny.py --rounds 3                          # interleaved medians of 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx_hybrid  # first, as an app would: on Linux it loads OpenBLAS before MLX's library

import mlx.core as mx  # noqa: I001
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from mlx_hybrid.blas import active_blas  # noqa: E402
from mlx_hybrid.loaders import companion_drafter, load_draft_model  # noqa: E402
from train_tiny import corpus_files, opening_tokens, read  # noqa: E402


def teacher_forced(model, tokens: list[int], window: int, windows: int):
    trunk_hits = draft_hits = count = 0
    for start in range(0, min(len(tokens) - window - 1, window * windows), window):
        ids = mx.array([tokens[start : start + window + 1]])
        hidden = model.hidden_states(ids[:, :-1])
        trunk = mx.argmax(model.logits_from_hidden(hidden), axis=-1)[0]  # predicts ids[t + 1]
        draft = mx.argmax(model.mtp_teacher_forced(hidden[:, :-1], ids[:, 1:-1]), axis=-1)[0]  # predicts ids[t + 2]
        targets = ids[0, 1:]
        trunk_hits += int((trunk == targets).sum())
        draft_hits += int((draft == trunk[1:]).sum())  # the first draft is accepted iff the trunk agrees
        count += window
    return trunk_hits / count, draft_hits / (count - count // window)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--windows", type=int, default=64, help="teacher-forced windows in all")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts to generate from")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-vocab", type=int, default=256, help="the reduced draft vocabulary to compare")
    p.add_argument("--draft-model", default=None, help="the DFlash drafter (default: the model's own, beside it)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of every setting in turn, each against its own plain runs; figures are the medians",
    )
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    print(f"BLAS: {active_blas()}")
    model, tokenizer = mlx_hybrid.load(args.model or mlx_hybrid.bundled_model_path())
    _, held_out = corpus_files()
    encoded = [tokenizer.encode(read(f)) for f in held_out]
    tokens = [t for ids in encoded for t in ids + tokenizer.eos_token_ids[-1:]]
    trunk_accuracy, first_draft = teacher_forced(model, tokens, args.window, args.windows)
    print(f"held-out files: {len(held_out)}, {len(tokens)} tokens")
    print(f"trunk next-token accuracy: {trunk_accuracy:.3f}")
    print(f"first MTP draft agrees with the trunk (acceptance of draft 1): {first_draft:.3f}")
    counts = np.sort(np.bincount(tokens, minlength=model.args.vocab_size))[::-1]
    covering = int(np.searchsorted(np.cumsum(counts), 0.99 * counts.sum())) + 1
    print(
        f"the {covering} most frequent tokens ({covering / model.args.vocab_size:.1%} of the vocabulary) "
        f"cover 99% of the held-out tokens"
    )

    prompts = opening_tokens(encoded, args.prompts, args.prompt_tokens)

    def run(**kwargs):
        tokens, tps, per_pass, by_position = [], [], [], []
        for prompt in prompts:
            responses = list(mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens, **kwargs))
            tokens.append([r.token for r in responses])
            tps.append(responses[-1].generation_tps)
            per_pass.append(responses[-1].tokens_per_pass or 1.0)
            by_position.append(responses[-1].acceptance_by_position or [])
        positions = max(map(len, by_position))
        mean_by_position = [np.mean([rates[j] for rates in by_position if len(rates) > j]) for j in range(positions)]
        return tokens, float(np.mean(tps)), float(np.mean(per_pass)), mean_by_position

    settings = {
        "whole vocabulary, k drafts": dict(draft_vocab=0, draft_p_min=0),
        f"{args.draft_vocab} tokens, k drafts": dict(draft_vocab=args.draft_vocab, draft_p_min=0),
        "default settings": {},
    }
    configs = [
        (f"MTP k={k}, {label}", dict(draft="mtp", num_draft_tokens=k, **extra))
        for label, extra in settings.items()
        for k in (1, 2, 3, 4)
    ]
    drafter = load_draft_model(args.draft_model) if args.draft_model else companion_drafter(model)
    if drafter is None:
        print("no DFlash drafter beside the model (give --draft-model)")
    block = drafter.args.block_size if drafter is not None else 0
    dflash_settings = {"k drafts (p-min 0)": dict(draft_p_min=0), "default settings": {}}
    configs += [
        (f"DFlash k={k}, {label}", dict(draft="dflash", draft_model=drafter, num_draft_tokens=k, **extra))
        for label, extra in (dflash_settings.items() if drafter is not None else ())
        for k in sorted({min(3, block - 1), min(7, block - 1), block - 1})
    ]
    run(draft=None)  # warm up
    figures = {label: [] for label, _ in configs}  # per round: (speedup, tokens/s, per pass, by position, same)
    for _ in range(args.rounds):
        plain_tokens, plain_before, _, _ = run(draft=None)
        measured = [(label, run(**kwargs)) for label, kwargs in configs]
        _, plain_after, _, _ = run(draft=None)
        plain_tps = (plain_before + plain_after) / 2  # before and after: the machine's drift shows, and averages out
        print(
            f"plain greedy decoding: {plain_before:.1f} tokens/s before, {plain_after:.1f} after (baseline: the mean)"
        )
        for label, (spec_tokens, tps, per_pass, by_position) in measured:
            figures[label].append((tps / plain_tps, tps, per_pass, by_position, spec_tokens == plain_tokens))
    for label, rounds in figures.items():
        speedup, tps = (float(np.median([r[i] for r in rounds])) for i in (0, 1))
        _, _, per_pass, by_position, _ = rounds[0]  # greedy: the same every round
        accepted = ", ".join(f"{rate:.0%}" for rate in by_position)
        print(
            f"{label}: {per_pass:.2f} tokens per trunk pass, accepted by draft position "
            f"{accepted}, {tps:.1f} tokens/s, speedup {speedup:.2f}x, "
            f"same tokens as plain: {all(r[4] for r in rounds)}"
        )


if __name__ == "__main__":
    main()
