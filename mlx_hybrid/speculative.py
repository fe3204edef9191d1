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

from .drafting.base import DraftDistributions
from .errors import GenerationError
from .sampling import row_items, split_keys


def keep_snapshot_buffers(cache, num_draft_tokens: int):
    """Let MLX's allocator keep a few rounds of snapshot buffers for reuse (it only raises the limit).

    Every verify pass allocates and frees the same buffers per layer: on a GPU (k + 1) recurrent
    states (each token's state is kept as a snapshot, so none is updated in place); on the CPU
    the state, each token's inputs to the rule and, after a rollback, the state replayed. Beyond
    the allocator's cache limit (32 MB by default on the CPU) they go back to the system and
    return as fresh pages, which made verify passes up to two and a half times slower at the
    Qwen3.5-0.8B shape when every token's state was kept on the CPU (benchmarks/spec_decode.py).
    """
    wanted = 4 * (num_draft_tokens + 1) * sum(c.step_nbytes for c in cache)
    previous = mx.set_cache_limit(wanted)
    if previous > wanted:
        mx.set_cache_limit(previous)


def check_num_draft_tokens(num_draft_tokens: int, most: int | None = None) -> int:
    """num_draft_tokens, or one error naming it: below 1, or above `most` (a drafter's
    `max_draft_tokens`, the most drafts its round can hold; None: no bound)."""
    if num_draft_tokens < 1:
        raise GenerationError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if most is not None and num_draft_tokens > most:
        raise GenerationError(f"num_draft_tokens must be at most {most} with this drafter, got {num_draft_tokens}")
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


def sampled_rounds(samplers, drafts: mx.array, marked: mx.array, draft_probs, target_logprobs) -> mx.array:
    """Speculative sampling (Leviathan et al., Chen et al.) for S rows at once: each row's output follows
    the target exactly. drafts [S, n] (int32, lazy) as the pass read them, and `marked`, the same with
    their p-min verdicts (`drafting.unmarked`): a row's round is its drafts before the first unsure one,
    u of them (a row with fewer drafts than n is padded with unsure ones). draft_probs [S, n, V]: the
    distributions each draft was drawn from (a point mass: its one-hot), None where n is 0;
    target_logprobs [S, n + 1, V]: the model's at each position. samplers: the rows' `Samplers`. Built on
    the device, read with the pass's other values: [S, 2], each row's [a, token], the drafts accepted and
    the model's token after them.

    The rule, draft by draft: accept d_i with probability min(1, p(d_i) / q(d_i)), with u_i from the
    row's next key; at the first rejection a token from the residual max(p - q, 0) with the key after,
    else the bonus token from position u's p. Every draft's test and residual is computed and the first
    rejection chosen on the device; the keys are the ones a draft-by-draft loop takes, and each row's
    stream is left where that loop leaves it. Every step is one operation over all rows."""
    n = drafts.shape[1]
    states, keys = [samplers.keys()], []  # the streams after each key taken, and the keys [S, 2]
    for _ in range(n + 1):
        state, key = split_keys(states[-1])
        states.append(state)
        keys.append(key)
    keys, states = mx.stack(keys, axis=1), mx.stack(states, axis=1)  # [S, n + 1, 2], [S, n + 2, 2]
    sure = mx.cumprod(marked >= 0, axis=1).sum(axis=1).astype(mx.int32) if n else mx.zeros(len(samplers), mx.int32)
    bonus = samplers.draw(row_items(target_logprobs, sure), row_items(keys, sure))  # all accepted: the bonus token
    accepted, token = sure, bonus
    if n:
        p = mx.exp(target_logprobs[:, :n])
        p_drafts = mx.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
        q_drafts = mx.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        u = mx.vmap(mx.vmap(lambda key: mx.random.uniform(key=key)))(keys[:, :n])
        accepted = mx.minimum(mx.cumprod(u * q_drafts < p_drafts, axis=1).sum(axis=1).astype(mx.int32), sure)
        rejected_at = mx.minimum(accepted, n - 1)
        residual = mx.maximum(row_items(p, rejected_at) - row_items(draft_probs, rejected_at), 0.0)
        fallback = samplers.draw(mx.log(residual), row_items(keys, rejected_at + 1))
        token = mx.where(accepted < sure, fallback, bonus)
    # the stream after the keys the loop takes: a + 1 tests and the fallback, or u tests and the bonus
    samplers.set_keys(row_items(states, mx.where(accepted < sure, accepted + 2, sure + 1)))
    return mx.stack([accepted, token.astype(mx.int32)], axis=1)


