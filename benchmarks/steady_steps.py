"""The engine's steady decode step, timed at each batch size: what batched decoding costs once every
row has read its prompt, without the prompt and the first steps' one-time work. Run by hand:

    python benchmarks/steady_steps.py bench_models/qwen3.5-0.8b            # 1 and 8 rows, plain greedy
    python benchmarks/steady_steps.py bench_models/qwen3.5-0.8b --rows 1 4 8 --repeats 3

Each measurement: `rows` prompts of 32-39 tokens read, a few steps decoded, then 30 steps timed one by
one (each ends in the host's read of its tokens); prints the median and fastest step and the
throughput ratio to one row (rows x one row's step / this step), each repeat in turn so that a shared
machine's drift spreads over all sizes. Uses only the public API, so the same file times any commit
(`PYTHONPATH` at that commit's tree).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx_hybrid
from mlx_hybrid.engine import Engine, PrefixStore


def steady_step_ms(model, tokenizer, rows: int, steps: int = 30) -> list[float]:
    engine = Engine(model, tokenizer, None, prefix_store=PrefixStore(0))
    for row in range(rows):
        engine.submit([3 + row] * (32 + row), max_tokens=10_000, stop_tokens=[])
    for _ in range(rows + 4):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    model, tokenizer = mlx_hybrid.load(args.checkpoint)
    for repeat in range(args.repeats):
        medians = {rows: statistics.median(steady_step_ms(model, tokenizer, rows)) for rows in args.rows}
        one = medians.get(1)
        for rows, median in medians.items():
            ratio = f"  {rows * one / median:.2f}x one row's tokens/s" if one else ""
            print(f"repeat {repeat + 1}: {rows} rows: median step {median:.1f} ms{ratio}")


if __name__ == "__main__":
    main()
