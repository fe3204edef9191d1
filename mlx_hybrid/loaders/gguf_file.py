"""GGUF files as llama.cpp's converter writes the hybrid models.

Undoes the conversion transforms listed in docs/MODELS.md: value heads tiled
(qwen35*), `ssm_ba` fused (qwen3next), experts stacked, MTP in a `nextn` block.
Decoder norms are stored as 1 + w and `ssm_a` as -exp(A_log): our canonical
forms already, so they load as they are.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError
from ..models.layers import FULL, LINEAR
from ..models.qwen3_5 import POST_NORM
from .common import Rule, rowwise, split_fused_ba
from .quantized import from_gguf_blocks

# -- hyper-parameters ------------------------------------------------------------

# Written only for an MTP head trained on the pre-norm state (llama.cpp knows no such key:
# the released heads, and llama.cpp, read the post-norm state).
MTP_HIDDEN_KEY = "mlx_hybrid.mtp_hidden"


class Metadata:
    """Typed access to a GGUF file's key-value fields."""

    def __init__(self, reader: GGUFFile):
        self.reader = reader
        self.arch = self.get("general.architecture")

    def get(self, key, default=None):
        return self.reader.metadata.get(key, default)

    def arch_value(self, key, default=None):
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key):
        value = self.arch_value(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {self.arch}.{key}")
        return value


def _per_layer_max(value):
    return max(value) if isinstance(value, list) else value


def _qwen_args(meta: Metadata, module, tensor_shapes: dict):
    nextn = meta.arch_value("nextn_predict_layers", 0)
    n_layer = meta.require("block_count") - nextn
    head_dim = meta.require("attention.key_length")
    recurrent = meta.arch_value("attention.recurrent_layers")
    if recurrent:
        layer_types = [LINEAR if r else FULL for r in recurrent[:n_layer]]
    else:
        interval = meta.arch_value("full_attention_interval", 4)
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layer)]
    value_heads = meta.require("ssm.time_step_rank")
    sections = meta.arch_value("rope.dimension_sections") or []  # MRoPE's (t, h, w, unused), interleaved
    return module.ModelArgs(
        model_type=GGUF_ARCHITECTURES[meta.arch][0],
        vocab_size=len(meta.get("tokenizer.ggml.tokens", [])) or meta.require("vocab_size"),
        hidden_size=meta.require("embedding_length"),
        num_hidden_layers=n_layer,
        num_attention_heads=_per_layer_max(meta.require("attention.head_count")),
        num_key_value_heads=_per_layer_max(meta.require("attention.head_count_kv")),
        head_dim=head_dim,
        rms_norm_eps=meta.require("attention.layer_norm_rms_epsilon"),
        rope_theta=meta.arch_value("rope.freq_base", 10000.0),
        partial_rotary_factor=meta.arch_value("rope.dimension_count", head_dim) / head_dim,
        linear_num_key_heads=meta.require("ssm.group_count"),
        linear_num_value_heads=value_heads,
        linear_key_head_dim=meta.require("ssm.state_size"),
        linear_value_head_dim=meta.require("ssm.inner_size") // value_heads,
        linear_conv_kernel_dim=meta.require("ssm.conv_kernel"),
        layer_types=layer_types,
        max_position_embeddings=meta.arch_value("context_length", 262144),
        intermediate_size=meta.arch_value("feed_forward_length", 0),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        num_experts=meta.arch_value("expert_count", 0),
        num_experts_per_tok=meta.arch_value("expert_used_count", 0),
        moe_intermediate_size=meta.arch_value("expert_feed_forward_length", 0),
        shared_expert_intermediate_size=meta.arch_value("expert_shared_feed_forward_length", 0),
        mtp_num_hidden_layers=nextn,
        mtp_hidden=meta.get(MTP_HIDDEN_KEY, POST_NORM),
        mrope_section=list(sections[:3]) if any(sections) else None,
    )


# -- tensor tables -------------------------------------------------------------------


