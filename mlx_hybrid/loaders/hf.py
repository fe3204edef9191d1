"""Hugging Face checkpoint directories and MLX conversions: each family's tensor tables, read and written
(the files themselves: `safetensors_files`)."""

from __future__ import annotations

import re

import mlx.core as mx

from .common import (
    Rule,
    halves,
    neg_exp,
    plus_one,
    rowwise,
    split_fused_ba,
    squeeze_conv,
)

# -- tensor tables -------------------------------------------------------------

# Multimodal checkpoints nest the text model under `model.language_model.`.
_PREFIX = r"(?:model\.language_model\.|language_model\.model\.|model\.)?"
_BLOCK = _PREFIX + r"(?P<blk>layers\.\d+|mtp\.layers\.\d+)\."


@rowwise
def _split_qkvz(w, args):
    """Qwen3-Next fused rows, per key head [q, k, v (R heads), z (R heads)] -> qkv, z."""
    Hk, Dk, Dv = args.linear_num_key_heads, args.linear_key_head_dim, args.linear_value_head_dim
    R = args.linear_num_value_heads // Hk
    grouped = w.reshape(Hk, 2 * Dk + 2 * R * Dv, -1)
    q, k, v, z = mx.split(grouped, [Dk, 2 * Dk, 2 * Dk + R * Dv], axis=1)
    flat = [t.reshape(-1, w.shape[-1]) for t in (q, k, v, z)]
    return mx.concatenate(flat[:3], axis=0), flat[3]


def fuse_qwen3_next_projections(weights: dict, args) -> dict:
    """Qwen3-Next's projections fused again as its checkpoints (and mlx-lm) keep them: in_proj_qkv and
    in_proj_z -> in_proj_qkvz, in_proj_b and in_proj_a -> in_proj_ba, per key head (`_split_qkvz`'s and
    `split_fused_ba`'s inverse). Rows only move, so a quantized matrix's weight, scales and biases fuse
    alike."""
    Hk, Dk, Dv = args.linear_num_key_heads, args.linear_key_head_dim, args.linear_value_head_dim
    R = args.linear_num_value_heads // Hk
    fused = dict(weights)
    for name in [n for n in weights if ".linear_attn.in_proj_qkv." in n]:
        z_name, suffix = name.replace("in_proj_qkv.", "in_proj_z."), name.rsplit(".", 1)[1]
        qkv, z = fused.pop(name), fused.pop(z_name)
        q, k, v = mx.split(qkv, [Hk * Dk, 2 * Hk * Dk], axis=0)
        heads = [q.reshape(Hk, Dk, -1), k.reshape(Hk, Dk, -1), v.reshape(Hk, R * Dv, -1), z.reshape(Hk, R * Dv, -1)]
        fused[name.replace(f"in_proj_qkv.{suffix}", f"in_proj_qkvz.{suffix}")] = mx.concatenate(heads, 1).reshape(
            -1, qkv.shape[-1]
        )
    for name in [n for n in weights if ".linear_attn.in_proj_b." in n]:
        b, a = fused.pop(name), fused.pop(name.replace("in_proj_b.", "in_proj_a."))
        ba = mx.concatenate([b.reshape(Hk, R, -1), a.reshape(Hk, R, -1)], axis=1).reshape(-1, b.shape[-1])
        fused[name.replace("in_proj_b.", "in_proj_ba.")] = ba
    return fused


# Two layouts of the same tensors: "hf" as published (zero-centred norms, conv [C, 1, K],
# text trunk under `model.language_model.`) and "mlx" as MLX-community conversions
# write them (plain norms, conv [C, K, 1], trunk under `language_model.model.`,
# quantized modules as .weight/.scales/.biases).
LAYOUTS = ("hf", "mlx")


