"""What every drafter shares: the `Drafter` calls, drafting several rows at once, the head that
turns hidden states into draft tokens, and the draw-until-unsure loop of the drafters that
compute distributions."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import NamedTuple

import mlx.core as mx

from ..errors import GenerationError
from ..sampling import Samplers, row_items

# Default confidence under which a drafter stops drafting, where the verdicts can shorten a pass
# (ops.drafts_stop_below_p_min; see speculative.DraftingPolicy for the acceptance-driven part of
# adaptive drafting). A low floor: it stops drafts from a head with no idea (a random head's top
# probability is ~0.001 over 32k tokens), while the bundled head keeps 2.73 of its 2.87 tokens per
# pass at k=3 (0.2: 2.56, 0.5: 2.04).
DEFAULT_DRAFT_P_MIN = 0.1
DEFAULT_DRAFT_TOKENS = 3  # drafts a round, where the request and the drafter name no other number
# where each token verified costs its arithmetic (`ops.verified_tokens_cost_arithmetic`): the MTP head's,
# and a block drafter's most (its blocks then as short as its rounds ask, `DFlashDrafter`)
FEWER_DRAFT_TOKENS = 2
FEWER_BLOCK_DRAFT_TOKENS = 7


class DraftHead:
    """Turns drafters' final hidden states into draft tokens, over all or some of the vocabulary."""

    def __init__(self, model, vocabulary=None):
        self.vocab_size = model.args.vocab_size
        if vocabulary is None:
            self.ids, self.project = None, model.project
        else:
            self.ids = mx.array(vocabulary, dtype=mx.int32)
            self.project = model.vocabulary_head(self.ids)

    def draw(self, x: mx.array, samplers: Samplers, allowed: list | None = None):
        """For x [1, R, E], one row per sampler: (tokens [R], the log-distributions [R, V] over the whole
        vocabulary that the rows drew from (None where every row is greedy), top probabilities [R]), all
        rows in the same operations. allowed: per row None or the tokens [V] (bool) it may draw (a
        grammar's); a row that allows none of the head's is drawn unmasked (its draft will be cut)."""
        logits = self.project(x)[0].astype(mx.float32)
        if allowed is not None and any(mask is not None for mask in allowed):
            logits = mx.where(self._allowed_rows(allowed), logits, -mx.inf)
        if samplers.greedy:
            tops = mx.exp(logits.max(axis=-1) - mx.logsumexp(logits, axis=-1))
            return self.tokens(mx.argmax(logits, axis=-1)), None, tops
        logprobs = samplers.log_probs(logits)
        index = samplers.sample(logits, logprobs)
        return self.tokens(index), self._whole_vocabulary(logprobs), mx.exp(logprobs.max(axis=-1))

    def draw_greedy(self, x: mx.array, p_min: float) -> tuple[mx.array, mx.array]:
        """For x [1, R, E]: each row's most likely token [R] (int32), and the same tokens marked with
        their p-min verdicts (`marked`; p_min 0: all sure), both left on the device."""
        return self.greedy(self.project(x)[0], p_min)

    def greedy(self, logits: mx.array, p_min: float) -> tuple[mx.array, mx.array]:
        """`draw_greedy` for logits [n, V_head] over the head's vocabulary (as `project` gives them)."""
        tokens = self.tokens(mx.argmax(logits, axis=-1))  # the argmax and the top logit: exact in any dtype
        if p_min <= 0:
            return tokens, tokens
        return tokens, _marked(logits.max(axis=-1), mx.logsumexp(logits, axis=-1), math.log(p_min), tokens)

    def tokens(self, index: mx.array) -> mx.array:
        """Token ids (int32) of indices into the head's vocabulary."""
        return index.astype(mx.int32) if self.ids is None else self.ids[index]

    def _allowed_rows(self, allowed: list) -> mx.array:
        """The rows' masks [R, V_head] over the head's own vocabulary."""
        rows = []
        for mask in allowed:
            if mask is None:
                rows.append(mx.ones((self.vocab_size,), dtype=mx.bool_))
            else:  # a draft model's vocabulary may be padded to another size than the target's
                n = min(mask.shape[0], self.vocab_size)
                rows.append(mx.concatenate([mask[:n], mx.zeros((self.vocab_size - n,), dtype=mx.bool_)]))
        masks = mx.stack(rows) if self.ids is None else mx.stack(rows)[:, self.ids]
        return masks | ~masks.any(axis=-1, keepdims=True)

    def _whole_vocabulary(self, logprobs: mx.array) -> mx.array:
        """The acceptance rule needs q over the whole vocabulary: logprobs [..., V_head] -> [..., V]."""
        if self.ids is None:
            return logprobs
        full = mx.full((*logprobs.shape[:-1], self.vocab_size), -mx.inf, dtype=mx.float32)
        full[..., self.ids] = logprobs
        return full


