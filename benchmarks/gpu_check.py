"""One visit to a GPU, one table: mlx-hybrid and mlx-lm on the same card, in the same run.

    python benchmarks/gpu_check.py --out runs/gpu_check      # wherever MLX computes on a GPU
    bash benchmarks/gpu_check.sh                              # a bare NVIDIA machine (see that file)

For Qwen3.5-0.8B's shape and Qwen3.5-35B-A3B's widths (4 layers, 32 experts: shapes.py), random
weights, each in bfloat16 and in 4 bits (affine groups of 64, bfloat16 scales, written by
`mlx_hybrid.convert`; mlx-lm reads the same directory), one row each:
- prefill of --prompt-tokens tokens (tokens over the time to the first token) and greedy decode
  tokens/s, both runners in this process, alternating for --rounds rounds; medians and ratios;
  beside them ours once more with the layers' split ops (no one-launch layer or residual-norm
  kernels), what those kernels change on this device;
- launches per decode step, both runners: the nodes of one step's graph that are not views, read
  on this device (`step_graph.py` says how it counts);
- the MTP head drafting k=3 with an oracle replacing its tokens at 80% and at 0% acceptance
  (adaptive length off; `spec_decode.py`), against plain decoding run just before each; a random
  DFlash drafter (5 layers, blocks of 16, k=15; `dflash_decode.py`) likewise at 80%;
- 8 sequences at once against 1 (aggregate decode tokens/s; `batch_decode.py`), both runners;
- whether greedy speculative output equals plain decoding (one row and the batch of 8).
Targets (written beside the table): decode >= mlx-lm's, prefill >= 1.5x mlx-lm's, MTP at 80%
>= 1.8x plain, a batch of 8 >= 4x one, greedy speculation = plain.

Each row is appended to OUT/gpu_check.md as soon as it is measured (and the log to stdout), so a
run cut short keeps what it measured. Checkpoints are written once under --models.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library

import mlx.core as mx  # noqa: I001

sys.path.insert(0, str(Path(__file__).parent))
from batch_decode import draft_head, engine_decode, mlx_lm_decode, oracle_drafters  # noqa: E402
from bench_generate import measure  # noqa: E402
from dflash_decode import random_drafter  # noqa: E402
from mlx_hybrid import ops  # noqa: E402
from mlx_hybrid.ops import gpu_kernels, selfcheck  # noqa: E402
from mlx_hybrid.export import convert  # noqa: E402
from mlx_hybrid.drafting import MTPDrafter  # noqa: E402
from mlx_hybrid.drafting.dflash import DFlashDrafter  # noqa: E402
from mlx_hybrid.export import save_mlx  # noqa: E402
from mlx_hybrid.loaders import load  # noqa: E402
from oracle import OracleDrafter  # noqa: E402
from shapes import SHAPES, random_model  # noqa: E402
from spec_decode import against_plain, plain_decode  # noqa: E402
from step_graph import describe, mlx_hybrid_step, mlx_lm_step, summary  # noqa: E402

FIXTURE_TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen35moe" / "hf"
PRECISIONS = ("bfloat16", "4-bit")
DRAFT_TOKENS = 3
COLUMNS = (
    "model", "weights", "prefill tok/s: ours / mlx-lm", "decode tok/s: ours / mlx-lm", "launches / step: ours / mlx-lm (host time to build it)",
    "MTP k=3, 80%", "MTP k=3, 0%", "DFlash b16 k=15, 80%", "batch 8 / 1: ours, mlx-lm", "greedy spec = plain",
)  # fmt: skip


def checkpoint(models: Path, shape: str, precision: str) -> Path:
    """The directory both runners load, written on first use."""
    dense = models / f"{shape}-bfloat16"
    if not dense.exists():
        _, tokenizer = load(FIXTURE_TOKENIZER)
        save_mlx(random_model(SHAPES[shape](), mx.bfloat16), tokenizer, dense, source_dir=FIXTURE_TOKENIZER)
    if precision == "bfloat16":
        return dense
    quantized = models / f"{shape}-4bit"
    if not quantized.exists():
        convert(dense, quantized, bits=4, group_size=64, dtype="bfloat16")
    return quantized


@contextlib.contextmanager
def split_layer_ops():
    """Inside: the linear-attention layers and the residual norms run as their single ops (the rule's
    and the conv's kernels, MLX's ops), as before their one-launch gpu_kernels."""
    passed = selfcheck.passed
    layer_kernels = (gpu_kernels.LINEAR_ATTENTION, gpu_kernels.ADD_RMS_NORM)
    with mock.patch.object(selfcheck, "passed", lambda spec, *a: spec not in layer_kernels and passed(spec, *a)):
        yield


def mlx_lm_generate(model):
    """mlx-lm's own token loop (generate_step, which its stream_generate runs), over token ids."""
    from mlx_lm.generate import generate_step

    def generate(prompt, n):
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
            yield token

    return generate


