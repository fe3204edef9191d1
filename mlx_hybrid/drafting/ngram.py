"""Drafting by n-gram lookup in the sequence so far: no model."""

from __future__ import annotations

import mlx.core as mx

from ..errors import GenerationError
from .base import Drafter


class NgramDrafter(Drafter):
    """Prompt lookup: proposes the tokens that followed the latest earlier occurrence of
    the last n tokens (n from `max_n` down to `min_n`) in the prompt and the output.

    Free to run and model-independent (Kimi Linear has no MTP head); long accepted runs
    where the output repeats its context, as in code editing and retrieval.
    """

    declines_cost = False  # a failed lookup is free: keep looking every round

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise GenerationError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.sizes = range(max_n, min_n - 1, -1)
        self.history: list[int] = []
        # (n-gram) -> index of the token that followed its latest occurrence
        self.following: dict[tuple[int, ...], int] = {}

    def _extend(self, tokens: list[int]):
        for token in tokens:
            self.history.append(token)
            end = len(self.history) - 1  # the n-grams ending just before `token` are followed by it
            for n in self.sizes:
                if end >= n:
                    self.following[tuple(self.history[end - n : end])] = end

    def fork(self) -> NgramDrafter:
        return NgramDrafter(self.max_n, self.min_n)

    def prefill(self, tokens: list[int], hidden):
        self._extend(tokens)

    def begin(self, first_token: int):
        self._extend([first_token])

    def draft(self, k: int, sampler):
        for n in self.sizes:
            if len(self.history) < n:
                continue
            start = self.following.get(tuple(self.history[-n:]))
            if start is not None:
                proposal = self.history[start : start + k]
                return [mx.array(t) for t in proposal], [None] * len(proposal)
        return [], []

    def update(self, verify_hidden, accepted: list[int]):
        self._extend(accepted)
