"""What constrained decoding costs, run by hand: tokens/s and MTP tokens per trunk pass with a
grammar, each against the same request unconstrained, measured beside it in the same run.

    python benchmarks/constrained.py                        # the bundled model
    python benchmarks/constrained.py --model path.gguf      # any checkpoint with an MTP head

For each prompt (chat questions, rendered by the model's template), greedy, `--tokens` at
most, in --rounds rounds, each setting:
- a JSON schema (an object of a few typed fields), plain decoding and MTP drafting;
- a regular expression that any text matches (the grammar's bookkeeping alone), MTP;
and right after it its baseline: the same request unconstrained, decoding as many tokens
(end tokens ignored), so that both time the same number of steps. Tokens/s counts the tokens
after the first over the time from the first to the last, as `bench_generate.py`. Under MTP
a grammar masks the head's logits too, so its drafts are ones the grammar allows.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library

from mlx_hybrid.processors import Grammar  # noqa: I001

BUNDLED = Path(mlx_hybrid.__file__).parent / "data" / "tiny-qwen35.gguf"
QUESTIONS = [
    "Describe a city as JSON.",
    "Give me a person record with a name, an age and a list of hobbies.",
    "What is the weather like today?",
    "Write a short function that adds two numbers.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "count", "tags", "active"],
    "additionalProperties": False,
}
SETTINGS = {  # label -> (draft, grammar)
    "plain + json schema": (None, Grammar("json_schema", SCHEMA)),
    "mtp + json schema": ("mtp", Grammar("json_schema", SCHEMA)),
    "mtp + any-text regex": ("mtp", Grammar("regex", r"(?s:.*)")),
}


def run(model, tokenizer, prompt, tokens, draft, grammar, **settings):
    """(tokens generated, tokens/s after the first, MTP tokens per trunk pass or None)."""
    last = None
    for last in mlx_hybrid.stream_generate(
        model, tokenizer, prompt, max_tokens=tokens, draft=draft, grammar=grammar, **settings
    ):
        pass
    return last.generation_tokens, last.generation_tps, last.tokens_per_pass


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BUNDLED), help="a checkpoint with an MTP head (default: the bundled model)")
    p.add_argument("--tokens", type=int, default=96, help="most tokens per answer")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from mlx_hybrid.blas import active_blas
    from mlx_hybrid.prompt import chat_prompt

    model, tokenizer = mlx_hybrid.load(args.model)
    prompts = [chat_prompt(tokenizer, [{"role": "user", "content": q}]).ids for q in QUESTIONS]
    print(f"model: {args.model}, ops {mlx_hybrid.ops.backend_name()}, BLAS {active_blas()}")
    run(model, tokenizer, prompts[0], 8, "mtp", SETTINGS["mtp + json schema"][1])  # warm up
    ratios = {label: [] for label in SETTINGS}
    passes = {label: ([], []) for label in SETTINGS}
    counts = {label: 0 for label in SETTINGS}
    for _ in range(args.rounds):
        for prompt in prompts:
            for label, (draft, grammar) in SETTINGS.items():
                n, tps, per_pass = run(model, tokenizer, prompt, args.tokens, draft, grammar)
                _, base_tps, base_per_pass = run(model, tokenizer, prompt, n, draft, None, stop_tokens=())
                ratios[label].append(tps / base_tps)
                counts[label] += n
                if per_pass is not None:
                    passes[label][0].append(per_pass)
                    passes[label][1].append(base_per_pass)
    print(f"{'':22s} {'tokens/s vs unconstrained':>26s} {'tokens/pass (unconstrained)':>28s} {'tokens':>7s}")
    for label in SETTINGS:
        constrained, free = passes[label]
        per_pass = f"{statistics.mean(constrained):.2f} ({statistics.mean(free):.2f})" if constrained else "-"
        print(f"{label:22s} {statistics.median(ratios[label]):25.2f}x {per_pass:>28s} {counts[label]:7d}")


if __name__ == "__main__":
    main()
