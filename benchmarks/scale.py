"""Full-size GGUF files: load time, peak memory, prompt and decode speed beside llama.cpp's.

    python benchmarks/scale.py --make --shape 35b-a3b-8 --quant Q4_K_M     # once: writes the file
    python benchmarks/scale.py --shape 35b-a3b-8 --quant Q4_K_M --llama-bin DIR [DIR ...]

--make writes a GGUF file at a published model's exact shape by streaming random blocks to disk
(a few hundred MB in memory at a time), with the types llama-quantize chooses for the mixture
(llama.cpp's `llama_tensor_get_type`: for Q4_K_M, Q6_K for the attention values and fused QKV and
the feed-forward down matrices of its "more bits" layers and for the output matrix, Q4_K for the
rest; Q8_0: every matrix Q8_0; norms, the router, the conv and the SSM vectors float32), and the
fixtures' tokenizer padded to the shape's vocabulary as llama.cpp's converter pads it. Each block's
float16 scales are small normal numbers, so that the model's states stay finite.

Each runner then runs in a process of its own (its peak resident memory is its own), on the file as
it lies, page cache warm (one untimed read before the first round):
- mlx-hybrid: `load` timed (seconds, from the call to the model's arrays evaluated), a prompt of
  --prompt tokens (the best of 2) and --tokens greedy tokens, timed from the second;
- llama.cpp: `llama-bench -p P -n N` with the same threads, once with its CPU repacking (its default)
  and once with `--repack 0` (computing from the mapped file), and its whole run's seconds; for each
  build named (`--llama-bin`: the folders of its binaries, e.g. an AVX2 build and the CPU's own).
Rounds alternate the runners; the ratios are against llama.cpp's fastest build and setting.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "qwen35moe" / "model-Q4_K_M.gguf"  # its metadata and tokenizer


@dataclass(frozen=True)
class Shape:
    """A qwen35 / qwen35moe text model's widths, as its config.json publishes them."""

    layers: int
    hidden: int
    heads: int  # full attention: query heads, key-value heads, head size
    kv_heads: int
    head_dim: int
    key_heads: int  # linear attention: key heads, value heads (key and value head size 128)
    value_heads: int
    intermediate: int = 0  # dense feed-forward
    experts: int = 0
    experts_used: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    vocab: int = 248320  # padded as llama.cpp's converter pads it
    linear_head_dim: int = 128

    @property
    def arch(self) -> str:
        return "qwen35moe" if self.experts else "qwen35"


SHAPES = {
    # Qwen3.5-35B-A3B (and 3.6): 40 layers, 256 experts of 512, 8 chosen, a shared expert of 512
    "35b-a3b": Shape(40, 2048, 16, 2, 256, 16, 32, experts=256, experts_used=8, expert_intermediate=512,
                     shared_intermediate=512),
    # its widths with 8 layers, for quick runs
    "35b-a3b-8": Shape(8, 2048, 16, 2, 256, 16, 32, experts=256, experts_used=8, expert_intermediate=512,
                       shared_intermediate=512),
    # Qwen3.5-27B, dense
    "27b": Shape(64, 5120, 24, 4, 256, 16, 48, intermediate=17408),
}  # fmt: skip

# float16 fields of a block (offset in bytes) and the size of a random block's scale there: small
# enough that a weight is a few hundredths (q and the sub-block codes multiply it)
BLOCKS = {
    "Q4_K": (144, (0, 2), 1e-4),
    "Q5_K": (176, (0, 2), 5e-5),
    "Q6_K": (210, (208,), 1e-5),
    "Q8_0": (34, (0,), 2e-4),
}


# llama.cpp's llama_ftype of each mixture (general.file_type)
FILE_TYPES = {"Q8_0": 7, "Q4_K_M": 15}


def tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy-order shape) of every tensor, in the converter's order: the embedding,
    the blocks (the MTP block last), the output norm and matrix."""
    e, lin = shape.hidden, shape.linear_head_dim
    key_dim, value_dim = shape.key_heads * lin, shape.value_heads * lin
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [("token_embd.weight", (shape.vocab, e))]
    for i in range(shape.layers + 1):  # + the MTP block
        full = (i + 1) % 4 == 0 or i == shape.layers
        block = [("attn_norm.weight", (e,)), ("post_attention_norm.weight", (e,))]
        if full:
            block += [
                ("attn_q.weight", (2 * q_dim, e)),
                ("attn_k.weight", (kv_dim, e)),
                ("attn_v.weight", (kv_dim, e)),
                ("attn_output.weight", (e, q_dim)),
                ("attn_q_norm.weight", (shape.head_dim,)),
                ("attn_k_norm.weight", (shape.head_dim,)),
            ]
        else:
            conv = 2 * key_dim + value_dim
            block += [
                ("attn_qkv.weight", (conv, e)),
                ("attn_gate.weight", (value_dim, e)),
                ("ssm_alpha.weight", (shape.value_heads, e)),
                ("ssm_beta.weight", (shape.value_heads, e)),
                ("ssm_a", (shape.value_heads,)),
                ("ssm_dt.bias", (shape.value_heads,)),
                ("ssm_conv1d.weight", (conv, 4)),
                ("ssm_norm.weight", (lin,)),
                ("ssm_out.weight", (e, value_dim)),
            ]
        if shape.experts:
            x, f, s = shape.experts, shape.expert_intermediate, shape.shared_intermediate
            block += [
                ("ffn_gate_inp.weight", (x, e)),
                ("ffn_gate_exps.weight", (x, f, e)),
                ("ffn_up_exps.weight", (x, f, e)),
                ("ffn_down_exps.weight", (x, e, f)),
                ("ffn_gate_inp_shexp.weight", (e,)),
                ("ffn_gate_shexp.weight", (s, e)),
                ("ffn_up_shexp.weight", (s, e)),
                ("ffn_down_shexp.weight", (e, s)),
            ]
        else:
            f = shape.intermediate
            block += [("ffn_gate.weight", (f, e)), ("ffn_up.weight", (f, e)), ("ffn_down.weight", (e, f))]
        if i == shape.layers:
            block += [
                ("nextn.eh_proj.weight", (e, 2 * e)),
                ("nextn.enorm.weight", (e,)),
                ("nextn.hnorm.weight", (e,)),
                ("nextn.shared_head_norm.weight", (e,)),
            ]
        out += [(f"blk.{i}.{name}", dims) for name, dims in sorted(block)]
    return out + [("output_norm.weight", (e,)), ("output.weight", (shape.vocab, e))]


def chosen_types(names: list[tuple[str, tuple]], shape: Shape, quant: str) -> dict[str, str]:
    """Each tensor's type as llama-quantize chooses it for the mixture `quant` (Q4_K_M or Q8_0)."""

    def more_bits(i, n):
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    quantized = [
        name
        for name, dims in names
        if len(dims) > 1 and not any(part in name for part in ("ffn_gate_inp.", "ssm_conv1d"))
    ]
    attention_values = [name for name in quantized if "attn_v." in name or "attn_qkv." in name]
    blocks = shape.layers + 1
    types = {name: "F32" for name, _ in names}
    for name in quantized:
        if dict(names)[name][-1] % 256:  # (llama-quantize's fallbacks for narrower rows are not modelled)
            raise ValueError(f"{name}: rows of {dict(names)[name][-1]} values, not whole blocks of 256")
        if quant == "Q8_0":
            types[name] = "Q8_0"
        elif name == "output.weight":
            types[name] = "Q6_K"
        elif name in attention_values:
            types[name] = "Q6_K" if more_bits(attention_values.index(name), len(attention_values)) else "Q4_K"
        elif "ffn_down" in name:
            types[name] = "Q6_K" if more_bits(int(name.split(".")[1]), blocks) else "Q4_K"
        else:
            types[name] = "Q4_K"
    return types


