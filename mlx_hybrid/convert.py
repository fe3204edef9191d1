"""`mlx_hybrid.convert`: a checkpoint (HF directory or GGUF file) -> an MLX-quantized directory
that keeps the MTP head.

The output has the layout MLX-community conversions use (mlx-lm loads it too; it
ignores the `mtp.*` tensors, which mlx_hybrid keeps for speculative decoding):
trunk under `language_model.model.`, plain norms, conv weights [C, K, 1],
quantized modules as .weight/.scales/.biases, and `quantization` in config.json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import mlx.nn as nn

from .commands import ArgumentParser
from .errors import MlxHybridError
from .export import save_mlx
from .loaders import DTYPES, bundled_model_path, hf, hub, load


QWEN_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Kimi Linear is written with its own config.json, so from its Hugging Face directory only
FROM_DIRECTORIES_ONLY = ("kimi_linear",)


def convert(source, mlx_path, bits: int = 4, group_size: int = 64, dtype=None) -> Path:
    """Quantize every linear, embedding and expert layer whose input size the group size divides.

    source: an HF checkpoint directory or a GGUF file (its tokenizer is written as tokenizer.json).
    dtype: of the scales and what stays unquantized (default: the checkpoint's own, see `_config_dtype`;
    float32 from a GGUF).
    """
    mlx_path = Path(mlx_path)
    if mlx_path.exists():  # as mlx-lm: never write over what is there
        raise MlxHybridError(f"{mlx_path} already exists; remove it or give another --mlx-path")
    source = hub.resolve(source) if hub.is_hub_name(source) else Path(source)
    checkpoint_dtype = "float32"  # a GGUF's blocks dequantize exactly to float32
    if source.is_dir():  # refuse early, before loading the weights
        config = hf.read_config(source)
        if config.get("model_type") not in QWEN_TYPES + FROM_DIRECTORIES_ONLY:
            raise MlxHybridError(
                f"convert supports the Qwen hybrid families and Kimi Linear, not {config.get('model_type')!r}"
            )
        if config.get("quantization") or config.get("quantization_config"):
            raise MlxHybridError(f"{source} is already quantized; convert its float checkpoint")
        checkpoint_dtype = _config_dtype(config)
    # by default the checkpoint's dtype, not the machine's compute dtype (bfloat16 on a GPU):
    # the same source gives the same directory on every machine. A GGUF's blocks are dequantized,
    # then quantized to this one layout (a directory with one `quantization` entry holds one layout).
    model, tokenizer = load(source, dtype=dtype or checkpoint_dtype, dequantize=not source.is_dir())
    if model.model_type in FROM_DIRECTORIES_ONLY and not source.is_dir():
        raise MlxHybridError(f"convert writes {model.model_type} from its Hugging Face directory, not from a GGUF file")
    nn.quantize(model, group_size, bits, class_predicate=lambda path, m: _quantizable(path, m, group_size))
    quantization = {"group_size": group_size, "bits": bits, "mode": "affine"}
    quantization |= {  # the modules quantized otherwise, by their paths (as mlx-lm writes them)
        path: {"group_size": m.group_size, "bits": m.bits}
        for path, m in model.named_modules()
        if hasattr(m, "bits") and (m.bits, m.group_size) != (bits, group_size)
    }
    # written beside the target and renamed into place: a failed conversion leaves nothing behind
    partial = mlx_path.with_name(f".{mlx_path.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save_mlx(model, tokenizer, partial, source_dir=source if source.is_dir() else None, quantization=quantization)
        partial.rename(mlx_path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return mlx_path


# MoE routers (and the shared expert's gate) in 8 bits, groups of 64, as mlx-lm's conversions keep
# them: a router's few outputs choose the experts, where 4-bit rounding flips choices
ROUTER_QUANTIZATION = {"group_size": 64, "bits": 8}
ROUTERS = ("mlp.gate", "mlp.shared_expert_gate")


def _quantizable(path: str, module, group_size: int):
    """Linear, embedding and expert layers of the language model whose input size the group size
    divides (routers as ROUTER_QUANTIZATION says). The vision tower stays as it is, as mlx-vlm's
    conversions keep it (mlx-vlm reads a quantized tower of ours otherwise than we do)."""
    if path.startswith("vision.") or not hasattr(module, "to_quantized"):
        return False
    if path.endswith(ROUTERS):
        return ROUTER_QUANTIZATION if module.weight.shape[-1] % ROUTER_QUANTIZATION["group_size"] == 0 else False
    return module.weight.shape[-1] % group_size == 0


def _config_dtype(config: dict) -> str:
    """An HF checkpoint's own dtype, as mlx-lm's convert takes it: its config's `dtype` (formerly
    `torch_dtype`), at the top or in `text_config`; float32 where it names none we write."""
    for entry in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if entry.get(key) in DTYPES:
                return entry[key]
    return "float32"


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="mlx_hybrid.convert",
        description=__doc__,
        epilog="example (the bundled model, then generating from the result):\n"
        "  mlx_hybrid.convert --mlx-path ./tiny-q4\n"
        '  mlx_hybrid.generate --model ./tiny-q4 --prompt "def parse_args("',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        "--hf-path",
        dest="model",
        default=None,
        help="a Hugging Face checkpoint directory, a .gguf file or a hub name (org/repo, org/repo:file.gguf; "
        "default: the bundled model)",
    )
    p.add_argument("--mlx-path", required=True, help="where to write the quantized model")
    p.add_argument("--q-bits", type=int, default=4, choices=[2, 3, 4, 5, 6, 8], help="bits per weight (default: 4)")
    p.add_argument("--q-group-size", type=int, default=64, choices=[32, 64, 128], help="group size (default: 64)")
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="dtype of the scales and of what stays unquantized, and of the weights the quantization "
        "starts from (default: an HF checkpoint's own, from its config; float32 from a GGUF)",
    )
    args = p.parse_args(argv)
    try:
        out = convert(args.model or bundled_model_path(), args.mlx_path, args.q_bits, args.q_group_size, args.dtype)
    except MlxHybridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {args.q_bits}-bit, groups of {args.q_group_size}", file=sys.stderr)
    for file in sorted(out.iterdir()):
        print(f"  {file.name}  {file.stat().st_size / 1e6:.1f} MB", file=sys.stderr)
    return 0


def entry():
    sys.exit(main())


if __name__ == "__main__":
    entry()