def qwen_rules(layout: str = "hf"):
    norm = plus_one if layout == "hf" else None
    return [
        # mlx-vlm's conversions: the tower under `vision_tower.`, the patch kernel in MLX's conv3d layout
        Rule(_VISION_TOWER + r"patch_embed\.proj\.weight", "vision.patch_embed.weight", _flatten_mlx_patch_kernel),
        Rule(_VISION_TOWER + r"patch_embed\.proj\.bias", "vision.patch_embed.bias"),
        Rule(_VISION_TOWER + r"pos_embed\.weight", "vision.pos_embed"),
        Rule(_VISION_TOWER + r"(?P<rest>.+)", "vision.{rest}"),
        Rule(_VISION + r"patch_embed\.proj\.weight", "vision.patch_embed.weight", _flatten_patch_kernel),
        Rule(_VISION + r"patch_embed\.proj\.bias", "vision.patch_embed.bias"),
        Rule(_VISION + r"pos_embed\.weight", "vision.pos_embed"),
        Rule(_VISION + r"(?P<rest>.+)", "vision.{rest}"),
        Rule(_PREFIX + r"embed_tokens\.weight", "embed_tokens.weight"),
        Rule(_PREFIX + r"norm\.weight", "norm.weight", norm),
        Rule(r"(?:language_model\.)?lm_head\.weight", "lm_head.weight"),
        Rule(r"mtp\.fc\.weight", "mtp.fc.weight"),
        Rule(r"mtp\.pre_fc_norm_embedding\.weight", "mtp.enorm.weight", norm),
        Rule(r"mtp\.pre_fc_norm_hidden\.weight", "mtp.hnorm.weight", norm),
        Rule(r"mtp\.norm\.weight", "mtp.norm.weight", norm),
        Rule(_BLOCK + _DECODER_NORMS, "{blk}.{norm}.weight", norm),
        Rule(_BLOCK + r"linear_attn\.A_log", "{blk}.linear_attn.A", neg_exp),
        Rule(_BLOCK + r"linear_attn\.conv1d\.weight", "{blk}.linear_attn.conv1d_weight", squeeze_conv),
        Rule(
            _BLOCK + r"linear_attn\.in_proj_qkvz\.weight",
            ("{blk}.linear_attn.in_proj_qkv.weight", "{blk}.linear_attn.in_proj_z.weight"),
            _split_qkvz,
        ),
        Rule(
            _BLOCK + r"linear_attn\.in_proj_ba\.weight",
            ("{blk}.linear_attn.in_proj_b.weight", "{blk}.linear_attn.in_proj_a.weight"),
            split_fused_ba,
        ),
        Rule(
            _BLOCK + r"mlp\.experts\.gate_up_proj",
            ("{blk}.mlp.switch_mlp.gate_proj.weight", "{blk}.mlp.switch_mlp.up_proj.weight"),
            halves,
        ),
        Rule(_BLOCK + r"mlp\.experts\.down_proj", "{blk}.mlp.switch_mlp.down_proj.weight"),
        Rule(
            _BLOCK + r"mlp\.experts\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight",
            "{blk}.mlp.switch_mlp.{proj}_proj.weight[{e}]",
        ),
        Rule(_BLOCK + r"(?P<rest>.+)", "{blk}.{rest}"),
    ]


