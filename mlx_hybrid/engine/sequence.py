"""What a submitter of requests sees of the engine: a `Sequence` whose tokens arrive as `Event`s,
and the settings a request is submitted with."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import mlx.core as mx

from ..sampling import SamplingParams
from ..speculative import SpeculativeStats


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (before sampling settings), and
    the likeliest alternatives at its position, best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Event:
    """What a sequence produced in one step: new tokens, and at the end why it ended."""

    tokens: list[int]
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    error: str | None = None  # what went wrong, with "error"
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    accepted_drafts: int = 0  # how many of the tokens, from the first, are drafts the model accepted

    @property
    def drafted(self) -> int:
        """`accepted_drafts`' former name."""
        return self.accepted_drafts


@dataclass
class Sequence:
    """One request in the engine, as its submitter sees it."""

    prompt: list[int]
    max_tokens: int
    logprobs: int | None = None  # None: none; k: each token's log-probability and the top k
    cached_tokens: int = 0  # prompt tokens that came from a checkpoint
    # set once the engine has taken the sequence in and looked up its checkpoint (cached_tokens is final)
    started: threading.Event = field(default_factory=threading.Event)
    tokens: list[int] = field(default_factory=list)  # generated so far
    finish_reason: str | None = None
    error: str | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False
    stats: SpeculativeStats | None = None  # with a drafter: drafts accepted, tokens per pass

    def cancel(self):
        """Stop generating; the engine frees the row at its next step."""
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def stream(self, timeout: float | None = None):
        """The events, as the engine produces them (for a consumer on another thread)."""
        while True:
            event = self.events.get(timeout=timeout)
            yield event
            if event.finish_reason is not None:
                return


def request_params(params: SamplingParams | None, max_tokens: int | None, settings: dict) -> SamplingParams:
    """`submit`'s settings: `params` (default: all defaults) with max_tokens and the keywords applied."""
    if max_tokens is not None:
        settings = {**settings, "max_tokens": max_tokens}
    return (params or SamplingParams()).replace(**settings)


def token_logprobs(tokens: list[int], logits: mx.array, top: int) -> list[TokenLogprob]:
    """Each token's log-probability under logits [n, V] (float32), and the top alternatives."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0]
    if top:
        best = mx.argsort(-logprobs, axis=-1)[:, :top]
        best_logprobs = mx.take_along_axis(logprobs, best, axis=-1)
        best, best_logprobs = best.tolist(), best_logprobs.tolist()
    else:
        best, best_logprobs = [[]] * len(tokens), [[]] * len(tokens)
    return [
        TokenLogprob(token, logprob, list(zip(ids, values)))
        for token, logprob, ids, values in zip(tokens, chosen.tolist(), best, best_logprobs)
    ]
