"""Writing models back out: GGUF in llama.cpp's qwen35 layout, HF directories, and the MLX-community
layout (with `convert`: a checkpoint quantized into it).

The name mappings are the loaders' tables run the other way (see
`loaders/gguf_architectures.py` and `loaders/hf.py`), so a written file loads back to the
same parameters.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .errors import MlxHybridError
from .loaders import DTYPES, families, gguf_architectures, gguf_file, hf, hub, load
from .loaders.common import rename
from .loaders.hf_config import read_config
from .loaders.row_tables import write_row_tables
from .models.layers import LINEAR
from .models.qwen3_5 import POST_NORM
from .quantized_tensor import FLOAT_MODES, mode_refused


def _canonical(model):
    return [(name, (lambda p=p: p)) for name, p in tree_flatten(model.parameters())]


def _tokenizer_tables(tokenizer, vocab_size: int):
    """Tokens by id, merges and GGUF token types from a byte-level BPE `tokenizers` object."""
    inner = tokenizer.backend
    vocab = inner.get_vocab(with_added_tokens=True)
    # ids the tokenizer never produces (embedding rows padded for alignment) get
    # placeholder names, as llama.cpp's converter writes them
    tokens = [f"[PAD{i}]" for i in range(max(vocab_size, len(vocab)))]
    for token, i in vocab.items():
        tokens[i] = token
    merges = json.loads(inner.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    special = {t.content for t in inner.get_added_tokens_decoder().values() if t.special}
    types = [
        3 if t in special else 5 if t.startswith("[PAD") and t not in vocab else 1 for t in tokens
    ]  # control, unused, normal
    return tokens, merges, types


def save_gguf(model, tokenizer, path, *, name: str = "mlx-hybrid", matrix_dtype=np.float16, encode_matrix=None):
    """A GGUF file llama.cpp's `qwen35`/`qwen35moe` loaders read (value heads tiled, MTP as `nextn`).

    Matrices are written as `matrix_dtype`, or as `encode_matrix(gguf_name, array)`
    returns them where it returns (block bytes, GGMLQuantizationType) instead of None.
    """
    import gguf

    args = model.args
    written = families.family(args.model_type).gguf
    if written is None or not written.written:
        supported = sorted(f.model_type for f in families.FAMILIES if f.gguf is not None and f.gguf.written)
        raise ValueError(f"GGUF export supports {supported}, not {args.model_type!r}")
    arch = written.name
    weights, unmatched = rename(_canonical(model), gguf_architectures.qwen_rules(True, to_gguf=True), args)
    assert not unmatched, unmatched
    n_layer, nextn = args.num_hidden_layers, args.mtp_num_hidden_layers
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(n_layer + nextn)
    writer.add_context_length(args.max_position_embeddings)
    writer.add_embedding_length(args.hidden_size)
    if args.intermediate_size:
        writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_attention_heads)
    writer.add_head_count_kv(args.num_key_value_heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    rope_dims = int(args.head_dim * args.partial_rotary_factor)
    writer.add_rope_dimension_count(rope_dims)
    writer.add_rope_dimension_sections(rope_sections(args, rope_dims))
    writer.add_ssm_conv_kernel(args.linear_conv_kernel_dim)
    writer.add_ssm_state_size(args.linear_key_head_dim)
    writer.add_ssm_group_count(args.linear_num_key_heads)
    writer.add_ssm_time_step_rank(args.linear_num_value_heads)
    writer.add_ssm_inner_size(args.linear_num_value_heads * args.linear_value_head_dim)
    writer.add_nextn_predict_layers(nextn)
    if args.mtp_hidden != POST_NORM:
        writer.add_string(gguf_architectures.MTP_HIDDEN_KEY, args.mtp_hidden)
    writer.add_array(f"{arch}.attention.recurrent_layers", [t == LINEAR for t in args.layer_types] + [False] * nextn)
    writer.add_full_attention_interval(args.layer_types.index("full_attention") + 1)
    if args.num_experts:
        writer.add_expert_count(args.num_experts)
        writer.add_expert_used_count(args.num_experts_per_tok)
        writer.add_expert_feed_forward_length(args.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(args.shared_expert_intermediate_size)
    tokens, merges, types = _tokenizer_tables(tokenizer, args.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_ids[0])
    writer.add_pad_token_id(tokenizer.eos_token_ids[0])
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
    for canonical_name, tensor in weights.items():
        array = np.array(tensor.astype(mx.float32))
        tensor_name = gguf_file.gguf_block_name(canonical_name, n_layer)
        # the conv's weight stays float32, as llama.cpp's converter keeps it (its ssm_conv op takes no other)
        if array.ndim >= 2 and not tensor_name.endswith("ssm_conv1d.weight") and min(array.shape) > 1:
            encoded = encode_matrix(tensor_name, array) if encode_matrix else None
            if encoded is not None:
                writer.add_tensor(tensor_name, encoded[0], raw_dtype=encoded[1])
                continue
            if array.ndim == 2:
                array = array.astype(matrix_dtype)
        writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def rope_sections(args, rope_dims: int) -> list[int]:
    """MRoPE's sections (t, h, w, unused) as llama.cpp's converter writes them: the model's own, else
    (plain rotary positions) sections that reach every rotary pair. llama.cpp's interleaved MRoPE gives
    pair i the position of section i mod 3 while i < 3 * that section, and a pair none reaches the
    fourth position, 0 for text: [d, 0, 0] would leave two pairs in three unrotated."""
    if getattr(args, "mrope_section", None):
        return [*args.mrope_section, 0]
    pairs = rope_dims // 2
    return [(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3, 0]


def hf_config(args, tokenizer) -> dict:
    """config.json for a model's arguments: nested under text_config for the multimodal families."""
    written_apart = ("model_type", "rope_theta", "partial_rotary_factor", "mrope_section", "vision")
    text = {k: v for k, v in vars(args).items() if k not in written_apart}
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": args.partial_rotary_factor}
    if getattr(args, "mrope_section", None):
        rope.update(mrope_section=list(args.mrope_section), mrope_interleaved=True)
    text.update(rope_parameters=rope, eos_token_id=tokenizer.eos_token_ids[0])
    family = families.family(args.model_type)
    if not family.multimodal:  # Qwen3-Next's config also names its rope settings at the top
        rope_settings = {"rope_theta": args.rope_theta, "partial_rotary_factor": args.partial_rotary_factor}
        return {"architectures": [family.hf_class], "model_type": args.model_type, **text, **rope_settings}
    config = {
        "architectures": [family.hf_class],
        "model_type": args.model_type,
        "tie_word_embeddings": args.tie_word_embeddings,
        "text_config": {**text, "model_type": args.model_type + "_text"},
    }
    if getattr(args, "vision", None) is not None:
        config["vision_config"] = vision_config(args.vision)
        # the image tokens' ids, which mlx-vlm and transformers read from here
        for key, token in IMAGE_TOKEN_IDS.items():
            if tokenizer.token_to_id(token) is not None:
                config[key] = tokenizer.token_to_id(token)
    return config


