"""Quantized models on the CPU against llama.cpp and mlx-lm: the same files, the same threads.

    python benchmarks/quantized_cpu.py --make bench_models/gguf-0.8b    # once: the files
    python benchmarks/quantized_cpu.py --dir bench_models/gguf-0.8b --rounds 2

--make writes random weights at Qwen3.5-0.8B's shape (shapes.py) as a float32 GGUF in
llama.cpp's layout (mlx_hybrid.export), then Q8_0 and Q4_K_M files made by llama.cpp's own
quantizer, and the float32 weights as an MLX directory for mlx-lm.

Each measurement runs in a process of its own, so that its peak resident memory is its own:
a 512-token prompt, then 32 greedy tokens, with --threads threads. Rounds alternate the
runners, so a shared machine's drift falls on all of them; medians are printed, with the
ratio of mlx-hybrid to llama.cpp. mlx-lm runs the float32 directory (it reads no GGUF; on
MLX's quantized CPU kernels a 512-token prefill takes minutes, so its quantized runs are
left out).

Needs llama-cpp-python, built from source with explicit instruction sets (a CPU that
reports AMX a virtual machine cannot run would break a native build):
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
        pip install llama-cpp-python --no-binary llama-cpp-python
adding -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON on AVX-512 CPUs,
and mlx-lm for its column.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

FILES = {"f32": "model-f32.gguf", "Q8_0": "model-Q8_0.gguf", "Q4_K_M": "model-Q4_K_M.gguf"}
MLX_DIR = "mlx-f32"
FIXTURE_TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen35" / "hf"


def make(directory: Path):
    import mlx_hybrid  # noqa: F401  (OpenBLAS before MLX)

    import llama_cpp
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    from shapes import SHAPES, random_model

    from mlx_hybrid.export import save_mlx
    from mlx_hybrid.export import save_gguf
    from mlx_hybrid.loaders import load

    directory.mkdir(parents=True, exist_ok=True)
    _, tokenizer = load(FIXTURE_TOKENIZER)
    model = random_model(SHAPES["qwen3.5-0.8b"](), mx.float32)
    save_gguf(model, tokenizer, directory / FILES["f32"], matrix_dtype=np.float32)
    save_mlx(model, tokenizer, directory / MLX_DIR, source_dir=FIXTURE_TOKENIZER)
    for name, ftype in (("Q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0), ("Q4_K_M", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = ftype, os.cpu_count() or 1
        source, target = str(directory / FILES["f32"]).encode(), str(directory / FILES[name]).encode()
        if llama_cpp.llama_model_quantize(source, target, params) != 0:
            sys.exit(f"llama.cpp could not quantize to {name}")
    for path in sorted(directory.iterdir()):
        print(f"wrote {path}", file=sys.stderr)


def prompt_ids(count: int) -> list[int]:
    return [(i * 7919) % 500 + 10 for i in range(count)]  # ids every runner's tokenizer knows


def run_llama_cpp(path: Path, prompt: list[int], tokens: int, threads: int) -> tuple[float, float]:
    import llama_cpp

    llm = llama_cpp.Llama(
        str(path),
        n_ctx=len(prompt) + tokens + 8,
        n_batch=len(prompt),
        n_ubatch=len(prompt),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    import numpy as np

    def last_token_argmax() -> int:  # the logits of the batch's last token (the only ones kept)
        return int(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).argmax())

    start = time.perf_counter()
    llm.eval(prompt)
    prefilled = time.perf_counter()
    token = last_token_argmax()
    for _ in range(tokens - 1):
        llm.eval([token])
        token = last_token_argmax()
    done = time.perf_counter()
    return len(prompt) / (prefilled - start), (tokens - 1) / (done - prefilled)


def run_mlx_hybrid(path: Path, prompt: list[int], tokens: int, threads: int) -> tuple[float, float]:
    import mlx_hybrid

    model, tokenizer = mlx_hybrid.load(path)
    return _timed(mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=tokens, draft=None))


def run_mlx_lm(path: Path, prompt: list[int], tokens: int, threads: int) -> tuple[float, float]:
    import mlx_hybrid  # noqa: F401  (OpenBLAS before MLX: mlx-lm gets the BLAS we get)
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(path))
    return _timed(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=tokens))


def _timed(responses) -> tuple[float, float]:
    """(prompt tokens/s, generated tokens/s after the first) from the wall clock."""
    start = time.perf_counter()
    times = []
    for _ in responses:
        times.append(time.perf_counter())
    return 0.0 if not times else len(PROMPT) / (times[0] - start), (len(times) - 1) / (times[-1] - times[0])


RUNNERS = {"llama.cpp": run_llama_cpp, "mlx-hybrid": run_mlx_hybrid, "mlx-lm": run_mlx_lm}
PROMPT: list[int] = []


def measure_in_child(runner: str, path: Path, args) -> dict:
    return json_of_child(
        [
            __file__,
            "--child",
            runner,
            str(path),
            "--prompt-tokens",
            str(args.prompt_tokens),
            "--tokens",
            str(args.tokens),
            "--threads",
            str(args.threads),
        ],
        args,
    )


def json_of_child(arguments: list[str], args) -> dict:
    """The last line a Python child printed (a JSON object), with args.threads threads and
    args.timeout seconds; {"error": its last line of stderr} where it failed."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads))
    done = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, env=env, timeout=args.timeout)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["exit status %d" % done.returncode])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make", type=Path, metavar="DIR", help="write the benchmark files into DIR and stop")
    p.add_argument("--dir", type=Path, default=Path("bench_models/gguf-0.8b"))
    p.add_argument("--files", nargs="+", default=list(FILES), choices=list(FILES))
    p.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--timeout", type=float, default=900, help="seconds a single measurement may take")
    p.add_argument("--child", nargs=2, metavar=("RUNNER", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    PROMPT[:] = prompt_ids(args.prompt_tokens)
    if args.make:
        return make(args.make)
    if args.child:
        runner, path = args.child
        prefill_tps, decode_tps = RUNNERS[runner](Path(path), PROMPT, args.tokens, args.threads)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        result = {"prefill": prefill_tps, "decode": decode_tps, "peak_gib": peak}
        if runner != "llama.cpp":  # MLX's products: without OpenBLAS, prefill and f32 run far slower
            from mlx_hybrid.blas import active_blas

            result["blas"] = active_blas()
        print(json.dumps(result))
        return
    results: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(args.rounds):
        for name in args.files:
            for runner in args.runners:
                if runner == "mlx-lm" and name != "f32":
                    continue
                path = args.dir / (MLX_DIR if runner == "mlx-lm" else FILES[name])
                r = measure_in_child(runner, path, args)
                results.setdefault((name, runner), []).append(r)
                print(f"round {round_index + 1} {name:7s} {runner:10s} {r}", file=sys.stderr, flush=True)
    blas = sorted({r["blas"] for runs in results.values() for r in runs if "blas" in r})
    print(
        f"\n{args.prompt_tokens}-token prompt, {args.tokens} tokens, {args.threads} threads; medians of {args.rounds}; "
        f"MLX's BLAS: {', '.join(blas) or '-'}"
    )
    print(f"{'file':7s} {'runner':10s} {'prefill t/s':>12s} {'decode t/s':>11s} {'peak GiB':>8s} {'file GiB':>8s}")
    for name in args.files:
        size = (args.dir / FILES[name]).stat().st_size / 2**30
        medians = {}
        for runner in args.runners:
            runs = [r for r in results.get((name, runner), []) if "error" not in r]
            if not runs:
                continue
            medians[runner] = {k: statistics.median(r[k] for r in runs) for k in ("prefill", "decode", "peak_gib")}
            m = medians[runner]
            print(f"{name:7s} {runner:10s} {m['prefill']:12.1f} {m['decode']:11.2f} {m['peak_gib']:8.2f} {size:8.2f}")
        if "llama.cpp" in medians and "mlx-hybrid" in medians:
            ours, theirs = medians["mlx-hybrid"], medians["llama.cpp"]
            print(
                f"{'':7s} ratio      {ours['prefill'] / theirs['prefill']:11.2f}x {ours['decode'] / theirs['decode']:10.2f}x "
                f"{ours['peak_gib'] / size:7.2f}x of the file"
            )


if __name__ == "__main__":
    main()
