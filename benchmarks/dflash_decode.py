"""DFlash block drafting against plain decoding, run by hand: what a block's verify pass costs, and the
speed at set acceptance lengths.

    python benchmarks/dflash_decode.py                     # Qwen3.5-0.8B shape, random weights
    python benchmarks/dflash_decode.py --blocks 8 16 --rates 0 0.5 0.9

The target is a random-weight model at `--shape`; the drafter a random DFlash drafter at the target's
width (`--draft-layers` Qwen3 layers, the target layers z-lab's recipe picks for that many, blocks of
each `--blocks`). Prints, each against plain decoding measured in the same run (plain decoding runs
again just before every speculative row):
- the verify pass (1 + k tokens, snapshots on) and one drafter pass (its block, and the block's
  drafts through the target's head over the first `--draft-vocab` ids) relative to one decode step;
- tokens/s with an oracle at set acceptance rates, k = the block less one (the drafter runs each
  round and its drafts are evaluated before the oracle replaces them, so its cost counts in full),
  and the drafter alone (random weights: its drafts are rejected).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library

import mlx.core as mx  # noqa: I001

sys.path.insert(0, str(Path(__file__).parent))
from mlx_hybrid.draft_vocab import DEFAULT_DRAFT_VOCAB  # noqa: E402
from mlx_hybrid.drafting import DraftHead  # noqa: E402
from mlx_hybrid.drafting.dflash import DFlashDrafter  # noqa: E402
from mlx_hybrid.models.dflash import DFlashArgs, target_layer_ids  # noqa: E402
from mlx_hybrid.models.dflash import DFlashDrafter as DFlashModel  # noqa: E402
from mlx_hybrid.models.init import initialise  # noqa: E402
from oracle import OracleDrafter  # noqa: E402
from shapes import SHAPES, random_model  # noqa: E402
from spec_decode import against_plain, plain_decode, timed, verify_cost  # noqa: E402


def random_drafter(target, layers: int, block: int, dtype) -> DFlashModel:
    t = target.args
    args = DFlashArgs(
        hidden_size=t.hidden_size, intermediate_size=3 * t.hidden_size, num_hidden_layers=layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1e7, vocab_size=t.vocab_size,
        target_layer_ids=target_layer_ids(t.num_hidden_layers, layers), block_size=block, mask_token_id=t.vocab_size - 1,
    )  # fmt: skip
    return initialise(DFlashModel(args), 1, dtype)


def drafter_cost(target, model: DFlashModel, head: DraftHead, prompt: list[int]) -> float:
    """Seconds of one drafter pass: its block over a prompt's worth of context, the drafts' logits
    through `head` (the target's, over the draft vocabulary)."""
    context = mx.random.normal((1, len(prompt), len(model.args.target_layer_ids) * target.args.hidden_size))
    context = context.astype(target.norm.weight.dtype)
    block = mx.array([[prompt[-1]] + [model.args.mask_token_id] * (model.args.block_size - 1)])

    def one_pass():
        cache = model.make_cache()
        mx.eval(model.block_hidden(target.embed(block), context[:, :-1], cache))  # the context read once
        hidden = model.block_hidden(target.embed(block), context[:, -1:], cache)  # a round's pass
        mx.eval(model.block_logits(hidden, head.project))

    return timed(one_pass)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.5-0.8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per measurement")
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.5, 0.8, 1.0])
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB, help="the first N ids; 0: all")
    args = p.parse_args()
    from mlx_hybrid.blas import active_blas

    dtype = getattr(mx, args.dtype)
    target = random_model(SHAPES[args.shape](), dtype)
    prompt = mx.random.randint(0, target.args.vocab_size, (args.prompt_tokens,)).tolist()
    vocabulary = list(range(min(args.draft_vocab, target.args.vocab_size))) if args.draft_vocab else None
    head = DraftHead(target, vocabulary)
    print(
        f"target: {args.shape} (random weights), {args.dtype}, BLAS {active_blas()}, device {mx.default_device()}, "
        f"draft vocabulary {len(vocabulary) if vocabulary else 'all'}"
    )
    reference, plain_tps = plain_decode(target, prompt, args.tokens)
    print(f"plain decoding: {plain_tps:.2f} tokens/s (baseline)")
    for block in args.blocks:
        model = random_drafter(target, args.draft_layers, block, dtype)
        k = block - 1
        verify, step = verify_cost(target, prompt, k)
        draft = drafter_cost(target, model, head, prompt)
        print(
            f"\nblock {block} ({args.draft_layers} drafter layers over target layers {model.args.target_layer_ids}):"
            f" verify pass {verify / step:.2f}x a step, drafter pass {draft / step:.2f}x ({step * 1e3:.1f} ms a step)"
        )
        for rate in args.rates:
            make = lambda rate=rate: OracleDrafter(  # noqa: E731
                reference, rate, target.args.vocab_size, inner=DFlashDrafter(target, model, head=head)
            )
            tps, baseline, stats, departs = against_plain(target, prompt, reference, args.tokens, k, make)
            print(
                f"  oracle {rate:4.2f}, k={k}: {tps:6.2f} vs {baseline:5.2f} tokens/s  {tps / baseline:5.2f}x"
                f"  ({stats.tokens_per_pass:.2f} tokens a pass)"
                + ("" if departs is None else f"  GREEDY OUTPUT DEPARTS FROM PLAIN DECODING AT TOKEN {departs}")
            )


if __name__ == "__main__":
    main()
