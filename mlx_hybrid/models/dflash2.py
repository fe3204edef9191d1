"""What DFlash2 (`DFlash2DraftModel`, z-lab) adds to a DFlash drafter: in every layer, a grouped dynamic
causal convolution over the block's positions before and after attention and before and after the MLP
(`GroupedDynamicConv`), and a `CandidateSelector`: of each position's top `selector_top_k` tokens by the
block's logits, the drafts are a path chosen position by position by the logit plus a bilinear score of
the previous token's and the candidate's codebook rows with the position's projected state."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from .layers import Linear


class GroupedDynamicConv(nn.Module):
    """DFlash2's causal convolution over the block's positions, around attention or the MLP: `prepare`
    convolves the block's input and computes the kernel `finish` convolves the output with. Each tap
    o's weight at position t: a static one per channel (`base_kernel`) plus a dynamic one per group of
    channels, projected from the input at t (`kernel_projection`); positions before the block are
    zeros."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        B, T, E = x.shape
        dynamic = self.kernel_projection(x).reshape(B, T, 2, self.kernel_size, E // self.group_size)
        return self._convolve(x, dynamic[:, :, 0], self.base_kernel[0]), dynamic[:, :, 1]

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return self._convolve(x, dynamic, self.base_kernel[1])

    def _convolve(self, x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
        """x [B, T, E], dynamic [B, T, K, G], base [K, E]: sum over taps o of (base[o] + dynamic[t, o]) x[t - o].
        The taps' inputs are one gather, not a slice a tap and a stack: the same values, and a
        convolution's `prepare` and `finish` 41 operations, not 53 (a DFlash2 layer has two)."""
        B, T, E = x.shape
        K, g = min(self.kernel_size, T), self.group_size
        padded = mx.pad(x.reshape(B, T, E // g, g), [(0, 0), (K - 1, 0), (0, 0), (0, 0)])
        shifted = mx.take(padded, _taps(T, K), axis=1)  # [B, T, K, G, g]
        weights = base[:K].reshape(1, 1, K, E // g, g) + dynamic[:, :, :K, :, None]
        return (weights * shifted).sum(axis=2).reshape(B, T, E)


@lru_cache(maxsize=64)
def _taps(length: int, taps: int) -> mx.array:
    """[length, taps] int32: where x[t - o] sits in x padded by taps - 1 zeros in front."""
    return mx.array([[taps - 1 - o + t for o in range(taps)] for t in range(length)], dtype=mx.int32)


class CandidateSelector(nn.Module):
    """DFlash2's choice of drafts among each position's top candidates (see the module's docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = mx.zeros((vocab_size, rank))
        self.successor_codebook = mx.zeros((vocab_size, rank))

    def candidates(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """logits [B, T, V] -> the top_k (all V where fewer) per position: their logits and indices [B, T, k]."""
        k = min(self.top_k, logits.shape[-1])
        index = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
        return mx.take_along_axis(logits, index, axis=-1), index

    def scores(self, unary: mx.array, candidates: mx.array, previous: mx.array, projected: mx.array) -> mx.array:
        """One position's: unary [B, k] (the candidates' logits), candidates [B, k] and previous [B] (token ids),
        projected [B, r] (`hidden_projection` of the position's state) -> [B, k]."""
        left = self.predecessor_codebook[previous] * projected
        return unary + (self.successor_codebook[candidates] @ left[..., None])[..., 0]

    def greedy_path(self, unary: mx.array, candidates: mx.array, first: mx.array, projected: mx.array):
        """The best-scored path through every position's candidates ([B, T, k] each, projected [B, T, r]) from
        the tokens `first` [B]: (the path [B, T], each step's best score and its scores' log-sum-exp [B, T]).
        A step's predecessor is one of the step before's candidates, so every step's scores for every
        predecessor come at once ([B, T - 1, k, k]); only the walk through them is sequential, an index a
        step."""
        first_scores = self.scores(unary[:, 0], candidates[:, 0], first, projected[:, 0])  # [B, k]
        if unary.shape[1] == 1:
            path = mx.take_along_axis(candidates[:, 0], mx.argmax(first_scores, axis=-1)[:, None], axis=-1)
            return path, first_scores.max(axis=-1)[:, None], mx.logsumexp(first_scores, axis=-1)[:, None]
        # scores[b, j, p, c]: position j + 1's candidate c after position j's candidate p
        scores = self.scores(unary[:, 1:, None], candidates[:, 1:, None], candidates[:, :-1], projected[:, 1:, None])
        best = mx.argmax(scores, axis=-1)  # [B, T - 1, k]
        choices = [mx.argmax(first_scores, axis=-1)]
        for j in range(scores.shape[1]):
            choices.append(mx.take_along_axis(best[:, j], choices[-1][:, None], axis=-1)[:, 0])
        choice = mx.stack(choices, axis=1)  # [B, T]
        at = choice[:, :-1, None, None]
        chosen = mx.concatenate([first_scores[:, None], mx.take_along_axis(scores, at, axis=2)[:, :, 0]], axis=1)
        path = mx.take_along_axis(candidates, choice[..., None], axis=-1)[..., 0]
        return path, chosen.max(axis=-1), mx.logsumexp(chosen, axis=-1)
