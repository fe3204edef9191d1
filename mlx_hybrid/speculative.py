"""Speculative decoding for hybrid models: draft, verify in one trunk pass, roll back by snapshot.

A round, with the trunk having processed tokens 0..m-1 and token m sampled:

1. the drafter (`drafting`) proposes d_1..d_k for positions m+1..m+k (k may be 0: a
   plain decoding step);
2. the trunk runs [x_m, d_1..d_k] once; every linear-attention layer records its
   (conv tail, S) after each of those k+1 tokens;
3. the longest agreeing prefix d_1..d_a is accepted (greedy), or the speculative
   sampling rule decides (temp > 0), and one more token comes from the trunk's
   distribution at the first disagreement;
4. attention caches are trimmed and recurrent layers take their snapshot after
   token a; the drafter is told what was accepted.

No trunk pass is repeated after a rejection.

Adaptive drafting (on unless draft_p_min is 0): besides the drafter's own confidence
stop, after MISSES_BEFORE_BACKOFF misses in a row (rounds whose first draft was
rejected, or whose drafter declined at a cost) a row runs plain steps for 1, 2,
4, ... 16 rounds before trying again, so that misses cost almost nothing. It does not
shorten rounds otherwise: at a first-draft acceptance near 50% full rounds still pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .errors import GenerationError


def keep_snapshot_buffers(cache, num_draft_tokens: int):
    """Let MLX's allocator keep a few rounds of snapshot buffers for reuse (it only raises the limit).

    Every verify pass allocates and frees the same (k + 1) recurrent states per layer
    (each token's state is kept as a snapshot, so none is updated in place). Beyond the
    allocator's cache limit (32 MB by default on the CPU) they go back to the system and
    return as fresh pages, which made verify passes up to two and a half times slower at the
    Qwen3.5-0.8B shape (benchmarks/spec_decode.py).
    """
    wanted = 4 * (num_draft_tokens + 1) * sum(c.step_nbytes for c in cache)
    previous = mx.set_cache_limit(wanted)
    if previous > wanted:
        mx.set_cache_limit(previous)


def check_num_draft_tokens(num_draft_tokens: int) -> int:
    if num_draft_tokens < 1:
        raise GenerationError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    return num_draft_tokens


@dataclass
class SpeculativeStats:
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    emitted: int = 0
    # per position j in a round (0: the first draft): drafts proposed there, and accepted
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int):
        """A trunk pass that verified `drafted` drafts and accepted the first `accepted`."""
        self.drafted += drafted
        self.accepted += accepted
        self.passes += 1
        self.emitted += accepted + 1
        _count_positions(self.drafted_at, drafted)
        _count_positions(self.accepted_at, accepted)

    def merge(self, other: SpeculativeStats):
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.passes += other.passes
        self.emitted += other.emitted
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at)):
            _count_positions(mine, len(theirs), theirs)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.emitted / self.passes if self.passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Of the drafts proposed at position j of a round, the share accepted (as vLLM reports
        it: a draft is accepted only with all before it). A chained draft fed the wrong state
        shows here: drafts 2 and 3 collapse while draft 1 looks fine."""
        accepted = self.accepted_at + [0] * (len(self.drafted_at) - len(self.accepted_at))
        return [a / d for a, d in zip(accepted, self.drafted_at)]

    def summary(self) -> dict:
        """The figures, for a report (a server's /health, say)."""
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_pass": self.tokens_per_pass,
            "acceptance_by_position": self.acceptance_by_position,
        }


def _count_positions(counts: list[int], n: int, amounts=None):
    """Add amounts[j] (default 1) to counts[j] for j < n, growing counts as needed."""
    counts.extend([0] * (n - len(counts)))
    for j in range(n):
        counts[j] += 1 if amounts is None else amounts[j]


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The longest prefix of drafts the trunk agrees with, then the trunk's own token."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return drafts[:a] + [targets[a]]


def accept_sampled(sampler, drafts: list[int], draft_logprobs, target_logprobs) -> list[int]:
    """Speculative sampling (Leviathan et al., Chen et al.): the output follows the target exactly.
    draft_logprobs: per draft, the drafter's distribution (None: a point mass); target_logprobs
    [len(drafts) + 1, V]: the model's at each position."""
    for i, token in enumerate(drafts):
        p = mx.exp(target_logprobs[i])
        q = mx.exp(draft_logprobs[i]) if draft_logprobs[i] is not None else None
        p_token = p[token]
        q_token = q[token] if q is not None else mx.array(1.0)
        u = mx.random.uniform(key=sampler.next_key())
        if bool(u * q_token < p_token):  # accept with probability min(1, p/q)
            continue
        if q is None:  # point-mass draft: the residual is p without that token
            residual = mx.where(mx.arange(p.shape[-1]) == token, 0.0, p)
        else:
            residual = mx.maximum(p - q, 0.0)
        fallback = sampler.draw(mx.log(residual))
        return drafts[:i] + [int(fallback)]
    bonus = sampler.draw(target_logprobs[len(drafts)])
    return drafts + [int(bonus)]


def accept(sampler, drafts: list[int], scores, draft_logprobs, greedy_targets: list[int] | None) -> list[int]:
    """A round's tokens: the drafts the model accepts, then one of its own. Greedy rows bring the
    model's argmax at each position (greedy_targets); sampling rows its scores [len(drafts) + 1, V]."""
    if greedy_targets is not None:
        return accept_greedy(drafts, greedy_targets)
    return accept_sampled(sampler, drafts, draft_logprobs, sampler.log_probs(scores))


class DraftingPolicy:
    """How many drafts one sequence asks for each round (`plan`: up to num_draft_tokens; 0: a plain
    step), adapted to what its rounds accept (`record`), and its figures (`stats`)."""

    # misses in a row before the policy backs off, and the longest run of plain rounds
    MISSES_BEFORE_BACKOFF = 3
    MAX_PLAIN_ROUNDS = 16

    def __init__(self, num_draft_tokens: int, adaptive: bool = False):
        self.k = check_num_draft_tokens(num_draft_tokens)
        self.adaptive = adaptive
        self.stats = SpeculativeStats()
        self.misses = 0  # rounds in a row that asked for drafts and accepted none
        self.plain_rounds = 0  # rounds still to run without drafting

    def plan(self, max_new: int | None = None) -> int:
        """How many drafts to ask for this round (0: a plain step); max_new: tokens still allowed."""
        if self.plain_rounds:
            self.plain_rounds -= 1
            return 0
        return self.k if max_new is None else max(0, min(self.k, max_new - 1))

    def record(self, drafted: int, accepted: int, asked: int, declines_cost: bool):
        """After a verify pass of `drafted` drafts (`asked` for) that accepted the first `accepted`;
        declines_cost: whether the drafter's declining to draft cost a pass (adapts as a miss)."""
        if self.adaptive and (drafted or (asked and declines_cost)):
            self._adapt(accepted)
        self.stats.record(drafted, accepted)

    def _adapt(self, accepted: int):
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= self.MISSES_BEFORE_BACKOFF:
            self.plain_rounds = min(2 ** (self.misses - self.MISSES_BEFORE_BACKOFF), self.MAX_PLAIN_ROUNDS)
