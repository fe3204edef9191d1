"""What an image costs, run by hand: time and peak memory of reading one image (decoding,
resizing, cutting into patches) and of the vision tower over it, with random weights of a
given shape, at the compute dtype the loader picks.

    python benchmarks/vision_tower.py                          # 1024x768, Qwen3.5-0.8B's tower
    python benchmarks/vision_tower.py --size 1920x1080 --depth 27 --width 1152 --heads 16 --mlp 4304

The tower's time is the median of --rounds evaluated runs after one warm-up; peak memory is
MLX's, over one run, beside the weights' own bytes.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import mlx_hybrid  # noqa: F401  (first: on Linux it loads OpenBLAS before MLX's library)

import mlx.core as mx  # noqa: I001
import numpy as np
from mlx.utils import tree_flatten
from PIL import Image

from mlx_hybrid.images import ImageProcessor, read_image
from mlx_hybrid.loaders import resolve_dtype
from mlx_hybrid.models.vision import VisionArgs, VisionTower


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1024x768", help="the image's width x height (default: 1024x768)")
    # Qwen3.5-0.8B's tower (its config's vision_config): 12 blocks of width 768, 12 heads
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--mlp", type=int, default=3072)
    p.add_argument("--out", type=int, default=1024, help="the text model's width")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: as the loader)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    width, height = (int(x) for x in args.size.split("x"))

    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    photo.save(buffer, format="JPEG", quality=90)
    start = time.perf_counter()
    image = ImageProcessor()(read_image(buffer.getvalue()))
    read_s = time.perf_counter() - start

    dtype = resolve_dtype(args.dtype)
    tower = VisionTower(VisionArgs(args.depth, args.width, args.mlp, args.heads, args.out, 2304))
    tower.update(
        {name: (mx.random.normal(p.shape) * 0.02).astype(dtype) for name, p in tree_flatten(tower.parameters())},
        strict=False,
    )
    params = [p for _, p in tree_flatten(tower.parameters())]
    mx.eval(params)
    weights = sum(p.nbytes for p in params)
    patches = mx.array(image.patches)
    mx.eval(tower(patches, image.grid))  # warm-up
    times = []
    mx.reset_peak_memory()
    for _ in range(args.rounds):
        start = time.perf_counter()
        mx.eval(tower(patches, image.grid))
        times.append(time.perf_counter() - start)
    print(
        f"{width}x{height} image -> grid {image.grid} = {image.patches.shape[0]} patches, {image.num_tokens} tokens\n"
        f"read + preprocess: {read_s * 1e3:.1f} ms\n"
        f"tower ({args.depth} x {args.width}, {dtype}): {statistics.median(times) * 1e3:.0f} ms "
        f"(median of {args.rounds}); weights {weights / 2**20:.0f} MiB, "
        f"peak memory {mx.get_peak_memory() / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