def speeds(ours, theirs, prompt_tokens: int, decode_tokens: int, rounds: int) -> dict:
    """Median prefill and decode tokens/s of each runner, rounds alternating them."""
    runs = {"ours": [], "mlx-lm": []}
    for generate in (ours, theirs):  # a GPU compiles kernels for each new shape: the prompt's length too
        for _ in generate(list(range(3, 3 + prompt_tokens)), 2):
            pass
    for _ in range(rounds):
        for name, generate in (("ours", ours), ("mlx-lm", theirs)):
            runs[name].append(measure(name, generate, [prompt_tokens], decode_tokens))
    return {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]} for name, results in runs.items()
    }


def speculation(model, prompt, tokens: int, rate: float):
    """(speed ratio to plain decoding, acceptance, where greedy output departs from plain or None) for the
    MTP head drafting k=3 with its tokens replaced by an oracle at `rate` acceptance. The oracle replays
    plain decoding's tokens: once speculative output departs from them, its drafts miss."""
    reference, _ = plain_decode(model, prompt, tokens)
    head = draft_head(model)

    def drafter():
        return OracleDrafter(
            reference, rate, model.args.vocab_size, inner=MTPDrafter(model, draft_p_min=0.0, head=head)
        )

    tps, baseline, stats, departs = against_plain(model, prompt, reference, tokens, DRAFT_TOKENS, drafter)
    print(f"  MTP + oracle {rate:.0%}: {tps:.2f} vs {baseline:.2f} tokens/s, acceptance {stats.acceptance_rate:.2f}")
    return tps / baseline, stats.acceptance_rate, departs


def block_speculation(model, prompt, tokens: int, rate: float):
    """As `speculation`, for a random DFlash drafter of 5 layers drafting blocks of 16 (k=15) over the
    default draft vocabulary's size (`dflash_decode.py`), its tokens replaced by the oracle."""
    reference, _ = plain_decode(model, prompt, tokens)
    block, head = random_drafter(model, 5, 16, model.norm.weight.dtype), draft_head(model)

    def drafter():
        return OracleDrafter(reference, rate, model.args.vocab_size, inner=DFlashDrafter(model, block, head=head))

    tps, baseline, stats, departs = against_plain(model, prompt, reference, tokens, 15, drafter)
    print(f"  DFlash + oracle {rate:.0%}: {tps:.2f} vs {baseline:.2f} tokens/s, acceptance {stats.acceptance_rate:.2f}")
    return tps / baseline, stats.acceptance_rate, departs


def batches(model, tokenizer, lm_model, tokens: int):
    """(ours 8 / 1, mlx-lm's 8 / 1, whether speculation left every row of 8 unchanged)."""
    vocab = model.args.vocab_size
    for batch in (1, 8):  # untimed: a GPU compiles kernels for each new batch size
        engine_decode(model, tokenizer, batch, 32, 2)
        mlx_lm_decode(lm_model, batch, 32, 2, vocab)
    one, _ = engine_decode(model, tokenizer, 1, 32, tokens)
    eight, outputs = engine_decode(model, tokenizer, 8, 32, tokens)
    drafters = oracle_drafters(model, outputs, 0.8, draft_head(model))
    _, spec_outputs = engine_decode(model, tokenizer, 8, 32, tokens, drafters, DRAFT_TOKENS)
    lm_one = mlx_lm_decode(lm_model, 1, 32, tokens, vocab)
    lm_eight = mlx_lm_decode(lm_model, 8, 32, tokens, vocab)
    print(f"  batch: ours {one:.1f} -> {eight:.1f} tokens/s, mlx-lm {lm_one:.1f} -> {lm_eight:.1f}")
    return eight / one, lm_eight / lm_one, spec_outputs == outputs


