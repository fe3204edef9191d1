"""Drafters for speculative decoding: the model's MTP head, a draft model, n-gram lookup,
and an oracle for measurements.

Every drafter has the same three calls, made by `speculative.SpeculativeDecoder`:
- `start(prompt, prompt_hidden, first_token)` after the prefill;
- `draft(k, sampler)` -> (tokens, logprobs): up to k drafted tokens as scalar arrays, and
  for each the log-distribution [V] it was drawn from (None: a point mass). Fewer than k,
  or none, when confidence runs out;
- `update(verify_hidden, accepted)`: what the trunk accepted this round (the accepted
  drafts and the trunk's own next token), with the verify pass's hidden states. The
  decoder may skip `draft` for a round; `update` is still called;
- `declines_cost`: whether drafting nothing still cost a model step (then repeated
  declines make the decoder back off, as repeated rejections do).

Drafters that compute a distribution (MTP head, draft model) can project onto a reduced
vocabulary (`vocabulary=`, sorted token ids, see `draft_vocab`) and stop drafting once
their top probability falls below `draft_p_min`, as llama.cpp's draft p-min does.
"""

from __future__ import annotations

import mlx.core as mx

from .cache import KVCache, RecurrentCache
from .draft_vocab import draft_vocabulary
from .errors import GenerationError
from .prompt import prefill

# Default confidence under which a drafter stops drafting (see SpeculativeDecoder for
# the acceptance-driven part of adaptive drafting). A low floor: it stops drafts from a
# head with no idea (a random head's top probability is ~0.001 over 32k tokens), while
# the bundled head keeps 2.74 of its 2.83 tokens per pass (0.2: 2.54, 0.5: 1.90).
DEFAULT_DRAFT_P_MIN = 0.1


class DraftHead:
    """Turns a drafter's final hidden state into a draft token, over all or some of the vocabulary."""

    def __init__(self, model, vocabulary=None):
        self.vocab_size = model.args.vocab_size
        if vocabulary is None:
            self.ids, self.project = None, model.project
        else:
            self.ids = mx.array(vocabulary, dtype=mx.int32)
            self.project = model.vocabulary_head(self.ids)

    def draw(self, x: mx.array, sampler):
        """(token, log-distribution over the whole vocabulary or None, top probability) for x [1, 1, E]."""
        logits = self.project(x)[0, -1].astype(mx.float32)
        if sampler.greedy:
            index = mx.argmax(logits, axis=-1)
            top = mx.exp(logits.max() - mx.logsumexp(logits))
            logprobs = None
        else:
            logprobs = sampler.log_probs(logits)
            index = mx.random.categorical(logprobs, key=sampler.next_key())
            top = mx.exp(logprobs.max())
            if self.ids is not None:  # the acceptance rule needs q over the whole vocabulary
                full = mx.full((self.vocab_size,), -mx.inf, dtype=mx.float32)
                full[self.ids] = logprobs
                logprobs = full
        token = index if self.ids is None else self.ids[index]
        return token, logprobs, top


def check_draft_p_min(draft_p_min: float) -> float:
    if not 0.0 <= draft_p_min <= 1.0:
        raise GenerationError(f"draft_p_min must be in [0, 1], got {draft_p_min}")
    return draft_p_min


class _ConfidentDrafting:
    """The loop shared by drafters that compute distributions: draw, stop below p-min, feed."""

    declines_cost = True  # the first draft step ran before the confidence said stop

    def __init__(self, draft_p_min: float):
        self.draft_p_min = check_draft_p_min(draft_p_min)

    def _drafts(self, k: int, sampler, hidden, head: DraftHead, feed):
        """Up to k drafts from `hidden`; `feed(token)` advances the drafter and gives the next
        hidden state. Returns the tokens, their distributions and how many were fed."""
        tokens, logprobs, fed = [], [], 0
        for _ in range(k):
            token, logprob, top = head.draw(hidden, sampler)
            if self.draft_p_min > 0:
                mx.eval(token, top)  # deciding whether to go on needs the value now
                if top.item() < self.draft_p_min:
                    break
            tokens.append(token)
            logprobs.append(logprob)
            if len(tokens) == k:
                break
            hidden = feed(token)
            fed += 1
        return tokens, logprobs, fed


