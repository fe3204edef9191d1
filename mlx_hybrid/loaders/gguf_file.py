"""GGUF files as llama.cpp's converter writes the hybrid models.

Undoes the conversion transforms listed in docs/MODELS.md: value heads tiled
(qwen35*), `ssm_ba` fused (qwen3next), experts stacked, MTP in a `nextn` block.
Decoder norms are stored as 1 + w and `ssm_a` as -exp(A_log): our canonical
forms already, so they load as they are.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError
from ..models.qwen3_5 import FULL, LINEAR
from .common import Rule

# -- hyper-parameters ------------------------------------------------------------


class Metadata:
    """Typed access to a GGUF file's key-value fields."""

    def __init__(self, reader):
        self.reader = reader
        self.arch = self.get("general.architecture")

    def get(self, key, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def arch_value(self, key, default=None):
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key):
        value = self.arch_value(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {self.arch}.{key}")
        return value


def _per_layer_max(value):
    return max(value) if isinstance(value, list) else value


def _qwen_args(meta: Metadata, module, tensor_names: set[str]):
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
        tie_word_embeddings="output.weight" not in tensor_names,
        num_experts=meta.arch_value("expert_count", 0),
        num_experts_per_tok=meta.arch_value("expert_used_count", 0),
        moe_intermediate_size=meta.arch_value("expert_feed_forward_length", 0),
        shared_expert_intermediate_size=meta.arch_value("expert_shared_feed_forward_length", 0),
        mtp_num_hidden_layers=nextn,
    )


# -- tensor tables -------------------------------------------------------------------

_BLOCK = r"(?P<blk>layers\.\d+|mtp\.layers\.\d+)\."


def _untile(w, args, *, axis=0, offset=0, head_size=1):
    """Put value heads back in checkpoint order: GGUF head r*Hk + j is checkpoint head j*R + r."""
    Hk, Hv = args.linear_num_key_heads, args.linear_num_value_heads
    R = Hv // Hk
    if R == 1:
        return w
    gguf_head = np.array([(h % R) * Hk + h // R for h in range(Hv)])
    rows = (gguf_head[:, None] * head_size + np.arange(head_size)).reshape(-1) + offset
    index = np.concatenate([np.arange(offset), rows, np.arange(offset + Hv * head_size, w.shape[axis])])
    return mx.take(w, mx.array(index), axis=axis)


def _untile_qkv(w, args):  # rows [q | k | v]: only v is tiled
    offset = 2 * args.linear_num_key_heads * args.linear_key_head_dim
    return _untile(w, args, offset=offset, head_size=args.linear_value_head_dim)


def _untile_value_rows(w, args):
    return _untile(w, args, head_size=args.linear_value_head_dim)


def _untile_heads(w, args):
    return _untile(w, args)


def _untile_value_columns(w, args):
    return _untile(w, args, axis=1, head_size=args.linear_value_head_dim)


def _split_ba(w, args):
    """Qwen3-Next `ssm_ba`, per key head [b (R), a (R)] -> b, a."""
    b, a = mx.split(w.reshape(args.linear_num_key_heads, -1, w.shape[-1]), 2, axis=1)
    return b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])


