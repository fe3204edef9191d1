"""Plain vs speculative decoding speed, run by hand.

    python benchmarks/spec_decode.py                       # Qwen3.5-0.8B shape, random weights
    python benchmarks/spec_decode.py --model path.gguf     # a real checkpoint (MTP acceptance is real too)

Prints, each against plain decoding measured in the same run (for every row, plain
decoding runs again just before it: the ratio is within that pair, which keeps a
shared machine's drift out of it; `--rounds N` runs N pairs and prints medians):
- the verify pass (1 + k tokens, snapshots on) relative to one decode step;
- tokens/s with the model's MTP head drafting, default settings;
- tokens/s with an oracle drafter at set acceptance rates, k = 1..4, adaptive length
  off (exactly k drafts a round). The MTP head drafts alongside over the reduced
  vocabulary, and its tokens are evaluated before the oracle replaces them, so the
  draft cost counts in full;
- the oracle at 0% acceptance with default settings (adaptive length on).

Each speculative row runs once untimed first (a GPU compiles kernels on first use), and says
where its greedy output departs from plain decoding's, if it does.

The random-weight shapes draft over the first `--draft-vocab` token ids (what costs is
the subset's size); a real checkpoint uses the ranking of `mlx_hybrid.draft_vocab`.
"""

from __future__ import annotations

import argparse
import sys
import time
from statistics import median
from pathlib import Path

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library

import mlx.core as mx  # noqa: I001

sys.path.insert(0, str(Path(__file__).parent))
from mlx_hybrid.cache import marks, record_snapshots, rewind  # noqa: E402
from mlx_hybrid.draft_vocab import DEFAULT_DRAFT_VOCAB, draft_vocabulary  # noqa: E402
from mlx_hybrid.drafting import MTPDrafter, draft_p_min_for  # noqa: E402
from mlx_hybrid.engine import Engine, PrefixStore  # noqa: E402
from mlx_hybrid.api import prefill  # noqa: E402
from mlx_hybrid.speculative import DraftingPolicy, keep_snapshot_buffers  # noqa: E402
from oracle import OracleDrafter  # noqa: E402
from shapes import SHAPES, random_model  # noqa: E402


def timed(fn, repeat=3):
    fn()  # warm up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def engine_decode(model, prompt, n, k=1, drafter=None, adaptive=False):
    """n greedy tokens as every entry point produces them (the engine's step, one row):
    (tokens, tokens/s after the first, the drafting statistics)."""
    engine = Engine(model, None, None, k, adaptive=adaptive, max_batch=1, prefix_store=PrefixStore(0))
    sequence = engine.submit(prompt, n, drafter=drafter, stop_tokens=())
    engine.step()  # the prompt, and the first token
    start = time.perf_counter()
    engine.run()
    return sequence.tokens, (n - 1) / (time.perf_counter() - start), sequence.stats


def plain_decode(model, prompt, n):
    tokens, tps, _ = engine_decode(model, prompt, n)
    return tokens, tps


def speculative_decode(model, prompt, n, k, drafter, adaptive=False):
    return engine_decode(model, prompt, n, k, drafter, adaptive)


def verify_cost(model, prompt, k):
    """Seconds of one verify pass over 1 + k tokens, and of one decode step, on a filled cache."""
    cache = model.make_cache()
    prefill(model, prompt, cache)
    keep_snapshot_buffers(cache, k)  # as the decoder does
    step = mx.array([[prompt[-1]]])
    block = mx.array([prompt[-1 - k :]])

    start = marks(cache)  # each pass leaves the caches as it found them

    def decode_step():
        mx.eval(model(step, cache))
        rewind(cache, start)

    def verify_pass():  # as the engine runs it: the trunk with snapshots, then logits for every row
        record_snapshots(cache, True)
        mx.eval(model.logits_from_hidden(model.hidden_states(block, cache)), [c.arrays for c in cache])
        record_snapshots(cache, False)
        rewind(cache, start)

    return timed(verify_pass), timed(decode_step)