# A draft that carries its p-min verdict to the verify pass: the token t where the drafter was sure
# (its top probability at least p-min), -1 - t where not; the pass feeds `unmarked` ids and reads the
# marked ones (`sure_drafts`), so the verdicts cost the read nothing.


@mx.compile
def _marked(top: mx.array, total: mx.array, log_floor: float, tokens: mx.array) -> mx.array:
    """tokens where e^(top - total) >= e^log_floor, else -1 - tokens (one launch; in float32: a 16-bit
    log-sum-exp moves the floor by a few percent at most)."""
    sure = top.astype(mx.float32) - total.astype(mx.float32) >= log_floor
    return mx.where(sure, tokens, -1 - tokens)


@mx.compile
def _marked_by(tops: mx.array, p_min: float, tokens: mx.array) -> mx.array:
    """tokens where their probability `tops` is at least p_min, else -1 - tokens (one launch)."""
    return mx.where(tops >= p_min, tokens, -1 - tokens)


@mx.compile
def unmarked(ids: mx.array) -> mx.array:
    """Marked drafts as the tokens they are (one launch)."""
    return mx.where(ids < 0, -1 - ids, ids)


def sure_drafts(marked: list[int]) -> list[int]:
    """The drafts up to the first unsure one, from their marked values."""
    sure = next((i for i, value in enumerate(marked) if value < 0), len(marked))
    return marked[:sure]


def check_draft_p_min(draft_p_min: float) -> float:
    if not 0.0 <= draft_p_min <= 1.0:
        raise GenerationError(f"draft_p_min must be in [0, 1], got {draft_p_min}")
    return draft_p_min


def _join(arrays: list) -> mx.array:
    """Rows [1, n, E] side by side on the token axis (one row: itself, no copy)."""
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=1)


def _values(tokens: list) -> list[int]:
    """Lazy draft tokens (scalars) as ints."""
    return mx.stack(tokens).reshape(-1).tolist() if tokens else []


def _rows_of(picks: list[tuple[mx.array, int]]) -> mx.array:
    """Row i of each pick (x [1, N, E], i) side by side [1, R, E]: the array itself where the picks are its
    rows in order, one gather where they come from one array, else a slice each."""
    first = picks[0][0]
    if all(x is first for x, _ in picks):
        index = [i for _, i in picks]
        return first if index == list(range(first.shape[1])) else first[:, mx.array(index)]
    return _join([x[:, i : i + 1] for x, i in picks])


def _last_of_each(x: mx.array, lengths: list[int]) -> mx.array:
    """The last position of each packed row of x [1, N, E] -> [1, R, E]."""
    if len(lengths) == 1:
        return x[:, -1:]
    return x[:, mx.array(list(accumulate(lengths))) - 1]


