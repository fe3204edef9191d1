"""Drafting with a smaller model of the same vocabulary."""

from __future__ import annotations

import mlx.core as mx

from ..cache import marks, rewind
from ..errors import GenerationError
from ..prompt import prefill
from ..row_caches import packed
from .base import DraftHead, _ConfidentDrafting, _last_of_each


class DraftModelDrafter(_ConfidentDrafting):
    """Drafts with a separate (smaller) model that shares the tokenizer."""

    def __init__(
        self, draft_model, target_model, draft_p_min: float = 0.0, vocabulary=None, head: DraftHead | None = None
    ):
        if draft_model.args.vocab_size != target_model.args.vocab_size:
            raise GenerationError(
                f"the draft model's vocabulary ({draft_model.args.vocab_size}) differs from the target's "
                f"({target_model.args.vocab_size})"
            )
        super().__init__(draft_p_min, head or DraftHead(draft_model, vocabulary))
        self.model = draft_model
        self.target_model = target_model
        self.cache = draft_model.make_cache()
        self.pending: list[int] = []  # accepted tokens the draft model has not read yet
        self._marks = []  # where its caches were after reading 0, 1, ... drafts

    def fork(self) -> DraftModelDrafter:
        return DraftModelDrafter(self.model, self.target_model, self.draft_p_min, head=self.head)

    def prefill(self, tokens: list[int], hidden):
        prefill(self.model, tokens, self.cache)  # the draft model reads the prompt as part of the prefill

    def begin(self, first_token: int):
        self.pending = [first_token]

    @staticmethod
    def _read(drafters, tokens: list[int], lengths: list[int]):
        """Run the draft model over each row's tokens; each row's last normed hidden state [1, R, E]."""
        model = drafters[0].model
        hidden = model.hidden_states(mx.array(tokens)[None], packed([d.cache for d in drafters], lengths))
        # drafts run one token per call, so where the caches are after each call are the
        # rollback points (a mark holds references or an offset: it copies nothing)
        for drafter in drafters:
            drafter._marks.append(marks(drafter.cache))
        return model.norm(_last_of_each(hidden, lengths))

    @staticmethod
    def _open(drafters):
        for drafter in drafters:
            drafter._marks = []
        return DraftModelDrafter._read(
            drafters, [t for d in drafters for t in d.pending], [len(d.pending) for d in drafters]
        )

    @staticmethod
    def _feed(drafters, tokens):
        return DraftModelDrafter._read(drafters, tokens.tolist(), [1] * len(drafters))

    def update(self, verify_hidden, accepted: list[int]):
        if not self.drafted:  # a round without drafts: the tokens wait for the next draft
            self.pending += accepted
            return
        self.drafted = False
        kept = min(len(accepted) - 1, self.fed_drafts)  # accepted drafts already in the cache
        rewind(self.cache, self._marks[kept])
        self.pending = accepted[kept:]
