"""Drafting a block at a time with a DFlash drafter (`models.dflash`), over the target's states."""

from __future__ import annotations

import math
from itertools import accumulate

import mlx.core as mx
import numpy as np

from .. import ops
from ..errors import GenerationError
from ..parallel import PIPELINE
from ..row_caches import KVRowsPass
from .base import (
    FEWER_BLOCK_DRAFT_TOKENS,
    DraftDistributions,
    DraftHead,
    Drafter,
    GroupRow,
    StateSpan,
    _join as _joined,
    _marked,
    _marked_by,
    check_draft_p_min,
)


class DFlashDrafter(Drafter):
    """Proposes a block of drafts in one pass of a DFlash drafter.

    It reads the target's states at the drafter's layer ids (`reads_layers`: the engine hands them in
    place of the trunk's last hidden states, from the passes it runs anyway: prompt chunks and verify
    passes), for the accepted positions only, as they come; a round's block is the last accepted
    token and a mask token for each draft the round asks for (the whole block where it asks for
    block_size - 1, see `_draft_together`), and its drafts are the block's later positions through
    the target's head (over a reduced vocabulary where given, as the MTP head's): argmax where
    greedy, drawn from their distributions (kept for the acceptance rule) where not; a DFlash2
    drafter's, its candidate selector's path (`_selected`).
    """

    declines_cost = True  # a block's pass ran (and in lockstep its drafts were verified) before a cut
    drafts_blocks = True

    def __init__(self, target, drafter, draft_p_min: float = 0.0, vocabulary=None, head: DraftHead | None = None):
        check_fits(target, drafter)
        self.target, self.model, self.draft_p_min = target, drafter, check_draft_p_min(draft_p_min)
        self.head = head or DraftHead(target, vocabulary)  # the target's head, over all or some tokens
        self.reads_layers = tuple(drafter.args.target_layer_ids)
        self.cache = drafter.make_cache()
        self.pending: list[StateSpan] = []  # the target's states at positions the drafter has not read
        self.token: int | None = None  # the last accepted token: the next block's first
        # a whole block; more would draft past the block the drafter was trained on
        self.default_draft_tokens = self.max_draft_tokens = drafter.args.block_size - 1
        if ops.verified_tokens_cost_arithmetic(target.widest_product):
            self.default_draft_tokens = min(FEWER_BLOCK_DRAFT_TOKENS, self.default_draft_tokens)

    def fork(self) -> DFlashDrafter:
        return DFlashDrafter(self.target, self.model, self.draft_p_min, head=self.head)

    def batch_key(self):
        return type(self), id(self.model), self.head, self.draft_p_min  # one pass, one head, one floor

    def prefill(self, tokens: list[int], states):
        self._read(states)

    def begin(self, first_token: int):
        self.token = first_token

    def _read(self, states: StateSpan | None):
        if states is not None and states.stop > states.start:
            self.pending.append(states)

    def draft(self, k: int, sampler):
        return self.draft_rows([self], [k], [sampler], [None])[0]

    @classmethod
    def draft_rows(cls, drafters, ks, samplers, masks, verdicts_first=False):
        """Up to block_size - 1 drafts for each row, its block's first ks[r], each marked with its p-min
        verdict (the verify pass cuts a row's drafts at its first unsure one; see `drafting.base.GroupRow`).

        Greedy rows draft their blocks in one pass of the drafter (their caches one batch,
        `row_caches.KVRows`; each row's unread context gathered at once): launches that do not grow with
        the rows. Their blocks are as long as the longest a row asks for, and their drafts may round
        otherwise than alone, which leaves their tokens as they are. A sampling row drafts alone: what
        it draws depends on its drafts, and it draws what it draws alone. Grammars do not mask a block
        (its drafts are proposals; the verify pass applies the grammar)."""
        greedy = [r for r, sampler in enumerate(samplers) if sampler.greedy]
        groups = ([greedy] if greedy else []) + [[r] for r, sampler in enumerate(samplers) if not sampler.greedy]
        drafts = [None] * len(drafters)
        for rows in groups:
            done = cls._draft_together([drafters[r] for r in rows], [ks[r] for r in rows], [samplers[r] for r in rows])
            for row, result in zip(rows, done):
                drafts[row] = result
        return drafts

    @staticmethod
    def block_logits(drafters) -> mx.array:
        """The rows' blocks' draft logits [R, B - 1, V_head] (see `block_hidden`)."""
        return drafters[0].model.block_logits(DFlashDrafter.block_hidden(drafters), drafters[0].head.project)

    @staticmethod
    def block_hidden(drafters, length: int | None = None) -> mx.array:
        """The rows' blocks' states [R, length, E] (default: the drafter's block size), from one pass of
        the drafter over each row's unread context (then read) and its cache."""
        first, args = drafters[0], drafters[0].model.args
        length = args.block_size if length is None else length
        block = mx.array([[d.token] + [args.mask_token_id] * (length - 1) for d in drafters])
        features, counts = _unread_context(drafters)
        if len(drafters) == 1:
            cache, counts = first.cache, None
        else:
            cache = [KVRowsPass([d.cache[i] for d in drafters]) for i in range(len(first.cache))]
        hidden = first.model.block_hidden(first.target.embed(block), features, cache, counts)
        for drafter in drafters:
            drafter.pending = []
        return hidden

    @classmethod
    def _draft_together(cls, drafters, ks, samplers):
        first, n = drafters[0], max(ks)
        # A block of the drafts asked for, not the whole: the drafter's products scale with its
        # positions, and those dropped are masks whose drafts no row uses. The drafts then differ from
        # the whole block's where the layers are not causal (proposals: the verify pass keeps the tokens
        # exact) and held up (the bundled model, held-out prompts: 4.53 -> 4.57 tokens a pass, 1.15-1.17x
        # -> 1.25-1.29x plain decoding; docs/benchmarks.md, "DFlash blocks as long as the round asks").
        hidden = cls.block_hidden(drafters, n + 1)
        # the head projects the positions drafted only: each row's logits are the same bits alone
        logits = first.model.block_logits(hidden, first.head.project)
        if first.model.args.dflash2:
            drafts, marked, logprobs = first._selected(drafters, hidden[:, 1:], logits, samplers[0])
        elif samplers[0].greedy:  # a group is greedy rows or one sampling row
            (drafts, marked), logprobs = first.head.greedy(logits, first.draft_p_min), [[None] * k for k in ks]
        else:
            sampler, k, head = samplers[0], ks[0], first.head
            distribution = sampler.log_probs(logits[0])
            drafts = marked = head.tokens(sampler.draw(distribution))[None]  # the block's positions, one key
            logprobs = [DraftDistributions(head._whole_vocabulary(distribution)[None], 0, k)]
            if first.draft_p_min > 0:
                marked = _marked_by(mx.exp(distribution.max(axis=-1)), first.draft_p_min, drafts)
        columns = [marked[:, j] for j in range(max(ks))]
        for row, drafter in enumerate(drafters):
            drafter.drafted_columns = GroupRow(columns, row)
        return [([drafts[r, j : j + 1] for j in range(k)], logprobs[r][:k]) for r, k in enumerate(ks)]

    def _selected(self, drafters, hidden: mx.array, logits: mx.array, sampler):
        """DFlash2's drafts: the candidate selector's path through each position's top candidates, from each
        row's last token (greedy rows: the best scores; a sampling row: drawn from the scores'
        distribution, which the acceptance rule then reads over the whole vocabulary). (drafts [R, n],
        the drafts marked with their p-min verdicts, per row the distributions or Nones.)"""
        selector, head = self.model.candidate_selector, self.head
        unary, index = selector.candidates(logits.astype(mx.float32))
        candidates, projected = head.tokens(index), selector.hidden_projection(hidden)
        previous = mx.array([d.token for d in drafters], dtype=mx.int32)
        log_floor = math.log(self.draft_p_min) if self.draft_p_min > 0 else None
        if sampler.greedy:
            drafts, top, total = selector.greedy_path(unary, candidates, previous, projected)
            marked = drafts if log_floor is None else _marked(top, total, log_floor, drafts)
            return drafts, marked, [[None] * drafts.shape[1] for _ in drafters]
        path, marks, distributions = [], [], []
        for j in range(logits.shape[1]):
            distribution = sampler.log_probs(selector.scores(unary[:, j], candidates[:, j], previous, projected[:, j]))
            choice = sampler.draw(distribution)
            whole = mx.full((head.vocab_size,), -mx.inf, dtype=mx.float32)
            whole[candidates[0, j]] = distribution[0]
            distributions.append(whole)
            previous = mx.take_along_axis(candidates[:, j], choice[:, None], axis=-1)[:, 0]
            path.append(previous)
            top = distribution.max(axis=-1)
            marks.append(previous if log_floor is None else _marked(top, mx.zeros_like(top), log_floor, previous))
        drafts, marked = mx.stack(path, axis=1), mx.stack(marks, axis=1)
        return drafts, marked, [DraftDistributions(mx.stack(distributions)[None], 0, len(distributions))]

    def update(self, states: StateSpan, accepted: list[int]):
        """states: the target's at the pass's positions; the first len(accepted) are read (the round's
        token and the drafts accepted), the last accepted token starts the next block."""
        self._read(states.head(len(accepted)))
        self.token = accepted[-1]

    def checkpoint(self) -> dict[str, mx.array]:
        entries = {f"cache.{i}.{j}": a for i, c in enumerate(self.cache) for j, a in enumerate(c.checkpoint())}
        if self.pending:
            entries["pending"] = _joined([span.states[:, span.start : span.stop] for span in self.pending])
        return entries

    def restore(self, state: dict[str, mx.array], tokens: list[int]):
        for i, layer_cache in enumerate(self.cache):
            layer_cache.restore(tuple(state[f"cache.{i}.{j}"] for j in range(len(state)) if f"cache.{i}.{j}" in state))
        pending = state.get("pending")
        self.pending = [StateSpan(pending, 0, pending.shape[1])] if pending is not None else []


