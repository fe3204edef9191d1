"""Drafters for speculative decoding: the model's MTP head, a draft model, n-gram lookup.

Every drafter has the same calls, made by the engine for each of its rows that speculate (one
drafter a row, `engine.rows.Row`):
- `prefill(tokens, hidden)` for each part of the prompt the trunk has read (hidden: its
  hidden states [1, T, E], or None), then `begin(first_token)` with the first sampled
  token; `start(prompt, prompt_hidden, first_token)` does both at once;
- `draft(k, sampler)` -> (tokens, logprobs): up to k drafted tokens as scalar arrays, and
  for each the log-distribution [V] it was drawn from (None: a point mass). Fewer than k,
  or none, when confidence runs out. `draft_rows(drafters, ks, samplers, masks)` drafts for
  several rows at once, the drafting model's steps packed into one call per step, each
  row drawn from what its grammar allows (masks);
- `update(verify_hidden, accepted)`: what the trunk accepted this round (the accepted
  drafts and the trunk's own next token), with the verify pass's hidden states. The
  decoder may skip `draft` for a round; `update` is still called;
- `declines_cost`: whether drafting nothing still cost a model step (then repeated
  declines make the decoder back off, as repeated rejections do);
- `fork()`: a drafter of the same kind with no sequence yet, sharing what is fixed
  (the model, the draft vocabulary's head).

Drafters that compute a distribution (MTP head, draft model) can project onto a reduced
vocabulary (`vocabulary=`, sorted token ids, see `draft_vocab`) and stop drafting once
their top probability falls below `draft_p_min`, as llama.cpp's draft p-min does.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import mlx.core as mx

from .cache import KVCache, marks, packed, rewind, row_caches
from .draft_vocab import draft_vocabulary
from .errors import GenerationError
from .prompt import PREFILL_STEP, prefill

# Default confidence under which a drafter stops drafting (see speculative.DraftingPolicy for
# the acceptance-driven part of adaptive drafting). A low floor: it stops drafts from a
# head with no idea (a random head's top probability is ~0.001 over 32k tokens), while
# the bundled head keeps 2.73 of its 2.87 tokens per pass at k=3 (0.2: 2.56, 0.5: 2.04).
DEFAULT_DRAFT_P_MIN = 0.1


class DraftHead:
    """Turns drafters' final hidden states into draft tokens, over all or some of the vocabulary."""

    def __init__(self, model, vocabulary=None):
        self.vocab_size = model.args.vocab_size
        if vocabulary is None:
            self.ids, self.project = None, model.project
        else:
            self.ids = mx.array(vocabulary, dtype=mx.int32)
            self.project = model.vocabulary_head(self.ids)

    def draw(self, x: mx.array, samplers: list, allowed: list | None = None):
        """For x [1, R, E], one row per sampler: (tokens [R], per row the log-distribution over
        the whole vocabulary or None, top probabilities [R]). allowed: per row None or the
        tokens [V] (bool) it may draw (a grammar's); a row that allows none of the head's is
        drawn unmasked (its draft will be cut)."""
        logits = self.project(x)[0].astype(mx.float32)
        if allowed is not None and any(mask is not None for mask in allowed):
            logits = mx.where(self._allowed_rows(allowed), logits, -mx.inf)
        if all(sampler.greedy for sampler in samplers):
            index = mx.argmax(logits, axis=-1)
            tops = mx.exp(logits.max(axis=-1) - mx.logsumexp(logits, axis=-1))
            logprobs = [None] * len(samplers)
        else:
            indices, top_list, logprobs = [], [], []
            for row, sampler in zip(logits, samplers):
                row_logprobs = sampler.log_probs(row)
                indices.append(mx.argmax(row, axis=-1) if sampler.greedy else sampler.draw(row_logprobs))
                top_list.append(mx.exp(row_logprobs.max()))
                logprobs.append(None if sampler.greedy else self._whole_vocabulary(row_logprobs))
            index, tops = mx.stack(indices), mx.stack(top_list)
        return (index if self.ids is None else self.ids[index]), logprobs, tops

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
        """The acceptance rule needs q over the whole vocabulary."""
        if self.ids is None:
            return logprobs
        full = mx.full((self.vocab_size,), -mx.inf, dtype=mx.float32)
        full[self.ids] = logprobs
        return full


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


def _last_of_each(x: mx.array, lengths: list[int]) -> mx.array:
    """The last position of each packed row of x [1, N, E] -> [1, R, E]."""
    if len(lengths) == 1:
        return x[:, -1:]
    return x[:, mx.array(list(accumulate(lengths))) - 1]


class Drafter:
    """What every drafter shares: `start`, drafting rows one at a time, and checkpoints that
    hold nothing (the drafter reads the tokens again on restore)."""

    declines_cost = False

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
    def draft_rows(cls, drafters: list, ks: list[int], samplers: list, masks: list) -> list[tuple[list, list]]:
        """Drafters that draw from no distribution (n-grams) have nothing to mask."""
        return [drafter.draft(k, sampler) for drafter, k, sampler in zip(drafters, ks, samplers)]


