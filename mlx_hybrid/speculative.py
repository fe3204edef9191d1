"""Speculative decoding for hybrid models: draft, verify in one trunk pass, roll back by snapshot.

A round, with the trunk having processed tokens 0..m-1 and token m sampled:

1. the drafter proposes d_1..d_k for positions m+1..m+k;
2. the trunk runs [x_m, d_1..d_k] once; every linear-attention layer records its
   (conv tail, S) after each of those k+1 tokens;
3. the longest agreeing prefix d_1..d_a is accepted (greedy), or the speculative
   sampling rule decides (temp > 0), and one more token comes from the trunk's
   distribution at the first disagreement;
4. attention caches are trimmed and recurrent layers take their snapshot after
   token a; the drafter is told what was accepted.

No trunk pass is repeated after a rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .cache import KVCache, RecurrentCache
from .errors import GenerationError


def rollback(cache, keep: int, recorded: int):
    """Keep the first `keep` of the `recorded` tokens the last call added to each layer."""
    for layer_cache in cache:
        if isinstance(layer_cache, RecurrentCache):
            layer_cache.rollback(keep, recorded)
        else:
            layer_cache.trim(recorded - keep)


def _record_snapshots(cache, on: bool):
    for layer_cache in cache:
        if isinstance(layer_cache, RecurrentCache):
            layer_cache.record_snapshots = on


def keep_snapshot_buffers(cache, num_draft_tokens: int):
    """Let MLX's allocator keep a few rounds of snapshot buffers for reuse (it only raises the limit).

    Every verify pass allocates and frees the same (k + 1) recurrent states per layer,
    twice over (as computed, then stacked). Beyond the allocator's cache limit (32 MB
    by default on the CPU) they go back to the system and return as fresh pages: at
    the Qwen3.5-0.8B shape a k=4 verify pass took 300 to 560 ms instead of 220 ms.
    """
    state_bytes = sum(c.state.nbytes + c.conv_tail.nbytes for c in cache if isinstance(c, RecurrentCache))
    wanted = 4 * (num_draft_tokens + 1) * state_bytes
    previous = mx.set_cache_limit(wanted)
    if previous > wanted:
        mx.set_cache_limit(previous)


def _draw(sampler, logits):
    """A draft token and the log-distribution it came from (None for greedy: a point mass)."""
    if sampler.greedy:
        return mx.argmax(logits, axis=-1), None
    logprobs = sampler.log_probs(logits)
    return mx.random.categorical(logprobs, key=sampler.next_key()), logprobs


class MTPDrafter:
    """Drafts by chaining the model's MTP head, which keeps its own KV cache.

    The MTP cache holds one entry per (trunk hidden state h_t, token t+1) pair.
    Pairs whose h_t is known but not yet fed are kept pending and go in with the
    next round's first draft step, so catching up after a verify costs no extra call.
    """

    def __init__(self, model):
        if not model.has_mtp:
            raise GenerationError("this model has no MTP head, so draft='mtp' is unavailable")
        self.model = model
        self.cache = KVCache()
        self.pending_hidden = None  # [1, n, E]
        self.pending_next: list[int] = []  # the token after each pending hidden state
        self.speculative_entries = 0

    def start(self, prompt: list[int], prompt_hidden: mx.array, first_token: int):
        # the prompt's pairs go in now, as part of the prefill; the last one starts the first draft
        if len(prompt) > 1:
            mx.eval(self._step(prompt_hidden[:, :-1], mx.array(prompt[1:])[None]))
        self.pending_hidden = prompt_hidden[:, -1:]
        self.pending_next = [first_token]

    def _step(self, hidden, tokens):
        return self.model.mtp(hidden, self.model.embed(tokens), self.cache)

    def draft(self, k: int, sampler):
        u = self._step(self.pending_hidden, mx.array(self.pending_next)[None])[:, -1:]
        tokens, logprobs = [], []
        for j in range(k):
            token, logprob = _draw(sampler, self.model.project(self.model.mtp.norm(u))[0, -1])
            tokens.append(token)
            logprobs.append(logprob)
            if j + 1 < k:
                u = self._step(u, token.reshape(1, 1))  # its own output is the next h
        self.speculative_entries = k - 1
        return tokens, logprobs

    def sync(self):
        """Feed the pending pairs into the MTP cache (no draft)."""
        self._step(self.pending_hidden, mx.array(self.pending_next)[None])
        self.pending_hidden, self.pending_next = self.pending_hidden[:, :0], []

    def update(self, verify_hidden: mx.array, accepted: list[int]):
        """accepted: the a accepted drafts and the trunk's token after them."""
        self.cache.trim(self.speculative_entries)
        self.pending_hidden = verify_hidden[:, : len(accepted)]
        self.pending_next = list(accepted)


