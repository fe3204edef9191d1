"""Pure-MLX forms of the linear-attention ops and the norms (rotary embeddings: `rotary`).

These run on every backend and are the reference the custom kernels are checked
against. Shapes, for one layer:

    q, k   [B, T, Hk, Dk]   L2-normalised; q already scaled by Dk**-0.5
    v      [B, T, Hv, Dv]   value head h reads key head h // (Hv // Hk)
    g      [B, T, Hv]       log decay (<= 0), one per head (Qwen GDN), or
           [B, T, Hv, Dk]   one per key channel (Kimi KDA)
    beta   [B, T, Hv]
    state  [B, Hv, Dk, Dv]  float32

Everything is computed in float32 whatever the input dtype. `linear_attention` composes the
ops into a layer's work between its projections.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .activations import sigmoid, silu

F32 = mx.float32


@partial(mx.compile, shapeless=True)
def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, accumulated in float32, in x's dtype."""
    normed = x.astype(F32)
    normed = normed * mx.rsqrt((normed * normed).mean(axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


@partial(mx.compile, shapeless=True)
def l2_normalize(x: mx.array, eps: float) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32."""
    x = x.astype(F32)
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def _expand_key_heads(x: mx.array, num_value_heads: int) -> mx.array:
    """[B, T, Hk, D] -> [B, T, Hv, D]: value head h uses key head h // R."""
    ratio = num_value_heads // x.shape[2]
    return x if ratio == 1 else mx.repeat(x, ratio, axis=2)


def _prepare(q, k, v, g, beta, state):
    num_value_heads = v.shape[2]
    q = _expand_key_heads(q.astype(F32), num_value_heads)
    k = _expand_key_heads(k.astype(F32), num_value_heads)
    if state is None:
        B, _, Hv, Dv = v.shape
        state = mx.zeros((B, Hv, k.shape[-1], Dv), dtype=F32)
    return q, k, v.astype(F32), g.astype(F32), beta.astype(F32), state.astype(F32)


@mx.compile
def _delta_step(state, q, k, v, g, beta):
    """One token for every head, with two passes over the state.

    With D = exp(g) the decay: S' = D S + k (x) delta, delta = beta (v - k^T D S),
    and the output q^T S' = q^T D S + (q . k) delta. So one product reads (q D, k D)
    off S, and one fused elementwise pass writes S'.
    """
    # a scalar gate [B, H] scales the whole [Dk, Dv] state, a vector gate [B, H, Dk] each key row
    row_decay = mx.exp(g)[..., None] if g.ndim == 2 else mx.exp(g)
    reads = mx.stack([q * row_decay, k * row_decay], axis=-2) @ state  # [B, H, 2, Dv]
    delta = beta[..., None] * (v - reads[..., 1, :])
    out = reads[..., 0, :] + (q * k).sum(axis=-1, keepdims=True) * delta
    return out, state * row_decay[..., None] + k[..., None] * delta[..., None, :]


def gated_delta_recurrent(q, k, v, g, beta, state=None, *, snapshots: bool = False):
    """The gated delta rule one token at a time (decode and verify passes).

    Returns (out [B, T, Hv, Dv] float32, final state, the states after each token as
    a list of T arrays [B, Hv, Dk, Dv], or None). The list holds the arrays the recurrence
    computes anyway: stacking them would copy T states per layer in every verify pass.
    """
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, state)
    outputs, states = [], []
    for t in range(v.shape[1]):
        out, state = _delta_step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outputs.append(out)
        if snapshots:
            states.append(state)
    out = mx.stack(outputs, axis=1)
    return out, state, (states if snapshots else None)


@lru_cache(maxsize=None)
def _chunk_masks(chunk: int):
    """Causal masks and the block masks used to invert unit lower-triangular matrices."""
    row = np.arange(chunk)[:, None]
    col = np.arange(chunk)[None, :]
    inclusive = mx.array(row >= col)
    strict = mx.array(row > col)
    # Level s of the blocked inversion: the lower-left s x s block of every 2s x 2s
    # diagonal block.
    levels = []
    size = 1
    while size < chunk:
        same_pair = (row // (2 * size)) == (col // (2 * size))
        lower_half = (row // size) == (col // size) + 1
        levels.append(mx.array(same_pair & lower_half))
        size *= 2
    return inclusive, strict, levels


def unit_lower_inverse(strict_lower: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], C a power of two.

    Blocked inversion: with X the inverse of the block diagonal at block size s,
    the inverse at size 2s is X - X A_off X, A_off the lower-left sub-blocks.
    Only matrix products, so it runs on any backend, and it is as accurate as
    forward substitution.
    """
    chunk = strict_lower.shape[-1]
    if chunk & (chunk - 1):
        raise ValueError(f"chunk size must be a power of two, got {chunk}")
    _, _, levels = _chunk_masks(chunk)
    inverse = mx.broadcast_to(mx.eye(chunk, dtype=strict_lower.dtype), strict_lower.shape)
    for block in levels:
        off_diagonal = mx.where(block, strict_lower, 0.0)
        inverse = inverse - inverse @ off_diagonal @ inverse
    return inverse


def gated_delta_chunked(q, k, v, g, beta, state=None, *, chunk: int = 64):
    """The gated delta rule over chunks (prefill): WY/UT form with matrix products.

    Equal to `gated_delta_recurrent` up to float rounding. Returns (out, final state).
    """
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, state)
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    vector_gate = g.ndim == 4
    pad = (-T) % chunk
    if pad:
        # zero keys and betas leave the state untouched; zero log decay keeps it
        def padded(x):
            return mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

        q, k, v, g, beta = map(padded, (q, k, v, g, beta))
    n = (T + pad) // chunk

    def chunked(x):  # [B, T', H, ...] -> [B, H, n, C, ...]
        x = x.reshape(B, n, chunk, H, *x.shape[3:])
        return mx.moveaxis(x, 3, 1)

    q, k, v, g, beta = map(chunked, (q, k, v, g, beta))
    inclusive, strict, _ = _chunk_masks(chunk)

    cum = mx.cumsum(g, axis=3)  # log of the decay from the chunk start to position i
    if vector_gate:
        # per-channel decay between positions i >= j: exp(cum_i - cum_j), [.., C, C, Dk]
        diff = cum[..., :, None, :] - cum[..., None, :, :]
        pair_decay = mx.exp(mx.where(inclusive[..., None], diff, -mx.inf))
        kk = (k[..., :, None, :] * pair_decay * k[..., None, :, :]).sum(-1)
        qk = (q[..., :, None, :] * pair_decay * k[..., None, :, :]).sum(-1)
        cum_decay = mx.exp(cum)  # [.., C, Dk]
        to_end = mx.exp(cum[..., -1:, :] - cum)
        chunk_decay = mx.exp(cum[..., -1, :])[..., None]  # [B, H, n, Dk, 1]
    else:
        diff = cum[..., :, None] - cum[..., None, :]
        pair_decay = mx.exp(mx.where(inclusive, diff, -mx.inf))
        kk = (k @ k.swapaxes(-1, -2)) * pair_decay
        qk = (q @ k.swapaxes(-1, -2)) * pair_decay
        cum_decay = mx.exp(cum)[..., None]
        to_end = mx.exp(cum[..., -1:] - cum)[..., None]
        chunk_decay = mx.exp(cum[..., -1])[..., None, None]  # [B, H, n, 1, 1]

    beta_col = beta[..., None]
    solve = unit_lower_inverse(mx.where(strict, kk * beta_col, 0.0))
    new_values = solve @ (v * beta_col)  # "u" before the state's contribution
    state_reads = solve @ (k * beta_col * cum_decay)
    q_decayed = q * cum_decay
    k_to_end = (k * to_end).swapaxes(-1, -2)  # [B, H, n, Dk, C]

    outputs = []
    for i in range(n):
        v_new = new_values[:, :, i] - state_reads[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + qk[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i] @ v_new
    out = mx.stack(outputs, axis=2).reshape(B, H, n * chunk, Dv)
    out = out.swapaxes(1, 2)[:, :T]
    return out, state


@mx.compile
def _conv_silu(padded: mx.array, weight: mx.array) -> mx.array:
    """SiLU of the depthwise conv over `padded` [B, K-1+T, C] (one fused pass)."""
    K = weight.shape[-1]
    T = padded.shape[1] - (K - 1)
    w = weight.astype(F32)
    acc = padded[:, 0:T].astype(F32) * w[:, 0]
    for j in range(1, K):
        acc = acc + padded[:, j : j + T].astype(F32) * w[:, j]
    return silu(acc).astype(padded.dtype)


def causal_conv1d_silu(x, weight, tail=None, *, snapshots: bool = False):
    """Depthwise causal conv over time, then SiLU, continuing from a carried tail.

    x [B, T, C], weight [C, K], tail [B, K-1, C] (the last K-1 inputs seen; zeros
    when None). Returns (y [B, T, C] in x's dtype, new tail, the tails after each token
    as a list of T views [B, K-1, C] of the padded input, or None).
    """
    B, T, C = x.shape
    K = weight.shape[-1]
    if tail is None:
        tail = mx.zeros((B, K - 1, C), dtype=x.dtype)
    padded = mx.concatenate([tail.astype(x.dtype), x], axis=1)
    tails = None
    if snapshots:
        tails = [padded[:, t + 1 : t + K] for t in range(T)]
    # a long call's tail gathered (a copy): a slice would keep the whole padded input alive in the
    # cache, a prefill chunk a layer (0.2 GB for 512 tokens of Qwen3.5-0.8B)
    new_tail = padded[:, T:] if T < K else mx.take(padded, mx.arange(T, T + K - 1), axis=1)
    return _conv_silu(padded, weight), new_tail, tails


L2_EPS = 1e-6  # q's and k's L2 normalization (as FLA and transformers)


class HeadShape(NamedTuple):
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int


class Decay(NamedTuple):
    """The rule's log decay, g = A softplus(a + dt_bias): per head (Qwen's GDN: dt_bias [Hv]) or
    per head and key channel (Kimi's KDA: a [B, T, Hv, Dk], dt_bias [Hv Dk])."""

    A: mx.array  # [Hv]: -exp(A_log)
    dt_bias: mx.array


@partial(mx.compile, shapeless=True)
def _gates(a, b, A, dt_bias):
    return A * mx.logaddexp(a.astype(F32) + dt_bias, 0.0), sigmoid(b.astype(F32))


def gates(a: mx.array, b: mx.array, decay: Decay) -> tuple[mx.array, mx.array]:
    """(g, beta) in float32 for a [B, T, Hv] or [B, T, Hv, Dk] and b [B, T, Hv]: the log decay
    A softplus(a + dt_bias) and the write strength sigmoid(b)."""
    A, dt_bias = decay
    if a.ndim == 4:
        A, dt_bias = A[:, None], dt_bias.reshape(a.shape[-2:])
    return _gates(a, b, A, dt_bias)


class OutputNorm(NamedTuple):
    """A linear-attention layer's output: RMSNorm(out) * weight * activation(gate)."""

    weight: mx.array  # [Dv]
    eps: float
    activation: str  # "silu" (Qwen's GDN) or "sigmoid" (Kimi's KDA)


class LayerResult(NamedTuple):
    out: mx.array  # [B, T, Hv Dv] in x's dtype (computed in float32)
    tail: mx.array  # the conv's tail after the last token [B, K-1, C]
    state: mx.array  # [B, Hv, Dk, Dv] float32, after the last token
    tail_snapshots: Sequence | None  # T arrays [B, K-1, C]: the tail after each token
    state_snapshots: Sequence | None  # T arrays [B, Hv, Dk, Dv]: the state after each token


class BuiltOnRead(Sequence):
    """A call's T snapshots, each built (`build(t)`, once) where it is read. A verify pass keeps a
    state after every token and a rollback reads one at most: the others then cost no array, no
    slice and, where the kernels replay them (`cpu_kernels.linear_attention`), no computing."""

    def __init__(self, count: int, build: Callable[[int], mx.array]):
        self._count, self._build, self._built = count, build, {}

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, t: int) -> mx.array:
        t = range(self._count)[t]  # negative indices, and IndexError past the end
        if t not in self._built:
            self._built[t] = self._build(t)
        return self._built[t]


def per_token(stacked: mx.array) -> BuiltOnRead:
    """A kernel's stacked snapshots [B, T, ...] as the per-token sequence the ops give."""
    return BuiltOnRead(stacked.shape[1], lambda t: stacked[:, t])


def linear_attention(
    x,
    conv_weight,
    a,
    b,
    gate,
    decay: Decay,
    norm: OutputNorm,
    heads: HeadShape,
    tail=None,
    state=None,
    *,
    snapshots: bool = False,
    conv=causal_conv1d_silu,
    rule=gated_delta_recurrent,
    l2=l2_normalize,
    rms=rms_norm,
) -> LayerResult:
    """A linear-attention layer's work between its projections: the causal conv + SiLU over
    x = q|k|v [B, T, 2 Hk Dk + Hv Dv], q and k L2-normalised (q scaled by Dk**-0.5), the gated
    delta rule from `state` with the `gates` of a and b, then the output norm with gate
    [B, T, Hv Dv]. conv, rule, l2 and rms: the ops it composes (these pure-MLX forms, or `ops`'
    choices)."""
    B, T, _ = x.shape
    Hk, Hv, Dk, Dv = heads
    g, beta = gates(a, b, decay)
    y, new_tail, tails = conv(x, conv_weight, tail, snapshots=snapshots)
    q, k, v = mx.split(y, [Hk * Dk, 2 * Hk * Dk], axis=-1)
    q = l2(q.reshape(B, T, Hk, Dk), L2_EPS) * Dk**-0.5
    k = l2(k.reshape(B, T, Hk, Dk), L2_EPS)
    out, new_state, states = rule(q, k, v.reshape(B, T, Hv, Dv), g, beta, state, snapshots=snapshots)
    activation = {"silu": silu, "sigmoid": sigmoid}[norm.activation]
    out = rms(out, norm.weight.astype(F32), norm.eps) * activation(gate.reshape(B, T, Hv, Dv).astype(F32))
    out = out.reshape(B, T, Hv * Dv).astype(x.dtype)
    # the new tail and state computed with the output: left for a next call, their lazy graphs
    # would keep this call's inputs alive (a prefill chunk's worth a layer)
    (out,) = mx.depends([out], [new_tail, new_state])
    return LayerResult(out, new_tail, new_state, tails, states)


class QuantizedEntries(NamedTuple):
    """Keys or values [B, H, S, D] of a quantized KV cache as `mx.quantize` gives them (affine groups):
    codes uint32 [B, H, S, D bits / 32], scales and biases [B, H, S, D / group_size]."""

    codes: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    @property
    def arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.codes, self.scales, self.biases

    def leading(self, features: int) -> QuantizedEntries:
        """The first `features` of each entry (a multiple of the group size): views of the same arrays."""
        words, groups = features * self.bits // 32, features // self.group_size
        return self._replace(
            codes=self.codes[..., :words], scales=self.scales[..., :groups], biases=self.biases[..., :groups]
        )


def quantized_attention(q, keys: QuantizedEntries, values: QuantizedEntries, scale: float, mask=None) -> mx.array:
    """mx.fast.scaled_dot_product_attention's contract (mask None, "causal" or booleans [B, 1, T, S])
    over a quantized cache's keys and values, through MLX's quantized products (q grouped by KV head)
    and a float32 softmax."""
    B, H, T, D = q.shape
    Hkv = keys.codes.shape[1]
    q = (q * scale).reshape(B, Hkv, H // Hkv, T, D)
    quantized = dict(group_size=keys.group_size, bits=keys.bits)
    scores = mx.quantized_matmul(q, *(a[:, :, None] for a in keys.arrays), transpose=True, **quantized)
    if isinstance(mask, mx.array):
        scores = mx.where(mask[:, :, None], scores, mx.finfo(scores.dtype).min)
    elif mask == "causal" and T > 1:
        S = scores.shape[-1]
        seen = mx.arange(S)[None] <= mx.arange(T)[:, None] + (S - T)
        scores = mx.where(seen, scores, mx.finfo(scores.dtype).min)
    p = mx.softmax(scores.astype(F32), axis=-1).astype(q.dtype)
    out = mx.quantized_matmul(p, *(a[:, :, None] for a in values.arrays), transpose=False, **quantized)
    return out.reshape(B, H, T, -1)
