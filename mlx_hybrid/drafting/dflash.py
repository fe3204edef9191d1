"""Drafting a block at a time with a DFlash drafter (`models.dflash`), over the target's states."""

from __future__ import annotations

import mlx.core as mx

from ..errors import GenerationError
from ..parallel import PIPELINE
from .base import DraftHead, Drafter, GroupRow, _marked_by, check_draft_p_min


class DFlashDrafter(Drafter):
    """Proposes a block of drafts in one pass of a DFlash drafter.

    It reads the target's states at the drafter's layer ids (`reads_layers`: the engine hands them in
    place of the trunk's last hidden states, from the passes it runs anyway: prompt chunks and verify
    passes), for the accepted positions only, as they come; a round's block is the last accepted
    token and mask tokens, and its drafts are the block's later positions through the target's head
    (over a reduced vocabulary where given, as the MTP head's): argmax where greedy, drawn from their
    distributions (kept for the acceptance rule) where not.
    """

    declines_cost = False

    def __init__(self, target, drafter, draft_p_min: float = 0.0, vocabulary=None, head: DraftHead | None = None):
        check_fits(target, drafter)
        self.target, self.model, self.draft_p_min = target, drafter, check_draft_p_min(draft_p_min)
        self.head = head or DraftHead(target, vocabulary)  # the target's head, over all or some tokens
        self.reads_layers = tuple(drafter.args.target_layer_ids)
        self.cache = drafter.make_cache()
        self.pending = None  # [1, n, L E]: the target's states at positions the drafter has not read
        self.token: int | None = None  # the last accepted token: the next block's first

    def fork(self) -> DFlashDrafter:
        return DFlashDrafter(self.target, self.model, self.draft_p_min, head=self.head)

    def batch_key(self):
        return type(self), id(self.model)

    def prefill(self, tokens: list[int], states):
        self._read(states)

    def begin(self, first_token: int):
        self.token = first_token

    def _read(self, states):
        self.pending = states if self.pending is None else mx.concatenate([self.pending, states], axis=1)

    def draft(self, k: int, sampler):
        """Up to block_size - 1 drafts: the block's first k, each marked with its p-min verdict (the
        verify pass cuts them at the first unsure one; see `drafting.base.GroupRow`)."""
        args = self.model.args
        block = mx.array([[self.token] + [args.mask_token_id] * (args.block_size - 1)])
        hidden = self.model.block_hidden(self.target.embed(block), self.pending, self.cache)
        self.pending = None
        logits = self.model.block_logits(hidden, self.head.project)[0, :k]
        if sampler.greedy:
            (drafts, marked), logprobs = self.head.greedy(logits, self.draft_p_min), [None] * k
        else:
            distribution = sampler.log_probs(logits)
            drafts = self.head.tokens(sampler.draw(distribution))  # the block's positions drawn with one key
            logprobs, marked = [self.head._whole_vocabulary(distribution[j]) for j in range(k)], drafts
            if self.draft_p_min > 0:
                marked = _marked_by(mx.exp(distribution.max(axis=-1)), self.draft_p_min, drafts)
        self.drafted_columns = GroupRow([marked[j : j + 1] for j in range(k)], 0)
        return [drafts[j : j + 1] for j in range(k)], logprobs

    def update(self, states: mx.array, accepted: list[int]):
        """states [1, n, L E]: the target's at the pass's positions; the first len(accepted) are read
        (the round's token and the drafts accepted), the last accepted token starts the next block."""
        self._read(states[:, : len(accepted)])
        self.token = accepted[-1]

    def checkpoint(self) -> dict[str, mx.array]:
        entries = {f"cache.{i}.{j}": a for i, c in enumerate(self.cache) for j, a in enumerate(c.checkpoint())}
        return entries | ({"pending": self.pending} if self.pending is not None else {})

    def restore(self, state: dict[str, mx.array], tokens: list[int]):
        for i, layer_cache in enumerate(self.cache):
            layer_cache.restore(tuple(state[f"cache.{i}.{j}"] for j in range(2) if f"cache.{i}.{j}" in state))
        self.pending = state.get("pending")


def check_fits(target, drafter):
    """Refuse a drafter made for another target, naming what differs."""
    args, trunk = drafter.args, target.args
    if target.parallel is not None and target.parallel.mode == PIPELINE:
        raise GenerationError("a DFlash drafter reads layers a pipeline's other ranks hold: use tensor parallelism")
    if args.hidden_size != trunk.hidden_size:
        raise GenerationError(
            f"the DFlash drafter's hidden size ({args.hidden_size}) differs from the target's ({trunk.hidden_size})"
        )
    layers = len(target.layers)
    if any(not 0 <= i < layers for i in args.target_layer_ids):
        raise GenerationError(
            f"the DFlash drafter reads target layers {args.target_layer_ids}, but the target has {layers} (0 to "
            f"{layers - 1})"
        )
    if not 0 <= args.mask_token_id < trunk.vocab_size:
        raise GenerationError(
            f"the DFlash drafter's mask token {args.mask_token_id} is outside the target's vocabulary "
            f"({trunk.vocab_size})"
        )
