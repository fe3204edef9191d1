"""Every GGUF type at a real shape: memory after `load` against the file, and decode speed
beside llama.cpp's on the same file, in the same run.

    python benchmarks/gguf_types.py --make bench_models/gguf-types --llama-bin DIR   # once: the files
    python benchmarks/gguf_types.py --dir bench_models/gguf-types --llama-bin DIR [DIR ...]
    python benchmarks/gguf_types.py --kernels [--rows 512]   # each type's product alone
    python benchmarks/gguf_types.py --kernels --queued   # the same, no wait on MLX's thread a call
    python benchmarks/gguf_types.py --kernels --queued --matrices 64   # each from memory, as a decode step's
    python benchmarks/gguf_types.py --kernels --types F16 --rows 4 --matrix 768 256   # the bundled model's

--make writes random weights at Qwen3.5-0.8B's shape (shapes.py) as a float32 GGUF in
llama.cpp's layout (mlx_hybrid.export), then one file per type made by llama.cpp's own
`llama-quantize` (its `_M` / `_S` mixtures as it makes them; IQ3_XXS and the IQ2 types with an
importance matrix from `llama-imatrix`). DIR (--llama-bin) holds llama.cpp's `llama-quantize`,
`llama-imatrix` and `llama-bench` (cmake --build build --target llama-quantize llama-imatrix
llama-bench).

Each measurement runs in a process of its own, so that its peak resident memory is its own:
- mlx-hybrid: `load` (weights after load: the bytes of the model's arrays), a 512-token prompt's
  prefill (the best of 3, `--prefill`; its hidden states, as generation reads a prompt), then 32
  greedy tokens after an 8-token prompt, timed from the second token (a GGUF file's default:
  llama.cpp's 8-bit activations where the CPU kernels run);
- "float32": the same with `load(cpu_activations="float32")`, what the dequantized weights compute;
- "dequantized": the same with `load(dequantize=True)` and every weight in float32 (what a type
  without kernels of its own costs);
- llama.cpp: `llama-bench -p 512 -n 32` (its prompt and token-generation rates) with the same threads,
  each build named (`--llama-bin`: the folders of its binaries, e.g. an AVX2 build and the CPU's own;
  `--make` takes the first's llama-quantize and llama-imatrix).
Rounds alternate the runners; medians are printed, the ratios against the fastest llama.cpp build and
against the file's size.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

TYPES = [
    "F16",
    "BF16",
    "Q8_0",
    "Q6_K",
    "Q5_K_M",
    "Q5_0",
    "Q4_K_M",
    "Q4_0",
    "IQ4_NL",
    "IQ4_XS",
    "Q3_K_M",
    "Q3_K_S",
    "IQ3_S",
    "IQ3_XXS",
    "Q2_K",
    "IQ2_S",
    "IQ2_XS",
    "IQ2_XXS",
    "IQ1_M",
    "IQ1_S",
    "MXFP4",
    "TQ2_0",
    "TQ1_0",
]
# llama-quantize wants an importance matrix for them
WITH_IMATRIX = ("IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
# llama-quantize's MXFP4_MOE puts a MoE model's experts alone in MXFP4 (the rest Q8_0); on this
# dense shape every attention and feed-forward matrix is made MXFP4 instead
QUANTIZE_AS = {"MXFP4": ("MXFP4_MOE", ["--tensor-type", "attn_=mxfp4", "--tensor-type", "ffn_=mxfp4"])}
FIXTURE_TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen35" / "hf"
PROMPT = [(i * 7919) % 500 + 10 for i in range(8)]  # ids every runner's tokenizer knows


def file_of(directory: Path, type_name: str) -> Path:
    return directory / f"model-{type_name}.gguf"


def make(directory: Path, llama_bin: Path, types: list[str]):
    import mlx_hybrid  # noqa: F401  (OpenBLAS before MLX)

    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    from shapes import SHAPES, random_model

    from mlx_hybrid.export import save_gguf
    from mlx_hybrid.loaders import load

    directory.mkdir(parents=True, exist_ok=True)
    _, tokenizer = load(FIXTURE_TOKENIZER)
    source, imatrix = directory / "model-f32.gguf", directory / "imatrix.gguf"
    args = SHAPES["qwen3.5-0.8b"]()
    if not source.is_file():  # (kept: more types can be made from it later)
        save_gguf(random_model(args, mx.float32), tokenizer, source, matrix_dtype=np.float32)
    # the importance matrix from this script's own text; the MTP block, which that text never
    # reaches, in Q4_K
    if not imatrix.is_file() and set(types) & set(WITH_IMATRIX):
        run([llama_bin / "llama-imatrix", "-m", source, "-f", __file__, "-o", imatrix, "-c", "128"])
    for type_name in types:
        options = ["--imatrix", imatrix, "--tensor-type", rf"blk\.{args.num_hidden_layers}\.=q4_k"]
        options = options if type_name in WITH_IMATRIX else []
        quantize_as, options = QUANTIZE_AS.get(type_name, (type_name, options))
        run([llama_bin / "llama-quantize", *options, source, file_of(directory, type_name), quantize_as])
        print(f"wrote {file_of(directory, type_name)}", file=sys.stderr)


def run(command: list):
    if subprocess.run([str(part) for part in command], capture_output=True, text=True).returncode:
        sys.exit(f"{' '.join(map(str, command))} failed")


def run_ours(path: Path, tokens: int, prompt_tokens: int, dequantize: bool, activations: str | None = None) -> dict:
    import mlx_hybrid  # (OpenBLAS before MLX)

    import mlx.core as mx
    from mlx.utils import tree_map

    from mlx_hybrid.prompt import prefill

    model, tokenizer = mlx_hybrid.load(path, dequantize=dequantize, cpu_activations=activations)
    if dequantize:  # 16-bit matrices too: every weight float32
        model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    weights = model.nbytes
    prefill_s = float("inf")
    for _ in range(3 if prompt_tokens else 0):
        start = time.perf_counter()
        mx.eval(prefill(model, [PROMPT[i % len(PROMPT)] + i % 7 for i in range(prompt_tokens)], model.make_cache()))
        prefill_s = min(prefill_s, time.perf_counter() - start)
    times = [
        time.perf_counter() for _ in mlx_hybrid.stream_generate(model, tokenizer, PROMPT, max_tokens=tokens, draft=None)
    ]
    return {
        "decode": (len(times) - 1) / (times[-1] - times[0]),
        "prefill": prompt_tokens / prefill_s,
        "weights": weights,
    }


def run_llama_cpp(path: Path, tokens: int, prompt_tokens: int, threads: int, llama_bin: Path, options=()) -> dict:
    """llama-bench's prompt and decode rates on the file (options: more of its flags), its peak memory."""
    command = [
        str(llama_bin / "llama-bench"),
        "-m",
        str(path),
        "-p",
        str(prompt_tokens),
        "-n",
        str(tokens),
        "-t",
        str(threads),
        "-r",
        "1",
        "-o",
        "json",
        *options,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = process.communicate()
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
    if process.returncode:
        raise RuntimeError(err.strip().splitlines()[-1] if err.strip() else f"exit {process.returncode}")
    rates = {"prefill" if test["n_prompt"] else "decode": test["avg_ts"] for test in json.loads(out)}
    return rates | {"peak_gib": peak}


# ours as load() computes a file (llama.cpp's 8-bit activations), with float32 activations, with every
# matrix dequantized; llama.cpp
RUNNERS = ("mlx-hybrid", "float32", "dequantized", "llama.cpp")
# the types whose expert products --experts times beside the grid types (MoE files' usual ones)
EXPERT_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q5_0", "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K", "MXFP4")


def build_name(llama_bin: Path) -> str:
    """A llama.cpp build's name: its folder's (the one above bin/)."""
    return llama_bin.parent.name if llama_bin.name == "bin" else llama_bin.name


def llama_cpp_runners(llama_bins: list[Path]) -> dict[str, Path]:
    """Each llama.cpp build's runner name -> its binaries."""
    return {f"llama.cpp {build_name(llama_bin)}": llama_bin for llama_bin in llama_bins}


def measure_in_child(runner: str, path: Path, args) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from quantized_cpu import json_of_child

    return json_of_child(
        [
            __file__,
            "--child",
            runner,
            str(path),
            "--tokens",
            str(args.tokens),
            "--prefill",
            str(args.prefill),
            "--threads",
            str(args.threads),
            "--llama-bin",
            *map(str, args.llama_bin),
        ]
        + (["--instruction-set", args.instruction_set] if args.instruction_set else []),
        args,
    )


def child(args):
    runner, path = args.child
    if runner.startswith("llama.cpp"):
        llama_bin = llama_cpp_runners(args.llama_bin)[runner]
        result = run_llama_cpp(Path(path), args.tokens, args.prefill, args.threads, llama_bin)
    else:
        if args.instruction_set:
            import mlx_hybrid  # noqa: F401  (OpenBLAS before MLX)

            from mlx_hybrid.ops import cpu_quantized

            cpu_quantized.extension().use_instruction_set(args.instruction_set)
        result = run_ours(
            Path(path),
            args.tokens,
            args.prefill,
            dequantize=runner == "dequantized",
            activations="float32" if runner == "float32" else None,
        )
        result["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(result))


def without_subnormal_blocks(q):
    """q with MXFP4's random exponent 2^-127 (random_block_weights' one block in 17, for the tests) made
    2^-8: a file's blocks have no such scale, and its subnormal products slow the float32 path 10x and
    more at many rows."""
    import dataclasses

    import mlx.core as mx

    if not (q.block is not None and getattr(q.block, "exponent_factors", False)):
        return q
    return dataclasses.replace(q, scales=mx.where(q.scales == 0, 120, q.scales).astype(mx.uint8))


def int8_inputs(q):
    """What `cpu_quantized.int8_matmul` takes after x for a held matrix q: (w, factors, codes, type, grid);
    `int8_gather_matmul` takes the indices after the first three."""
    from mlx_hybrid.ops import cpu_quantized, products as ops_products
    from mlx_hybrid.quantized_tensor import no_codes

    codes = no_codes(q.scales) if q.biases is None else q.biases
    held_type = ops_products.int8_type(q.bits, q.group_size, q.block)
    return q.weight, q.scales, codes, held_type, cpu_quantized.int8_grid(q.block)


def kernels(rounds: int, rows: int, types, matrix=(3584, 1024), queued: bool = False, matrices: int = 1):
    """One decode step's product per type, the kernel alone: 1 row (`rows`: a verify pass's, a prompt's)
    against an N x K `matrix` (the 0.8B shape's gate projection) of random values in the type's
    layout, with float32 activations and with llama.cpp's 8-bit ones ("int8": the 8-bit kernel at any
    rows, past the type's `ops.int8_row_limit` too, where a model's products take the float32 path); the
    16-bit matrices with float32 activations and with llama.cpp's 16-bit ones ("llama.cpp").
    matrices: the "int8" products' calls take this many random matrices in turn, so that with enough
    of them (more than the L3 cache holds) each call reads its matrix from memory, as a decode step's
    products do."""
    import mlx_hybrid  # noqa: F401  (OpenBLAS before MLX)

    import mlx.core as mx

    from mlx_hybrid import ops
    from mlx_hybrid.loaders.gguf_blocks import BLOCK_TYPES
    from mlx_hybrid.quantized_tensor import GRID_TYPES
    from mlx_hybrid.ops import cpu_quantized, llama_reference

    n, k = matrix
    x = mx.random.normal((rows, k))
    dense = mx.random.normal((n, k)) / 8
    products = {"float32 (BLAS)": lambda: x @ dense.T}
    for dtype in (mx.bfloat16, mx.float16):
        w, name = dense.astype(dtype), str(dtype).rsplit(".", 1)[-1]
        products[name] = lambda w=w: cpu_quantized.matmul_16bit(x, w)
        # llama.cpp's 16-bit activations (a GGUF file's F16 and BF16 matrices)
        products[f"{name} llama.cpp"] = lambda w=w: cpu_quantized.half_matmul(x, w)

    def random_matrix(name):  # of the type, N x K
        if name in GRID_TYPES:
            return llama_reference.random_grid_weights((n, k), GRID_TYPES[name])
        bits, group_size, _, block = BLOCK_TYPES[name]
        return without_subnormal_blocks(llama_reference.random_block_weights((n, k), bits, group_size, block))

    names = [name for name in BLOCK_TYPES if name not in GRID_TYPES] + list(GRID_TYPES)
    tensors = {name: random_matrix(name) for name in names if not types or name in types}
    for name, q in tensors.items():
        products[name] = lambda q=q: cpu_quantized.quantized_matmul(
            x, q.weight, q.scales, q.biases, q.group_size, q.bits, q.block
        )
        if not ops.int8_activations(q.bits, q.group_size, q.block):
            helds = [int8_inputs(q)] + [int8_inputs(random_matrix(name)) for _ in range(matrices - 1)]
            products[f"{name} int8"] = lambda helds=helds, turn=itertools.count(): cpu_quantized.int8_matmul(
                x, *helds[next(turn) % len(helds)]
            )
    calls = max(matrices, 300 // rows)
    print(f"{rows} x {k} @ ({n} x {k})^T, the best of {rounds} rounds of {calls}" + (", queued" if queued else ""))
    time_products(products, rounds, calls, queued)


def time_products(products: dict, rounds: int, calls: int, queued: bool = False):
    """Each product's best time over `rounds` rounds of `calls` calls, printed. queued: a round's calls
    evaluated together, so that a call's time is its kernel's and its host work's without the wait for
    MLX's thread that evaluating each alone adds (on the 2-core VMs measured, about 80 us a call)."""
    import mlx.core as mx

    for name, product in products.items():
        mx.eval(product())
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            if queued:
                mx.eval([product() for _ in range(calls)])
            else:
                for _ in range(calls):
                    mx.eval(product())
            best = min(best, (time.perf_counter() - start) / calls)
        print(f"{name:20s} {best * 1e6:7.0f} us", flush=True)


def expert_kernels(rounds: int, tokens: int, experts: int, types, queued: bool = False):
    """Expert products, the kernels alone: `tokens` rows of x, each against 8 of `experts` matrices of
    512 x 2048 (Qwen3.5-35B-A3B's expert gate; the 8 chosen at random, without repeats), for the types
    that compute experts, with float32 activations and with llama.cpp's 8-bit ones ("int8")."""
    import mlx_hybrid  # noqa: F401  (OpenBLAS before MLX)

    import mlx.core as mx
    import numpy as np

    from mlx_hybrid.loaders.gguf_blocks import BLOCK_TYPES
    from mlx_hybrid.quantized_tensor import GRID_TYPES
    from mlx_hybrid.ops import cpu_quantized, llama_reference

    n, k, chosen = 512, 2048, 8
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((tokens, 1, k)).astype(np.float32))
    choices = np.stack([rng.choice(experts, chosen, replace=False) for _ in range(tokens)])
    indices = mx.array(choices.astype(np.uint32))
    timed = {}
    for name in ("F16", "BF16"):  # 16-bit experts, with float32 activations and llama.cpp's 16-bit ones
        if types and name not in types:
            continue
        w = (mx.array(rng.standard_normal((experts, n, k)).astype(np.float32)) / 8).astype(
            mx.float16 if name == "F16" else mx.bfloat16
        )
        timed[name] = lambda w=w: cpu_quantized.gather_matmul_16bit(x, w, indices)
        timed[f"{name} llama.cpp"] = lambda w=w: cpu_quantized.half_gather_matmul(x, w, indices)
    for name in (*EXPERT_TYPES, *GRID_TYPES):
        if types and name not in types:
            continue
        if name in GRID_TYPES:
            q = llama_reference.random_grid_weights((experts, n, k), GRID_TYPES[name])
        else:
            bits, group_size, _, block = BLOCK_TYPES[name]
            q = without_subnormal_blocks(llama_reference.random_block_weights((experts, n, k), bits, group_size, block))
        timed[name] = lambda q=q: cpu_quantized.gather_quantized_matmul(
            x, q.weight, q.scales, q.biases, indices, q.group_size, q.bits, q.block
        )
        timed[f"{name} int8"] = lambda held=int8_inputs(q): cpu_quantized.int8_gather_matmul(
            x, *held[:3], indices, *held[3:]
        )
    print(f"{tokens} tokens x {chosen} of {experts} experts ({n} x {k}), the best of {rounds} rounds of 20")
    time_products(timed, rounds, 20, queued)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make", type=Path, metavar="DIR", help="write the benchmark files into DIR and stop")
    p.add_argument("--dir", type=Path, default=Path("bench_models/gguf-types"))
    p.add_argument(
        "--llama-bin",
        type=Path,
        nargs="+",
        help="the folders of llama.cpp's builds (llama-bench; the first's llama-quantize and llama-imatrix)",
    )
    p.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    p.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measured (0: none)")
    p.add_argument(
        "--instruction-set",
        choices=("avx2", "avx512"),
        help="our kernels' build (default: the CPU's best); with OPENBLAS_CORETYPE=Haswell, an AVX2 "
        "machine's instructions on an AVX-512 one",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--timeout", type=float, default=900, help="seconds a single measurement may take")
    p.add_argument("--kernels", action="store_true", help="time each type's product alone (no files) and stop")
    p.add_argument("--rows", type=int, default=1, help="--kernels: rows of x a product (1: a decode step's)")
    p.add_argument(
        "--queued",
        action="store_true",
        help="--kernels: evaluate a round's calls together, not each alone (no wait on MLX's thread a call)",
    )
    p.add_argument(
        "--experts",
        type=int,
        default=0,
        help="--kernels: time expert products instead, --rows tokens each against 8 of this many experts",
    )
    p.add_argument(
        "--matrix",
        type=int,
        nargs=2,
        default=[3584, 1024],
        metavar=("N", "K"),
        help="--kernels: the matrix's shape (default: the 0.8B shape's gate projection)",
    )
    p.add_argument(
        "--matrices",
        type=int,
        default=1,
        help="--kernels: the 8-bit products take this many matrices in turn (64 of the default shape: from memory)",
    )
    p.add_argument("--child", nargs=2, metavar=("RUNNER", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.matrices < 1:
        p.error("--matrices: at least 1")
    if args.kernels:
        if args.instruction_set:
            import mlx_hybrid  # noqa: F401  (OpenBLAS before MLX)

            from mlx_hybrid.ops import cpu_quantized

            cpu_quantized.extension().use_instruction_set(args.instruction_set)
        # the kernels of the files' types named (Q4_K_M: Q4_K's), or all of them
        types = None if args.types == TYPES else {t[:-2] if "_K_" in t else t for t in args.types}
        if args.experts:
            if args.experts < 8:
                p.error("--experts: at least 8 (each token chooses 8)")
            return expert_kernels(max(args.rounds, 3), args.rows, args.experts, types, args.queued)
        return kernels(max(args.rounds, 3), args.rows, types, tuple(args.matrix), args.queued, args.matrices)
    if args.llama_bin is None:
        p.error("--llama-bin is required to make or measure files")
    if args.make:
        return make(args.make, args.llama_bin[0], args.types)
    if args.child:
        return child(args)
    missing = [str(file_of(args.dir, name)) for name in args.types if not file_of(args.dir, name).is_file()]
    if missing:
        p.error(f"no benchmark file {', '.join(missing)}: make them first with --make {args.dir} --types ...")
    builds = list(llama_cpp_runners(args.llama_bin))
    runners = [name for runner in args.runners for name in (builds if runner == "llama.cpp" else [runner])]
    results: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(args.rounds):
        for type_name in args.types:
            for runner in runners:
                r = measure_in_child(runner, file_of(args.dir, type_name), args)
                results.setdefault((type_name, runner), []).append(r)
                print(f"round {round_index + 1} {type_name:7s} {runner:11s} {r}", file=sys.stderr, flush=True)

    def median(type_name, runner, key):
        runs = [r[key] for r in results.get((type_name, runner), []) if key in r]
        return statistics.median(runs) if runs else float("nan")

    def fastest(type_name, key):  # the llama.cpp build that ran fastest: (its name, its rate)
        rates = {build: median(type_name, build, key) for build in builds}
        best = max(rates, key=lambda b: -1.0 if rates[b] != rates[b] else rates[b])  # (nan: did not run)
        return best, rates[best]

    def rates_text(type_name, key):
        return ", ".join(f"{median(type_name, b, key):.2f} ({b.removeprefix('llama.cpp ')})" for b in builds)

    print(
        f"\n{args.tokens} tokens after an 8-token prompt, {args.threads} threads; medians of {args.rounds}; decode in tokens/s"
    )
    print(
        "| type | file GiB | weights / file | peak / file | decode | float32 decode | dequantized decode | "
        "llama.cpp decode | decode / fastest llama.cpp | float32 / fastest | llama.cpp peak / file |"
    )
    print("| --- " * 11 + "|")
    prefill_rows = []
    for type_name in args.types:
        size = file_of(args.dir, type_name).stat().st_size
        ours, floats = median(type_name, "mlx-hybrid", "decode"), median(type_name, "float32", "decode")
        build, theirs = fastest(type_name, "decode")
        print(
            f"| {type_name} | {size / 2**30:.2f} | {median(type_name, 'mlx-hybrid', 'weights') / size:.2f}x | "
            f"{median(type_name, 'mlx-hybrid', 'peak_gib') * 2**30 / size:.2f}x | {ours:.2f} | {floats:.2f} | "
            f"{median(type_name, 'dequantized', 'decode'):.2f} | {rates_text(type_name, 'decode')} | "
            f"{ours / theirs:.2f}x | {floats / theirs:.2f}x | {median(type_name, build, 'peak_gib') * 2**30 / size:.2f}x |"
        )
        prefill_rows.append(
            f"| {type_name} | {median(type_name, 'mlx-hybrid', 'prefill'):.1f} | "
            f"{median(type_name, 'float32', 'prefill'):.1f} | {rates_text(type_name, 'prefill')} |"
        )
    if args.prefill:
        print(f"\n{args.prefill}-token prefill in tokens/s")
        print("| type | prefill | float32 prefill | llama.cpp prefill |\n" + "| --- " * 4 + "|")
        print("\n".join(prefill_rows))


if __name__ == "__main__":
    main()
