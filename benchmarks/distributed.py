"""One process against two (tensor parallel and pipeline), run by hand.

    python benchmarks/distributed.py [MODEL] [--tokens N]

MODEL: a .gguf file or HF directory (default: the bundled model). The script runs itself
once as a single process and twice under `mlx.launch --backend ring -n 2` over
127.0.0.1, each run decoding the same prompt greedily, plain and with MTP speculation
where the model has a head, and prints tokens/s with the ratio to one process, the
weight bytes each rank holds, and the communication per token by layer type (from the
model's shapes and the collectives each split runs).

On one machine the ranks share its cores and talk over loopback TCP: this measures
what splitting costs, not what a cluster of Macs gains (there each rank brings its own
memory bandwidth, which is what decoding is bound by).
"""

import mlx_hybrid  # noqa: I001  (first: it picks the BLAS before MLX loads)

import argparse
import json
import shutil
import subprocess
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_hybrid.cli.running import on_every_rank
from mlx_hybrid.drafting import make_drafter
from mlx_hybrid.engine import Engine, ReplicatedEngine
from mlx_hybrid.models.layers import LINEAR
from mlx_hybrid.parallel import launched_group

PROMPT = "import os\nimport sys\n\n\ndef main():\n"


def rank_run(model_path: str, tokens: int, pipeline: bool):
    """Inside each process: load (split when launched), decode, print one JSON line from rank 0."""
    group = launched_group()
    model, tokenizer = mlx_hybrid.load(model_path, group=group, pipeline=pipeline)
    result = {"bytes": sum(a.nbytes for _, a in tree_flatten(model.parameters()))}
    for draft in ["none"] + (["mtp"] if model.has_mtp else []):
        drafter = make_drafter(model, tokenizer, draft)
        engine = (ReplicatedEngine if group else Engine)(model, tokenizer, drafter, max_batch=1)
        if group is not None and group.rank() > 0:
            engine.follow()
            continue
        for warm in (True, False):
            sequence = engine.submit(PROMPT, 8 if warm else tokens, stop_tokens=[])
            first = None
            for event in engine.drive(sequence):
                first = first or time.perf_counter()
            end = time.perf_counter()
        result[draft] = (len(sequence.tokens) - 1) / (end - first)
        if group is not None:
            engine.stop()
    if group is not None:
        result["idle_cpu"] = idle_cpu_shares(model, tokenizer, group)
    if group is None or group.rank() == 0:
        print(json.dumps(result), flush=True)


def idle_cpu_shares(model, tokenizer, group, seconds: float = 5.0) -> dict:
    """Each rank's CPU time over wall time while rank 0 has nothing to do: its engine idling
    as a server's does (rank 0 stepping on the engine's thread, the others following), and
    as a baseline the others waiting inside one collective for that long."""

    def share(work) -> float:
        cpu, wall = time.process_time(), time.perf_counter()
        work()
        return (time.process_time() - cpu) / (time.perf_counter() - wall)

    def engine_idles():
        on_every_rank(ReplicatedEngine(model, tokenizer), lambda: time.sleep(seconds))

    def waiting_in_a_collective():
        if group.rank() == 0:
            time.sleep(seconds)
        mx.eval(mx.distributed.all_sum(mx.array([1]), group=group))

    shares = mx.array([share(engine_idles), share(waiting_in_a_collective)])
    gathered = mx.distributed.all_gather(shares[None], group=group).tolist()
    return {"engine idling": [s[0] for s in gathered], "in one collective": [s[1] for s in gathered]}


def communication(args, ranks: int, dtype_bytes: int):
    """Bytes each rank sends per decoded token, by where: (tensor parallel, pipeline)."""
    E, V = args.hidden_size, args.vocab_size
    ring = 2 * (ranks - 1) / ranks  # an all-sum moves this many times the array through each rank
    gather = (ranks - 1) / ranks  # an all-gather: the others' parts
    linear = sum(t == LINEAR for t in args.layer_types)
    full = len(args.layer_types) - linear
    edges = {
        "embedding (all-sum of the rows)": (ring * E * dtype_bytes, ring * E * dtype_bytes),
        "LM head (all-gather of logits)": (gather * V * dtype_bytes, gather * V * dtype_bytes),
        f"{linear} linear-attention layers (mixer + MLP all-sums)": (linear * 2 * ring * E * dtype_bytes, 0),
        f"{full} full-attention layers (mixer + MLP all-sums)": (full * 2 * ring * E * dtype_bytes, 0),
        "pipeline hand-offs (send + final gather)": (0, (1 + ranks - 1) * E * dtype_bytes),
    }
    return edges


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(mlx_hybrid.bundled_model_path()))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank-run", choices=["tensor", "pipeline"], help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.rank_run:
        return rank_run(options.model, options.tokens, options.rank_run == "pipeline")

    launcher = shutil.which("mlx.launch")
    this = [__file__, options.model, "--tokens", str(options.tokens), "--rank-run"]
    runs = {"1 process": [sys.executable, *this, "tensor"]}
    for split in ("tensor", "pipeline"):
        runs[f"2 ranks, {split}"] = [
            launcher,
            "--backend",
            "ring",
            "-n",
            "2",
            "--python",
            sys.executable,
            "--",
            *this,
            split,
        ]
    results = {}
    for name, command in runs.items():
        done = subprocess.run(command, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("{")), None)
        if line is None:
            sys.exit(f"{name} failed:\n{done.stderr[-2000:]}")
        results[name] = json.loads(line)

    base = results["1 process"]
    drafts = [d for d in ("none", "mtp") if d in base]
    print(f"model: {options.model}; {options.tokens} tokens, greedy; ranks over 127.0.0.1 (ring backend)\n")
    print("| run | weights per rank | " + " | ".join(f"{d} tok/s | vs 1 process" for d in drafts) + " |")
    print("| --- | --- | " + " | ".join("--- | ---" for _ in drafts) + " |")
    for name, r in results.items():
        cells = " | ".join(f"{r[d]:.1f} | {r[d] / base[d]:.2f}x" for d in drafts)
        print(f"| {name} | {r['bytes'] / base['bytes']:.2f} of the model | {cells} |")

    print("\nCPU per rank while rank 0 has nothing to do for 5 s (mlx.launch's own relay not counted):\n")
    print("| run | engine idling | ranks waiting in one collective |")
    print("| --- | --- | --- |")
    for name, r in results.items():
        if "idle_cpu" in r:
            cells = [", ".join(f"{share:.0%}" for share in shares) for shares in r["idle_cpu"].values()]
            print(f"| {name} | {' | '.join(cells)} |")

    model, _ = mlx_hybrid.load(options.model)
    dtype_bytes = model.norm.weight.dtype.size
    print(f"\ncommunication per decoded token and rank, 2 ranks, {dtype_bytes}-byte activations:\n")
    print("| where | tensor parallel | pipeline |")
    print("| --- | --- | --- |")
    totals = [0, 0]
    for where, (tensor, pipe) in communication(model.args, 2, dtype_bytes).items():
        totals = [totals[0] + tensor, totals[1] + pipe]
        print(f"| {where} | {tensor / 1024:.1f} KiB | {pipe / 1024:.1f} KiB |")
    print(f"| all | {totals[0] / 1024:.1f} KiB | {totals[1] / 1024:.1f} KiB |")
    collectives = 2 + 2 * model.args.num_hidden_layers
    print(f"\ntensor parallel runs {collectives} collectives per pass, a pipeline 4 (each a network round trip)")


if __name__ == "__main__":
    main()
