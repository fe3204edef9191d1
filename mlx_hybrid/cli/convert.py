"""`mlx_hybrid.convert`: a checkpoint (HF directory or GGUF file) -> an MLX-quantized directory
that keeps the MTP head (`export.convert`).

The output has the layout MLX-community conversions use (mlx-lm loads it too; it
ignores the `mtp.*` tensors, which mlx_hybrid keeps for speculative decoding):
trunk under `language_model.model.`, plain norms, conv weights [C, K, 1],
quantized modules as .weight/.scales/.biases, and `quantization` in config.json.
"""

from __future__ import annotations

import argparse
import sys

from mlx_hybrid.errors import MlxHybridError
from mlx_hybrid.export import convert
from mlx_hybrid.loaders import DTYPES, bundled_model_path

from .common import ArgumentParser


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