def qwen4_rules(layout: str = "hf"):
    """Qwen3.8-Flash-Next (`qwen4_exp`): Qwen3.5's names, and its hyper-connections, indexers and PLE
    layers (their zero-centred norms, the PLE's depthwise convolution); the n-gram hash's buffers are
    dropped (the model computes them from the config, as transformers does) and its tables stay in
    their files (`QWEN4_ROW_TABLES`)."""
    norm = plus_one if layout == "hf" else None
    return [
        # the trunk's last mixer stands where a final norm does (`norm`), the MTP head's where its norm does
        Rule(r"mtp\.hyper_connection_mixer\.hc_norm\.weight", "mtp.norm.hc_norm.weight", norm),
        Rule(r"mtp\.hyper_connection_mixer\.(?P<rest>.+)", "mtp.norm.{rest}"),
        Rule(_PREFIX + r"hyper_connection_mixer\.hc_norm\.weight", "norm.hc_norm.weight", norm),
        Rule(_PREFIX + r"hyper_connection_mixer\.(?P<rest>.+)", "norm.{rest}"),
        Rule(r"mtp\.(?P<fc>fc_embedding|fc_hidden)\.(?P<rest>.+)", "mtp.{fc}.{rest}"),
        Rule(_BLOCK + r"(?P<hc>attn|mlp)_hyper_connection\.hc_norm\.weight", "{blk}.{hc}_hyper_connection.hc_norm.weight",
             norm),
        Rule(_BLOCK + r"self_attn\.indexer\.(?P<n>q|k)_layernorm\.weight", "{blk}.self_attn.{n}_layernorm.weight", norm),
        Rule(_BLOCK + r"self_attn\.indexer\.index_qk_proj\.(?P<rest>.+)", "{blk}.self_attn.index_qk_proj.{rest}"),
        Rule(_BLOCK + r"ple\.(?P<n>norm_key|norm_query|norm_conv)\.weight", "{blk}.ple.{n}.weight", norm),
        Rule(_BLOCK + r"ple\.conv1d\.weight", "{blk}.ple.conv1d_weight", squeeze_conv),
        Rule(_BLOCK + r"ple\.ple_embedding\.(?P<name>layer_multipliers|ngram_heads_offsets|ngram_heads_vocab_sizes)",
             "{blk}.ple.hash.{name}"),
        *qwen_rules(layout),
    ]  # fmt: skip


# the tables left in their files, read by rows (`row_tables`): a pattern whose `table` group names the
# layer and whose `shard` group numbers the table's parts
QWEN4_ROW_TABLES = (
    _PREFIX + r"(?P<table>layers\.\d+)\.ple\.ple_embedding\.ngram_embedding\.shard_(?P<shard>\d+)\.weight"
)


_VISION = r"(?:model\.)?visual\."
_VISION_TOWER = r"vision_tower\."


def _flatten_mlx_patch_kernel(w, _args):
    """MLX's conv3d kernel [E, T, P, P, C] -> the linear map of a flattened patch [E, C T P P]."""
    return w.transpose(0, 4, 1, 2, 3).reshape(w.shape[0], -1)


def _flatten_patch_kernel(w, _args):
    """Conv3d kernel [E, C, T, P, P] with stride = kernel -> the linear map of a flattened patch [E, C T P P]."""
    return w.reshape(w.shape[0], -1)


_DECODER_NORMS = r"(?P<norm>input_layernorm|post_attention_layernorm|self_attn\.q_norm|self_attn\.k_norm)\.weight"


def _patch_kernel(w, args):
    """The linear map of a flattened patch [E, C T P P] -> the conv3d kernel [E, C, T, P, P]
    (`_flatten_patch_kernel`'s inverse)."""
    v = args.vision
    return w.reshape(w.shape[0], v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)


def _mlx_patch_kernel(w, args):
    """The same in MLX's conv3d layout [E, T, P, P, C] (`_flatten_mlx_patch_kernel`'s inverse)."""
    return _patch_kernel(w, args).transpose(0, 2, 3, 4, 1)


def _minus_one(w, _args):
    return w.astype(mx.float32) - 1.0


def _log_neg(a, _args):
    return mx.log(-a.astype(mx.float32))


def _conv_layout(layout):
    def expand(w, _args):  # [C, K] -> [C, 1, K] (hf) or [C, K, 1] (mlx)
        return w[:, None, :] if layout == "hf" else w[:, :, None]

    return expand