def against_plain(model, prompt, reference, n, k, make_drafter, adaptive=False, rounds=1):
    """Speculative decoding with a fresh `make_drafter()` against plain decoding run just before it,
    `rounds` times: (the median of its tokens/s, of plain tokens/s, and of the rounds' ratios; the last
    round's SpeculativeStats; the index where its greedy tokens leave `reference`, plain decoding's, or
    None)."""
    # a short untimed run first: a GPU compiles each new kernel and shape on its first use
    speculative_decode(model, prompt, min(n, 2 * (k + 1)), k, make_drafter(), adaptive)
    speeds, baselines, departs = [], [], None
    for _ in range(rounds):
        baselines.append(plain_decode(model, prompt, n)[1])
        tokens, tps, stats = speculative_decode(model, prompt, n, k, make_drafter(), adaptive)
        speeds.append(tps)
        if departs is None:
            departs = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    ratios = [a / b for a, b in zip(speeds, baselines)]
    return median(speeds), median(baselines), median(ratios), stats, departs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint to load instead of a random-weight shape")
    p.add_argument("--shape", default="qwen3.5-0.8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per measurement")
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.5, 0.8, 1.0])
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB, help="0: the whole vocabulary")
    p.add_argument("--skip-verify", action="store_true", help="leave out the verify-pass timings")
    p.add_argument("--verify-only", action="store_true", help="only the verify-pass timings")
    p.add_argument(
        "--max-plain-rounds",
        type=int,
        default=DraftingPolicy.MAX_PLAIN_ROUNDS,
        help="the adaptive policy's longest run of plain rounds between tries (default: the package's)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="pairs of plain and speculative runs per row: medians (a noisy machine wants 5 or more)",
    )
    args = p.parse_args()
    if args.rounds < 1 or args.max_plain_rounds < 1:
        p.error("--rounds and --max-plain-rounds must be at least 1")
    DraftingPolicy.MAX_PLAIN_ROUNDS = args.max_plain_rounds
    from mlx_hybrid.blas import active_blas

    dtype = getattr(mx, args.dtype)
    if args.model:
        model, tokenizer = mlx_hybrid.load(args.model, dtype=dtype)
        prompt = tokenizer.encode(Path(__file__).read_text())[: args.prompt_tokens]
        vocabulary = draft_vocabulary(tokenizer, args.draft_vocab, model.args.vocab_size)
        name = args.model
    else:
        model = random_model(SHAPES[args.shape](), dtype)
        prompt = mx.random.randint(0, model.args.vocab_size, (args.prompt_tokens,)).tolist()
        size = args.draft_vocab or model.args.vocab_size
        vocabulary = list(range(min(size, model.args.vocab_size))) if args.draft_vocab else None
        name = f"{args.shape} (random weights)"
    print(
        f"model: {name}, {args.dtype}, ops {mlx_hybrid.ops.backend_name()}, BLAS {active_blas()}, "
        f"device {mx.default_device()}, draft vocabulary {len(vocabulary) if vocabulary is not None else 'all'}"
    )

    reference, plain_tps = plain_decode(model, prompt, args.tokens)
    print(f"plain decoding: {plain_tps:.2f} tokens/s (baseline)")

    if not args.skip_verify:
        print("\nverify pass (1 + k tokens, state snapshots) vs one decode step:")
        for k in args.draft_tokens:
            verify, step = verify_cost(model, prompt, k)
            print(f"  k={k}: {verify * 1e3:7.1f} ms vs {step * 1e3:6.1f} ms  = {verify / step:.2f}x one step")

    if args.verify_only:
        return

    def report(label, k, make_drafter, adaptive=False):
        tps, baseline, ratio, stats, departs = against_plain(
            model, prompt, reference, args.tokens, k, make_drafter, adaptive, args.rounds
        )
        print(
            f"  {label:<29} k={k}: {tps:6.2f} vs {baseline:5.2f} tokens/s  {ratio:5.2f}x  "
            f"(acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_pass:.2f} tokens/pass)"
            + ("" if departs is None else f"  GREEDY OUTPUT DEPARTS FROM PLAIN DECODING AT TOKEN {departs}")
        )
        return ratio

    def mtp(p_min):
        return MTPDrafter(model, draft_p_min=p_min, vocabulary=vocabulary)

    def oracle(rate, p_min):
        return lambda: OracleDrafter(reference, rate, model.args.vocab_size, inner=mtp(p_min))

    default_p_min = draft_p_min_for(model)  # the API's for this model (none for the bundled one)
    print("\nspeculative decoding, tokens/s and speed ratio to plain:")
    for k in args.draft_tokens:
        report("MTP head, default settings", k, lambda: mtp(default_p_min), adaptive=True)
    table = {}
    for k in args.draft_tokens:
        for rate in args.rates:
            table[k, rate] = report(f"oracle {rate:4.2f}, adaptive off", k, oracle(rate, 0.0))
        default = oracle(0.0, default_p_min)
        table[k, "default"] = report("oracle 0.00, default settings", k, default, adaptive=True)
    columns = [*args.rates, "default"]
    print("\nspeed ratio to plain decoding (oracle acceptance; 'default': 0% with adaptive drafting):")
    print("  k  " + "".join(f"{c if isinstance(c, str) else f'{c:.0%}':>9}" for c in columns))
    for k in args.draft_tokens:
        print(f"  {k}  " + "".join(f"{table[k, c]:8.2f}x" for c in columns))


if __name__ == "__main__":
    main()