class DraftModelDrafter:
    """Drafts with a separate (smaller) model that shares the tokenizer."""

    def __init__(self, draft_model, target_model):
        if draft_model.args.vocab_size != target_model.args.vocab_size:
            raise GenerationError(
                f"the draft model's vocabulary ({draft_model.args.vocab_size}) differs from the target's "
                f"({target_model.args.vocab_size})"
            )
        self.model = draft_model
        self.cache = draft_model.make_cache()
        self.pending: list[int] = []  # accepted tokens the draft model has not read yet
        self.fed_drafts = 0  # drafts of this round the draft model has read
        self._states = []  # recurrent states after reading 0, 1, ... drafts

    def start(self, prompt: list[int], prompt_hidden, first_token: int):
        from .generation import prefill  # generation builds on this module

        prefill(self.model, prompt, self.cache)  # the draft model reads the prompt as part of the prefill
        self.pending = [first_token]

    def draft(self, k: int, sampler):
        logits = self.model(mx.array(self.pending)[None], self.cache)[0, -1]
        # drafts run one token per call, so the recurrent states after each call are the
        # rollback points (MLX arrays are immutable: keeping them copies nothing)
        self._states = [self._recurrent_states()]
        tokens, logprobs = [], []
        for j in range(k):
            token, logprob = _draw(sampler, logits)
            tokens.append(token)
            logprobs.append(logprob)
            if j + 1 < k:
                logits = self.model(token.reshape(1, 1), self.cache)[0, -1]
                self._states.append(self._recurrent_states())
        self.fed_drafts = k - 1
        return tokens, logprobs

    def _recurrent_states(self):
        return [(c.conv_tail, c.state) for c in self.cache if isinstance(c, RecurrentCache)]

    def update(self, verify_hidden, accepted: list[int]):
        kept = min(len(accepted) - 1, self.fed_drafts)  # accepted drafts already in the cache
        recurrent = [c for c in self.cache if isinstance(c, RecurrentCache)]
        for c, (tail, state) in zip(recurrent, self._states[kept]):
            c.conv_tail, c.state = tail, state
        for c in self.cache:
            if isinstance(c, KVCache):
                c.trim(self.fed_drafts - kept)
        self.pending = accepted[kept:]


class OracleDrafter:
    """Replays a known continuation so that a set share of drafts is accepted (greedy).

    For measuring and testing the verify/rollback machinery: each round proposes
    a correct tokens and then a wrong one, a drawn so that a / k averages
    `acceptance`. `inner`, if given (an MTPDrafter, say), drafts alongside so its
    cost and cache bookkeeping are included, but its tokens are replaced.
    """

    def __init__(self, continuation: list[int], acceptance: float, vocab_size: int, inner=None, seed: int = 0):
        import random

        self.continuation = list(continuation)
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.inner = inner
        self.rng = random.Random(seed)
        self.position = 0  # index in `continuation` of the next token to draft

    def start(self, prompt, prompt_hidden, first_token: int):
        self.position = 1
        if self.inner is not None:
            self.inner.start(prompt, prompt_hidden, first_token)

    def draft(self, k: int, sampler):
        if self.inner is not None:
            self.inner.draft(k, sampler)
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