def _qwen_rules(tiled_value_heads: bool):
    def untiled(transform):
        return transform if tiled_value_heads else None

    la = "{blk}.linear_attn."
    return [
        Rule(r"token_embd\.weight", "embed_tokens.weight"),
        Rule(r"output_norm\.weight", "norm.weight"),
        Rule(r"output\.weight", "lm_head.weight"),
        Rule(_BLOCK + r"nextn\.eh_proj\.weight", "mtp.fc.weight"),
        Rule(_BLOCK + r"nextn\.enorm\.weight", "mtp.enorm.weight"),
        Rule(_BLOCK + r"nextn\.hnorm\.weight", "mtp.hnorm.weight"),
        Rule(_BLOCK + r"nextn\.shared_head_norm\.weight", "mtp.norm.weight"),
        # optional copies of token_embd / output that the MTP head shares anyway
        Rule(_BLOCK + r"nextn\.(?:embed_tokens|shared_head_head)\.weight", ""),
        Rule(_BLOCK + r"attn_norm\.weight", "{blk}.input_layernorm.weight"),
        Rule(_BLOCK + r"post_attention_norm\.weight", "{blk}.post_attention_layernorm.weight"),
        Rule(_BLOCK + r"attn_(?P<p>q|k|v)\.weight", "{blk}.self_attn.{p}_proj.weight"),
        Rule(_BLOCK + r"attn_output\.weight", "{blk}.self_attn.o_proj.weight"),
        Rule(_BLOCK + r"attn_(?P<p>q|k)_norm\.weight", "{blk}.self_attn.{p}_norm.weight"),
        Rule(_BLOCK + r"attn_qkv\.weight", la + "in_proj_qkv.weight", untiled(_untile_qkv)),
        Rule(_BLOCK + r"attn_gate\.weight", la + "in_proj_z.weight", untiled(_untile_value_rows)),
        Rule(_BLOCK + r"ssm_alpha\.weight", la + "in_proj_a.weight", untiled(_untile_heads)),
        Rule(_BLOCK + r"ssm_beta\.weight", la + "in_proj_b.weight", untiled(_untile_heads)),
        Rule(_BLOCK + r"ssm_ba\.weight", (la + "in_proj_b.weight", la + "in_proj_a.weight"), _split_ba),
        Rule(_BLOCK + r"ssm_a", la + "A", untiled(_untile_heads)),
        Rule(_BLOCK + r"ssm_dt\.bias", la + "dt_bias", untiled(_untile_heads)),
        Rule(_BLOCK + r"ssm_conv1d\.weight", la + "conv1d_weight", untiled(_untile_qkv)),
        Rule(_BLOCK + r"ssm_norm\.weight", la + "norm.weight"),
        Rule(_BLOCK + r"ssm_out\.weight", la + "out_proj.weight", untiled(_untile_value_columns)),
        Rule(_BLOCK + r"ffn_(?P<p>gate|up|down)\.weight", "{blk}.mlp.{p}_proj.weight"),
        Rule(_BLOCK + r"ffn_gate_inp\.weight", "{blk}.mlp.gate.weight"),
        Rule(_BLOCK + r"ffn_(?P<p>gate|up|down)_exps\.weight", "{blk}.mlp.switch_mlp.{p}_proj"),
        Rule(_BLOCK + r"ffn_(?P<p>gate|up|down)_shexp\.weight", "{blk}.mlp.shared_expert.{p}_proj.weight"),
        Rule(_BLOCK + r"ffn_gate_inp_shexp\.weight", "{blk}.mlp.shared_expert_gate.weight"),
    ]


# GGUF architecture -> (our model type, hyper-parameters, tensor table)
GGUF_ARCHITECTURES = {
    "qwen35": ("qwen3_5", _qwen_args, _qwen_rules(tiled_value_heads=True)),
    "qwen35moe": ("qwen3_5_moe", _qwen_args, _qwen_rules(tiled_value_heads=True)),
    "qwen3next": ("qwen3_next", _qwen_args, _qwen_rules(tiled_value_heads=False)),
}


# -- files ---------------------------------------------------------------------------


def open_gguf(path: Path):
    import gguf

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic number)")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError on short files
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({e})") from None
    size = path.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(f"{path}: truncated ({size} bytes, tensor data runs to {end})")
    return reader


def block_names(reader, n_layer: int):
    """Source tensors with `blk.N.` renamed to our block paths (MTP blocks come after the trunk)."""
    from gguf.quants import dequantize

    def renamed(name):
        m = re.match(r"blk\.(\d+)\.", name)
        if not m:
            return name
        i = int(m.group(1))
        block = f"layers.{i}" if i < n_layer else f"mtp.layers.{i - n_layer}"
        return block + name[m.end() - 1 :]

    for t in reader.tensors:
        yield renamed(t.name), (lambda t=t: mx.array(dequantize(t.data, t.tensor_type).astype(np.float32)))