def _tiled_order(args):
    """GGUF value head p = r*Hk + j holds checkpoint head j*R + r (llama.cpp's qwen35 layout)."""
    Hk, Hv = args.linear_num_key_heads, args.linear_num_value_heads
    R = Hv // Hk
    return np.array([(p % Hk) * R + p // Hk for p in range(Hv)])


def _permute_heads(w, args, order, *, axis=0, offset=0, head_size=1):
    """Reorder the value heads found at [offset, offset + Hv*head_size) along `axis`: new head i = old order[i]."""
    Hv = args.linear_num_value_heads
    rows = (order[:, None] * head_size + np.arange(head_size)).reshape(-1) + offset
    index = np.concatenate([np.arange(offset), rows, np.arange(offset + Hv * head_size, w.shape[axis])])
    return mx.take(w, mx.array(index), axis=axis)


def _head_transforms(to_gguf: bool):
    """Transforms between checkpoint order and tiled GGUF order of the value heads, per tensor kind."""

    def order(args):
        tiled = _tiled_order(args)
        return tiled if to_gguf else np.argsort(tiled)

    @rowwise
    def qkv(w, args):  # rows [q | k | v]: only v has value heads
        offset = 2 * args.linear_num_key_heads * args.linear_key_head_dim
        return _permute_heads(w, args, order(args), offset=offset, head_size=args.linear_value_head_dim)

    @rowwise
    def value_rows(w, args):
        return _permute_heads(w, args, order(args), head_size=args.linear_value_head_dim)

    @rowwise
    def heads(w, args):
        return _permute_heads(w, args, order(args))

    def value_columns(w, args):
        return _permute_heads(w, args, order(args), axis=1, head_size=args.linear_value_head_dim)

    def value_columns_of_blocks(q, args):
        """Heads of whole groups move as packed words and group scales (else: None, dequantize)."""
        head = args.linear_value_head_dim
        q = q.cut_at([head])
        if q is None:
            return None
        groups = head // q.group_size
        return q.map_columns(
            lambda part, entries: _permute_heads(part, args, order(args), axis=-1, head_size=entries(groups))
        )

    value_columns.on_quantized = value_columns_of_blocks
    return qkv, value_rows, heads, value_columns


# (GGUF tensor, canonical parameter, which value-head transform applies) for qwen35*/qwen3next.
# Head transform names index into _head_transforms(); None: the tensor has no value heads.
# Block names are ours (`layers.N`, `mtp.layers.N`); see block_names for `blk.N`.
_QWEN_TENSORS = [
    ("token_embd.weight", "embed_tokens.weight", None),
    ("output_norm.weight", "norm.weight", None),
    ("output.weight", "lm_head.weight", None),
    ("mtp.layers.0.nextn.eh_proj.weight", "mtp.fc.weight", None),
    ("mtp.layers.0.nextn.enorm.weight", "mtp.enorm.weight", None),
    ("mtp.layers.0.nextn.hnorm.weight", "mtp.hnorm.weight", None),
    ("mtp.layers.0.nextn.shared_head_norm.weight", "mtp.norm.weight", None),
    ("{blk}.attn_norm.weight", "{blk}.input_layernorm.weight", None),
    ("{blk}.post_attention_norm.weight", "{blk}.post_attention_layernorm.weight", None),
    ("{blk}.attn_{qkv}.weight", "{blk}.self_attn.{qkv}_proj.weight", None),
    ("{blk}.attn_output.weight", "{blk}.self_attn.o_proj.weight", None),
    ("{blk}.attn_{qk}_norm.weight", "{blk}.self_attn.{qk}_norm.weight", None),
    ("{blk}.attn_qkv.weight", "{blk}.linear_attn.in_proj_qkv.weight", "qkv"),
    ("{blk}.attn_gate.weight", "{blk}.linear_attn.in_proj_z.weight", "value_rows"),
    ("{blk}.ssm_alpha.weight", "{blk}.linear_attn.in_proj_a.weight", "heads"),
    ("{blk}.ssm_beta.weight", "{blk}.linear_attn.in_proj_b.weight", "heads"),
    ("{blk}.ssm_a", "{blk}.linear_attn.A", "heads"),
    ("{blk}.ssm_dt.bias", "{blk}.linear_attn.dt_bias", "heads"),
    ("{blk}.ssm_conv1d.weight", "{blk}.linear_attn.conv1d_weight", "qkv"),
    ("{blk}.ssm_norm.weight", "{blk}.linear_attn.norm.weight", None),
    ("{blk}.ssm_out.weight", "{blk}.linear_attn.out_proj.weight", "value_columns"),
    ("{blk}.ffn_{ffn}.weight", "{blk}.mlp.{ffn}_proj.weight", None),
    ("{blk}.ffn_gate_inp.weight", "{blk}.mlp.gate.weight", None),
    ("{blk}.ffn_{ffn}_exps.weight", "{blk}.mlp.switch_mlp.{ffn}_proj.weight", None),
    ("{blk}.ffn_{ffn}_shexp.weight", "{blk}.mlp.shared_expert.{ffn}_proj.weight", None),
    ("{blk}.ffn_gate_inp_shexp.weight", "{blk}.mlp.shared_expert_gate.weight", None),
]
# what each placeholder of the table may stand for
_GROUPS = {
    "blk": r"(?P<blk>layers\.\d+|mtp\.layers\.\d+)",
    "qkv": r"(?P<qkv>q|k|v)",
    "qk": r"(?P<qk>q|k)",
    "ffn": r"(?P<ffn>gate|up|down)",
}


def _pattern(template):
    parts = re.split(r"\{(\w+)\}", template)  # odd items are placeholder names
    return "".join(_GROUPS[part] if i % 2 else re.escape(part) for i, part in enumerate(parts))


def _rules(table, to_gguf=False, head_transforms=None, extra=()):
    """A tensor table as Rules, GGUF -> canonical (or back with to_gguf); head_transforms
    maps the table's transform names to functions (None: the tensors load as stored)."""
    rules = []
    for gguf_name, canonical, heads in table:
        source, target = (canonical, gguf_name) if to_gguf else (gguf_name, canonical)
        transform = head_transforms[heads] if heads and head_transforms else None
        rules.append(Rule(_pattern(source), target, transform))
    return rules + ([] if to_gguf else list(extra))


def _qwen_rules(tiled_value_heads: bool, to_gguf: bool = False):
    transforms = None
    if tiled_value_heads:
        transforms = dict(zip(("qkv", "value_rows", "heads", "value_columns"), _head_transforms(to_gguf)))
    extra = [
        # optional copies of token_embd / output that the MTP head shares anyway
        Rule(_pattern("{blk}.nextn.") + r"(?:embed_tokens|shared_head_head)\.weight", ""),
        Rule(
            _pattern("{blk}.ssm_ba.weight"),
            ("{blk}.linear_attn.in_proj_b.weight", "{blk}.linear_attn.in_proj_a.weight"),
            split_fused_ba,
        ),
    ]
    return _rules(_QWEN_TENSORS, to_gguf, transforms, extra)


_KIMI_TENSORS = [
    ("token_embd.weight", "embed_tokens.weight", None),
    ("output_norm.weight", "norm.weight", None),
    ("output.weight", "lm_head.weight", None),
    ("{blk}.attn_norm.weight", "{blk}.input_layernorm.weight", None),
    ("{blk}.ffn_norm.weight", "{blk}.post_attention_layernorm.weight", None),
    # KDA layers
    ("{blk}.attn_{qkv}.weight", "{blk}.self_attn.{qkv}_proj.weight", None),
    ("{blk}.ssm_conv1d_{qkv}.weight", "{blk}.self_attn.{qkv}_conv1d_weight", None),
    ("{blk}.ssm_f_a.weight", "{blk}.self_attn.f_a_proj.weight", None),
    ("{blk}.ssm_f_b.weight", "{blk}.self_attn.f_b_proj.weight", None),
    ("{blk}.ssm_g_a.weight", "{blk}.self_attn.g_a_proj.weight", None),
    ("{blk}.ssm_g_b.weight", "{blk}.self_attn.g_b_proj.weight", None),
    ("{blk}.ssm_a", "{blk}.self_attn.A", None),
    ("{blk}.ssm_dt.bias", "{blk}.self_attn.dt_bias", None),
    ("{blk}.ssm_beta.weight", "{blk}.self_attn.b_proj.weight", None),
    ("{blk}.ssm_norm.weight", "{blk}.self_attn.o_norm.weight", None),
    ("{blk}.attn_output.weight", "{blk}.self_attn.o_proj.weight", None),
    # MLA layers (attn_q and attn_output as above)
    ("{blk}.attn_kv_a_mqa.weight", "{blk}.self_attn.kv_a_proj_with_mqa.weight", None),
    ("{blk}.attn_kv_a_norm.weight", "{blk}.self_attn.kv_a_layernorm.weight", None),
    ("{blk}.attn_k_b.weight", "{blk}.self_attn.k_b_proj", None),
    ("{blk}.attn_v_b.weight", "{blk}.self_attn.v_b_proj", None),
    # feed-forward
    ("{blk}.ffn_{ffn}.weight", "{blk}.mlp.{ffn}_proj.weight", None),
    ("{blk}.ffn_gate_inp.weight", "{blk}.mlp.gate.weight", None),
    ("{blk}.exp_probs_b.bias", "{blk}.mlp.e_score_correction_bias", None),
    ("{blk}.ffn_{ffn}_exps.weight", "{blk}.mlp.switch_mlp.{ffn}_proj.weight", None),
    ("{blk}.ffn_{ffn}_shexp.weight", "{blk}.mlp.shared_experts.{ffn}_proj.weight", None),
]


def _kimi_args(meta: Metadata, module, tensor_shapes: dict):
    n_layer = meta.require("block_count")
    kv_heads = meta.require("attention.head_count_kv")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * n_layer
    layer_types = [LINEAR if heads == 0 else FULL for heads in kv_heads]  # 0 marks a KDA layer
    if meta.arch_value("expert_gating_func", 2) != 2:
        raise ModelLoadError("kimi-linear GGUF: only sigmoid expert gating is supported")
    kda = layer_types.index(LINEAR) if LINEAR in layer_types else None
    rope_dim = meta.arch_value("rope.dimension_count", 0)
    head_dim = meta.require("kda.head_dim")
    return module.ModelArgs(
        model_type="kimi_linear",
        vocab_size=len(meta.get("tokenizer.ggml.tokens", [])) or meta.require("vocab_size"),
        hidden_size=meta.require("embedding_length"),
        num_hidden_layers=n_layer,
        rms_norm_eps=meta.require("attention.layer_norm_rms_epsilon"),
        layer_types=layer_types,
        linear_num_heads=tensor_shapes[f"blk.{kda}.ssm_beta.weight"][0] if kda is not None else 0,
        linear_head_dim=head_dim,
        linear_conv_kernel_dim=meta.require("ssm.conv_kernel"),
        num_attention_heads=_per_layer_max(meta.require("attention.head_count")),
        kv_lora_rank=meta.require("attention.kv_lora_rank"),
        qk_nope_head_dim=meta.require("attention.key_length_mla") - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=meta.require("attention.value_length_mla"),
        intermediate_size=meta.arch_value("feed_forward_length", 0),
        first_k_dense_replace=meta.arch_value("leading_dense_block_count", 0),
        num_experts=meta.arch_value("expert_count", 0),
        num_experts_per_tok=meta.arch_value("expert_used_count", 0),
        moe_intermediate_size=meta.arch_value("expert_feed_forward_length", 0),
        num_shared_experts=meta.arch_value("expert_shared_count", 0),
        routed_scaling_factor=meta.arch_value("expert_weights_scale", 1.0),
        norm_topk_prob=bool(meta.arch_value("expert_weights_norm", True)),
        max_position_embeddings=meta.arch_value("context_length", 1048576),
        tie_word_embeddings="output.weight" not in tensor_shapes,
    )


# GGUF architecture -> (our model type, hyper-parameters, tensor table)
GGUF_ARCHITECTURES = {
    "qwen35": ("qwen3_5", _qwen_args, _qwen_rules(tiled_value_heads=True)),
    "qwen35moe": ("qwen3_5_moe", _qwen_args, _qwen_rules(tiled_value_heads=True)),
    "qwen3next": ("qwen3_next", _qwen_args, _qwen_rules(tiled_value_heads=False)),
    "kimi-linear": ("kimi_linear", _kimi_args, _rules(_KIMI_TENSORS)),
}


# -- files ---------------------------------------------------------------------------


# -- the vision projector (llama.cpp's mmproj file) ------------------------------------

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
        depth=need("block_count"), hidden_size=need("embedding_length"), intermediate_size=need("feed_forward_length"),
        num_heads=need("attention.head_count"), out_hidden_size=need("projection_dim"),
        num_position_embeddings=shapes.get("v.position_embd.weight", (0,))[0], patch_size=patch,
        spatial_merge_size=merge, layer_norm_eps=meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6),
    )  # fmt: skip
    if args.out_hidden_size != text_width:
        raise ModelLoadError(f"{path}: the projector gives width {args.out_hidden_size}, the model's is {text_width}")
    per_token = (patch * merge) ** 2
    processor = ImageProcessor(
        min_pixels=meta.get("clip.vision.image_min_pixels", MMPROJ_MIN_TOKENS * per_token),
        max_pixels=meta.get("clip.vision.image_max_pixels", MMPROJ_MAX_TOKENS * per_token),
        patch_size=patch, merge_size=merge,
        image_mean=tuple(need("image_mean")), image_std=tuple(need("image_std")),
    )  # fmt: skip
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


