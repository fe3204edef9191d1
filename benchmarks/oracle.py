"""A drafter for measurements: it replays a known continuation at a set acceptance rate.

Used by the benchmarks and by the tests of the verify/rollback machinery (which import
it as `benchmarks.oracle`); no generation path uses it.
"""

from __future__ import annotations

import random

import mlx.core as mx

from mlx_hybrid.drafting import Drafter
from mlx_hybrid.drafting.base import GroupRow


class OracleDrafter(Drafter):
    """Replays a known continuation so that a set share of drafts is accepted (greedy).

    For measuring and testing the verify/rollback machinery: each round proposes
    a correct tokens and then a wrong one, a drawn so that a / k averages
    `acceptance`. `inner`, if given (an MTPDrafter, say), drafts alongside: its tokens
    are computed (so their cost counts) and its number of drafts is kept, but the
    tokens themselves are replaced.
    """

    def __init__(self, continuation: list[int], acceptance: float, vocab_size: int, inner=None, seed: int = 0):
        self.continuation = list(continuation)
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.inner = inner
        self.declines_cost = inner is not None and inner.declines_cost
        self.reads_layers = inner.reads_layers if inner is not None else ()  # the trunk states it reads
        self.rng = random.Random(seed)
        self.position = 0  # index in `continuation` of the next token to draft

    def prefill(self, tokens: list[int], hidden):
        if self.inner is not None:
            self.inner.prefill(tokens, hidden)

    def begin(self, first_token: int):
        self.position = 1
        if self.inner is not None:
            self.inner.begin(first_token)

    def draft(self, k: int, sampler):
        return self.draft_rows([self], [k], [sampler], [None])[0]

    @classmethod
    def draft_rows(cls, drafters, ks, samplers, masks, verdicts_first=False):
        """The inner drafters draft together (as they would without the oracle), then each row's
        tokens are replaced."""
        inner = [d.inner for d in drafters]
        if inner[0] is not None:
            inner_drafts = type(inner[0]).draft_rows(inner, ks, samplers, masks, verdicts_first)
            mx.eval([tokens for tokens, _ in inner_drafts])  # MLX is lazy: replaced tokens must still run
            ks = [len(tokens) for tokens, _ in inner_drafts]
        drafts = [drafter._replay(k) for drafter, k in zip(drafters, ks)]
        for drafter, (tokens, _) in zip(drafters, drafts):  # the inner drafts' p-min verdicts, on these
            columns = drafter.inner.drafted_columns if drafter.inner is not None else None
            drafter.drafted_columns = (
                None
                if columns is None or not tokens
                else GroupRow(
                    [
                        mx.where(column[columns.row : columns.row + 1] < 0, -1 - token.reshape(1), token.reshape(1))
                        for column, token in zip(columns.columns, tokens)
                    ],
                    0,
                )
            )
        return drafts

    def _replay(self, k: int):
        share = round(self.acceptance * k, 9)  # a rate of a/k means exactly a
        correct = int(share) + (self.rng.random() < share - int(share))
        tokens = []
        for j in range(k):
            index = min(self.position + j, len(self.continuation) - 1)
            true = self.continuation[index]
            tokens.append(mx.array(true if j < correct else (true + 1) % self.vocab_size))
        return tokens, [None] * k

    def update(self, verify_hidden, accepted: list[int]):
        self.position += len(accepted)
        if self.inner is not None:
            self.inner.update(verify_hidden, accepted)