class MTPDrafter(_ConfidentDrafting):
    """Drafts by chaining the model's MTP head, which keeps its own KV cache.

    The MTP cache holds one entry per (trunk hidden state h_t, token t+1) pair.
    Pairs whose h_t is known but not yet fed are kept pending and go in with the
    next round's first draft step, so catching up after a verify costs no extra call.
    """

    def __init__(self, model, draft_p_min: float = 0.0, vocabulary=None):
        super().__init__(draft_p_min)
        if not model.has_mtp:
            raise GenerationError("this model has no MTP head, so draft='mtp' is unavailable")
        self.model = model
        self.head = DraftHead(model, vocabulary)
        self.cache = KVCache()
        self.pending_hidden = None  # [1, n, E]
        self.pending_next: list[int] = []  # the token after each pending hidden state
        self.speculative_entries = 0  # drafted pairs in the cache, trimmed at the update
        self.drafted = False  # whether this round's draft consumed the pending pairs

    def start(self, prompt: list[int], prompt_hidden: mx.array, first_token: int):
        # the prompt's pairs go in now, as part of the prefill; the last one starts the first draft
        if len(prompt) > 1:
            mx.eval(self._step(prompt_hidden[:, :-1], mx.array(prompt[1:])[None]))
        self.pending_hidden = prompt_hidden[:, -1:]
        self.pending_next = [first_token]

    def _step(self, hidden, tokens):
        return self.model.mtp(hidden, self.model.embed(tokens), self.cache)

    def _output(self, u):
        return self.model.mtp.norm(u)

    def draft(self, k: int, sampler):
        u = self._step(self.pending_hidden, mx.array(self.pending_next)[None])[:, -1:]
        self.drafted = True

        def feed(token):
            nonlocal u
            u = self._step(u, token.reshape(1, 1))  # its own output is the next h
            return self._output(u)

        tokens, logprobs, self.speculative_entries = self._drafts(k, sampler, self._output(u), self.head, feed)
        return tokens, logprobs

    def sync(self):
        """Feed the pending pairs into the MTP cache (no draft)."""
        self._step(self.pending_hidden, mx.array(self.pending_next)[None])
        self.pending_hidden, self.pending_next = self.pending_hidden[:, :0], []

    def update(self, verify_hidden: mx.array, accepted: list[int]):
        """accepted: the a accepted drafts and the trunk's token after them."""
        new_hidden = verify_hidden[:, : len(accepted)]
        if self.drafted:
            self.cache.trim(self.speculative_entries)
            self.pending_hidden, self.pending_next = new_hidden, list(accepted)
        else:  # a round without drafts: the pairs wait for the next draft
            self.pending_hidden = mx.concatenate([self.pending_hidden, new_hidden], axis=1)
            self.pending_next += accepted
        self.speculative_entries, self.drafted = 0, False


class DraftModelDrafter(_ConfidentDrafting):
    """Drafts with a separate (smaller) model that shares the tokenizer."""

    def __init__(self, draft_model, target_model, draft_p_min: float = 0.0, vocabulary=None):
        super().__init__(draft_p_min)
        if draft_model.args.vocab_size != target_model.args.vocab_size:
            raise GenerationError(
                f"the draft model's vocabulary ({draft_model.args.vocab_size}) differs from the target's "
                f"({target_model.args.vocab_size})"
            )
        self.model = draft_model
        self.head = DraftHead(draft_model, vocabulary)
        self.cache = draft_model.make_cache()
        self.pending: list[int] = []  # accepted tokens the draft model has not read yet
        self.fed_drafts = 0  # drafts of this round the draft model has read
        self._states = []  # recurrent states after reading 0, 1, ... drafts
        self.drafted = False

    def start(self, prompt: list[int], prompt_hidden, first_token: int):
        prefill(self.model, prompt, self.cache)  # the draft model reads the prompt as part of the prefill
        self.pending = [first_token]

    def _read(self, tokens: mx.array):
        """Run the draft model over tokens [1, T]; its last normed hidden state [1, 1, E]."""
        return self.model.norm(self.model.hidden_states(tokens, self.cache)[:, -1:])

    def draft(self, k: int, sampler):
        hidden = self._read(mx.array(self.pending)[None])
        self.drafted = True
        # drafts run one token per call, so the recurrent states after each call are the
        # rollback points (MLX arrays are immutable: keeping them copies nothing)
        self._states = [self._recurrent_states()]

        def feed(token):
            hidden = self._read(token.reshape(1, 1))
            self._states.append(self._recurrent_states())
            return hidden

        tokens, logprobs, self.fed_drafts = self._drafts(k, sampler, hidden, self.head, feed)
        return tokens, logprobs

    def _recurrent_states(self):
        return [(c.conv_tail, c.state) for c in self.cache if isinstance(c, RecurrentCache)]

    def update(self, verify_hidden, accepted: list[int]):
        if not self.drafted:  # a round without drafts: the tokens wait for the next draft
            self.pending += accepted
            return
        self.drafted = False
        kept = min(len(accepted) - 1, self.fed_drafts)  # accepted drafts already in the cache
        recurrent = [c for c in self.cache if isinstance(c, RecurrentCache)]
        for c, (tail, state) in zip(recurrent, self._states[kept]):
            c.conv_tail, c.state = tail, state
        for c in self.cache:
            if isinstance(c, KVCache):
                c.trim(self.fed_drafts - kept)
        self.pending = accepted[kept:]


