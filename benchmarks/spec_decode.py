"""Plain vs speculative decoding speed, run by hand.

    python benchmarks/spec_decode.py                       # Qwen3.5-0.8B shape, random weights
    python benchmarks/spec_decode.py --model path.gguf     # a real checkpoint (MTP acceptance is real too)

Prints, each against plain decoding measured in the same run:
- the verify pass (1 + k tokens, snapshots on) relative to one decode step;
- tokens/s with the model's MTP head drafting;
- tokens/s with an oracle drafter at set acceptance rates (MTP drafting runs
  alongside, so its cost is included; only its tokens are replaced).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))

import mlx_hybrid  # noqa: E402
from mlx_hybrid.cache import KVCache, RecurrentCache  # noqa: E402
from mlx_hybrid.generation import prefill  # noqa: E402
from mlx_hybrid.sampling import Sampler  # noqa: E402
from mlx_hybrid.speculative import MTPDrafter, OracleDrafter, SpeculativeDecoder, keep_snapshot_buffers  # noqa: E402
from shapes import SHAPES, random_model  # noqa: E402


def timed(fn, repeat=3):
    fn()  # warm up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def plain_decode(model, prompt, n):
    cache = model.make_cache()
    hidden = prefill(model, prompt, cache)
    token = mx.argmax(model.logits_from_hidden(hidden[:, -1:])[0, -1])
    tokens = [int(token)]
    start = time.perf_counter()
    for _ in range(n - 1):
        token = mx.argmax(model(token.reshape(1, 1), cache)[0, -1])
        tokens.append(int(token))
    return tokens, (n - 1) / (time.perf_counter() - start)


def speculative_decode(model, prompt, n, k, drafter):
    cache = model.make_cache()
    decoder = SpeculativeDecoder(model, drafter, Sampler(0.0), k, cache)
    tokens = [decoder.start(prompt, prefill(model, prompt, cache))]
    start = time.perf_counter()
    while len(tokens) < n:
        tokens += decoder.step(max_new=n - len(tokens))
    elapsed = time.perf_counter() - start
    return tokens[:n], (len(tokens) - 1) / elapsed, decoder.stats


def verify_cost(model, prompt, k):
    """Seconds of one verify pass over 1 + k tokens, and of one decode step, on a filled cache."""
    cache = model.make_cache()
    prefill(model, prompt, cache)
    keep_snapshot_buffers(cache, k)  # as the decoder does
    step = mx.array([[prompt[-1]]])
    block = mx.array([prompt[-1 - k :]])

    attention = [c for c in cache if isinstance(c, KVCache)]
    recurrent = [c for c in cache if isinstance(c, RecurrentCache)]

    # each pass leaves the attention caches as it found them; recurrent state just moves on
    def decode_step():
        mx.eval(model(step, cache))
        for c in attention:
            c.trim(1)

    def verify_pass():
        for c in recurrent:
            c.record_snapshots = True
        mx.eval(model.hidden_states(block, cache), [c.state_snapshots for c in recurrent])
        for c in recurrent:
            c.record_snapshots = False
        for c in attention:
            c.trim(k + 1)

    return timed(verify_pass), timed(decode_step)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint to load instead of a random-weight shape")
    p.add_argument("--shape", default="qwen3.5-0.8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per measurement")
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.5, 0.8, 1.0])
    args = p.parse_args()
    from mlx_hybrid.blas import active_blas, prefer_optimized_blas

    prefer_optimized_blas()  # restarts with OpenBLAS preloaded where installed
    dtype = getattr(mx, args.dtype)
    if args.model:
        model, tokenizer = mlx_hybrid.load(args.model, dtype=dtype)
        prompt = tokenizer.encode(Path(__file__).read_text())[: args.prompt_tokens]
        name = args.model
    else:
        model = random_model(SHAPES[args.shape](), dtype)
        prompt = mx.random.randint(0, model.args.vocab_size, (args.prompt_tokens,)).tolist()
        name = f"{args.shape} (random weights)"
    print(
        f"model: {name}, {args.dtype}, ops {mlx_hybrid.ops.backend_name()}, BLAS {active_blas()}, "
        f"device {mx.default_device()}"
    )

    reference, plain_tps = plain_decode(model, prompt, args.tokens)
    print(f"plain decoding: {plain_tps:.2f} tokens/s (baseline)")

    print("\nverify pass (1 + k tokens, state snapshots) vs one decode step:")
    for k in args.draft_tokens:
        verify, step = verify_cost(model, prompt, k)
        print(f"  k={k}: {verify * 1e3:7.1f} ms vs {step * 1e3:6.1f} ms  = {verify / step:.2f}x one step")

    print("\nspeculative decoding, tokens/s and speed ratio to plain:")
    for k in args.draft_tokens:
        tokens, tps, stats = speculative_decode(model, prompt, args.tokens, k, MTPDrafter(model))
        assert tokens == reference, "speculative greedy output differs from plain decoding"
        print(
            f"  MTP head      k={k}: {tps:6.2f} tokens/s  {tps / plain_tps:5.2f}x  "
            f"(acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_pass:.2f} tokens/pass)"
        )
        for rate in args.rates:
            drafter = OracleDrafter(reference, rate, model.args.vocab_size, inner=MTPDrafter(model))
            tokens, tps, stats = speculative_decode(model, prompt, args.tokens, k, drafter)
            assert tokens == reference, "speculative greedy output differs from plain decoding"
            print(
                f"  oracle {rate:4.2f}   k={k}: {tps:6.2f} tokens/s  {tps / plain_tps:5.2f}x  "
                f"(acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_pass:.2f} tokens/pass)"
            )


if __name__ == "__main__":
    main()
