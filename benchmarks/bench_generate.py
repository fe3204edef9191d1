"""Prefill and decode speed and peak memory: mlx_hybrid against mlx-lm, same run, same files.

    python benchmarks/make_checkpoints.py --out bench_models     # once
    python benchmarks/bench_generate.py bench_models/qwen3.5-0.8b

Both runners load the same checkpoint in the same dtype, in this process (so the
same BLAS: the script restarts itself with OpenBLAS preloaded where installed;
pass --reference-blas to keep MLX's own). Prints tokens/s for a prefill of each
prompt length and for greedy decoding, and peak memory, for --rounds rounds that
alternate the runners; then the medians and their mlx_hybrid / mlx-lm ratios.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import mlx.core as mx


def measure(name, generate, prompt_lengths, decode_tokens):
    """Prefill and decode tokens/s and peak memory of each runner's own streaming generation.

    Timed here, the same way for both runners (their own figures count differently:
    mlx-lm's decode rate counts the first token, which its prompt time paid for).
    Prefill: prompt tokens over the time to the first token. Decode: the tokens after
    the first over the time from the first to the last.
    """
    results = {}
    for _ in generate(list(range(3, 67)), 8):  # warm up: compiled graphs, allocator caches
        pass
    for n in prompt_lengths:
        prompt = mx.random.randint(3, 512, (n,), key=mx.random.key(n)).tolist()
        mx.reset_peak_memory()
        start = time.perf_counter()
        arrivals = [time.perf_counter() for _ in generate(prompt, decode_tokens)]
        if len(arrivals) < 2:
            raise SystemExit(f"{name} stopped after {len(arrivals)} token(s); decode speed needs two")
        results[f"prefill@{n}"] = n / (arrivals[0] - start)
        results[f"decode@{n}"] = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
        results[f"peak GB@{n}"] = mx.get_peak_memory() / 1e9
    print(f"{name:19s} " + "  ".join(f"{k} {v:7.2f}" for k, v in results.items()), flush=True)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reference-blas", action="store_true", help="do not preload OpenBLAS")
    p.add_argument("--only", choices=["mlx_hybrid", "mlx-lm"], help="measure one runner")
    p.add_argument("--rounds", type=int, default=3, help="rounds of both runners; medians are compared")
    args = p.parse_args()
    if args.reference_blas:
        os.environ["MLX_HYBRID_BLAS"] = "reference"
    from mlx_hybrid.blas import active_blas, prefer_optimized_blas

    prefer_optimized_blas()
    dtype = getattr(mx, args.dtype)
    print(f"checkpoint {args.checkpoint}, {args.dtype}, BLAS {active_blas()}, device {mx.default_device()}")
    runners = {
        "mlx_hybrid": lambda: _mlx_hybrid(args.checkpoint, dtype),
        "mlx-lm": lambda: _mlx_lm(args.checkpoint, args.dtype, dtype),
    }
    if args.only:
        runners = {args.only: runners[args.only]}
    # Rounds alternate the runners, each loaded alone (so peak memory is its own), and
    # the medians over rounds are compared: this machine's speed drifts from minute to minute.
    rounds = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, load in runners.items():
            generate = load()
            rounds[name].append(measure(name, generate, args.prompt_lengths, args.decode_tokens))
            del generate
            gc.collect()
            mx.clear_cache()
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rounds.items()}
    for name, values in medians.items():
        print(f"{name + ' median':19s} " + "  ".join(f"{k} {v:7.2f}" for k, v in values.items()))
    if len(medians) == 2:
        ours, theirs = medians["mlx_hybrid"], medians["mlx-lm"]
        print("ratios of medians (mlx_hybrid / mlx-lm): " + "  ".join(f"{k} {ours[k] / theirs[k]:.2f}x" for k in ours))


def _mlx_hybrid(checkpoint, dtype):
    import mlx_hybrid

    model, tokenizer = mlx_hybrid.load(checkpoint, dtype=dtype)
    return lambda prompt, n: mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=n, draft=None)


def _mlx_lm(checkpoint, dtype_name, dtype):
    import mlx_lm

    model, tokenizer = mlx_lm.load(checkpoint, model_config={"dtype": dtype_name})
    model.set_dtype(dtype)
    return lambda prompt, n: mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n)


if __name__ == "__main__":
    sys.exit(main())