def qwen_export_rules(layout: str = "hf"):
    """Canonical names -> a layout (before the trunk prefix, which export_name adds).

    Dense experts only: fused HF experts would need two inputs per tensor.
    """
    norm = _minus_one if layout == "hf" else None
    block = r"(?P<blk>(?:mtp\.)?layers\.\d+)\."
    tower, patch_kernel = ("visual", _patch_kernel) if layout == "hf" else ("vision_tower", _mlx_patch_kernel)
    return [
        # the vision tower as published (`visual.`, placed by export_name) or as mlx-vlm's conversions
        # keep it (`vision_tower.`): the patch embedding a conv3d kernel again, in that layout
        Rule(r"vision\.patch_embed\.weight", f"{tower}.patch_embed.proj.weight", patch_kernel),
        Rule(r"vision\.patch_embed\.bias", f"{tower}.patch_embed.proj.bias"),
        Rule(r"vision\.pos_embed", f"{tower}.pos_embed.weight"),
        Rule(r"vision\.(?P<rest>.+)", tower + ".{rest}"),
        Rule(r"norm\.weight", "norm.weight", norm),
        Rule(r"mtp\.enorm\.weight", "mtp.pre_fc_norm_embedding.weight", norm),
        Rule(r"mtp\.hnorm\.weight", "mtp.pre_fc_norm_hidden.weight", norm),
        Rule(r"mtp\.norm\.weight", "mtp.norm.weight", norm),
        Rule(block + _DECODER_NORMS, "{blk}.{norm}.weight", norm),
        Rule(block + r"linear_attn\.A", "{blk}.linear_attn.A_log", _log_neg),
        Rule(block + r"linear_attn\.conv1d_weight", "{blk}.linear_attn.conv1d.weight", _conv_layout(layout)),
        Rule(r"(?P<name>.+)", "{name}"),
    ]


def kimi_export_rules(layout: str = "mlx"):
    """Canonical names -> mlx-lm's Kimi Linear layout (`kimi_rules("mlx")` read back), before the
    `model.` prefix export_name adds."""
    if layout != "mlx":
        raise ValueError("Kimi Linear is written in mlx-lm's layout only")
    block = r"(?P<blk>layers\.\d+)\."
    return [
        Rule(
            block + r"self_attn\.(?P<p>q|k|v)_conv1d_weight",
            "{blk}.self_attn.{p}_conv.conv.weight",
            _conv_layout("mlx"),
        ),
        Rule(block + r"self_attn\.k_b_proj", "{blk}.self_attn.embed_q.weight"),
        Rule(block + r"self_attn\.v_b_proj", "{blk}.self_attn.unembed_out.weight"),
        Rule(block + r"self_attn\.A", "{blk}.self_attn.A_log", _kimi_a_log),
        Rule(r"(?P<name>.+)", "{name}"),
    ]


def qwen4_export_rules(layout: str = "mlx"):
    """Canonical names -> the MLX layout of a qwen4_exp model (`qwen4_rules("mlx")` read back); its
    n-gram tables are written apart (`row_tables.write_row_tables`)."""
    if layout != "mlx":
        raise ValueError("qwen4_exp is written in the MLX layout only")
    block = r"(?P<blk>(?:mtp\.)?layers\.\d+)\."
    return [
        Rule(r"(?P<at>(?:mtp\.)?)norm\.(?P<rest>.+)", "{at}hyper_connection_mixer.{rest}"),
        Rule(block + r"self_attn\.(?P<n>index_qk_proj|q_layernorm|k_layernorm)\.(?P<rest>.+)",
             "{blk}.self_attn.indexer.{n}.{rest}"),
        Rule(block + r"ple\.conv1d_weight", "{blk}.ple.conv1d.weight", _conv_layout("mlx")),
        Rule(block + r"ple\.hash\.(?P<name>.+)", "{blk}.ple.ple_embedding.{name}"),
        *qwen_export_rules("mlx"),
    ]  # fmt: skip


def _kimi_a_log(a, _args):
    """A [H] -> A_log as Kimi's checkpoints store it, [1, 1, H, 1]."""
    return mx.log(-a.astype(mx.float32)).reshape(1, 1, -1, 1)


def export_name(name: str, layout: str = "hf", multimodal: bool = True) -> str:
    """Where a canonical tensor goes in a layout; MTP tensors and mlx-vlm's `vision_tower.` stay at the
    top, the published `visual.` goes under `model.` (see qwen_export_rules)."""
    if name.startswith("mtp."):
        return name
    if name.startswith("vision_tower."):
        return name
    if name.startswith("visual."):
        return "model." + name
    if not multimodal:
        return name if name.startswith("lm_head.") else "model." + name
    if layout == "mlx":
        return "language_model." + (name if name.startswith("lm_head.") else "model." + name)
    return name if name.startswith("lm_head.") else "model.language_model." + name