def attempt(what, fn, cells: int):
    """fn()'s cells, or `cells` cells naming the error: one failing measurement leaves the others."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (a one-visit measurement reports what failed and goes on)
        traceback.print_exc()
        return [f"{what} failed: {type(e).__name__}"] * cells


def check(path: Path, args) -> list[str]:
    import mlx_lm.utils

    model, tokenizer = mlx_hybrid.load(path, dtype=mx.bfloat16)
    lm_model, _ = mlx_lm.utils.load_model(path)

    def speed_cells():
        ours = lambda prompt, n: mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=n, draft=None)  # noqa: E731
        median = speeds(ours, mlx_lm_generate(lm_model), args.prompt_tokens, args.decode_tokens, args.rounds)
        a, b = median["ours"], median["mlx-lm"]
        prefill, decode = f"prefill@{args.prompt_tokens}", f"decode@{args.prompt_tokens}"
        with split_layer_ops():  # the path before the layer kernels, for their effect on this device
            split = measure("ours, split ops", ours, [args.prompt_tokens], args.decode_tokens)[decode]
        return [
            f"{a[prefill]:.0f} / {b[prefill]:.0f} = {a[prefill] / b[prefill]:.2f}x",
            f"{a[decode]:.1f} / {b[decode]:.1f} = {a[decode] / b[decode]:.2f}x (split ops {split:.1f})",
        ]

    def launch_cells():
        prompt = list(range(3, 67))
        (ours, ours_built), (theirs, theirs_built) = (
            step(m, prompt) for step, m in ((mlx_hybrid_step, model), (mlx_lm_step, lm_model))
        )
        for name, nodes, built in (("ours", ours, ours_built), ("mlx-lm", theirs, theirs_built)):
            print("  " + describe(name, nodes, built, top=20).replace("\n", "\n  "))
        launches = f"{summary(ours)['launches']} / {summary(theirs)['launches']}"
        return [f"{launches} (built in {ours_built * 1e3:.1f} / {theirs_built * 1e3:.1f} ms)"]

    departures = []

    def speculation_cells():
        prompt = mx.random.randint(3, model.args.vocab_size, (64,), key=mx.random.key(1)).tolist()
        cells = []
        for rate in (0.8, 0.0):
            ratio, acceptance, departs = speculation(model, prompt, args.spec_tokens, rate)
            cells.append(f"{ratio:.2f}x (acceptance {acceptance:.2f})")
            if departs is not None:
                departures.append(f"one row at {rate:.0%} departs at token {departs}")
        return cells

    def block_cells():
        prompt = mx.random.randint(3, model.args.vocab_size, (64,), key=mx.random.key(1)).tolist()
        ratio, acceptance, departs = block_speculation(model, prompt, args.spec_tokens, 0.8)
        if departs is not None:
            departures.append(f"a DFlash row departs at token {departs}")
        return [f"{ratio:.2f}x (acceptance {acceptance:.2f})"]

    def batch_cells():
        ours, theirs, equal = batches(model, tokenizer, lm_model, args.batch_tokens)
        if not equal:
            departures.append("a row of the batch of 8 differs")
        return [f"{ours:.2f}x, {theirs:.2f}x"]

    cells = attempt("speeds", speed_cells, 2) + attempt("count", launch_cells, 1)
    cells += attempt("speculation", speculation_cells, 2) + attempt("DFlash", block_cells, 1)
    cells += attempt("batch", batch_cells, 1)
    return [*cells, "no: " + "; ".join(departures) if departures else "yes"]


def device_name() -> str:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return str(info.get("device_name") or info.get("architecture") or mx.default_device())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    p.add_argument("--models", type=Path, default=Path("bench_models/gpu_check"), help="where checkpoints are written")
    p.add_argument("--shapes", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--spec-tokens", type=int, default=64, help="tokens per speculative measurement")
    p.add_argument("--batch-tokens", type=int, default=32, help="tokens per sequence in the batch rows")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    import mlx_lm

    args.out.mkdir(parents=True, exist_ok=True)
    table = args.out / "gpu_check.md"
    started = time.perf_counter()
    header = [
        f"{device_name()}, {datetime.date.today()}: MLX {mx.__version__}, mlx-lm {mlx_lm.__version__}, "
        f"ops {ops.backend_name()}; prefill of {args.prompt_tokens} tokens, {args.decode_tokens} decoded, "
        f"medians of {args.rounds} alternating rounds; random weights.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + " --- |" * len(COLUMNS),
    ]
    table.write_text("\n".join(header) + "\n")
    print("\n".join(header), flush=True)
    for shape in args.shapes:
        for precision in args.precisions:
            print(f"{shape}, {precision}:", flush=True)
            cells = check(checkpoint(args.models, shape, precision), args)
            row = "| " + " | ".join([shape, precision, *cells]) + " |"
            with table.open("a") as f:
                f.write(row + "\n")
            print(row, f"({time.perf_counter() - started:.0f} s)", flush=True)
            mx.clear_cache()
    with table.open("a") as f:
        f.write(
            "\nTargets: prefill >= 1.5x mlx-lm's, decode >= 1.0x, MTP at 80% >= 1.8x plain, a batch of 8 >= 4x one, "
            "greedy speculation = plain. Launches: graph nodes of one decode step that are not views "
            "(benchmarks/step_graph.py).\n"
        )
    print(f"written {table} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
