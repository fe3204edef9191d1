"""Decoding speed of two or more source trees of the package (a commit before a change, checked out
with `git worktree add`, and this one), alternated in fresh processes: plain decoding, the MTP head
and the DFlash drafter through the Python API, greedy, on the bundled model (or --model's, with the
--drafts it takes).

    git worktree add /tmp/before HEAD~1
    python benchmarks/compare_trees.py /tmp/before . --rounds 7
    python benchmarks/compare_trees.py /tmp/before . --model FILE.gguf --drafts none --tokens 200
    python benchmarks/compare_trees.py /tmp/before . --held-out 8 --tokens 128   # examples/eval_tiny.py's prompts

Each round runs every tree once, in its own process (its package first on the path, its CPU kernels
built from its sources), each round starting from the next tree, each drafter twice after an untimed
run; a round's figure is the better of the two. Prints each round, then per tree the medians, each
drafter's ratio to plain decoding, and whether the trees' tokens agree. Beside tokens/s, tokens per CPU-second (the process's threads
together, `time.process_time`): the work a token costs, which a shared machine's drift moves less
than the wall clock, and which bounds what a drafter can gain where plain decoding already keeps
every core busy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
DRAFTS = ("none", "mtp", "dflash")


def measure(model_path: str | None, drafts: list[str], tokens: int, held_out: int) -> dict:
    """In a tree's own process: {draft: [tokens/s, tokens per CPU-second, the tokens]}."""
    from layer_queue import held_out_prompts

    import mlx_hybrid

    model, tokenizer = mlx_hybrid.load(model_path or mlx_hybrid.bundled_model_path())
    prompts = held_out_prompts(tokenizer, held_out) if held_out else [PROMPT]

    def decode(draft):
        started, cpu, out = time.perf_counter(), time.process_time(), []
        for prompt in prompts:
            for response in mlx_hybrid.stream_generate(
                model, tokenizer, prompt, tokens, temp=0.0, draft=None if draft == "none" else draft
            ):
                out.append(response.token)
        return len(out) / (time.perf_counter() - started), len(out) / (time.process_time() - cpu), out

    results = {}
    for draft in drafts:
        decode(draft)  # untimed: kernel builds and checks
        runs = [decode(draft) for _ in range(2)]
        results[draft] = [max(run[0] for run in runs), max(run[1] for run in runs), runs[0][2]]
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", help="source trees (each holds mlx_hybrid/)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--model", help="a checkpoint directory or GGUF file (default: the bundled model)")
    p.add_argument("--drafts", nargs="+", choices=DRAFTS, default=list(DRAFTS), help="default: all; plain first")
    p.add_argument(
        "--held-out",
        type=int,
        default=0,
        metavar="N",
        help="the first 64 tokens of N held-out files "
        "(examples/eval_tiny.py's prompts), each decoded for --tokens, in place of the one prompt",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.held_out < 0:
        p.error("--held-out must be 0 or more")
    drafts = ["none", *(d for d in args.drafts if d != "none")]
    if args.child:
        print(json.dumps(measure(args.model, drafts, args.tokens, args.held_out)))
        return
    model = str(Path(args.model).resolve()) if args.model else None
    trees = [str(Path(tree).resolve()) for tree in args.trees]
    for tree in trees:
        if not (Path(tree) / "mlx_hybrid" / "__init__.py").is_file():
            p.error(f"{tree} holds no mlx_hybrid package")
    rates, per_cpu_second, tokens = {}, {}, {}
    for round_ in range(args.rounds):
        # each round starts from the next tree: on the VMs measured, the first process of a round ran
        # about 8% faster than the one after it, whichever tree it ran
        for tree in trees[round_ % len(trees) :] + trees[: round_ % len(trees)]:
            env = {**os.environ, "PYTHONPATH": tree}
            command = [sys.executable, __file__, tree, "--child", "--tokens", str(args.tokens), "--drafts", *drafts]
            command += ["--held-out", str(args.held_out)]
            command += ["--model", model] if model else []
            done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
            if done.returncode != 0:
                sys.exit(f"{tree}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            for draft, (rate, cpu_rate, out) in result.items():
                rates.setdefault((tree, draft), []).append(rate)
                per_cpu_second.setdefault((tree, draft), []).append(cpu_rate)
                tokens.setdefault(draft, set()).add(tuple(out))
            print(
                f"round {round_ + 1} {tree}: " + ", ".join(f"{d} {r:.0f}" for d, (r, _, _) in result.items()),
                flush=True,
            )
    for tree in trees:
        for label, figures in (("tok/s", rates), ("tokens per CPU-second", per_cpu_second)):
            plain = statistics.median(figures[tree, "none"])
            line = [f"plain {plain:.1f} {label}"]
            for draft in drafts[1:]:
                median = statistics.median(figures[tree, draft])
                line.append(f"{draft} {median:.1f} ({median / plain:.2f}x plain)")
            print(f"{tree}: " + ", ".join(line))
    print("tokens: " + ", ".join(f"{d} {'the same' if len(tokens[d]) == 1 else 'DIFFER'}" for d in drafts))


if __name__ == "__main__":
    main()