def detect_layout(tensors: dict) -> str:
    """MLX conversions store depthwise conv weights as [C, K, 1], published checkpoints as [C, 1, K]
    (`conv1d.weight` in Qwen's, `q_conv1d.weight` in Kimi's, `q_conv.conv.weight` in mlx-lm's Kimi)."""
    for name, t in tensors.items():
        if "conv" in name and name.endswith(".weight") and t.ndim == 3:
            return "mlx" if t.shape[-1] == 1 and t.shape[1] != 1 else "hf"
    return "hf"


def _split_kv_b(w, args):
    """MLA kv_b_proj, per head rows [k_nope | v] over the latent -> k_b [H, L, nope], v_b [H, v, L]."""
    H, nope = args.num_attention_heads, args.qk_nope_head_dim
    per_head = w.reshape(H, -1, w.shape[-1])
    return per_head[:, :nope].swapaxes(1, 2), per_head[:, nope:]


_KIMI_BLOCK = r"model\.(?P<blk>layers\.\d+)\."
_EXPERT = _KIMI_BLOCK + r"block_sparse_moe\.experts\.(?P<e>\d+)\."


def kimi_rules(layout: str = "hf"):
    """Kimi Linear as Moonshot publishes it, or as mlx-lm converts it: short convolutions as MLX
    conv layers ([C, K, 1] under `{p}_conv.conv`), kv_b_proj already split per head into
    `embed_q` [H, L, nope] and `unembed_out` [H, v, L] (our k_b_proj and v_b_proj), experts stacked
    under `mlp.switch_mlp` (our own names)."""
    if layout == "hf":
        return KIMI_RULES
    return [
        Rule(
            _KIMI_BLOCK + r"self_attn\.(?P<p>q|k|v)_conv\.conv\.weight",
            "{blk}.self_attn.{p}_conv1d_weight",
            squeeze_conv,
        ),
        Rule(_KIMI_BLOCK + r"self_attn\.embed_q\.weight", "{blk}.self_attn.k_b_proj"),
        Rule(_KIMI_BLOCK + r"self_attn\.unembed_out\.weight", "{blk}.self_attn.v_b_proj"),
        *KIMI_RULES,
    ]


KIMI_RULES = [
    Rule(r"model\.embed_tokens\.weight", "embed_tokens.weight"),
    Rule(r"model\.norm\.weight", "norm.weight"),
    Rule(r"lm_head\.weight", "lm_head.weight"),
    Rule(_KIMI_BLOCK + r"self_attn\.(?P<p>q|k|v)_conv1d\.weight", "{blk}.self_attn.{p}_conv1d_weight", squeeze_conv),
    Rule(_KIMI_BLOCK + r"self_attn\.A_log", "{blk}.self_attn.A", neg_exp),
    Rule(
        _KIMI_BLOCK + r"self_attn\.kv_b_proj\.weight",
        ("{blk}.self_attn.k_b_proj", "{blk}.self_attn.v_b_proj"),
        _split_kv_b,
    ),
    Rule(_EXPERT + r"w1\.weight", "{blk}.mlp.switch_mlp.gate_proj.weight[{e}]"),
    Rule(_EXPERT + r"w2\.weight", "{blk}.mlp.switch_mlp.down_proj.weight[{e}]"),
    Rule(_EXPERT + r"w3\.weight", "{blk}.mlp.switch_mlp.up_proj.weight[{e}]"),
    Rule(_KIMI_BLOCK + r"block_sparse_moe\.gate\.e_score_correction_bias", "{blk}.mlp.e_score_correction_bias"),
    Rule(_KIMI_BLOCK + r"block_sparse_moe\.(?P<rest>.+)", "{blk}.mlp.{rest}"),
    Rule(_KIMI_BLOCK + r"(?P<rest>.+)", "{blk}.{rest}"),
]


def has_vision_tower(tensor_names) -> bool:
    return any(re.match(_VISION, name) or re.match(_VISION_TOWER, name) for name in tensor_names)
