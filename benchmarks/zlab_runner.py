"""z-lab's own MLX runner (`dflash.model_mlx.stream_generate`, on mlx-lm) over a target and a DFlash
drafter, for `dflash_decode.py --zlab-python`: run in an environment that has `dflash` 0.1.0 and mlx-lm
(not this package's), it prints one JSON line: the greedy tokens, the tokens each pass gave, and the
decode rate (tokens after the first, over the time after the first).

    python benchmarks/zlab_runner.py TARGET_DIR DRAFTER_DIR --prompt-ids 1,2,3 --max-tokens 128
"""

import argparse
import json
import time

import dflash.model_mlx as runner
from mlx_lm import load


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target")
    p.add_argument("drafter")
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3, help="runs; the fastest is reported")
    args = p.parse_args()
    runner.snapshot_download = lambda path, **_: path  # a local directory, not a hub name
    model, tokenizer = load(args.target)
    draft = runner.load_draft(args.drafter)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    best = None
    for _ in range(args.rounds):
        tokens, passes, first_at = [], [], None
        for response in runner.stream_generate(
            model, draft, tokenizer, prompt, block_size=args.block_size, max_tokens=args.max_tokens
        ):
            if first_at is None:
                first_at = time.perf_counter()
            elif response.accepted is not None:
                passes.append(len(response.tokens))
            tokens += response.tokens
        rate = (len(tokens) - 1) / (time.perf_counter() - first_at)
        if best is None or rate > best["decode_tps"]:
            best = {"tokens": tokens, "passes": passes, "decode_tps": rate}
    print(json.dumps(best))


if __name__ == "__main__":
    main()
