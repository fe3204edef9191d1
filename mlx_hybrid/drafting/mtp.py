"""Drafting with the model's own multi-token-prediction head."""

from __future__ import annotations

import mlx.core as mx

from ..cache import KVCache
from ..errors import GenerationError
from ..prompt import PREFILL_STEP
from ..row_caches import row_caches
from .base import DraftHead, _ConfidentDrafting, _join, _last_of_each


class MTPDrafter(_ConfidentDrafting):
    """Drafts by chaining the model's MTP head, which keeps its own KV cache.

    The MTP cache holds one entry per (trunk hidden state h_t, token t+1) pair; the head
    reads h_t as `model.mtp_input` gives it, and a chained draft the previous step's
    carry (see `MTPHead`). Trunk states not yet fed are kept pending, as the trunk gave
    them, with the tokens that follow them, as far as known; the pairs a prompt completes
    go in with the prefill, and those a round completes go in with the next round's first
    draft step, at no extra call.
    """

    def __init__(self, model, draft_p_min: float = 0.0, vocabulary=None, head: DraftHead | None = None):
        if not model.has_mtp:
            raise GenerationError("this model has no MTP head, so draft='mtp' is unavailable")
        super().__init__(draft_p_min, head or DraftHead(model, vocabulary))
        self.model = model
        self.cache = KVCache()
        self.pending_hidden = None  # [1, n, E], the trunk's states
        self.pending_next: list[int] = []  # the tokens after the pending hidden states (n, or n - 1)
        self._carry = None  # this round's last MTP carry (the group's [1, R, E], its row): the next step's h

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
    def _open(drafters):
        lengths = [len(d.pending_next) for d in drafters]
        tokens = mx.array([t for d in drafters for t in d.pending_next])[None]
        caches = row_caches([d.cache for d in drafters], lengths)
        y, carry = drafters[0]._step_from_trunk(_join([d.pending_hidden for d in drafters]), tokens, caches)
        last_y = _last_of_each(y, lengths)
        return MTPDrafter._keep_carry(drafters, last_y, last_y if carry is y else _last_of_each(carry, lengths))

    @staticmethod
    def _feed(drafters, tokens):
        caches = row_caches([d.cache for d in drafters], [1] * len(drafters))
        whole = drafters[0]._carry[0]  # the rows that drafted last together, all going on: read as it is
        in_place = all(d._carry[0] is whole and d._carry[1] == i for i, d in enumerate(drafters))
        if in_place and whole.shape[1] == len(drafters):
            h = whole
        else:
            h = _join([carry[:, i : i + 1] for carry, i in (d._carry for d in drafters)])
        y, carry = drafters[0]._step(h, tokens[None], caches)
        return MTPDrafter._keep_carry(drafters, y, carry)

    @staticmethod
    def _keep_carry(drafters, y, carry):
        """Each row's carry is its next step's h (row i of the group's carry [1, R, E]); the draft head
        reads y [1, R, E]."""
        for i, drafter in enumerate(drafters):
            drafter._carry = (carry, i)
        return y

    def checkpoint(self):
        state = {f"cache.{i}": entry for i, entry in enumerate(self.cache.checkpoint())}
        return state | {"pending_hidden": self.pending_hidden}

    def restore(self, state, tokens):
        self.cache.restore(tuple(state[f"cache.{i}"] for i in range(len(state) - 1)))
        self.pending_hidden = state["pending_hidden"]
        held = self.pending_hidden.shape[1]
        self.pending_next = list(tokens[len(tokens) - held + 1 :]) if held > 1 else []

    def update(self, verify_hidden: mx.array, accepted: list[int]):
        """accepted: the a accepted drafts and the trunk's token after them."""
        new_hidden = verify_hidden[:, : len(accepted)]
        if self.drafted:
            self.cache.trim(self.fed_drafts)
            self.pending_hidden, self.pending_next = new_hidden, list(accepted)
        else:  # a round without drafts: the pairs wait for the next draft
            self.pending_hidden = mx.concatenate([self.pending_hidden, new_hidden], axis=1)
            self.pending_next += accepted
        self.fed_drafts, self.drafted, self._carry = 0, False, None