def draft_rows(drafters: list, ks: list[int], samplers: list, masks: list | None = None) -> list[tuple[list, list]]:
    """Each row's drafts (tokens, log-probabilities): rows whose drafters share a `batch_key`
    draft together; a batch may mix drafters of any kind. masks: per row None or a function
    (drafts so far) -> the tokens [V] (bool) it allows next, or None (a grammar's,
    `LogitsProcessor.draft_mask`): drafters that compute distributions draw from it."""
    masks = masks or [None] * len(drafters)
    groups: dict = {}
    for i, drafter in enumerate(drafters):
        groups.setdefault(drafter.batch_key(), []).append(i)
    drafts = [None] * len(drafters)
    for rows in groups.values():
        group = [drafters[i] for i in rows]
        done = type(group[0]).draft_rows(
            group, [ks[i] for i in rows], [samplers[i] for i in rows], [masks[i] for i in rows]
        )
        for i, result in zip(rows, done):
            drafts[i] = result
    return drafts


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

    def draft(self, k: int, sampler):
        return self.draft_rows([self], [k], [sampler], [None])[0]

    def batch_key(self):
        return type(self), self.head, self.draft_p_min  # one head call, one confidence floor

    @classmethod
    def draft_rows(cls, drafters, ks, samplers, masks):
        """Up to ks[r] (>= 1) drafts for each row (drafters of one `batch_key`), each drawn from
        what the row's mask allows after its drafts so far."""
        head, p_min = drafters[0].head, drafters[0].draft_p_min
        drafts = [([], []) for _ in drafters]
        active = list(range(len(drafters)))
        x = cls._open(drafters)
        for drafter in drafters:
            drafter.drafted, drafter.fed_drafts = True, 0
        while True:
            allowed = None
            if any(masks[r] is not None for r in active):  # the grammar reads the drafts' values
                allowed = [masks[r] and masks[r](_values(drafts[r][0])) for r in active]
            tokens, logprobs, tops = head.draw(x, [samplers[r] for r in active], allowed)
            if p_min > 0:
                mx.eval(tokens, tops)  # deciding whether to go on needs the values now
                confident = (tops >= p_min).tolist()
            else:
                confident = [True] * len(active)
            going = []
            for i, row in enumerate(active):
                if confident[i]:
                    drafts[row][0].append(tokens[i])
                    drafts[row][1].append(logprobs[i])
                    if len(drafts[row][0]) < ks[row]:
                        going.append(i)
            if not going:
                return drafts
            active = [active[i] for i in going]
            feeding = tokens if len(going) == len(tokens) else tokens[mx.array(going)]
            x = cls._feed([drafters[r] for r in active], feeding)
            for row in active:
                drafters[row].fed_drafts += 1


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
        self._carry = None  # this round's last MTP carry: the next draft step's h

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
        y, carry = drafters[0]._step(_join([d._carry for d in drafters]), tokens[None], caches)
        return MTPDrafter._keep_carry(drafters, y, carry)

    @staticmethod
    def _keep_carry(drafters, y, carry):
        """Each row's carry is its next step's h; the draft head reads y [1, R, E]."""
        for i, drafter in enumerate(drafters):
            drafter._carry = carry[:, i : i + 1]
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


DRAFTS = ("mtp", "ngram")
AUTO = "auto"  # the default: the model's MTP head where it has one, else no speculation


def resolve_draft(model, draft, draft_model=None) -> str | None:
    """`draft` as make_drafter takes it, with "auto" decided and "none" as None."""
    if draft == AUTO:
        return "mtp" if draft_model is None and model.has_mtp else None
    return None if draft == "none" else draft


@dataclass(frozen=True)
class SpeculationSettings:
    """How a request's tokens are drafted, as every entry point takes it (the API's keywords of these
    names, the commands' draft options), defaulted here and nowhere else.

    draft: "auto" (the MTP head where the model has one and no draft model is given), "mtp", "ngram"
    or None; draft_model: a loaded model of the same vocabulary; num_draft_tokens: drafts a round at
    most; draft_vocab: tokens a drafter projects onto (None: the default for the vocabulary's size,
    0: all); draft_p_min: the draft confidence under which a drafter stops; adaptive_drafting: back
    off after misses (None: on unless draft_p_min is 0, which asks for exactly num_draft_tokens)."""

    draft: str | None = AUTO
    draft_model: object = None
    num_draft_tokens: int = 3
    draft_vocab: int | None = None
    draft_p_min: float = DEFAULT_DRAFT_P_MIN
    adaptive_drafting: bool | None = None

    @property
    def adaptive(self) -> bool:
        """Whether rows back off after misses (see `speculative.DraftingPolicy`)."""
        return self.draft_p_min > 0 if self.adaptive_drafting is None else bool(self.adaptive_drafting)

    def drafter(self, model, tokenizer):
        """A drafter for `model` (each row gets a `fork` of it), or None for plain decoding."""
        return make_drafter(model, tokenizer, self.draft, self.draft_model, self.draft_vocab, self.draft_p_min)


def make_drafter(model, tokenizer, draft=None, draft_model=None, draft_vocab=None, draft_p_min=DEFAULT_DRAFT_P_MIN):
    """The drafter for `stream_generate`'s arguments, or None for plain decoding.

    draft: None or "none" (no speculation), "mtp", "ngram", or "auto" (the MTP head where
    the model has one and no draft model is given, else none); draft_model: a model of
    the same vocabulary. draft_vocab: tokens the drafter projects onto (None: the default
    for the vocabulary's size, 0: all).
    """
    check_draft_p_min(draft_p_min)  # it also decides the rows' backoff by default (see SpeculationSettings)
    draft = resolve_draft(model, draft, draft_model)
    if draft is not None and draft_model is not None:
        raise GenerationError("give either draft= or draft_model=, not both")
    if draft is not None and draft not in DRAFTS:
        raise GenerationError(f"unknown draft {draft!r} (use draft='mtp', 'ngram', 'auto' or None, or draft_model=)")
    if draft is None and draft_model is None:
        return None
    if draft == "ngram":
        return NgramDrafter()
    drafting_model = draft_model if draft_model is not None else model
    vocabulary = draft_vocabulary(tokenizer, draft_vocab, drafting_model.args.vocab_size)
    if draft_model is not None:
        return DraftModelDrafter(draft_model, model, draft_p_min, vocabulary)
    return MTPDrafter(model, draft_p_min, vocabulary)