class Drafter:
    """The calls the engine makes of a drafter. The defaults here are what every drafter shares:
    `start`, drafting rows one at a time, and checkpoints that hold nothing (on restore the drafter
    reads the tokens again)."""

    declines_cost = False  # whether drafting nothing still cost a model step (declines then back off as misses)
    drafted_columns = None  # see _ConfidentDrafting: a round's marked drafts as its group's columns
    reads_layers: tuple[int, ...] = ()  # trunk layers whose states it reads in place of the last hidden states
    default_draft_tokens = DEFAULT_DRAFT_TOKENS  # drafts a round unless the request says
    max_draft_tokens: int | None = None  # the most drafts a round can hold (None: no bound)
    drafts_blocks = False  # a block a pass, accepted in part: adaptive rows adapt how many they verify
    opens_from_pass = False  # whether it can take its next round's first step with a verify pass (`open_from_pass`)

    def prefill(self, tokens: list[int], hidden) -> None:
        """Read a part of the prompt the trunk has read: its tokens and the trunk's states over them
        ([1, T, E], the states at `reads_layers` as a `StateSpan` where it names some), or None."""
        raise NotImplementedError

    def begin(self, first_token: int) -> None:
        """The first token after the prompt, the trunk's."""
        raise NotImplementedError

    def draft(self, k: int, sampler) -> tuple[list, list]:
        """Up to k drafts (fewer, or none, where confidence runs out): the tokens as scalar arrays, and for
        each the log-distribution [V] it was drawn from (None: a point mass)."""
        raise NotImplementedError

    def update(self, verify_hidden, accepted: list[int]) -> None:
        """After a verify pass (`draft` may have been skipped for the round): the tokens it accepted (the
        drafts taken and the trunk's own next token), and its states at the pass's positions."""
        raise NotImplementedError

    def fork(self) -> Drafter:
        """A drafter of the same kind with no sequence yet, sharing what is fixed (the model, the head)."""
        raise NotImplementedError

    @classmethod
    def open_from_pass(cls, drafters: list, states: list, tokens: list[mx.array]) -> None:
        """For greedy rows that drafted this round (drafters of one `batch_key`), while their verify pass
        computes: the next round's first step, from each row's states at the pass's positions and the
        tokens [n] the pass chose there, for whatever the round accepts (`update` keeps what it does)."""
        raise NotImplementedError

    def start(self, prompt: list[int], prompt_hidden, first_token: int):
        self.prefill(list(prompt), prompt_hidden)
        self.begin(first_token)

    def checkpoint(self) -> dict[str, mx.array]:
        """The drafter's state after the tokens the trunk has read (see `engine.prefix_store`)."""
        return {}

    def restore(self, state: dict[str, mx.array], tokens: list[int]):
        """Take up a checkpoint's state, after `tokens`, in place of prefilling them."""
        self.prefill(list(tokens), None)

    def batch_key(self):
        """Drafters with equal keys draft their rows together in one `draft_rows` call."""
        return type(self)

    def use_positions(self, positions):
        """The sequence's rotary positions (`cache.RotaryPositions`), where they are not its
        token indices (a prompt with images); a drafter with its own positions takes them up."""

    @classmethod
    def draft_rows(
        cls, drafters: list, ks: list[int], samplers: list, masks: list, verdicts_first: bool = False
    ) -> list[tuple[list, list]]:
        """Drafters that draw from no distribution (n-grams) have nothing to mask, and no verdicts."""
        return [drafter.draft(k, sampler) for drafter, k, sampler in zip(drafters, ks, samplers)]


