"""Where the host's time goes in a pass of the engine, through the Python API: plain decoding, the MTP
head and the DFlash drafter on the bundled model (or --model's), greedy.

    python benchmarks/round_phases.py
    python benchmarks/round_phases.py --drafts none mtp --tokens 512 --rounds 5

A speculative pass's parts, in milliseconds a pass (the medians of --rounds runs, after one untimed
run):
- drafting: the drafts' graph built (`step.build_batch`), the drafter's layers queued as they are built;
- verify: the trunk's pass over the round's tokens built and queued (`step.run_model`); where the CPU
  computes a small model beside the host (`ops.layer_built`), building waits here whenever the host is
  a hundred or so operations ahead of MLX's CPU stream, so this part is the CPU's time as much as the
  host's;
- read: the tokens chosen and read back (`step.choose_tokens`): the wait for the pass's last layers;
- rest: the rows advanced (`Engine._advance`: acceptance, the caches rolled back, the tokens handed
  out) and what the step does besides.
Plain decoding queues the next step before it reads this one's token (`step.plain_round_ahead`): one
part.
The parts are timed by wrapping those functions of the engine's scheduler, in this process only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx_hybrid
from mlx_hybrid.engine import scheduler

sys.path.insert(0, str(Path(__file__).parent))
from compare_trees import PROMPT

PARTS = {"build_batch": "drafting", "run_model": "verify", "choose_tokens": "read", "plain_round_ahead": "plain step"}


def timed_parts() -> dict[str, float]:
    """Wrap the scheduler's parts of a pass; returns the dict their seconds add up in."""
    seconds = defaultdict(float)

    def wrapped(function, part):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - started

        return timed

    for name, part in PARTS.items():
        setattr(scheduler, name, wrapped(getattr(scheduler, name), part))
    return seconds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint directory or GGUF file (default: the bundled model)")
    p.add_argument("--drafts", nargs="+", choices=["none", "mtp", "dflash"], default=["none", "mtp", "dflash"])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model, tokenizer = mlx_hybrid.load(args.model or mlx_hybrid.bundled_model_path())
    seconds = timed_parts()
    for draft in args.drafts:
        runs = []
        for _ in range(args.rounds + 1):  # the first untimed: kernel builds and checks
            seconds.clear()
            started, tokens, per_pass = time.perf_counter(), 0, None
            for response in mlx_hybrid.stream_generate(
                model, tokenizer, PROMPT, args.tokens, temp=0.0, draft=None if draft == "none" else draft
            ):
                tokens += 1
                per_pass = response.tokens_per_pass
            wall = time.perf_counter() - started
            passes = round(tokens / per_pass) if draft != "none" and per_pass else tokens
            parts = {part: 1e3 * s / passes for part, s in seconds.items()}
            parts["rest"] = 1e3 * wall / passes - sum(parts.values())
            runs.append((tokens / wall, per_pass if draft != "none" else 1.0, 1e3 * wall / passes, parts))
        runs = runs[1:]
        median = {key: statistics.median(run[3].get(key, 0.0) for run in runs) for key in runs[0][3]}
        print(
            f"{draft}: {statistics.median(r[0] for r in runs):.0f} tokens/s, {runs[0][1]:.2f} tokens a pass, "
            f"{statistics.median(r[2] for r in runs):.2f} ms a pass: "
            + ", ".join(f"{part} {ms:.2f}" for part, ms in median.items())
        )


if __name__ == "__main__":
    main()