# -- the file ------------------------------------------------------------------
# GGUF's own reader (gguf.GGUFReader) keeps two numpy views per string of a string array:
# seconds and half a gigabyte for a 248k-token vocabulary before the first weight (docs/formats.md).
# This one reads the header into Python values and maps the tensor data.

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Header:
    """Reads GGUF's little-endian header values (struct formats) from a buffer; struct.error
    or IndexError past its end."""

    def __init__(self, buffer, at: int):
        self.buffer, self.at = buffer, at

    def number(self, form: str):
        (value,) = struct.unpack_from(form, self.buffer, self.at)
        self.at += struct.calcsize(form)
        return value

    def string(self) -> str:
        size = self.number("<Q")
        if self.at + size > len(self.buffer):
            raise IndexError("a string runs past the end of the file")
        text = str(self.buffer[self.at : self.at + size], "utf-8")
        self.at += size
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.number(_SCALARS[kind])
        item, count = self.number("<I"), self.number("<Q")
        if item in (_STRING, _ARRAY):
            return [self.value(item) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item])
        if self.at + count * dtype.itemsize > len(self.buffer):
            raise IndexError("an array runs past the end of the file")
        values = np.frombuffer(self.buffer, dtype, count, self.at).tolist()
        self.at += count * dtype.itemsize
        return values


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: fastest dimension first
    tensor_type: object  # gguf.GGMLQuantizationType
    data_offset: int
    n_bytes: int
    mapping: mmap.mmap

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes in the file's pages, shaped as gguf.quants.dequantize takes them."""
        from gguf import GGMLQuantizationType as T
        from gguf.quants import quant_shape_to_byte_shape

        plain = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
                 T.I32: np.int32, T.I64: np.int64}  # fmt: skip
        shape, dtype = tuple(reversed(self.shape)), plain.get(self.tensor_type)
        if dtype is None:  # blocks: bytes, a row's blocks along the last axis
            shape, dtype = quant_shape_to_byte_shape(shape, self.tensor_type), np.uint8
        count = self.n_bytes // np.dtype(dtype).itemsize
        return np.frombuffer(self.mapping, dtype, count, self.data_offset).reshape(shape)


