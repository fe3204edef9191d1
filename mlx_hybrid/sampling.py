"""A request's settings (`SamplingParams`), and turning logits into tokens: greedy, or
temperature with top-k / top-p / min-p (after the request's `processors`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import mlx.core as mx

from .errors import GenerationError
from .processors import Grammar, LogitsProcessor, response_format_grammar

SEED_LIMIT = 2**64  # MLX's random keys take unsigned 64-bit seeds


@dataclass(frozen=True)
class SamplingParams:
    """Every setting of one request, checked once, when it is made (a `GenerationError` that
    names the field). Every entry point builds one: `stream_generate`, `generate`,
    `batch_generate` and `Engine.submit` from their keyword arguments, the server from a
    request body, the commands from their flags.

    max_tokens: the most tokens to generate (the model's context may end it sooner).
    temp: 0 is greedy; above 0 tokens are drawn from the distribution at that temperature.
    top_p: draw from the likeliest tokens whose probabilities sum to top_p (1: all).
    top_k: draw from the k likeliest tokens (0: all).
    min_p: draw from tokens at least min_p times as likely as the likeliest (0: all).
    seed: the random stream's seed, an integer in [0, 2**64) (None: one drawn at random).
    stop_tokens: token ids that end the generation (None: the tokenizer's end tokens).
    logprobs: None, or k >= 0: each token's log-probability under the model (before the
        settings above and below) and the k likeliest alternatives.
    logit_bias: {token id: bias in [-100, 100]} added to those tokens' logits (None: none).
    presence_penalty, frequency_penalty: in [-2, 2], subtracted from the logit of each token
        the output holds (presence once, frequency per occurrence); 0: off.
    repetition_penalty: > 0; the logits of the last repetition_context_size (>= 1) tokens
        of prompt and output are divided by it where positive, multiplied where negative; 1: off.
    grammar: a `processors.Grammar` the output must match (JSON schema, any JSON object,
        regular expression, Lark or GBNF), or None.
    reasoning_budget: None, or n >= 1: after n tokens inside `<think>` (opened by the prompt or
        by the output), `</think>` is forced.
    The order and exact formulas of these five are in `processors`.
    """

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_tokens: tuple[int, ...] | None = None
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    grammar: Grammar | None = None
    reasoning_budget: int | None = None

    def __post_init__(self):
        _check(self, "max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 0, "an integer >= 0")
        _check(self, "temp", _is_number(self.temp) and self.temp >= 0, ">= 0")
        _check(self, "top_p", _is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "in (0, 1]")
        _check(self, "top_k", _is_int(self.top_k) and self.top_k >= 0, "an integer >= 0")
        _check(self, "min_p", _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "in [0, 1]")
        seed_ok = self.seed is None or (_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT)
        _check(self, "seed", seed_ok, "an integer in [0, 2**64)")
        logprobs_ok = self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0)
        _check(self, "logprobs", logprobs_ok, "None or an integer >= 0")
        if self.stop_tokens is not None:
            stops = tuple(self.stop_tokens) if not isinstance(self.stop_tokens, str) else None
            _check(self, "stop_tokens", stops is not None and all(map(_is_int, stops)), "token ids")
            object.__setattr__(self, "stop_tokens", stops)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(self, name, _is_number(value) and -2.0 <= value <= 2.0, "in [-2, 2]")
        _check(self, "repetition_penalty", _is_number(self.repetition_penalty) and self.repetition_penalty > 0, "> 0")
        size = self.repetition_context_size
        _check(self, "repetition_context_size", _is_int(size) and size >= 1, "an integer >= 1")
        if isinstance(self.grammar, dict):  # as `asdict` writes it (a request sent to other ranks)
            object.__setattr__(self, "grammar", Grammar(**self.grammar))
        _check(self, "grammar", self.grammar is None or isinstance(self.grammar, Grammar), "a Grammar or None")
        budget = self.reasoning_budget
        _check(self, "reasoning_budget", budget is None or (_is_int(budget) and budget >= 1), "None or an integer >= 1")

    def replace(self, response_format=None, **changes) -> SamplingParams:
        """These settings with some changed, as keyword arguments: any field, or OpenAI's
        `response_format` (a dict) for the grammar. An unknown keyword is an error that names it."""
        fields = [field.name for field in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise GenerationError(f"unknown setting {unknown[0]!r} (the settings: {', '.join(fields)})")
        format_grammar = response_format_grammar(response_format)
        if format_grammar is not None:
            if changes.get("grammar") is not None:
                raise GenerationError("give either grammar= or response_format=, not both")
            changes["grammar"] = format_grammar
        return dataclasses.replace(self, **changes)

    def sampler(self) -> Sampler:
        return Sampler(self.temp, self.top_p, self.top_k, self.min_p, self.seed)

    def processor(self, prompt: list[int], vocab_size: int, tokenizer) -> LogitsProcessor | None:
        """What acts on the logits before the sampler (None: nothing asked)."""
        return LogitsProcessor(self, prompt, vocab_size, tokenizer) if LogitsProcessor.wanted(self) else None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _logit_bias(bias) -> dict[int, float]:
    """{token id: bias}, ids as integers (JSON bodies send them as strings)."""
    if not isinstance(bias, dict):
        raise GenerationError(f"logit_bias must be a mapping of token ids to biases, got {bias!r}")
    checked = {}
    for token, value in bias.items():
        try:
            token_id = int(token) if not isinstance(token, (bool, float)) else None
        except ValueError:
            token_id = None
        if token_id is None:
            raise GenerationError(f"logit_bias: {token!r} is not a token id")
        if not (_is_number(value) and -100 <= value <= 100):
            raise GenerationError(f"logit_bias: the bias of token {token_id} must be in [-100, 100], got {value!r}")
        checked[token_id] = float(value)
    return checked


def _check(params, name: str, ok: bool, wanted: str):
    if not ok:
        raise GenerationError(f"{name} must be {wanted}, got {getattr(params, name)!r}")


class Sampler:
    """Samples from the filtered, tempered distribution; `temp == 0` is greedy. Its settings
    are those of a `SamplingParams`, which checks them."""

    def __init__(self, temp=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None):
        self.temp, self.top_p, self.top_k, self.min_p = temp, top_p, top_k, min_p
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        self.key = mx.random.key(seed)  # the random stream's position (a discarded pass sets it back)

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def next_key(self):
        self.key, key = mx.random.split(self.key)
        return key

    def log_probs(self, logits: mx.array) -> mx.array:
        """Log-probabilities [..., V] of the distribution `sample` draws from."""
        logits = logits.astype(mx.float32) / self.temp
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        keep = mx.ones(logprobs.shape, dtype=mx.bool_)
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = mx.sort(logprobs, axis=-1)[..., -self.top_k][..., None]
            keep = keep & (logprobs >= kth)
        if self.top_p < 1.0:
            order = mx.argsort(-logprobs, axis=-1)
            sorted_probs = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))
            # keep a token if the mass before it is below top_p (the first always stays)
            before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
            keep_sorted = before < self.top_p
            inverse = mx.argsort(order, axis=-1)
            keep = keep & mx.take_along_axis(keep_sorted, inverse, axis=-1)
        if self.min_p > 0.0:
            top = logprobs.max(axis=-1, keepdims=True)
            keep = keep & (logprobs >= top + mx.log(mx.array(self.min_p)))
        filtered = mx.where(keep, logprobs, -mx.inf)
        return filtered - mx.logsumexp(filtered, axis=-1, keepdims=True)

    def __call__(self, logits: mx.array) -> mx.array:
        """Tokens [...] for logits [..., V]."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return self.draw(self.log_probs(logits))

    def draw(self, logprobs: mx.array, key: mx.array | None = None) -> mx.array:
        """Tokens [...] drawn from log-probabilities [..., V] with the next key (or `key`); a single
        row draws the same token whether it comes as [V] or [1, V] (MLX's draw depends on the shape)."""
        rows = logprobs.reshape(-1, logprobs.shape[-1])
        key = self.next_key() if key is None else key
        return mx.random.categorical(rows, key=key).reshape(logprobs.shape[:-1])
