"""DFlash and DFlash2 block drafting against plain decoding and the MTP head, run by hand: what a block's
verify pass costs, and the speed at set acceptance lengths; and z-lab's own MLX runner beside ours.

    python benchmarks/dflash_decode.py                     # Qwen3.5-0.8B shape, random weights
    python benchmarks/dflash_decode.py --blocks 8 16 --rates 0 0.5 0.9 --kinds dflash2
    python benchmarks/dflash_decode.py --zlab-python /path/to/venv/bin/python --blocks --kinds

The target is a random-weight model at `--shape`; the drafters random DFlash and DFlash2 drafters
(`--kinds`) at the target's width (`--draft-layers` Qwen3 layers, the target layers z-lab's recipe picks
for that many, blocks of each `--blocks`; DFlash2's convolutions of kernel 4 over groups of 32 channels,
its selector of rank 64 over the top 16). Prints, each against plain decoding measured in the same run
(plain decoding runs again just before every speculative row):
- the verify pass (1 + k tokens, snapshots on) and one drafter pass (its block, and the block's
  drafts through the target's head over the first `--draft-vocab` ids) relative to one decode step;
- tokens/s with an oracle at set acceptance rates, k = the block less one (the drafter runs each
  round and its drafts are evaluated before the oracle replaces them, so its cost counts in full),
  and the MTP head's at k = 3 the same way where the shape has one.

--zlab-python: a Python that has z-lab's `dflash` 0.1.0 and mlx-lm (`pip install "mlx[cpu]" mlx-lm
dflash==0.1.0`, its own environment) runs `zlab_runner.py` (`dflash.model_mlx.stream_generate`) on the
bundled model converted to MLX's 8 bits (`--zlab-target`, written by `mlx_hybrid.convert` if missing)
with the bundled DFlash drafter and a random DFlash2 one; ours decodes the same prompts from the same
directories, whole blocks verified as z-lab's runner verifies them and then with our default settings:
greedy output equal, tokens a pass, decode tokens/s (each the best of 3).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library

import mlx.core as mx  # noqa: I001

sys.path.insert(0, str(Path(__file__).parent))
from mlx_hybrid.draft_vocab import DEFAULT_DRAFT_VOCAB  # noqa: E402
from mlx_hybrid.drafting import DraftHead  # noqa: E402
from mlx_hybrid.drafting.dflash import DFlashDrafter  # noqa: E402
from mlx_hybrid.drafting.mtp import MTPDrafter  # noqa: E402
from mlx_hybrid.models.dflash import (  # noqa: E402
    DRAFT2_ARCHITECTURE,
    DFlashArgs,
    DFlashDraftModel,
    save_drafter,
    target_layer_ids,
)
from mlx_hybrid.models.random_weights import initialise  # noqa: E402
from oracle import OracleDrafter  # noqa: E402
from shapes import SHAPES, random_model  # noqa: E402
from spec_decode import against_plain, plain_decode, timed, verify_cost  # noqa: E402


DFLASH2 = {"conv_kernel_size": 4, "conv_group_size": 32, "selector_rank": 64, "selector_top_k": 16}


def random_drafter(target, layers: int, block: int, dtype, kind: str = "dflash") -> DFlashDraftModel:
    t = target.args
    args = DFlashArgs(
        hidden_size=t.hidden_size,
        intermediate_size=3 * t.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e7,
        vocab_size=t.vocab_size,
        target_layer_ids=target_layer_ids(t.num_hidden_layers, layers),
        block_size=block,
        mask_token_id=t.vocab_size - 1,
        **(DFLASH2 if kind == "dflash2" else {}),
    )
    return initialise(DFlashDraftModel(args), 1, dtype)


def drafter_cost(target, model: DFlashDraftModel, head: DraftHead, prompt: list[int]) -> float:
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


def zlab_comparison(zlab_python: str, target_dir: Path, tokens: int, dtype):
    """z-lab's MLX runner and ours on the bundled model's MLX conversion, its DFlash drafter and a random
    DFlash2 one: greedy output, tokens a pass, decode tokens/s."""
    from mlx_hybrid.loaders import bundled_drafter_path, load_draft_model

    if not target_dir.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mlx_hybrid.convert",
                "--mlx-path",
                str(target_dir),
                "--q-bits",
                "8",
                "--dtype",
                "float32",
            ],
            check=True,
        )
    target, tokenizer = mlx_hybrid.load(target_dir)
    random_dir = Path(tempfile.mkdtemp()) / "dflash2"
    bundled = load_draft_model(bundled_drafter_path())
    random2 = random_drafter(target, bundled.args.num_hidden_layers, bundled.args.block_size, dtype, "dflash2")
    save_drafter(random2, random_dir, len(target.layers), mx.float32, target.args.max_position_embeddings)
    prompts = ["import os\n\ndef walk(path):\n", "class Parser:\n    def __init__(self, text):\n"]
    print(f"\nz-lab's MLX runner (dflash 0.1.0 on mlx-lm) and ours: {target_dir} (the bundled model, MLX 8 bits)")
    for name, drafter_dir in [
        ("DFlash (bundled)", bundled_drafter_path()),
        (DRAFT2_ARCHITECTURE + " (random)", random_dir),
    ]:
        block = load_draft_model(drafter_dir).args.block_size
        for prompt in prompts:
            ids = tokenizer.encode(prompt)
            out = subprocess.run(
                [
                    zlab_python,
                    str(Path(__file__).parent / "zlab_runner.py"),
                    str(target_dir),
                    str(drafter_dir),
                    "--prompt-ids",
                    ",".join(map(str, ids)),
                    "--max-tokens",
                    str(tokens),
                ],
                capture_output=True,
                text=True,
            )
            if out.returncode:
                sys.exit(f"zlab_runner.py failed: {out.stderr.strip().splitlines()[-1]}")
            theirs = json.loads(out.stdout.strip().splitlines()[-1])
            rows = [
                f"  {name}, {prompt.splitlines()[0]!r}: z-lab {theirs['decode_tps']:6.1f} tok/s, "
                f"{sum(theirs['passes']) / len(theirs['passes']):.2f} tokens a pass"
            ]
            for label, settings in [
                ("whole blocks", dict(num_draft_tokens=block - 1, draft_p_min=0)),
                ("defaults", {}),
            ]:
                best = None
                for _ in range(3):
                    times, responses = [], []
                    for response in mlx_hybrid.stream_generate(
                        target, tokenizer, ids, max_tokens=tokens, draft_model=drafter_dir, **settings
                    ):
                        times.append(time.perf_counter())
                        responses.append(response)
                    rate = (len(times) - 1) / (times[-1] - times[0])
                    best = max(best or (0, None), (rate, responses), key=lambda r: r[0])
                rate, responses = best
                same = [r.token for r in responses] == theirs["tokens"][: len(responses)]
                rows.append(
                    f"ours ({label}) {rate:6.1f} tok/s {rate / theirs['decode_tps']:5.2f}x, "
                    f"{responses[-1].tokens_per_pass:.2f} tokens a pass, output {'equal' if same else 'DIFFERS'}"
                )
            print("; ".join(rows))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.5-0.8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per measurement")
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--blocks", type=int, nargs="*", default=[4, 8, 16])
    p.add_argument("--kinds", nargs="*", default=["dflash", "dflash2"], choices=["dflash", "dflash2"])
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.5, 0.8, 1.0])
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB, help="the first N ids; 0: all")
    p.add_argument("--zlab-python", help="a Python with dflash 0.1.0 and mlx-lm: z-lab's runner beside ours")
    p.add_argument(
        "--zlab-target",
        type=Path,
        default=Path("bench_models/tiny-qwen35-8bit"),
        help="the bundled model's MLX conversion (written if missing)",
    )
    p.add_argument("--zlab-tokens", type=int, default=128)
    args = p.parse_args()
    from mlx_hybrid.blas import active_blas

    dtype = getattr(mx, args.dtype)
    print(f"BLAS {active_blas()}, device {mx.default_device()}")
    if args.blocks and args.kinds:
        at_set_acceptance(args, dtype)
    if args.zlab_python:
        zlab_comparison(args.zlab_python, args.zlab_target, args.zlab_tokens, dtype)


def at_set_acceptance(args, dtype):
    target = random_model(SHAPES[args.shape](), dtype)
    prompt = mx.random.randint(0, target.args.vocab_size, (args.prompt_tokens,)).tolist()
    vocabulary = list(range(min(args.draft_vocab, target.args.vocab_size))) if args.draft_vocab else None
    head = DraftHead(target, vocabulary)
    print(
        f"target: {args.shape} (random weights), {args.dtype}, draft vocabulary {len(vocabulary) if vocabulary else 'all'}"
    )
    reference, plain_tps = plain_decode(target, prompt, args.tokens)
    print(f"plain decoding: {plain_tps:.2f} tokens/s (baseline)")

    def oracle_rows(k: int, inner):
        for rate in args.rates:
            make = lambda rate=rate: OracleDrafter(reference, rate, target.args.vocab_size, inner=inner())  # noqa: E731
            tps, baseline, stats, departs = against_plain(target, prompt, reference, args.tokens, k, make)
            print(
                f"  oracle {rate:4.2f}, k={k}: {tps:6.2f} vs {baseline:5.2f} tokens/s  {tps / baseline:5.2f}x"
                f"  ({stats.tokens_per_pass:.2f} tokens a pass)"
                + ("" if departs is None else f"  GREEDY OUTPUT DEPARTS FROM PLAIN DECODING AT TOKEN {departs}")
            )

    if target.has_mtp:
        print("\nMTP head, k=3:")
        oracle_rows(3, lambda: MTPDrafter(target, head=head))
    for block in args.blocks:
        k = block - 1
        verify, step = verify_cost(target, prompt, k)
        for kind in args.kinds:
            model = random_drafter(target, args.draft_layers, block, dtype, kind)
            draft = drafter_cost(target, model, head, prompt)
            print(
                f"\n{kind}, block {block} ({args.draft_layers} drafter layers over target layers "
                f"{model.args.target_layer_ids}): verify pass {verify / step:.2f}x a step, drafter pass "
                f"{draft / step:.2f}x ({step * 1e3:.1f} ms a step)"
            )
            oracle_rows(k, lambda model=model: DFlashDrafter(target, model, head=head))


if __name__ == "__main__":
    main()