class NgramDrafter:
    """Prompt lookup: proposes the tokens that followed the latest earlier occurrence of
    the last n tokens (n from `max_n` down to `min_n`) in the prompt and the output.

    Free to run and model-independent (Kimi Linear has no MTP head); long accepted runs
    where the output repeats its context, as in code editing and retrieval.
    """

    declines_cost = False  # a failed lookup is free: keep looking every round

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise GenerationError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
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

    def start(self, prompt, prompt_hidden, first_token: int):
        self.history, self.following = [], {}
        self._extend(list(prompt) + [first_token])

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


class OracleDrafter:
    """Replays a known continuation so that a set share of drafts is accepted (greedy).

    For measuring and testing the verify/rollback machinery: each round proposes
    a correct tokens and then a wrong one, a drawn so that a / k averages
    `acceptance`. `inner`, if given (an MTPDrafter, say), drafts alongside: its tokens
    are computed (so their cost counts) and its number of drafts is kept, but the
    tokens themselves are replaced.
    """

    def __init__(self, continuation: list[int], acceptance: float, vocab_size: int, inner=None, seed: int = 0):
        import random

        self.continuation = list(continuation)
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.inner = inner
        self.declines_cost = inner is not None and inner.declines_cost
        self.rng = random.Random(seed)
        self.position = 0  # index in `continuation` of the next token to draft

    def start(self, prompt, prompt_hidden, first_token: int):
        self.position = 1
        if self.inner is not None:
            self.inner.start(prompt, prompt_hidden, first_token)

    def draft(self, k: int, sampler):
        if self.inner is not None:
            drafted, _ = self.inner.draft(k, sampler)
            mx.eval(drafted)  # MLX is lazy: replaced tokens would otherwise never be computed
            k = len(drafted)
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


DRAFTS = ("mtp", "ngram")


def make_drafter(model, tokenizer, draft=None, draft_model=None, draft_vocab=None, draft_p_min=DEFAULT_DRAFT_P_MIN):
    """The drafter for `stream_generate`'s arguments, or None for plain decoding.

    draft: None or "none" (no speculation), "mtp" or "ngram"; draft_model: a model of the
    same vocabulary. draft_vocab: tokens the drafter projects onto (None: the default for
    the vocabulary's size, 0: all).
    """
    check_draft_p_min(draft_p_min)  # it also switches the decoder's backoff, for every drafter
    if draft == "none":
        draft = None
    if draft is not None and draft_model is not None:
        raise GenerationError("give either draft= or draft_model=, not both")
    if draft is not None and draft not in DRAFTS:
        raise GenerationError(f"unknown draft {draft!r} (use draft='mtp', 'ngram' or 'none', or draft_model=)")
    if draft is None and draft_model is None:
        return None
    if draft == "ngram":
        return NgramDrafter()
    drafting_model = draft_model if draft_model is not None else model
    vocabulary = draft_vocabulary(tokenizer, draft_vocab, drafting_model.args.vocab_size)
    if draft_model is not None:
        return DraftModelDrafter(draft_model, model, draft_p_min, vocabulary)
    return MTPDrafter(model, draft_p_min, vocabulary)