def random_tensor(rng, dims: tuple, type_name: str, name: str) -> np.ndarray:
    """Random data of one tensor: blocks of `type_name` [rows, bytes], or float32 values."""
    if type_name == "F32":
        if name.endswith("ssm_a"):  # -exp(A_log): negative, so that the state decays
            return -rng.uniform(0.1, 1.0, dims).astype(np.float32)
        if name.endswith("norm.weight"):
            return (1 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
        return (0.05 * rng.standard_normal(dims)).astype(np.float32)
    block_bytes, fields, scale = BLOCKS[type_name]
    rows = int(np.prod(dims[:-1]))
    blocks = (
        np.frombuffer(rng.bytes(rows * dims[-1] // (32 if type_name == "Q8_0" else 256) * block_bytes), np.uint8)
        .reshape(-1, block_bytes)
        .copy()
    )
    for at in fields:
        d = (scale * rng.uniform(0.5, 1.5, len(blocks))).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*dims[:-1], -1)


def file_of(directory: Path, shape_name: str, quant: str) -> Path:
    return directory / f"qwen3.5-{shape_name}-{quant}.gguf"


def make(path: Path, shape: Shape, quant: str, seed: int = 0):
    import gguf
    from tqdm import tqdm

    names = tensors(shape)
    types = chosen_types(names, shape, quant)
    writer = gguf.GGUFWriter(path, shape.arch)
    source = gguf.GGUFReader(FIXTURE)
    values = {
        "block_count": shape.layers + 1, "embedding_length": shape.hidden, "attention.head_count": shape.heads,
        "attention.head_count_kv": shape.kv_heads, "attention.key_length": shape.head_dim,
        "attention.value_length": shape.head_dim, "rope.dimension_count": shape.head_dim // 4,
        "rope.dimension_sections": [11, 11, 10, 0], "ssm.state_size": shape.linear_head_dim,
        "ssm.group_count": shape.key_heads, "ssm.time_step_rank": shape.value_heads,
        "ssm.inner_size": shape.value_heads * shape.linear_head_dim, "context_length": 262144,
        "attention.recurrent_layers": [(i + 1) % 4 != 0 and i < shape.layers for i in range(shape.layers + 1)],
        "expert_count": shape.experts, "expert_used_count": shape.experts_used,
        "expert_feed_forward_length": shape.expert_intermediate,
        "expert_shared_feed_forward_length": shape.shared_intermediate, "feed_forward_length": shape.intermediate,
    }  # fmt: skip
    for field in source.fields.values():
        key = field.name
        if key.startswith("GGUF.") or key in ("general.architecture", "general.size_label"):
            continue
        short = key.split(".", 1)[1] if key.startswith("qwen35moe.") else None
        if short in values and not values[short]:
            continue  # (a dense shape's expert counts)
        value = values.pop(short, None) if short else None
        vtype = field.types[0]
        if value is None:
            value = FILE_TYPES[quant] if key == "general.file_type" else field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(value), shape.vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [gguf.TokenType.UNUSED] * (shape.vocab - len(value))
        if short is not None:
            key = f"{shape.arch}.{short}"
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for short, value in values.items():  # the shape's keys the fixture lacks
        if value:
            writer.add_uint32(f"{shape.arch}.{short}", value)
    sizes = {}
    for name, dims in names:
        type_name = types[name]
        if type_name == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
            continue
        block_bytes = BLOCKS[type_name][0]
        row_bytes = dims[-1] // (32 if type_name == "Q8_0" else 256) * block_bytes
        byte_dims = (*dims[:-1], row_bytes)
        sizes[name] = int(np.prod(byte_dims))
        writer.add_tensor_info(name, byte_dims, np.dtype(np.uint8), sizes[name], gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    total = sum(sizes.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {path.name}") as bar:
        for name, dims in names:
            writer.write_tensor_data(random_tensor(rng, dims, types[name], name))
            bar.update(sizes.get(name, 0))
    writer.close()


def run_ours(path: Path, prompt_tokens: int, tokens: int) -> dict:
    start = time.perf_counter()
    import mlx_hybrid  # (OpenBLAS before MLX)

    import mlx.core as mx

    from mlx_hybrid.prompt import prefill

    model, tokenizer = mlx_hybrid.load(path)
    mx.eval(model.parameters())
    load_s = time.perf_counter() - start
    weights = model.nbytes
    prompt = [(i * 7919) % 500 + 10 for i in range(prompt_tokens)]  # ids the fixtures' tokenizer knows
    prefill_s = float("inf")
    for _ in range(2):
        begin = time.perf_counter()
        mx.eval(prefill(model, prompt, model.make_cache()))
        prefill_s = min(prefill_s, time.perf_counter() - begin)
    times = [
        time.perf_counter()
        for _ in mlx_hybrid.stream_generate(model, tokenizer, prompt[:8], max_tokens=tokens, draft=None)
    ]
    return {
        "load_s": load_s,
        "weights_gb": weights / 1e9,
        "prefill": prompt_tokens / prefill_s,
        "decode": (len(times) - 1) / (times[-1] - times[0]),
    }


def run_llama_cpp(path: Path, prompt_tokens: int, tokens: int, threads: int, llama_bin: Path, repack: bool) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    import gguf_types

    start = time.perf_counter()
    rates = gguf_types.run_llama_cpp(path, tokens, prompt_tokens, threads, llama_bin, ["--repack", str(int(repack))])
    return rates | {"load_s": time.perf_counter() - start}  # (the whole run's seconds)


OURS = "mlx-hybrid"


def runners(llama_bins: list[Path]) -> dict[str, tuple]:
    """Each runner's name -> (llama.cpp's binaries, whether it repacks), ours first (None)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_types import llama_cpp_runners

    found = {OURS: None}
    for name, llama_bin in llama_cpp_runners(llama_bins).items():
        found[name] = (llama_bin, True)
        found[f"{name} --repack 0"] = (llama_bin, False)
    return found


def child(args):
    runner, path = args.child
    if runner == OURS:
        result = run_ours(Path(path), args.prompt, args.tokens)
    else:
        llama_bin, repack = runners(args.llama_bin)[runner]
        result = run_llama_cpp(Path(path), args.prompt, args.tokens, args.threads, llama_bin, repack)
    result["peak_gb"] = (
        max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) * 1024 / 1e9
    )
    print(json.dumps(result))


def measure(runner: str, path: Path, args) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from quantized_cpu import json_of_child

    builds = ["--llama-bin", *map(str, args.llama_bin)] if args.llama_bin else []
    return json_of_child(
        [
            __file__,
            "--child",
            runner,
            str(path),
            "--prompt",
            str(args.prompt),
            "--tokens",
            str(args.tokens),
            "--threads",
            str(args.threads),
            *builds,
        ],
        args,
    )


def warm(path: Path):
    """Read the file once, so that every runner finds it in the page cache (where it fits)."""
    with open(path, "rb") as f:
        while f.read(1 << 26):
            pass


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="35b-a3b-8")
    p.add_argument("--quant", choices=("Q4_K_M", "Q8_0"), default="Q4_K_M")
    p.add_argument("--dir", type=Path, default=ROOT / "bench_models" / "scale")
    p.add_argument("--make", action="store_true", help="write the file (if it is not there) and stop")
    p.add_argument(
        "--llama-bin",
        type=Path,
        nargs="+",
        default=[],
        help="folders of llama.cpp's llama-bench, one a build (else ours alone)",
    )
    p.add_argument("--ours-only", action="store_true", help="measure mlx-hybrid alone")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--tokens", type=int, default=16, help="decoded tokens (default 16)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--timeout", type=float, default=1800, help="seconds a single measurement may take")
    p.add_argument("--child", nargs=2, metavar=("RUNNER", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("rounds", "prompt", "tokens", "threads", "timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.child:
        return child(args)
    path = file_of(args.dir, args.shape, args.quant)
    if args.make or not path.is_file():
        if not path.is_file():
            args.dir.mkdir(parents=True, exist_ok=True)
            make(path, SHAPES[args.shape], args.quant)
        print(f"{path}: {path.stat().st_size / 1e9:.2f} GB", file=sys.stderr)
        if args.make:
            return
    for llama_bin in args.llama_bin:
        if not (llama_bin / "llama-bench").is_file():
            p.error(f"--llama-bin {llama_bin}: no llama-bench there")
    names = [OURS] if args.ours_only else list(runners(args.llama_bin))
    warm(path)
    results = {runner: [] for runner in names}
    for _ in range(args.rounds):
        for runner in names:
            results[runner].append(measure(runner, path, args))
            print(runner, json.dumps(results[runner][-1]), file=sys.stderr)
    print(
        f"{path.name}, {path.stat().st_size / 1e9:.2f} GB, {args.threads} threads, prompt {args.prompt}, "
        f"{args.tokens} tokens, medians of {args.rounds}"
    )
    medians = {}
    for runner, rounds in results.items():
        good = [r for r in rounds if "error" not in r]
        if not good:
            print(f"  {runner}: {rounds[-1]['error']}")
            continue
        medians[runner] = {k: float(np.median([r[k] for r in good])) for k in good[0]}
    peers = [m for runner, m in medians.items() if runner != OURS]
    for runner, m in medians.items():
        line = (
            f"  {runner:36s} load {m['load_s']:6.1f} s  peak {m['peak_gb']:6.2f} GB  prompt {m['prefill']:7.1f} "
            f"tok/s  decode {m['decode']:6.2f} tok/s"
        )
        if runner == OURS and peers:
            line += "  ({:.2f}x / {:.2f}x llama.cpp's fastest)".format(
                m["prefill"] / max(p["prefill"] for p in peers), m["decode"] / max(p["decode"] for p in peers)
            )
        print(line)


if __name__ == "__main__":
    main()
