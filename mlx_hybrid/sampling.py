"""Turning logits into tokens: greedy, or temperature with top-k / top-p / min-p."""

from __future__ import annotations

import os

import mlx.core as mx

from .errors import GenerationError


SEED_LIMIT = 2**64  # MLX's random keys take unsigned 64-bit seeds


class Sampler:
    """Samples from the filtered, tempered distribution; `temp == 0` is greedy."""

    def __init__(self, temp=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None):
        if temp < 0:
            raise GenerationError(f"temp must be >= 0, got {temp}")
        if not 0.0 < top_p <= 1.0:
            raise GenerationError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise GenerationError(f"top_k must be >= 0, got {top_k}")
        if not 0.0 <= min_p <= 1.0:
            raise GenerationError(f"min_p must be in [0, 1], got {min_p}")
        if seed is not None and not (isinstance(seed, int) and 0 <= seed < SEED_LIMIT):
            raise GenerationError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        self.temp, self.top_p, self.top_k, self.min_p = temp, top_p, top_k, min_p
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(seed)

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def next_key(self):
        self._key, key = mx.random.split(self._key)
        return key

    def log_probs(self, logits: mx.array) -> mx.array:
        """Log-probabilities [..., V] of the distribution `sample` draws from."""
        logits = logits.astype(mx.float32) / self.temp
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        keep = mx.ones(logprobs.shape, dtype=mx.bool_)
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = mx.sort(logprobs, axis=-1)[..., -self.top_k][..., None]
            keep = keep & (logprobs >= kth)
        if self.top_p < 1.0:
            order = mx.argsort(-logprobs, axis=-1)
            sorted_probs = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))
            # keep a token if the mass before it is below top_p (the first always stays)
            before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
            keep_sorted = before < self.top_p
            inverse = mx.argsort(order, axis=-1)
            keep = keep & mx.take_along_axis(keep_sorted, inverse, axis=-1)
        if self.min_p > 0.0:
            top = logprobs.max(axis=-1, keepdims=True)
            keep = keep & (logprobs >= top + mx.log(mx.array(self.min_p)))
        filtered = mx.where(keep, logprobs, -mx.inf)
        return filtered - mx.logsumexp(filtered, axis=-1, keepdims=True)

    def __call__(self, logits: mx.array) -> mx.array:
        """Tokens [...] for logits [..., V]."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return self.draw(self.log_probs(logits))

    def draw(self, logprobs: mx.array) -> mx.array:
        """Tokens [...] drawn from log-probabilities [..., V] with the next key; a single row
        draws the same token whether it comes as [V] or [1, V] (MLX's draw depends on the shape)."""
        rows = logprobs.reshape(-1, logprobs.shape[-1])
        return mx.random.categorical(rows, key=self.next_key()).reshape(logprobs.shape[:-1])
