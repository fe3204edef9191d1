"""Memory a loaded Q4_K_M GGUF takes, against its file size, run by hand.

    python benchmarks/resident_size.py                 # Qwen3.5-0.8B shape, random blocks
    python benchmarks/resident_size.py --model x.gguf  # a real file

No real Q4_K_M file can be had here and gguf-py writes no K-quants, so by default
the script writes one: the Qwen3.5-0.8B shape with llama.cpp's Q4_K_M choice of type
per tensor (Q6_K for the output matrix, for attn_v and ffn_down of the layers
llama.cpp gives more bits, Q5_K for the fused attn_qkv, Q4_K elsewhere) and random
blocks of those types. It then loads the file, exactly and then compact
(`mlx_hybrid.load(..., compact=True)`: 16-bit scales, Q6_K re-quantized to 6 bits),
and prints the active MLX memory the weights take against the file's size.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library

import mlx.core as mx  # noqa: I001
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES, random_model  # noqa: E402

FIXTURE_TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen35" / "hf"


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, n_layer: int, tied: bool):
    from gguf import GGMLQuantizationType as T

    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return T.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")):
        return T.Q6_K if more_bits(layer, n_layer) else T.Q4_K
    if name.endswith("attn_qkv.weight"):
        return T.Q5_K
    return T.Q4_K


def random_blocks(shape, qtype, rng) -> np.ndarray:
    """Random K-quant blocks with small scales, as bytes [..., rows, bytes per row]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    *lead, cols = shape
    blocks = rng.integers(0, 256, (*lead, cols // per_block, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
    if qtype == T.Q6_K:
        blocks[..., 208:210] = scale  # d
    else:
        blocks[..., 0:2] = scale  # d
        blocks[..., 2:4] = scale  # dmin
    return blocks.reshape(*lead, -1)


def write_q4_k_m(shape: str, path: Path):
    from mlx_hybrid.export import save_gguf

    model = random_model(SHAPES[shape](), mx.float32)
    _, tokenizer = mlx_hybrid.load(FIXTURE_TOKENIZER)
    args, rng = model.args, np.random.default_rng(0)
    n_layer = args.num_hidden_layers + args.mtp_num_hidden_layers

    def encode(name, array):
        if array.shape[-1] % 256:
            return None
        qtype = q4_k_m_type(name, n_layer, args.tie_word_embeddings)
        return random_blocks(array.shape, qtype, rng), qtype

    save_gguf(model, tokenizer, path, encode_matrix=encode)


def file_bytes_by_type(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    sizes = defaultdict(int)
    for tensor in GGUFReader(path).tensors:
        sizes[tensor.tensor_type.name] += int(tensor.n_bytes)
    return dict(sizes)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a Q4_K_M GGUF to measure instead of writing one")
    p.add_argument("--shape", default="qwen3.5-0.8b", choices=sorted(SHAPES))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = args.model
        if path is None:
            path = Path(scratch) / f"{args.shape}-Q4_K_M.gguf"
            write_q4_k_m(args.shape, path)
            gc.collect()
            mx.clear_cache()
        sizes = file_bytes_by_type(path)
        file_size = path.stat().st_size
        print(f"{path.name}: file {file_size / 1e6:.1f} MB; tensor bytes by type in the file:")
        for name, size in sorted(sizes.items(), key=lambda item: -item[1]):
            print(f"  {name:6s} {size / 1e6:9.1f} MB")
        for compact in (False, True):
            measure(path, file_size, compact)


def measure(path: Path, file_size: int, compact: bool):
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    model, _ = mlx_hybrid.load(path, compact=compact)
    resident = mx.get_active_memory() - before
    mode = "compact" if compact else "exact"
    print(f"loaded {mode} (float32 compute): {resident / 1e6:.1f} MB active = {resident / file_size:.2f}x the file")
    parameters = tree_flatten(model.parameters())
    quantized = sum(v.nbytes for k, v in parameters if k.endswith((".scales", ".biases")) or v.dtype == mx.uint32)
    print(f"  of which MLX quantized modules (packed weights, scales, biases): {quantized / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