class GGUFFile:
    """A GGUF file's key-value metadata (Python values) and its tensors (views of its pages)."""

    def __init__(self, path: Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            self.mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header = _Header(self.mapping, 4)  # after the magic number
        version = header.number("<I")
        if version not in (2, 3):
            swapped = "a big-endian file, which this reader does not take" if version & 0xFFFF == 0 else "unknown"
            raise ModelLoadError(f"{path}: GGUF version {version} ({swapped}; versions 2 and 3 are read)")
        tensor_count, field_count = header.number("<Q"), header.number("<Q")
        self.metadata = {}
        for _ in range(field_count):
            key = header.string()
            self.metadata[key] = header.value(header.number("<I"))
        table = []
        for _ in range(tensor_count):
            name = header.string()
            shape = tuple(header.number("<Q") for _ in range(header.number("<I")))
            table.append((name, shape, GGMLQuantizationType(header.number("<I")), header.number("<Q")))
        alignment = self.metadata.get("general.alignment", 32)
        start = -(-header.at // alignment) * alignment
        self.tensors = []
        for name, shape, kind, offset in table:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            n_bytes = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
            self.tensors.append(GGUFTensor(name, shape, kind, start + offset, n_bytes, self.mapping))


def open_gguf(path: Path) -> GGUFFile:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic number)")
    try:
        reader = GGUFFile(path)
    except (struct.error, IndexError, ValueError, KeyError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({e})") from None
    size = path.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(f"{path}: truncated ({size} bytes, tensor data runs to {end})")
    return reader


def tensor_shapes(reader) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in numpy order (GGUF lists dimensions fastest first)."""
    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}


def gguf_block_name(name: str, n_layer: int) -> str:
    """Our block path -> `blk.N` (MTP blocks follow the trunk's)."""
    m = re.match(r"(mtp\.)?layers\.(\d+)\.", name)
    if not m:
        return name
    index = int(m.group(2)) + (n_layer if m.group(1) else 0)
    return f"blk.{index}." + name[m.end() :]


def block_names(reader, n_layer: int, keep_quantized: bool = True, compact_scales=None):
    """Source tensors with `blk.N.` renamed to our block paths (MTP blocks come after the trunk).

    Each comes with a loader giving an mx.array, or a QuantizedTensor where the block
    type maps exactly onto MLX's affine groups (and keep_quantized), or, when compact
    (compact_scales: a dtype), where `quantized.from_gguf_blocks` re-quantizes it.
    """
    from gguf.quants import dequantize

    def loader(t):
        if keep_quantized:
            quantized = from_gguf_blocks(np.asarray(t.data), t.tensor_type.name, compact_scales)
            if quantized is not None:
                return quantized
        if t.tensor_type.name in ("F16", "BF16") and len(t.shape) > 1:
            # matrices as stored (the model's loader casts what it does not keep in 16 bits)
            raw = np.asarray(t.data)
            if t.tensor_type.name == "F16":
                return mx.array(raw)
            return mx.array(raw.view(np.uint16)).view(mx.bfloat16)
        # as float32 without a numpy copy where it is one (mx.array copies it from the file's pages)
        return mx.array(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))

    def renamed(name):
        m = re.match(r"blk\.(\d+)\.", name)
        if not m:
            return name
        i = int(m.group(1))
        block = f"layers.{i}" if i < n_layer else f"mtp.layers.{i - n_layer}"
        return block + name[m.end() - 1 :]

    def loaded_and_released(t):
        tensor = loader(t)  # a copy: the file's pages it read are no longer needed
        release_pages(reader, t.data_offset, t.n_bytes)
        return tensor

    for t in reader.tensors:
        yield renamed(t.name), (lambda t=t: loaded_and_released(t))


def release_pages(reader, offset: int, length: int):
    """Let the kernel drop the file's pages a tensor was read from: they count as the process's
    resident memory until then (a whole file's worth by the end of a load)."""
    mapping = reader.mapping
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    # whole pages only: the next tensor's may start in the last one
    end = min(offset + length, len(mapping)) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