def _unread_context(drafters) -> tuple[mx.array, tuple[int, ...]]:
    """The rows' unread target states [R, C, L E] (row r's first counts[r] positions its own, the rest
    padding) and the counts: one gather from the passes they came from, whatever the number of rows
    (one row with one span: a view)."""
    spans = [d.pending for d in drafters]
    if len(spans) == 1 and len(spans[0]) == 1:
        span = spans[0][0]
        return span.states[:, span.start : span.stop], (span.stop - span.start,)
    sources = list({id(span.states): span.states for row in spans for span in row}.values())
    bases = dict(zip(map(id, sources), accumulate([0] + [a.shape[1] for a in sources])))
    positions = [[bases[id(s.states)] + i for s in row for i in range(s.start, s.stop)] for row in spans]
    counts = tuple(len(p) for p in positions)
    index = np.zeros((len(spans), max(counts)), np.int32)
    for row, p in enumerate(positions):
        index[row, : len(p)] = p
    return _joined(sources)[0][mx.array(index)], counts


def check_fits(target, drafter):
    """Refuse a drafter made for another target, naming what differs."""
    args, trunk = drafter.args, target.args
    if target.parallel is not None and target.parallel.mode == PIPELINE:
        raise GenerationError("a DFlash drafter reads layers a pipeline's other ranks hold: use tensor parallelism")
    if target.residual_width != trunk.hidden_size:
        raise GenerationError(
            f"a DFlash drafter reads one hidden state per token and layer; this model's layers carry "
            f"{target.residual_width // trunk.hidden_size} residual streams, which no published drafter reads"
        )
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
    if args.dflash2 and args.vocab_size < trunk.vocab_size:  # its codebooks' rows are the target's tokens
        raise GenerationError(
            f"the DFlash2 drafter's codebooks hold {args.vocab_size} tokens, fewer than the target's vocabulary "
            f"({trunk.vocab_size})"
        )
    if not 0 <= args.mask_token_id < trunk.vocab_size:
        raise GenerationError(
            f"the DFlash drafter's mask token {args.mask_token_id} is outside the target's vocabulary "
            f"({trunk.vocab_size})"
        )
