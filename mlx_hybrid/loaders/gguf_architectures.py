"""The hybrid models' GGUF layouts as llama.cpp's converter writes them: per architecture, the
hyper-parameters from the file's metadata and the table of its tensors.

Undoes the conversion transforms listed in docs/models.md: value heads tiled
(qwen35*), `ssm_ba` fused (qwen3next), experts stacked, MTP in a `nextn` block.
Decoder norms are stored as 1 + w and `ssm_a` as -exp(A_log): our canonical
forms already, so they load as they are.
"""

from __future__ import annotations

import re
from dataclasses import replace

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError
from ..models.layers import FULL, LINEAR
from ..models.qwen3_5 import POST_NORM
from .common import Rule, rowwise, split_fused_ba
from .gguf_file import Metadata

# -- hyper-parameters ------------------------------------------------------------

# Written only for an MTP head trained on the pre-norm state (llama.cpp knows no such key:
# the released heads, and llama.cpp, read the post-norm state).
MTP_HIDDEN_KEY = "mlx_hybrid.mtp_hidden"


def _per_layer_max(value):
    return max(value) if isinstance(value, list) else value


def qwen_args(meta: Metadata, module, tensor_shapes: dict, model_type: str):
    nextn = meta.arch_value("nextn_predict_layers", 0)
    n_layer = meta.require("block_count") - nextn
    # a file that declares the MTP block without its tensors loads without the head, as an HF
    # checkpoint without mtp.* tensors does
    has_mtp = any(name.startswith(f"blk.{n_layer}.") for name in tensor_shapes)
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
        model_type=model_type,
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
        mtp_num_hidden_layers=nextn if has_mtp else 0,
        mtp_hidden=meta.get(MTP_HIDDEN_KEY, POST_NORM),
        mrope_section=list(sections[:3]) if any(sections) else None,
    )


# -- tensor tables -------------------------------------------------------------------


def _tiled_order(args):
    """GGUF value head p = r*Hk + j holds checkpoint head j*R + r (llama.cpp's qwen35 layout)."""
    Hk, Hv = args.linear_num_key_heads, args.linear_num_value_heads
    R = Hv // Hk
    return np.array([(p % Hk) * R + p // Hk for p in range(Hv)])


def _head_index(args, order, length: int, offset: int, head_size: int) -> np.ndarray:
    """The index along an axis of `length` that reorders the value heads at [offset, offset +
    Hv*head_size): new head i = old order[i]."""
    Hv = args.linear_num_value_heads
    rows = (order[:, None] * head_size + np.arange(head_size)).reshape(-1) + offset
    return np.concatenate([np.arange(offset), rows, np.arange(offset + Hv * head_size, length)])


def _permute_heads(w, args, order, *, axis=0, offset=0, head_size=1):
    """Reorder the value heads found at [offset, offset + Hv*head_size) along `axis`: new head i = old order[i]."""
    if (order == np.arange(args.linear_num_value_heads)).all():  # one value head a key head: the orders agree
        return w
    return mx.take(w, mx.array(_head_index(args, order, w.shape[axis], offset, head_size)), axis=axis)


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
        """Heads of whole groups move as packed words and group scales; heads smaller than a
        group (a grid type's blocks of 256) stay where they are, the products taking their
        inputs in the file's order instead."""
        head = args.linear_value_head_dim
        if (order(args) == np.arange(args.linear_num_value_heads)).all():
            return q
        cuttable = q.cut_at([head])
        if cuttable is None:
            index = _head_index(args, order(args), q.shape[-1], 0, head)  # new column i = old index[i]
            return replace(q, column_order=mx.array(np.argsort(index).astype(np.uint32)))
        groups = head // cuttable.group_size
        return cuttable.map_columns(
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


def qwen_rules(tiled_value_heads: bool, to_gguf: bool = False):
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


def kimi_rules():
    return _rules(_KIMI_TENSORS)


def kimi_args(meta: Metadata, module, tensor_shapes: dict, model_type: str):
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
        model_type=model_type,
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