@dataclass
class SpeculativeStats:
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.emitted / self.passes if self.passes else 0.0


class SpeculativeDecoder:
    """Runs rounds of draft + verify for one sequence (batch 1)."""

    def __init__(self, model, drafter, sampler, num_draft_tokens: int, cache):
        if num_draft_tokens < 1:
            raise GenerationError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.model = model
        self.drafter = drafter
        self.sampler = sampler
        self.k = num_draft_tokens
        self.cache = cache
        self.stats = SpeculativeStats()
        self.token: int | None = None  # sampled, not yet run through the trunk

    def start(self, prompt: list[int], prompt_hidden: mx.array) -> int:
        """prompt_hidden: the trunk's hidden states over the prompt (cache already filled)."""
        self.token = int(self.sampler(self.model.logits_from_hidden(prompt_hidden[:, -1:])[0, -1]))
        self.drafter.start(prompt, prompt_hidden, self.token)
        keep_snapshot_buffers(self.cache, self.k)
        return self.token

    def step(self, max_new: int | None = None) -> list[int]:
        """One round; returns the a accepted drafts and the trunk's next token."""
        k = self.k if max_new is None else max(1, min(self.k, max_new - 1))
        drafted, draft_logprobs = self.drafter.draft(k, self.sampler)
        # the verify pass is built on the lazy drafts: drafting and verifying run as one graph
        tokens = mx.concatenate([mx.array([self.token]), mx.stack(drafted).reshape(-1).astype(mx.int32)])
        hidden = self.verify(tokens)
        logits = self.model.logits_from_hidden(hidden)[0]  # [k+1, V]
        if self.sampler.greedy:
            drafts, target = mx.split(mx.concatenate([tokens[1:], mx.argmax(logits, axis=-1).astype(mx.int32)]), [k])
            drafts, target = drafts.tolist(), target.tolist()  # the round's one host sync
            a = 0
            while a < k and drafts[a] == target[a]:
                a += 1
            accepted = drafts[:a] + [target[a]]
        else:
            drafts = tokens[1:].tolist()
            accepted = self._accept_sampled(drafts, draft_logprobs, self.sampler.log_probs(logits))
        a = len(accepted) - 1
        rollback(self.cache, keep=a + 1, recorded=k + 1)
        self.drafter.update(hidden, accepted)
        self.token = accepted[-1]
        self.stats.drafted += k
        self.stats.accepted += a
        self.stats.passes += 1
        self.stats.emitted += a + 1
        return accepted

    def verify(self, tokens: mx.array) -> mx.array:
        """The trunk over [last token, drafts], recording recurrent snapshots after each."""
        _record_snapshots(self.cache, True)
        try:
            return self.model.hidden_states(tokens[None], self.cache)
        finally:
            _record_snapshots(self.cache, False)

    def _accept_sampled(self, drafts, draft_logprobs, target_logprobs):
        """Speculative sampling (Leviathan et al., Chen et al.): the output follows the target exactly."""
        for i, token in enumerate(drafts):
            p = mx.exp(target_logprobs[i])
            q = mx.exp(draft_logprobs[i]) if draft_logprobs[i] is not None else None
            p_token = p[token]
            q_token = q[token] if q is not None else mx.array(1.0)
            u = mx.random.uniform(key=self.sampler.next_key())
            if bool(u * q_token < p_token):  # accept with probability min(1, p/q)
                continue
            if q is None:  # point-mass draft: the residual is p without that token
                residual = mx.where(mx.arange(p.shape[-1]) == token, 0.0, p)
            else:
                residual = mx.maximum(p - q, 0.0)
            fallback = mx.random.categorical(mx.log(residual), key=self.sampler.next_key())
            return drafts[:i] + [int(fallback)]
        bonus = mx.random.categorical(target_logprobs[len(drafts)], key=self.sampler.next_key())
        return drafts + [int(bonus)]
