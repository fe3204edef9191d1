"""DFlash block drafters (z-lab, "Block Diffusion for Flash Speculative Decoding"): a few Qwen3 decoder
layers that propose a whole block of tokens in one non-causal pass, conditioned on the target's hidden
states, with the target's embedding and output head.

A round: the block [last accepted token, mask x (B - 1)], embedded by the target; the target's hidden
states at `target_layer_ids` (its layers' outputs, concatenated per position) for the positions the
drafter has not read yet go through `fc` and `hidden_norm` and enter every layer as keys and values
ahead of the block's own; the block attends to all of them and to itself (no mask), at rotary
positions continuing the sequence. The layers' caches keep the context's entries only: the block's are
dropped after the pass. The block's last B - 1 positions, through the target's head, are the drafts.

Layers of `layer_types` "sliding_attention" are causal inside the block and see only keys fewer than
`sliding_window` positions back (their caches drop what the window no longer reaches; `is_causal`
makes the full layers causal too).

DFlash2 (`DFlash2DraftModel`) adds its convolutions and candidate selector (`dflash2.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .. import ops
from ..cache import AttentionCache, KVCache, WindowKVCache
from ..errors import ModelLoadError
from .dflash2 import CandidateSelector, GroupedDynamicConv
from .layers import MLP, Linear, RMSNorm

DRAFT_ARCHITECTURE = "DFlashDraftModel"
DRAFT2_ARCHITECTURE = "DFlash2DraftModel"
DFLASH2_SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # its dflash_config's


@dataclass
class DFlashArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" or "sliding_attention" (empty: all full)
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: the sliding layers causal, the full ones not
    conv_kernel_size: int = 0  # DFlash2's; 0: a DFlash drafter
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def dflash2(self) -> bool:
        return self.selector_top_k > 0

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.sliding(layer) else None

    def causal(self, layer: int) -> bool:
        return self.sliding(layer) if self.is_causal is None else self.is_causal

    @classmethod
    def from_config(cls, config: dict) -> DFlashArgs:
        """The settings of z-lab's config.json (a Qwen3 config with `dflash_config`); what this
        implementation does not compute is refused by name."""
        architectures = config.get("architectures") or []
        if architectures not in ([DRAFT_ARCHITECTURE], [DRAFT2_ARCHITECTURE]):
            raise ModelLoadError(
                f"not a DFlash drafter: architectures {architectures} (expected {DRAFT_ARCHITECTURE} or "
                f"{DRAFT2_ARCHITECTURE})"
            )
        dflash2 = architectures == [DRAFT2_ARCHITECTURE]
        draft = config.get("dflash_config") or {}

        def setting(name, default=None):
            return draft.get(name, config.get(name, default))

        dflash2_settings = DFLASH2_SETTINGS if dflash2 else ()
        missing = [name for name in ("target_layer_ids", "mask_token_id", *dflash2_settings) if setting(name) is None]
        if missing:
            raise ModelLoadError(f"the DFlash config lacks {', '.join(missing)}")
        if dflash2 and config["hidden_size"] % int(setting("conv_group_size")):
            raise ModelLoadError(
                f"the DFlash2 config's conv_group_size {setting('conv_group_size')} does not divide its hidden size "
                f"{config['hidden_size']}"
            )
        # as transformers' Qwen3Config reads them, which z-lab's layers take
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        layer_types = config.get("layer_types") or [
            "sliding_attention" if window is not None and i >= config.get("max_window_layers", 28) else "full_attention"
            for i in range(config["num_hidden_layers"])
        ]
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown or len(layer_types) != config["num_hidden_layers"]:
            raise ModelLoadError(
                f"the DFlash config's layer_types {layer_types} are not one of full_attention or sliding_attention "
                f"for each of its {config['num_hidden_layers']} layers"
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ModelLoadError(f"DFlash drafters with rope scaling {rope.get('rope_type', rope.get('type'))!r}")
        softcap = setting("final_logit_softcapping")
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 1e6)),
            vocab_size=config["vocab_size"],
            target_layer_ids=list(setting("target_layer_ids")),
            block_size=int(setting("block_size", 16)),
            mask_token_id=int(setting("mask_token_id")),
            attention_bias=config.get("attention_bias", False),
            input_embedding_scale=float(setting("input_embedding_scale", 1.0)),
            output_multiplier=float(setting("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            layer_types=tuple(layer_types),
            sliding_window=int(window) if window is not None else None,
            is_causal=None if config.get("is_causal") is None else bool(config["is_causal"]),
            **{name: int(setting(name)) for name in dflash2_settings},
        )


def target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers z-lab's recipe has a drafter of `num_draft_layers` layers read (its
    `build_target_layer_ids`): spread from layer 1 to the fourth from last; one layer reads the middle."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class DFlashAttention(nn.Module):
    """Attention of the block over the context's entries (cached and new) and its own: unmasked, or
    causal, or within a sliding window (`DFlashArgs.causal`, `window_of`)."""

    def __init__(self, args: DFlashArgs, layer: int = 0):
        super().__init__()
        self.causal, self.window = args.causal(layer), args.window_of(layer)
        E, H, Hkv, D, bias = (
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            args.attention_bias,
        )
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta = H, Hkv, D, args.rope_theta
        self.q_proj = Linear(E, H * D, bias=bias)
        self.k_proj = Linear(E, Hkv * D, bias=bias)
        self.v_proj = Linear(E, Hkv * D, bias=bias)
        self.o_proj = Linear(H * D, E, bias=bias)
        self.q_norm = RMSNorm(D, args.rms_norm_eps)
        self.k_norm = RMSNorm(D, args.rms_norm_eps)

    def __call__(
        self, x: mx.array, context: mx.array, cache: AttentionCache | None, counts: tuple[int, ...] | None = None
    ) -> mx.array:
        """x [B, T, E] (the block, normed), context [B, C, E] (the new context's states): the block's
        output [B, T, E]; the cache gains the context's and the block's entries (the caller drops the
        block's). Without a cache the context is all there is, from position 0 (training).

        counts: rows drafting together (cache a `KVRowsPass`): row b's new context is its first counts[b]
        entries, the rest padding. Each row's keys are laid out as alone, its context then the block,
        the padding after them (written past the row's keys, never read)."""
        B, T, _ = x.shape
        C = context.shape[1]
        both = mx.concatenate([context, x], axis=1)
        if counts is not None:
            both = mx.take_along_axis(both, _context_then_block(counts, C, T), axis=1)
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.num_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(both).reshape(B, -1, self.num_kv_heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(both).reshape(B, -1, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        start = cache.rotary_span(C + T) if cache is not None else 0  # the first new entry's position(s)
        k = ops.rope(k, self.head_dim, self.rope_theta, start)
        q = ops.rope(q, self.head_dim, self.rope_theta, start + C if counts is None else _plus(start, counts))
        if cache is not None:
            kept = None if counts is None else _plus(counts, T)  # a row's keys: its context and the block
            k, v = cache.update_and_fetch(k, v) if kept is None else cache.update_and_fetch(k, v, counts=kept)
        lengths = None if counts is None else cache.key_lengths
        out = ops.scaled_dot_product_attention(
            q, k, v, self.head_dim**-0.5, "causal" if self.causal else None, key_lengths=lengths, window=self.window
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


@lru_cache(maxsize=16)
def _context_then_block(counts: tuple[int, ...], context: int, block: int) -> mx.array:
    """[R, C + T, 1] int32: per row, positions of [context (C), block (T)] giving its counts[r] context
    entries, the block, then padding (the block's last entry again)."""
    index = np.full((len(counts), context + block), context + block - 1, np.int32)
    for row, n in enumerate(counts):
        index[row, :n] = np.arange(n)
        index[row, n : n + block] = context + np.arange(block)
    return mx.array(index[..., None])


def _plus(starts: tuple[int, ...], counts: tuple[int, ...] | int) -> tuple[int, ...]:
    return tuple(s + n for s, n in zip(starts, counts if isinstance(counts, tuple) else [counts] * len(starts)))


class DFlashLayer(nn.Module):
    def __init__(self, args: DFlashArgs, layer: int = 0):
        super().__init__()
        self.self_attn = DFlashAttention(args, layer)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.dflash2:
            self.attention_conv = GroupedDynamicConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def __call__(self, x: mx.array, context: mx.array, cache, counts=None) -> mx.array:
        h = x + self._around(
            "attention_conv", lambda y: self.self_attn(y, context, cache, counts), self.input_layernorm(x)
        )
        return h + self._around("mlp_conv", self.mlp, self.post_attention_layernorm(h))

    def _around(self, conv: str, block, x: mx.array) -> mx.array:
        """block(x), inside DFlash2's convolutions where the layer has them."""
        if conv not in self:
            return block(x)
        x, dynamic = self[conv].prepare(x)
        return self[conv].finish(block(x), dynamic)


class DFlashDraftModel(nn.Module):
    """The drafter's layers. `block_hidden` runs a round; `block_logits` turns its output into the
    drafts' logits through the target's head."""

    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.args = args
        self.fc = Linear(len(args.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.layers = [DFlashLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.dflash2:
            self.candidate_selector = CandidateSelector(
                args.hidden_size, args.vocab_size, args.selector_rank, args.selector_top_k
            )

    @property
    def widest_product(self) -> int:
        """The most weights one of its products multiplies: `fc`'s or the feed-forward's."""
        args = self.args
        return args.hidden_size * max(args.intermediate_size, len(args.target_layer_ids) * args.hidden_size)

    def make_cache(self) -> list[KVCache]:
        return [
            KVCache() if layer.self_attn.window is None else WindowKVCache(layer.self_attn.window)
            for layer in self.layers
        ]

    def block_hidden(self, block_embeddings: mx.array, features: mx.array, cache: list | None, counts=None) -> mx.array:
        """block_embeddings [B, T, E] (the target's embedding of the block's ids), features [B, C, L E] (the
        target's states at the layer ids for the C positions after those the cache holds): the block's
        states [B, T, E]; each layer's cache then holds the context up to the block. cache: per layer a
        KVCache, or for rows drafting together a `row_caches.KVRowsPass` with each row's context count
        `counts` (see `DFlashAttention`); None: the features are the whole context (training)."""
        scale = self.args.input_embedding_scale
        x = block_embeddings * scale if scale != 1 else block_embeddings
        context = self.hidden_norm(self.fc(features))
        for i, layer in enumerate(self.layers):
            x = layer(x, context, cache[i] if cache is not None else None, counts)
            ops.layer_built(x, self.widest_product)
        for layer_cache in cache or ():
            layer_cache.trim(x.shape[1])
        return self.norm(x)

    def block_logits(self, hidden: mx.array, project) -> mx.array:
        """The drafts' logits [B, T - 1, V] from the block's states, through the target's head `project`."""
        logits = project(hidden[:, 1:])
        if self.args.output_multiplier != 1:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        return mx.tanh(logits / cap) * cap if cap else logits


def load_drafter(path: str | Path, dtype=mx.float32) -> DFlashDraftModel:
    """A DFlash drafter from its Hugging Face directory (config.json, safetensors)."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"cannot read the DFlash drafter's config.json in {path}: {error}") from None
    model = DFlashDraftModel(DFlashArgs.from_config(config))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no safetensors files in {path}")
    weights = {name: array.astype(dtype) for file in files for name, array in mx.load(str(file)).items()}
    for name in ("predecessor_codebook", "successor_codebook"):  # stored bare, or as save_pretrained writes it
        key = f"candidate_selector.{name}"
        if f"{key}.weight" in weights:
            weights[key] = weights.pop(f"{key}.weight")
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as error:
        raise ModelLoadError(f"the DFlash drafter's weights in {path} do not fit its config: {error}") from None
    mx.eval(model.parameters())
    return model


def save_drafter(
    drafter: DFlashDraftModel,
    path: str | Path,
    num_target_layers: int,
    dtype=mx.bfloat16,
    max_position_embeddings: int = 4096,
):
    """Write a drafter as z-lab's directories hold one (config.json of a Qwen3 decoder with
    `dflash_config`, model.safetensors; DFlash2's codebooks under their bare keys): what `load_drafter`
    and z-lab's `dflash` (its MLX runner too, which reads `max_position_embeddings`: the target's) read."""
    args, path = drafter.args, Path(path)
    path.mkdir(parents=True, exist_ok=True)
    window = {"use_sliding_window": True, "sliding_window": args.sliding_window} if args.sliding_window else {}
    dflash2 = DFLASH2_SETTINGS if args.dflash2 else ()
    config = {
        "architectures": [DRAFT2_ARCHITECTURE if args.dflash2 else DRAFT_ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size, "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads, "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim, "rms_norm_eps": args.rms_norm_eps, "vocab_size": args.vocab_size,
        "rope_parameters": {"rope_theta": args.rope_theta, "rope_type": "default"},
        "attention_bias": args.attention_bias, "hidden_act": "silu", "tie_word_embeddings": False,
        "layer_types": list(args.layer_types) or ["full_attention"] * args.num_hidden_layers, **window,
        **({"is_causal": args.is_causal} if args.is_causal is not None else {}),
        "num_target_layers": num_target_layers, "max_position_embeddings": max_position_embeddings,
        "dtype": str(dtype).split(".")[-1],
        "dflash_config": {
            "block_size": args.block_size, "mask_token_id": args.mask_token_id,
            "target_layer_ids": args.target_layer_ids, **{name: getattr(args, name) for name in dflash2},
        },
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {name: array.astype(dtype) for name, array in tree_flatten(drafter.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})


DFlashDrafter = DFlashDraftModel  # its former name (the drafting strategy is `drafting.DFlashDrafter`)