IMAGE_TOKEN_IDS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def vision_config(vision) -> dict:
    """A vision tower's `vision_config` as the published Qwen3.5 checkpoints write it (what the HF loader reads)."""
    values = {k: v for k, v in dataclasses.asdict(vision).items() if k not in ("rope_theta", "layer_norm_eps")}
    rope = {"rope_theta": vision.rope_theta, "rope_type": "axial"}
    return {"model_type": "qwen3_5_vision", "hidden_act": "gelu_pytorch_tanh", **values, "rope_parameters": rope}


def _write_directory(directory: Path, tensors: dict, config: dict, tokenizer, source_dir=None):
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), tensors, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if source_dir is not None:
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "generation_config.json",
            "preprocessor_config.json",
        ):
            if (Path(source_dir) / name).is_file():
                shutil.copy(Path(source_dir) / name, directory / name)
        return
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    eos = tokenizer.decode(tokenizer.eos_token_ids[:1])
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": eos,
        "add_bos_token": False,
        "model_max_length": config.get("text_config", config).get("max_position_embeddings"),
        "chat_template": tokenizer.chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


def save_hf(model, tokenizer, directory, source_dir=None):
    """A Hugging Face directory in the published Qwen3.5 layout (dense models)."""
    args = model.args
    if args.model_type != "qwen3_5":
        raise ValueError(f"HF export supports dense qwen3_5 models, not {args.model_type!r}")
    weights, _ = rename(_canonical(model), hf.qwen_export_rules("hf"), args)
    tensors = {hf.export_name(k, "hf", families.family(args.model_type).multimodal): v for k, v in weights.items()}
    _write_directory(Path(directory), tensors, hf_config(args, tokenizer), tokenizer, source_dir)


