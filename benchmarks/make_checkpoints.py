"""Write random-weight checkpoints at real shapes, for benchmarks both runners can load.

    python benchmarks/make_checkpoints.py --out bench_models

Shapes come from the published configs (see shapes.py): Qwen3.5-0.8B, and
Qwen3.5-35B-A3B scaled down (its widths and expert count kept where they shape
the kernels, its depth and expert count reduced to fit this machine). The files
use the MLX-community layout (mlx-lm loads it; so does mlx_hybrid), unquantized,
with the fixtures' tokenizer (ids below 512 only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx_hybrid  # noqa: F401  (first: on Linux it loads OpenBLAS before MLX's library)

import mlx.core as mx  # noqa: I001

sys.path.insert(0, str(Path(__file__).parent))

from mlx_hybrid.export import save_mlx  # noqa: E402
from mlx_hybrid.loaders import load  # noqa: E402
from shapes import SHAPES, random_model  # noqa: E402

FIXTURE_TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen35moe" / "hf"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench_models"))
    p.add_argument("--shapes", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    args = p.parse_args()
    _, tokenizer = load(FIXTURE_TOKENIZER)
    for name in args.shapes:
        model = random_model(SHAPES[name](), mx.float32)
        target = args.out / name
        save_mlx(model, tokenizer, target, source_dir=FIXTURE_TOKENIZER)
        print(f"wrote {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
