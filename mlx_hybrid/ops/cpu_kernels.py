"""Our CPU kernels as ops (csrc/, built into one module by `cpu_extension`, which lists them): each
call takes float32 inputs, gives the contract of its pure-MLX op in `reference` and is one MLX
primitive; each token's or row's bits are the same whatever tokens or rows come with it. `ops`
decides when they run (and `cpu_quantized` wraps the quantized products the same way)."""

from __future__ import annotations

import mlx.core as mx

from .cpu_extension import extension
from .reference import L2_EPS, BuiltOnRead, LayerResult, per_token


def keep_to_one_thread(value: bool):
    """Whether the kernels computed from now on run each job on MLX's CPU thread alone, however large
    (`schedule.layer_built` decides)."""
    extension().keep_to_one_thread(value)


def linear_attention(x, conv_weight, a, b, gate, decay, norm, heads, tail=None, state=None, *, snapshots=False):
    """Shapes as in `reference.linear_attention`; x and tail float32. Each token's bits are the same
    whatever tokens or rows come with it. With snapshots the kernel keeps each token's inputs to the
    rule, not its state (csrc/linear_attention.cpp): a state snapshot is the rule replayed over them
    from `state`, computed only where a rollback reads it."""
    B, T, C = x.shape
    Hk, Hv, Dk, Dv = heads
    if tail is None:
        tail = mx.zeros((B, conv_weight.shape[-1] - 1, C), dtype=x.dtype)
    if state is None:
        state = mx.zeros((B, Hv, Dk, Dv), dtype=mx.float32)
    out, new_tail, *rest = extension().linear_attention(
        x,
        conv_weight,
        tail,
        a,
        b,
        decay.A,
        decay.dt_bias,
        gate,
        norm.weight,
        state,
        Hk,
        Dk**-0.5,
        L2_EPS,
        norm.eps,
        norm.activation == "sigmoid",
        snapshots,
    )
    new_state, *kept = rest
    if not snapshots:
        return LayerResult(out, new_tail, new_state, None, None)
    tails, k, v, g, beta = kept

    def state_after(t: int) -> mx.array:
        # the rule's kernel over tokens 0..t, the bits of a state kept a token (k stands in for q,
        # which only the output, not read here, depends on)
        return new_state if t == T - 1 else extension().gated_delta(k, k, v, g, beta, state, False, t + 1)[1]

    return LayerResult(out, new_tail, new_state, per_token(tails), BuiltOnRead(T, state_after))


def gated_delta_recurrent(q, k, v, g, beta, state=None, *, snapshots: bool = False):
    """(out [B, T, Hv, Dv] float32, final state, the T states after each token or None); shapes
    as in `reference`. Each token's bits are the same whatever tokens or rows come with it."""
    if state is None:
        B, _, Hv, Dv = v.shape
        state = mx.zeros((B, Hv, q.shape[-1], Dv), dtype=mx.float32)
    out, *states = extension().gated_delta(q, k, v, g, beta, state, snapshots)
    return out, states[-1], (states if snapshots else None)


def causal_conv1d_silu(x, weight, tail=None, *, snapshots: bool = False):
    """(y [B, T, C], the tail after the last token [B, K-1, C], the T tails after each token or
    None); x and tail float32. Each token's bits are the same whatever tokens or rows come with it."""
    B, _, C = x.shape
    if tail is None:
        tail = mx.zeros((B, weight.shape[-1] - 1, C), dtype=x.dtype)
    y, new_tail, *tails = extension().conv1d_silu(x, weight, tail, snapshots)
    return y, new_tail, (per_token(tails[0]) if snapshots else None)


def rms_norm(x, weight, eps: float):
    return extension().rms_norm(x, weight, eps)


def add_rms_norm(x, y, weight, eps: float):
    """(x + y, rms_norm(x + y, weight, eps))."""
    return tuple(extension().add_rms_norm(x, y, weight, eps))


def l2_normalize(x, eps: float):
    return extension().l2_normalize(x, eps)


def rope(x, c, s, dims: int):
    """`rotary.rotate`: the rotary factors c, s applied to the first `dims` features."""
    return extension().rope(x, c, s, dims)


def attention(q, k, v, scale: float, causal: bool, key_lengths=None):
    """`mx.fast.scaled_dot_product_attention` (mask None or causal); key_lengths (int32 [B]): each
    batch row's keys, the causal mask aligned to its last."""
    return extension().attention(q, k, v, scale, causal, key_lengths)


def quantized_attention(q, keys, values, scale: float, causal: bool, key_lengths=None):
    """`attention` over a quantized cache's keys and values (`reference.QuantizedEntries`, float32
    scales): each decoded as mx.dequantize does, to the float32 floor (one FMA a value)."""
    return extension().quantized_attention(
        q, list(keys.arrays), list(values.arrays), scale, causal, keys.bits, keys.group_size, key_lengths
    )


def gated_product(x, gate, sigmoid: bool):
    """x * sigmoid(gate) (sigmoid) or x * SiLU(gate), in x's dtype."""
    return extension().gated_product(x, gate, sigmoid)


def gelu_tanh(x):
    """GELU, its tanh approximation (MLX's nn.gelu_approx)."""
    return extension().gelu_tanh(x)
