"""A Hugging Face checkpoint's config.json: reading it, and each family's model arguments from it
(what the models do not compute refused by name)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from ..errors import ModelLoadError
from ..models.layers import FULL, LINEAR
from ..models.vision import VisionArgs


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json (expected a Hugging Face model directory or a .gguf file)")
    try:
        return json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{config_file}: not valid JSON ({e})") from None


def model_type_of(config: dict) -> str:
    if "model_type" not in config:
        raise ModelLoadError("config.json has no model_type")
    return config["model_type"]


def _vision_args(config: dict) -> VisionArgs:
    """The vision tower's settings from `vision_config`; what this tower does not compute is refused."""
    if config.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ModelLoadError(f"vision towers with hidden_act {config['hidden_act']!r} are not supported")
    if config.get("deepstack_visual_indexes"):
        raise ModelLoadError("vision towers with deepstack mergers (Qwen3-VL) are not supported")
    try:
        return VisionArgs(
            depth=config["depth"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_heads=config["num_heads"],
            out_hidden_size=config["out_hidden_size"],
            num_position_embeddings=config["num_position_embeddings"],
            patch_size=config.get("patch_size", 16),
            temporal_patch_size=config.get("temporal_patch_size", 2),
            spatial_merge_size=config.get("spatial_merge_size", 2),
            in_channels=config.get("in_channels", 3),
            rope_theta=(config.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json's vision_config lacks {e.args[0]!r}") from None


def _mrope_section(rope: dict) -> list[int] | None:
    section = rope.get("mrope_section")
    if section and not rope.get("mrope_interleaved", False):
        raise ModelLoadError("MRoPE with contiguous sections (mrope_interleaved false) is not supported")
    return list(section) if section else None


def qwen_args(config: dict, module, has_mtp: bool, has_vision: bool = False):
    # multimodal configs keep the text model's settings under text_config
    text = {**config, **config.get("text_config", {})}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    values = {f.name: text[f.name] for f in fields(module.ModelArgs) if f.name in text}
    values["model_type"] = config["model_type"]
    values["rope_theta"] = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    values["partial_rotary_factor"] = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    if not values.get("head_dim"):
        values["head_dim"] = _require(text, "hidden_size") // _require(text, "num_attention_heads")
    if not text.get("layer_types"):
        interval = text.get("full_attention_interval", 4)
        n = _require(text, "num_hidden_layers")
        values["layer_types"] = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    values["mtp_num_hidden_layers"] = text.get("mtp_num_hidden_layers", 1) if has_mtp else 0
    values["mrope_section"] = _mrope_section(rope)
    if has_vision:
        values["vision"] = _vision_args(_require(config, "vision_config"))
    try:
        return module.ModelArgs(**values)
    except TypeError as e:
        raise ModelLoadError(f"config.json is missing settings: {e}") from None


def _require(config, key):
    if key not in config:
        raise ModelLoadError(f"config.json lacks {key!r}")
    return config[key]


def kimi_args(config: dict, module, has_mtp: bool, has_vision: bool = False):
    linear = config.get("linear_attn_config") or {}
    n = _require(config, "num_hidden_layers")
    kda_layers = set(linear.get("kda_layers", []))  # 1-based layer numbers
    if config.get("q_lora_rank"):
        raise ModelLoadError("Kimi Linear with a q LoRA (q_lora_rank) is not supported")
    if config.get("num_expert_group", 1) != 1:
        raise ModelLoadError("Kimi Linear with expert groups (num_expert_group > 1) is not supported")
    try:
        return module.ModelArgs(
            model_type=config["model_type"],
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_hidden_layers=n,
            rms_norm_eps=config.get("rms_norm_eps", 1e-5),
            layer_types=[LINEAR if i + 1 in kda_layers else FULL for i in range(n)],
            linear_num_heads=linear["num_heads"],
            linear_head_dim=linear["head_dim"],
            linear_conv_kernel_dim=linear.get("short_conv_kernel_size", 4),
            num_attention_heads=config["num_attention_heads"],
            kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"],
            intermediate_size=config["intermediate_size"],
            first_k_dense_replace=config.get("first_k_dense_replace", 0),
            num_experts=config.get("num_experts", 0),
            num_experts_per_tok=config.get("num_experts_per_token", config.get("num_experts_per_tok", 0)),
            moe_intermediate_size=config.get("moe_intermediate_size", 0),
            num_shared_experts=config.get("num_shared_experts", 0),
            routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
            norm_topk_prob=config.get("moe_renormalize", True),
            max_position_embeddings=config.get("max_position_embeddings", config.get("model_max_length", 1048576)),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from None
