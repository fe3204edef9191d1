"""A model family as one record (`Family`): its model file, the names each format gives it, how its
arguments are read from each format's config, its tensor tables both ways, and what `convert` and the
exporters write. Every lookup by model type or GGUF architecture reads `FAMILIES`; adding a family is
its model file and its record (`register` adds one at run time)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from ..errors import UnsupportedArchitectureError
from ..models import kimi_linear, qwen3_5, qwen4_exp
from . import gguf_architectures as gguf
from . import hf, hf_config


@dataclass(frozen=True)
class GGUFArchitecture:
    """How llama.cpp's files of a family read: its architecture name, the hyper-parameters
    (`args(meta, module, tensor_shapes, model_type)`) and the tensor table."""

    name: str
    args: Callable
    rules: list
    written: bool = False  # `export.save_gguf` writes it


@dataclass(frozen=True)
class Family:
    """One model family. model_type: its config.json's name (`also_named`: others that load the same
    model, a multimodal wrapper's text part's). module: its model file (`ModelArgs`, `Model`,
    `FLOAT32_PARAMS`). hf_args(config, module, has_mtp, has_vision) reads its arguments; hf_rules(layout)
    and export_rules(layout) are its tensor tables from and to the HF and MLX layouts (`hf.LAYOUTS`; no
    export_rules: not written). multimodal: published with a vision tower, the text model under a
    prefix. hf_class: the transformers class `export.hf_config` names. row_tables: the pattern of
    tensors left in their files (`loaders.row_tables`). config_from_source: `convert` copies the
    checkpoint's own config.json (so it converts from a Hugging Face directory only).
    export_weights(weights, args): what writing does to the renamed weights beyond the table."""

    model_type: str
    module: ModuleType
    hf_args: Callable
    hf_rules: Callable[[str], list]
    export_rules: Callable[[str], list] | None = None
    also_named: tuple[str, ...] = ()
    multimodal: bool = False
    hf_class: str | None = None
    row_tables: str | None = None
    gguf: GGUFArchitecture | None = None
    config_from_source: bool = False
    export_weights: Callable | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model_type, *self.also_named)


FAMILIES: list[Family] = [
    Family(
        "qwen3_5", qwen3_5, hf_config.qwen_args, hf.qwen_rules, hf.qwen_export_rules, multimodal=True,
        hf_class="Qwen3_5ForConditionalGeneration",
        gguf=GGUFArchitecture("qwen35", gguf.qwen_args, gguf.qwen_rules(tiled_value_heads=True), written=True),
    ),
    Family(
        "qwen3_5_moe", qwen3_5, hf_config.qwen_args, hf.qwen_rules, hf.qwen_export_rules, multimodal=True,
        hf_class="Qwen3_5MoeForConditionalGeneration",
        gguf=GGUFArchitecture("qwen35moe", gguf.qwen_args, gguf.qwen_rules(tiled_value_heads=True), written=True),
    ),
    Family(
        "qwen3_next", qwen3_5, hf_config.qwen_args, hf.qwen_rules, hf.qwen_export_rules,
        hf_class="Qwen3NextForCausalLM", export_weights=hf.fuse_qwen3_next_projections,
        gguf=GGUFArchitecture("qwen3next", gguf.qwen_args, gguf.qwen_rules(tiled_value_heads=False)),
    ),
    Family(
        "qwen4_exp", qwen4_exp, hf_config.qwen_args, hf.qwen4_rules, hf.qwen4_export_rules,
        also_named=("qwen4_exp_text",), multimodal=True, row_tables=hf.QWEN4_ROW_TABLES, config_from_source=True,
    ),
    Family(
        "kimi_linear", kimi_linear, hf_config.kimi_args, hf.kimi_rules, hf.kimi_export_rules,
        gguf=GGUFArchitecture("kimi-linear", gguf.kimi_args, gguf.kimi_rules()), config_from_source=True,
    ),
]  # fmt: skip


def register(family: Family):
    """Add a family (one defined outside the package); a name already taken is refused."""
    taken = {name for f in FAMILIES for name in f.names} | {f.gguf.name for f in FAMILIES if f.gguf}
    clash = [name for name in (*family.names, *([family.gguf.name] if family.gguf else [])) if name in taken]
    if clash:
        raise ValueError(f"a family named {clash[0]!r} is already registered")
    FAMILIES.append(family)


def family(model_type: str) -> Family:
    """The family of a config's model type."""
    for candidate in FAMILIES:
        if model_type in candidate.names:
            return candidate
    known = ", ".join(sorted(name for f in FAMILIES for name in f.names))
    raise UnsupportedArchitectureError(f"unsupported architecture {model_type!r} (supported: {known})")


def gguf_family(architecture: str, path) -> Family:
    """The family of a GGUF file's architecture."""
    for candidate in FAMILIES:
        if candidate.gguf is not None and candidate.gguf.name == architecture:
            return candidate
    known = ", ".join(sorted(f.gguf.name for f in FAMILIES if f.gguf))
    raise UnsupportedArchitectureError(f"{path}: unsupported GGUF architecture {architecture!r} (supported: {known})")
