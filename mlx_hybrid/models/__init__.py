"""Architectures mlx_hybrid implements, by the model type of their HF config."""

from __future__ import annotations

from types import ModuleType

from ..errors import UnsupportedArchitectureError
from . import kimi_linear, qwen3_5, qwen4_exp

ARCHITECTURES: dict[str, ModuleType] = {
    "qwen3_5": qwen3_5,
    "qwen3_5_moe": qwen3_5,
    "qwen3_next": qwen3_5,
    "qwen4_exp": qwen4_exp,
    "qwen4_exp_text": qwen4_exp,
    "kimi_linear": kimi_linear,
}


def architecture(model_type: str) -> ModuleType:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        known = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedArchitectureError(f"unsupported architecture {model_type!r} (supported: {known})") from None
