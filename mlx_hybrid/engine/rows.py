"""The engine's side of one sequence: a `Row` owns its caches, sampler and next token, and where it
speculates its drafter and drafting policy; it advances by the tokens a pass gave it."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..cache import rewind, rollback
from ..speculative import DraftingPolicy, keep_snapshot_buffers
from .prompt_images import PromptImages
from .sequence import Sequence


@dataclass
class Ahead:
    """A row's share of a pass built and queued before the tokens it reads were known."""

    marks: list  # the row's caches before the pass
    key: mx.array  # the sampler's random key before the pass
    token: mx.array | None = None  # [1] the token it chooses, lazy
    logits: mx.array | None = None  # [1, V] where it is chosen
    hidden: mx.array | None = None  # [1, 1, E] the trunk's state at the token it read


class Row:
    """One sequence in the engine.

    cache: the model's per-layer caches; sampler: its `sampling.Sampler`; drafter and policy:
    a `drafting` drafter and its `DraftingPolicy`, or both None for a row that does not speculate;
    processor: the request's `processors.LogitsProcessor`, or None; images: its `PromptImages`.
    """

    def __init__(
        self,
        sequence: Sequence,
        cache,
        sampler,
        stop_tokens,
        checkpoint_at,
        drafter=None,
        policy: DraftingPolicy | None = None,
        processor=None,
        images: PromptImages | None = None,
    ):
        self.sequence = sequence
        self.cache = cache
        self.sampler = sampler
        self.drafter = drafter
        self.policy = policy
        self.processor = processor
        self.images = images
        self.stop_tokens = stop_tokens
        self.checkpoint_at = sorted(p for p in set(checkpoint_at) if 0 < p <= len(sequence.prompt))
        self.token: int | None = None  # chosen, not yet read by the model (None while prefilling)
        self.fed: list[int] = []  # tokens the caches have read
        self.last_hidden = None  # the trunk's hidden state at the last fed token [1, 1, E]
        self.drafts: list[int] = []  # with a processor: the drafts this pass verifies
        self.ahead: Ahead | None = None  # a queued pass that reads `token` (see `step.plain_round_ahead`)
        self.prompt_checkpoint: tuple[int, ...] | None = None  # the key of the last checkpoint in its prompt
        self.number: int | None = None  # the request's number, where an engine numbers them (replicated)

    @property
    def prefilling(self) -> bool:
        return self.token is None

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return self.sequence.max_tokens - len(self.sequence.tokens)

    def checkpoint_key(self, tokens: list[int]) -> list[int] | None:
        """What finds a checkpoint of this row after `tokens` (None: the tokens themselves)."""
        return self.images.key_of(tokens) if self.images is not None else None

    def plan(self) -> int:
        """How many drafts to ask for this round (0: a plain step)."""
        return self.policy.plan(self.remaining) if self.policy is not None else 0

    def steps_plain(self) -> bool:
        """Whether the row's next round is a plain step whose drafter, if any, reads only the trunk's last
        states: no drafter, or one whose policy has backed off (such steps may be queued a step ahead,
        `step.plain_round_ahead`)."""
        return self.drafter is None or (not self.drafter.reads_layers and self.policy.backed_off)

    def begin(self, first_token: int):
        """The prompt is read (and the drafter has read its parts): the first token."""
        self.token = first_token
        if self.drafter is not None:
            self.drafter.begin(first_token)
            keep_snapshot_buffers(self.cache, self.policy.k)

    def advance(
        self,
        hidden: mx.array,
        accepted: list[int],
        drafted: int,
        asked: int,
        verified: int | None = None,
        drafter_states=None,
    ):
        """Move on after a pass.

        The pass read the row's token and `verified` drafts (default: `drafted`), of which the first
        `drafted` were this round's sure drafts out of `asked`, and gave `hidden` [1, verified + 1, E].
        The caches roll back to the accepted tokens; the drafter reads what it reads of the pass
        (`drafter_states`, default `hidden`), the policy records the round, and the last accepted token
        becomes the row's next one."""
        verified = drafted if verified is None else verified
        if verified:
            rollback(self.cache, keep=len(accepted), recorded=verified + 1)
        if self.drafter is not None:
            self.drafter.update(hidden if drafter_states is None else drafter_states, accepted)
            self.policy.record(drafted, len(accepted) - 1, asked, self.drafter.declines_cost)
        self.fed += [self.token] + accepted[:-1]
        self.last_hidden = hidden[:, len(accepted) - 1 : len(accepted)]
        self.token = accepted[-1]

    def take_back(self):
        """Undo the queued pass (`ahead`): the caches and random stream as before it."""
        if self.ahead is not None:
            rewind(self.cache, self.ahead.marks)
            self.sampler.key = self.ahead.key
            self.ahead = None

    def handed_out(self, accepted: list[int]) -> tuple[list[int], str | None]:
        """A round's tokens as they are handed out (the accepted drafts, then the model's own token), up
        to the one that ends the row, and why it ends: "stop", "length", "error" (the grammar refused a
        token it had allowed), or None if it goes on."""
        out = []
        for token in accepted:
            out.append(token)
            if self.processor is not None and not self.processor.accept([token]):
                return out, "error"
            if token in self.stop_tokens:
                return out, "stop"
            if len(self.sequence.tokens) + len(out) >= self.sequence.max_tokens:
                return out, "length"
            if self.processor is not None and self.processor.finished:
                return out, "stop"  # the grammar is complete and allows nothing more, as plain decoding ends
        return out, None

    def until_end(self, accepted: list[int]) -> list[int]:
        """The accepted tokens up to the first one that ends the row (a stop token, or max_tokens).

        The caches then hold, as after plain decoding, everything before that last token and nothing
        past it, so the row's checkpoint is a prefix of the conversation's next turn, whatever end token
        the chat template writes there instead."""
        for i, token in enumerate(accepted):
            if token in self.stop_tokens or i + 1 >= self.remaining:
                return accepted[: i + 1]
        return accepted
