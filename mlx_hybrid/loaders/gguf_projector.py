"""Qwen3.5's vision projector as llama.cpp writes it: the `mmproj` GGUF beside a model."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

from ..errors import ModelLoadError
from .gguf_file import Metadata, block_names, open_gguf, tensor_shapes

# llama.cpp's image bounds for these projectors, in tokens, where the file names none
MMPROJ_MIN_TOKENS, MMPROJ_MAX_TOKENS = 8, 4096

_MMPROJ_BLOCK = {
    "attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2",
    "ln1": "norm1", "ln2": "norm2",
}  # fmt: skip
_MMPROJ_OTHER = {
    "v.position_embd.weight": "vision.pos_embed", "v.patch_embd.bias": "vision.patch_embed.bias",
    "v.post_ln.weight": "vision.merger.norm.weight", "v.post_ln.bias": "vision.merger.norm.bias",
    "mm.0.weight": "vision.merger.linear_fc1.weight", "mm.0.bias": "vision.merger.linear_fc1.bias",
    "mm.2.weight": "vision.merger.linear_fc2.weight", "mm.2.bias": "vision.merger.linear_fc2.bias",
}  # fmt: skip


def find_mmproj(model_path: Path) -> Path | None:
    """The projector beside a GGUF model (`mmproj*.gguf`), where there is exactly one."""
    found = sorted(p for p in model_path.parent.glob("*.gguf") if "mmproj" in p.name.lower() and p != model_path)
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelLoadError(f"several projector files beside {model_path.name} ({names}): choose one with mmproj=")
    return found[0] if found else None


def read_mmproj(path: Path, text_width: int):
    """A Qwen3.5 vision projector GGUF: (VisionArgs, ImageProcessor, weights by our names)."""
    from ..images import ImageProcessor
    from ..models.vision import VisionArgs

    reader = open_gguf(path)
    meta = Metadata(reader)
    if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder"):
        raise ModelLoadError(f"{path}: not a vision projector (mmproj) GGUF")
    kind = meta.get("clip.projector_type")
    if kind != "qwen3vl_merger":
        raise ModelLoadError(f"{path}: projector type {kind!r} is not supported (Qwen3.5's is 'qwen3vl_merger')")
    if any(meta.get("clip.vision.is_deepstack_layers") or []):
        raise ModelLoadError(f"{path}: deepstack projectors (Qwen3-VL) are not supported")
    shapes = tensor_shapes(reader)

    def need(key):
        value = meta.get(f"clip.vision.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: projector metadata lacks clip.vision.{key}")
        return value

    patch, merge = need("patch_size"), meta.get("clip.vision.spatial_merge_size", 2)
    args = VisionArgs(
        depth=need("block_count"),
        hidden_size=need("embedding_length"),
        intermediate_size=need("feed_forward_length"),
        num_heads=need("attention.head_count"),
        out_hidden_size=need("projection_dim"),
        num_position_embeddings=shapes.get("v.position_embd.weight", (0,))[0],
        patch_size=patch,
        spatial_merge_size=merge,
        layer_norm_eps=meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6),
    )
    if args.out_hidden_size != text_width:
        raise ModelLoadError(f"{path}: the projector gives width {args.out_hidden_size}, the model's is {text_width}")
    per_token = (patch * merge) ** 2
    processor = ImageProcessor(
        min_pixels=meta.get("clip.vision.image_min_pixels", MMPROJ_MIN_TOKENS * per_token),
        max_pixels=meta.get("clip.vision.image_max_pixels", MMPROJ_MAX_TOKENS * per_token),
        patch_size=patch,
        merge_size=merge,
        image_mean=tuple(need("image_mean")),
        image_std=tuple(need("image_std")),
    )
    weights, frames = {}, {}
    for name, load in block_names(reader, 0, keep_quantized=False):
        m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)", name)
        if m and m.group(2) in _MMPROJ_BLOCK:
            weights[f"vision.blocks.{m.group(1)}.{_MMPROJ_BLOCK[m.group(2)]}.{m.group(3)}"] = load()
        elif name in _MMPROJ_OTHER:
            weights[_MMPROJ_OTHER[name]] = load()
        elif name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
            frames[name] = load()  # the temporal pair of the patch kernel: two 2-D kernels [E, C, P, P]
        else:
            raise ModelLoadError(f"{path}: projector tensor this loader does not know: {name}")
    if len(frames) != 2:
        raise ModelLoadError(f"{path}: the projector lacks its patch embedding (v.patch_embd.weight, .weight.1)")
    kernel = mx.stack([frames["v.patch_embd.weight"], frames["v.patch_embd.weight.1"]], axis=2)
    weights["vision.patch_embed.weight"] = kernel.reshape(args.hidden_size, -1)
    return args, processor, weights