def save_mlx(model, tokenizer, directory, source_dir=None, quantization: dict | None = None):
    """The MLX-community layout (what mlx-lm writes), the MTP head in `mtp.safetensors`; `quantization`
    ({"group_size", "bits", "mode"}, and {"group_size", "bits"} by module path where a module differs)
    describes a model already quantized in memory."""
    args = model.args
    stored = [(name, (lambda v=v: v)) for name, v in model.stored_values().items()]
    family = families.family(args.model_type)
    if family.export_rules is None:
        raise ValueError(f"writing {args.model_type} models is not supported")
    weights, _ = rename(_canonical(model) + stored, family.export_rules("mlx"), args)
    if family.export_weights is not None:
        weights = family.export_weights(weights, args)
    tensors = {hf.export_name(k, "mlx", family.multimodal): v for k, v in weights.items()}
    # its config.json is the checkpoint's own, as mlx-lm's convert copies it
    if family.config_from_source:
        if source_dir is None:
            raise ValueError(f"writing {args.model_type} takes its Hugging Face directory's config.json")
        config = read_config(Path(source_dir))
    else:
        config = hf_config(args, tokenizer)
    if quantization:  # a module quantized otherwise is named as its tensors are written
        quantization = {
            (
                hf.export_name(f"{key}.weight", "mlx", family.multimodal)[: -len(".weight")]
                if isinstance(v, dict)
                else key
            ): v
            for key, v in quantization.items()
        }
        config.update(quantization=quantization, quantization_config=quantization)
    # the MTP head in a file of its own: mlx-lm reads model*.safetensors only (its Qwen3-Next refuses
    # mtp.* tensors there); our loader reads every .safetensors file of the directory
    head = {name: tensor for name, tensor in tensors.items() if name.startswith("mtp.")}
    trunk = {name: tensor for name, tensor in tensors.items() if name not in head}
    _write_directory(Path(directory), trunk, config, tokenizer, source_dir)
    if tables := model.row_tables():  # as the checkpoint stores them (one shard a table)
        write_row_tables(
            Path(directory) / "row_tables.safetensors",
            {hf.export_name(f"{name}.weight", "mlx", family.multimodal): table for name, table in tables.items()},
        )
    if head:
        mx.save_safetensors(str(Path(directory) / "mtp.safetensors"), head, metadata={"format": "pt"})


# -- MLX-quantized directories from checkpoints (the `mlx_hybrid.convert` command)