def draft_rows(
    drafters: list, ks: list[int], samplers: list, masks: list | None = None, verdicts_first: bool = False
) -> list[tuple[list, list]]:
    """Each row's drafts, as (tokens, log-probabilities). Rows whose drafters share a `batch_key` draft
    together, and a batch may mix drafters of any kind.

    masks: per row, None or a grammar's function (`LogitsProcessor.draft_mask`) from the drafts so far
    to the tokens [V] (bool) it allows next, or None. Drafters that compute distributions draw within
    it. verdicts_first: the caller reads the drafts' p-min verdicts before it verifies them
    (`ops.read_draft_verdicts_first`)."""
    masks = masks or [None] * len(drafters)
    groups: dict = {}
    for i, drafter in enumerate(drafters):
        groups.setdefault(drafter.batch_key(), []).append(i)
    drafts = [None] * len(drafters)
    for rows in groups.values():
        group = [drafters[i] for i in rows]
        done = type(group[0]).draft_rows(
            group, [ks[i] for i in rows], [samplers[i] for i in rows], [masks[i] for i in rows], verdicts_first
        )
        for i, result in zip(rows, done):
            drafts[i] = result
    return drafts


class StateSpan(NamedTuple):
    """What a drafter that reads the target's layers (`Drafter.reads_layers`) reads of one row: the
    positions start .. stop of a pass's states [1, N, ...]. The whole pass's array is kept, so that rows
    drafting together gather theirs in one op."""

    states: mx.array
    start: int
    stop: int

    def head(self, count: int) -> StateSpan:
        """The first `count` positions."""
        return StateSpan(self.states, self.start, self.start + count)


class GroupRow(NamedTuple):
    """One row of a drafting group's round. The round is kept column by column: for draft j, one array
    [R] over the group's rows, with this row's draft at columns[j][row]. The engine then reads or packs
    all the group's rows at once, whatever their number."""

    columns: list[mx.array]
    row: int


@dataclass(frozen=True)
class DraftDistributions:
    """The distributions a row's drafts were drawn from, kept as its drafting group's array: log-
    probabilities [R, k, V] over the whole vocabulary. This row's are at `row`, and the first `count`
    belong to its drafts. It is cut as the row's drafts are (`[:m]`). The engine gathers a pass's
    sampling rows from such arrays at once."""

    logprobs: mx.array
    row: int
    count: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, cut: slice) -> DraftDistributions:
        return replace(self, count=len(range(self.count)[cut]))


