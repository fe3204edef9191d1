"""Every way of producing tokens, recorded: a refactor of the engine, the API or the commands must
leave each output as it was, token for token.

    python benchmarks/same_outputs.py --out before.json       # on the commit before
    python benchmarks/same_outputs.py --compare before.json   # on the change: exit 1 on any difference

Runs on the fixture checkpoints (tests/fixtures), each family's HF and GGUF files (float32 and
quantized; `--cpu-activations` as load() takes it, for a quantized file's products): plain greedy and
sampled decoding (seeded), MTP speculation greedy and sampled at k = 1 and 3 (adaptive and not),
n-gram and draft-model speculation, a batch of prompts with mixed settings and lengths, penalties and
logit bias, a JSON schema grammar with and without drafts, logprobs, a stop at max_tokens, and a
checkpoint resumed in a second turn. Records token ids, finish reasons and logprobs (rounded to 1e-5)
of each case.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx_hybrid
from mlx_hybrid import Engine, SamplingParams, batch_generate, load, stream_generate
from mlx_hybrid.drafting import make_drafter

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
PROMPTS = ["The quick brown fox", "1, 2, 3, 4, 5, 6, 7", "Once upon a time there was", "hello hello hello hello"]


def tokens_of(model, tokenizer, prompt, **kwargs) -> dict:
    out = list(stream_generate(model, tokenizer, prompt, **kwargs))
    return {"tokens": [r.token for r in out], "finish": out[-1].finish_reason if out else None}


def cases(family: str, path: Path, cpu_activations: str | None = None) -> dict:
    model, tokenizer = load(
        path, **({"cpu_activations": cpu_activations} if cpu_activations and path.suffix == ".gguf" else {})
    )
    has_mtp = getattr(model, "mtp", None) is not None
    prompt = PROMPTS[0]
    out = {
        "greedy": tokens_of(model, tokenizer, prompt, max_tokens=24, draft=None),
        "sampled": tokens_of(model, tokenizer, prompt, max_tokens=24, draft=None, temp=0.8, top_p=0.9, seed=3),
        "penalties": tokens_of(
            model,
            tokenizer,
            PROMPTS[3],
            max_tokens=24,
            draft=None,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            logit_bias={5: 3.0},
        ),  # fmt: skip
        "ngram": tokens_of(model, tokenizer, PROMPTS[1], max_tokens=24, draft="ngram"),
        "ngram-sampled": tokens_of(model, tokenizer, PROMPTS[1], max_tokens=24, draft="ngram", temp=0.7, seed=5),
        "draft-model": tokens_of(model, tokenizer, prompt, max_tokens=16, draft=None, draft_model=model),
        "json": tokens_of(
            model,
            tokenizer,
            prompt,
            max_tokens=40,
            draft=None,
            response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        ),  # fmt: skip
    }
    if has_mtp:
        for k in (1, 3):
            out[f"mtp-k{k}"] = tokens_of(model, tokenizer, prompt, max_tokens=24, draft="mtp", num_draft_tokens=k)
            out[f"mtp-k{k}-sampled"] = tokens_of(
                model, tokenizer, prompt, max_tokens=24, draft="mtp", num_draft_tokens=k, temp=0.9, seed=7
            )
        out["mtp-fixed"] = tokens_of(model, tokenizer, prompt, max_tokens=24, draft="mtp", draft_p_min=0)
        out["mtp-json"] = tokens_of(
            model,
            tokenizer,
            prompt,
            max_tokens=40,
            draft="mtp",
            response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        )
    draft = "mtp" if has_mtp else None
    out["batch"] = batch_generate(model, tokenizer, PROMPTS, max_tokens=20, draft=draft, max_batch=3)
    out["batch-sampled"] = batch_generate(model, tokenizer, PROMPTS, max_tokens=20, draft=draft, temp=0.8, seed=11)
    settings = [
        {"max_tokens": 12, "logprobs": 2},
        {"max_tokens": 20, "temp": 0.7, "seed": 2},
        {"max_tokens": 5},
        {"max_tokens": 16, "temp": 0.5, "seed": 9, "logprobs": 0},
    ]
    drafter = make_drafter(model, tokenizer, draft, None, None, 0.0) if draft else None
    engine = Engine(model, tokenizer, drafter, 3, max_batch=3)
    sequences = [engine.submit(p, params=SamplingParams().replace(**s)) for p, s in zip(PROMPTS, settings)]
    events = [[] for _ in sequences]
    while engine.step():
        pass
    for i, s in enumerate(sequences):
        while not s.events.empty():
            events[i].append(s.events.get())
    out["engine"] = [
        {
            "tokens": s.tokens,
            "finish": s.finish_reason,
            "logprobs": [
                [round(t.logprob, 5), [(a, round(b, 5)) for a, b in t.top]] for e in ev for t in e.logprobs or []
            ],
        }
        for s, ev in zip(sequences, events)
    ]
    # a second turn resumed from the first one's checkpoint
    first = engine.submit(PROMPTS[2], max_tokens=8)
    engine.run()
    second = engine.submit(first.prompt + first.tokens + tokenizer.encode(" and then"), max_tokens=8)
    engine.run()
    out["resumed"] = {"tokens": second.tokens, "cached": second.cached_tokens}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write the outputs here")
    p.add_argument("--compare", type=Path, help="compare with outputs written before; exit 1 on a difference")
    p.add_argument(
        "--cpu-activations",
        choices=["float32", "int8"],
        default=None,
        help="how the GGUF files' quantized products compute (default: load()'s)",
    )
    args = p.parse_args()
    sources = {
        f"{family}/{kind}": FIXTURES / family / kind
        for family in ("qwen35", "qwen35moe", "qwen3next", "kimilinear")
        for kind in ("hf", "model.gguf", "model-Q8_0.gguf", "model-Q4_K_M.gguf")
    }
    outputs = {}
    for name, path in sources.items():
        if path.exists():
            outputs[name] = cases(name, path, args.cpu_activations)
            print(f"{name}: {len(outputs[name])} cases", flush=True)
    if args.out:
        args.out.write_text(json.dumps(outputs, indent=1))
    if args.compare:
        before = json.loads(args.compare.read_text())
        now = json.loads(json.dumps(outputs))
        differ = [f"{m}: {c}" for m in before for c in before[m] if now.get(m, {}).get(c) != before[m][c]]
        missing = [m for m in before if m not in now]
        for line in differ + [f"{m}: missing" for m in missing]:
            print("DIFFERS", line)
        cases_count = sum(len(v) for v in before.values())
        print(f"{cases_count - len(differ)} of {cases_count} cases identical (mlx_hybrid {mlx_hybrid.__file__})")
        sys.exit(1 if differ or missing else 0)


if __name__ == "__main__":
    main()
