"""`mlx_hybrid.convert`: a checkpoint (HF directory or GGUF file) -> an MLX-quantized directory
that keeps the MTP head (`export.convert`).

The output has the layout MLX-community conversions use (mlx-lm loads it too; it
ignores the `mtp.*` tensors, which mlx_hybrid keeps for speculative decoding):
trunk under `language_model.model.`, plain norms, conv weights [C, K, 1],
quantized modules as .weight/.scales/.biases (mxfp4: .weight/.scales), and `quantization` in
config.json.
"""

from __future__ import annotations

import sys

from mlx_hybrid.errors import MlxHybridError
from mlx_hybrid.export import convert
from mlx_hybrid.loaders import DTYPES, bundled_model_path
from mlx_hybrid.quantized_tensor import FLOAT_MODES

from .common import ArgumentParser


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="mlx_hybrid.convert",
        description=__doc__,
        epilog="example (the bundled model, then generating from the result):\n"
        "  mlx_hybrid.convert --mlx-path ./tiny-q4\n"
        '  mlx_hybrid.generate --model ./tiny-q4 --prompt "def parse_args("',
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
    p.add_argument("--q-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8], help="bits per weight (default: 4)")
    p.add_argument(
        "--q-group-size",
        type=int,
        default=None,
        choices=[32, 64, 128],
        help="group size (default: 64; mxfp4: 32)",
    )
    p.add_argument(
        "--q-mode",
        default="affine",
        choices=["affine", *FLOAT_MODES],
        help="quantization mode, as mlx-lm's: affine (a scale and a bias a group) or mxfp4 (4-bit floats "
        "times a power of two a group of 32; MoE routers stay affine in 8 bits) (default: affine)",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="dtype of the scales and of what stays unquantized, and of the weights the quantization "
        "starts from (default: an HF checkpoint's own, from its config; float32 from a GGUF)",
    )
    args = p.parse_args(argv)
    bits, group_size = FLOAT_MODES[args.q_mode][:2] if args.q_mode in FLOAT_MODES else (4, 64)
    if args.q_mode in FLOAT_MODES and (args.q_bits or bits, args.q_group_size or group_size) != (bits, group_size):
        p.error(f"--q-mode {args.q_mode} takes {bits} bits in groups of {group_size}")
    bits, group_size = args.q_bits or bits, args.q_group_size or group_size
    try:
        out = convert(args.model or bundled_model_path(), args.mlx_path, bits, group_size, args.dtype, args.q_mode)
    except MlxHybridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mode = f" {args.q_mode}" if args.q_mode != "affine" else ""
    print(f"wrote {out}: {bits}-bit{mode}, groups of {group_size}", file=sys.stderr)
    for file in sorted(out.iterdir()):
        print(f"  {file.name}  {file.stat().st_size / 1e6:.1f} MB", file=sys.stderr)
    return 0


def entry():
    sys.exit(main())


if __name__ == "__main__":
    entry()