class _ConfidentDrafting(Drafter):
    """The loop shared by drafters that compute distributions: draw, stop below p-min, feed.

    A subclass gives `_open(drafters)`, the first step of a round for those rows, and
    `_feed(drafters, tokens)`, one more token each; both return the rows' final hidden
    states [1, R, E] for the head, and run the rows packed into one model call.
    """

    declines_cost = True  # the first draft step ran before the confidence said stop

    def __init__(self, draft_p_min: float, head: DraftHead):
        self.draft_p_min = check_draft_p_min(draft_p_min)
        self.head = head
        self.fed_drafts = 0  # drafts of this round the drafting model has read
        self.drafted = False  # whether this round's draft ran
        # this round's drafts, marked with the p-min verdicts the verify pass applies, as columns of its
        # group (see `_draft_in_lockstep`); None where drafting stopped at the first unsure draft itself
        self.drafted_columns: GroupRow | None = None

    def draft(self, k: int, sampler):
        return self.draft_rows([self], [k], [sampler], [None])[0]

    def batch_key(self):
        return type(self), self.head, self.draft_p_min  # one head call, one confidence floor

    @classmethod
    def draft_rows(cls, drafters, ks, samplers, masks, verdicts_first=False):
        """Up to ks[r] (>= 1) drafts for each row (drafters of one `batch_key`), each drawn from
        what the row's mask allows after its drafts so far. Below p-min a row stops drafting.

        Rows without a grammar draft in lockstep and leave that verdict on the device
        (`_draft_in_lockstep`), unless the caller reads the verdicts before verifying (verdicts_first):
        it waits for them anyway, so reading after every draft costs little there, and a row whose first
        draft is unsure runs one head step, not k (the 0.8B shape on the CPU, drafts that never land: a
        declined round 32 -> 14 ms over a plain step's 120). Rows with a grammar decide here too, reading
        the device after every draft (the grammar reads the drafts)."""
        head, p_min = drafters[0].head, drafters[0].draft_p_min
        for drafter in drafters:
            drafter.drafted, drafter.fed_drafts, drafter.drafted_columns = True, 0, None
        if all(m is None for m in masks) and not verdicts_first:
            return cls._draft_in_lockstep(drafters, ks, samplers, p_min)
        drafts = [([], []) for _ in drafters]
        active = list(range(len(drafters)))
        x = cls._open(drafters)
        while True:
            allowed = None
            if any(masks[r] is not None for r in active):  # the grammar reads the drafts' values
                allowed = [masks[r] and masks[r](_values(drafts[r][0])) for r in active]
            tokens, logprobs, tops = head.draw(x, Samplers([samplers[r] for r in active]), allowed)
            if p_min > 0:
                # deciding whether to go on needs the values now; the tokens are queued first, so that the
                # same wait computes them for the grammar's or the verify pass's read of them after
                mx.async_eval(tokens)
                confident = (tops >= p_min).tolist()
            else:
                confident = [True] * len(active)
            going = []
            for i, row in enumerate(active):
                if confident[i]:
                    drafts[row][0].append(tokens[i : i + 1])
                    drafts[row][1].append(None if samplers[row].greedy else logprobs[i])
                    if len(drafts[row][0]) < ks[row]:
                        going.append(i)
            if not going:
                return drafts
            active = [active[i] for i in going]
            feeding = tokens if len(going) == len(tokens) else tokens[mx.array(going)]
            x = cls._feed([drafters[r] for r in active], feeding)
            for row in active:
                drafters[row].fed_drafts += 1

    @classmethod
    def _draft_in_lockstep(cls, drafters, ks, samplers, p_min: float):
        """Draft for rows without a grammar. Every row draws max(ks) drafts, with one head call per
        draft for all rows; a row asked for fewer keeps its first ks[r]. Each drafter keeps its drafts,
        marked with their p-min verdicts, as its group's columns (`GroupRow`).

        The verify pass cuts each row's drafts at its first unsure one. That gives the tokens that
        stopping here would give, with one wait a round instead of one after every draft. A sampling
        row's random stream is set back on the device to where stopping at that draft would have left
        it; its draws past that draft are discarded."""
        head, group = drafters[0].head, Samplers(samplers)
        tokens, marked, logprobs, streams = [], [], [], [group.keys()]
        x = cls._open(drafters)
        for _ in range(max(ks)):
            if tokens:
                x = cls._feed(drafters, tokens[-1])
                for drafter in drafters:
                    drafter.fed_drafts += 1
            if group.greedy:
                drawn, drawn_marked = head.draw_greedy(x, p_min)
            else:
                drawn, drawn_logprobs, tops = head.draw(x, group, None)
                drawn_marked = _marked_by(tops, p_min, drawn) if p_min > 0 else drawn
                logprobs.append(drawn_logprobs)
                streams.append(group.keys())
            tokens.append(drawn)
            marked.append(drawn_marked)
        for row, drafter in enumerate(drafters):
            drafter.drafted_columns = GroupRow(marked, row)
        if group.greedy:
            return [([column[row : row + 1] for column in tokens[:k]], [None] * k) for row, k in enumerate(ks)]
        # each row's stream where a draft-by-draft loop leaves it: past its draws up to its first unsure one
        limits = mx.array(ks, mx.int32)
        sure = mx.cumprod((mx.stack(marked, axis=1) >= 0) & (mx.arange(max(ks)) < limits[:, None]), axis=1)
        group.set_keys(row_items(mx.stack(streams, axis=1), mx.minimum(sure.sum(axis=1) + 1, limits)))
        distributions = mx.stack(logprobs, axis=1)  # [R, max(ks), V]
        return [
            (
                [column[row : row + 1] for column in tokens[:k]],
                [None] * k if sampler.greedy else DraftDistributions(distributions, row, k),
            )
            for row, (k, sampler) in enumerate(zip(ks, samplers))
        ]
