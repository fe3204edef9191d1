"""Drafting with the model's own multi-token-prediction head."""

from __future__ import annotations

from itertools import accumulate

import mlx.core as mx

from .. import ops
from ..cache import KVCache
from ..errors import GenerationError
from ..prompt import PREFILL_STEP
from ..row_caches import row_caches
from .base import FEWER_DRAFT_TOKENS, DraftHead, _ConfidentDrafting, _join, _last_of_each, _rows_of


class MTPDrafter(_ConfidentDrafting):
    """Drafts by chaining the model's MTP head, which keeps its own KV cache.

    The MTP cache holds one entry per (trunk hidden state h_t, token t+1) pair; the head
    reads h_t as `model.mtp_input` gives it, and a chained draft the previous step's
    carry (see `MTPHead`). Trunk states not yet fed are kept pending, as the trunk gave
    them, with the tokens that follow them, as far as known; the pairs a prompt completes
    go in with the prefill, and those a round completes go in with the next round's first
    draft step, at no extra call. Where the engine says so (`open_from_pass`), a greedy round's
    pairs go in while its verify pass computes instead, and that step is ready when the next
    round drafts.
    """

    opens_from_pass = True

    def __init__(self, model, draft_p_min: float = 0.0, vocabulary=None, head: DraftHead | None = None):
        if not model.has_mtp:
            raise GenerationError("this model has no MTP head, so draft='mtp' is unavailable")
        super().__init__(draft_p_min, head or DraftHead(model, vocabulary))
        self.model = model
        if ops.verified_tokens_cost_arithmetic(model.widest_product):
            self.default_draft_tokens = FEWER_DRAFT_TOKENS
        self.cache = KVCache()
        self.pending_hidden = None  # [1, n, E], the trunk's states
        self.pending_next: list[int] = []  # the tokens after the pending hidden states (n, or n - 1)
        self._carry = None  # this round's last MTP carry (the group's [1, R, E], its row): the next step's h
        # (y, carry, first, count): the head over this pass's pairs (open_from_pass), this row's from `first`
        self._opened = None
        # (y, carry, row, h): the next round's first step, taken with the pass: its outputs at the last
        # accepted position (the group's row) and the trunk's state there, whose pair the cache holds
        self._ready = None

    def fork(self) -> MTPDrafter:
        return MTPDrafter(self.model, self.draft_p_min, head=self.head)

    def use_positions(self, positions):
        self.cache.positions = positions.shifted(1)  # the pair (h_t, token t + 1) sits where token t + 1 does

    def _step(self, head_input, tokens, cache):
        """The head over pairs (head_input[t], tokens[t]): (y, carry), see `MTPHead`."""
        return self.model.mtp(head_input, self.model.embed(tokens), cache)

    def _step_from_trunk(self, trunk_hidden, tokens, cache):
        return self._step(self.model.mtp_input(trunk_hidden), tokens, cache)

    def prefill(self, tokens: list[int], hidden: mx.array):
        """Feed the pairs the trunk's new hidden states complete; the last state waits for its token."""
        held = 0 if self.pending_hidden is None else self.pending_hidden.shape[1]
        known = self.pending_next + list(tokens)
        hidden = hidden if held == 0 else mx.concatenate([self.pending_hidden, hidden], axis=1)
        complete = hidden.shape[1] - 1
        known = known[len(known) - complete :]
        for start in range(0, complete, PREFILL_STEP):
            end = min(start + PREFILL_STEP, complete)
            mx.eval(self._step_from_trunk(hidden[:, start:end], mx.array(known[start:end])[None], self.cache))
        self.pending_hidden, self.pending_next = hidden[:, complete:], []

    def begin(self, first_token: int):
        self.pending_next.append(first_token)

    @staticmethod
    def open_from_pass(drafters, states, tokens):
        """The head over each pass position's pair (the trunk's state, the token the pass chose after
        it). A pair is right up to the last accepted position: the token chosen after an accepted draft
        is that draft, and after the last accepted position it is the round's own token. The chained
        drafts' pairs leave the cache first; `update` keeps the accepted positions' pairs and the step at
        the last of them, which the next round's `_open` takes as it is."""
        for drafter in drafters:
            drafter.cache.trim(drafter.fed_drafts)
            drafter.fed_drafts = 0
        lengths = [t.size for t in tokens]
        caches = row_caches([d.cache for d in drafters], lengths)
        y, carry = drafters[0]._step_from_trunk(_join(states), mx.concatenate(tokens)[None], caches)
        for drafter, first, count in zip(drafters, accumulate(lengths, initial=0), lengths):
            drafter._opened = (y, carry, first, count)

    @staticmethod
    def _open(drafters):
        """The round's first step: the head over each row's pending pairs (y at the last), or as the pass
        took it (`_ready`)."""
        opening = [d for d in drafters if d._ready is None]
        if opening:
            lengths = [len(d.pending_next) for d in opening]
            tokens = mx.array([t for d in opening for t in d.pending_next])[None]
            caches = row_caches([d.cache for d in opening], lengths)
            y, carry = opening[0]._step_from_trunk(_join([d.pending_hidden for d in opening]), tokens, caches)
            last_y = _last_of_each(y, lengths)
            last_carry = last_y if carry is y else _last_of_each(carry, lengths)
            for i, drafter in enumerate(opening):
                drafter._ready = (last_y, last_carry, i, None)
        y = _rows_of([(d._ready[0], d._ready[2]) for d in drafters])
        carry = _rows_of([(d._ready[1], d._ready[2]) for d in drafters])
        for drafter in drafters:
            drafter._ready = None
        return MTPDrafter._keep_carry(drafters, y, carry)

    @staticmethod
    def _feed(drafters, tokens):
        caches = row_caches([d.cache for d in drafters], [1] * len(drafters))
        y, carry = drafters[0]._step(_rows_of([d._carry for d in drafters]), tokens[None], caches)
        return MTPDrafter._keep_carry(drafters, y, carry)

    @staticmethod
    def _keep_carry(drafters, y, carry):
        """Each row's carry is its next step's h (row i of the group's carry [1, R, E]); the draft head
        reads y [1, R, E]."""
        for i, drafter in enumerate(drafters):
            drafter._carry = (carry, i)
        return y

    def checkpoint(self):
        entries, pending = self.cache.checkpoint(), self.pending_hidden
        if self._ready is not None:  # its last pair's token is the one not yet read: saved as it was before
            entries, pending = tuple(mx.contiguous(entry[..., :-1, :]) for entry in entries), self._ready[3]
        return {f"cache.{i}": entry for i, entry in enumerate(entries)} | {"pending_hidden": pending}

    def restore(self, state, tokens):
        self.cache.restore(tuple(state[f"cache.{i}"] for i in range(len(state) - 1)))
        self.pending_hidden, self._ready = state["pending_hidden"], None
        held = self.pending_hidden.shape[1]
        self.pending_next = list(tokens[len(tokens) - held + 1 :]) if held > 1 else []

    def update(self, verify_hidden: mx.array, accepted: list[int]):
        """accepted: the a accepted drafts and the trunk's token after them."""
        new_hidden = verify_hidden[:, : len(accepted)]
        if self._opened is not None:  # the pass's pairs went in (open_from_pass): the accepted ones stay
            y, carry, first, count = self._opened
            self.cache.trim(count - len(accepted))
            self._ready = (y, carry, first + len(accepted) - 1, new_hidden[:, -1:])
            self.pending_hidden, self.pending_next = new_hidden[:, :0], []
        elif self.drafted:
            self.cache.trim(self.fed_drafts)
            self.pending_hidden, self.pending_next = new_hidden, list(accepted)
        else:  # a round without drafts: the pairs wait for the next draft (a step taken with a pass is stale)
            self.pending_hidden = mx.concatenate([self.pending_hidden, new_hidden], axis=1)
            self.pending_next += accepted
            self._ready = None
        self.fed_drafts, self.drafted, self._carry, self._opened = 0, False, None, None