def convert(source, mlx_path, bits: int = 4, group_size: int = 64, dtype=None, mode: str = "affine") -> Path:
    """Quantize every linear, embedding and expert layer whose input size the group size divides.

    source: an HF checkpoint directory or a GGUF file (its tokenizer is written as tokenizer.json).
    dtype: of the scales and what stays unquantized (default: the checkpoint's own, see `_config_dtype`;
    float32 from a GGUF). mode: MLX's quantization mode, affine or one of `FLOAT_MODES` (mxfp4: 4
    bits in groups of 32, which bits and group_size must then say); the MoE routers stay affine.
    """
    if refused := mode_refused(mode):
        raise MlxHybridError(refused)
    if mode in FLOAT_MODES and (bits, group_size) != FLOAT_MODES[mode][:2]:
        raise MlxHybridError(f"{mode} takes {FLOAT_MODES[mode][0]} bits in groups of {FLOAT_MODES[mode][1]}")
    mlx_path = Path(mlx_path)
    if mlx_path.exists():  # as mlx-lm: never write over what is there
        raise MlxHybridError(f"{mlx_path} already exists; remove it or give another --mlx-path")
    source = hub.resolve(source) if hub.is_hub_name(source) else Path(source)
    checkpoint_dtype = "float32"  # a GGUF's blocks dequantize exactly to float32
    if source.is_dir():  # refuse early, before loading the weights
        config = read_config(source)
        families.family(config.get("model_type"))  # an unsupported one refused by name
        if config.get("quantization") or config.get("quantization_config"):
            raise MlxHybridError(f"{source} is already quantized; convert its float checkpoint")
        checkpoint_dtype = _config_dtype(config)
    # by default the checkpoint's dtype, not the machine's compute dtype (bfloat16 on a GPU):
    # the same source gives the same directory on every machine. A GGUF's blocks are dequantized,
    # then quantized to this one layout (a directory with one `quantization` entry holds one layout).
    model, tokenizer = load(source, dtype=dtype or checkpoint_dtype, dequantize=not source.is_dir())
    if families.family(model.model_type).config_from_source and not source.is_dir():
        raise MlxHybridError(f"convert writes {model.model_type} from its Hugging Face directory, not from a GGUF file")
    nn.quantize(model, group_size, bits, mode=mode, class_predicate=lambda path, m: _quantizable(path, m, group_size))
    quantization = {"group_size": group_size, "bits": bits, "mode": mode}
    quantization |= {  # the modules quantized otherwise, by their paths (as mlx-lm writes them)
        path: {"group_size": m.group_size, "bits": m.bits}
        for path, m in model.named_modules()
        if hasattr(m, "bits") and (m.bits, m.group_size) != (bits, group_size)
    }
    # written beside the target and renamed into place: a failed conversion leaves nothing behind
    partial = mlx_path.with_name(f".{mlx_path.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save_mlx(model, tokenizer, partial, source_dir=source if source.is_dir() else None, quantization=quantization)
        partial.rename(mlx_path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return mlx_path


# MoE routers (and the shared expert's gate) in 8 bits, groups of 64, as mlx-lm's conversions keep
# them: a router's few outputs choose the experts, where 4-bit rounding flips choices
ROUTER_QUANTIZATION = {"group_size": 64, "bits": 8}
ROUTERS = ("mlp.gate", "mlp.shared_expert_gate")


def _quantizable(path: str, module, group_size: int):
    """Linear, embedding and expert layers of the language model whose input size the group size
    divides (routers as ROUTER_QUANTIZATION says). The vision tower stays as it is, as mlx-vlm's
    conversions keep it (mlx-vlm reads a quantized tower of ours otherwise than we do)."""
    if path.startswith("vision.") or not hasattr(module, "to_quantized"):
        return False
    if path.endswith(ROUTERS):
        return ROUTER_QUANTIZATION if module.weight.shape[-1] % ROUTER_QUANTIZATION["group_size"] == 0 else False
    return module.weight.shape[-1] % group_size == 0


def _config_dtype(config: dict) -> str:
    """An HF checkpoint's own dtype, as mlx-lm's convert takes it: its config's `dtype` (formerly
    `torch_dtype`), at the top or in `text_config`; float32 where it names none we write."""
    for entry in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if entry.get(key) in DTYPES:
                return entry[key]
    return "float32"