def accept(drafts: list[int], round_values: list[int], greedy: bool) -> list[int]:
    """A round's tokens from what the pass read: greedy, the model's argmax at each position
    (`round_values`); sampling, its row of `sampled_rounds`' [a, token]."""
    if greedy:
        return accept_greedy(drafts, round_values)
    accepted, token = round_values
    return drafts[:accepted] + [token]


class DraftingPolicy:
    """How many drafts one sequence asks for each round (`plan`: up to num_draft_tokens; 0: a plain
    step), adapted to what its rounds accept (`record`), and its figures (`stats`).

    adaptive: back off to plain rounds after misses. adaptive_length (a block drafter's rows): ask for
    as many drafts as the rounds accept, doubling after a round that accepted all it asked for and
    else two more than it accepted (at least MIN_LENGTH): a verify pass's cost grows with its tokens
    where the products are compute-bound (a CPU), and a block is often accepted in part."""

    # misses in a row before the policy backs off, and the longest run of plain rounds (the bundled
    # model with drafts that never land: 0.83-0.85x plain decoding at 16, 0.87-0.88x at 64;
    # docs/benchmarks.md, "Drafts that keep missing")
    MISSES_BEFORE_BACKOFF = 3
    MAX_PLAIN_ROUNDS = 64
    MIN_LENGTH = 2

    def __init__(
        self, num_draft_tokens: int, adaptive: bool = False, adaptive_length: bool = False, most: int | None = None
    ):
        self.k = check_num_draft_tokens(num_draft_tokens, most)
        self.adaptive, self.adaptive_length = adaptive, adaptive_length
        self.length = self.k  # drafts asked for (k unless the length adapts)
        self.stats = SpeculativeStats()
        self.misses = 0  # rounds in a row that asked for drafts and accepted none
        self.plain_rounds = 0  # rounds still to run without drafting

    def plan(self, max_new: int | None = None) -> int:
        """How many drafts to ask for this round (0: a plain step); max_new: tokens still allowed."""
        if self.plain_rounds:
            self.plain_rounds -= 1
            return 0
        return self.length if max_new is None else max(0, min(self.length, max_new - 1))

    @property
    def backed_off(self) -> bool:
        """Whether the next round is a plain step, whatever `plan` is told."""
        return self.plain_rounds > 0

    def record(self, drafted: int, accepted: int, asked: int, declines_cost: bool):
        """After a verify pass of `drafted` drafts (`asked` for) that accepted the first `accepted`;
        declines_cost: whether the drafter's declining to draft cost a pass (adapts as a miss)."""
        if self.adaptive and (drafted or (asked and declines_cost)):
            self._adapt(accepted)
        if self.adaptive_length and asked:
            grown = 2 * self.length if accepted == asked else accepted + 2
            self.length = max(min(self.MIN_LENGTH, self.k), min(self.k, grown))
        self.stats.record(drafted, accepted)

    def _adapt(self, accepted: int):
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= self.MISSES_BEFORE_BACKOFF:
            self.plain_rounds = min(2 ** (self.misses - self.MISSES_BEFORE_BACKOFF), self.MAX_PLAIN_ROUNDS)


def draft_probabilities(distributions: list, drafts: mx.array, vocab: int) -> mx.array:
    """The sampling rows' draft distributions as probabilities [S, n, V].

    The rows of a drafting group (`DraftDistributions` over one array) are gathered at once; a row that
    drafted alone (a list of [V]) brings its own; a point mass (a list of None) is its draft's one-hot."""
    rows, n = drafts.shape
    sources, order, point_masses = {}, [], []  # id(array) -> (array, its rows' indices there)
    for r, q in enumerate(distributions):
        if isinstance(q, DraftDistributions):
            array, index = q.logprobs, q.row
        elif len(q) and q[0] is not None:
            array, index = mx.stack(list(q))[None], 0
        else:
            point_masses.append(r)
            continue
        sources.setdefault(id(array), (array, []))[1].append(index)
        order.append(r)
    parts = []
    for array, indices in sources.values():
        taken = array if indices == list(range(array.shape[0])) else array[mx.array(indices)]
        width = taken.shape[1]
        if width < n:
            taken = mx.concatenate([taken, mx.full((taken.shape[0], n - width, vocab), -mx.inf)], axis=1)
        parts.append(taken[:, :n])
    if point_masses:
        parts.append(mx.full((len(point_masses), n, vocab), -mx.inf))
    logprobs = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    order += point_masses
    if order != list(range(rows)):
        logprobs = logprobs[mx.array(sorted(range(rows), key=order.__getitem__))]  # row r at its place
    probs = mx.exp(logprobs)
    if not point_masses:
        return probs
    one_hot = mx.arange(vocab) == drafts[..., None]
    is_point = mx.array([r in point_masses for r in range(rows)]).reshape(-1, 1, 1)
    return mx.where(is_point, one_hot.astype(mx.float32), probs)
