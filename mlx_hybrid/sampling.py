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
    """One request's random stream and the settings it samples with (those of a `SamplingParams`,
    which checks them); `temp == 0` is greedy. It samples as `Samplers` samples its row."""

    def __init__(self, temp=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None):
        self.temp, self.top_p, self.top_k, self.min_p = temp, top_p, top_k, min_p
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        self.key = mx.random.key(seed)  # the random stream's position (a discarded pass sets it back)
        self._key_row = None  # (keys [R, 2], r, keys[r]) where `key` is row r of a `Samplers`' keys

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def log_probs(self, logits: mx.array) -> mx.array:
        """Log-probabilities [..., V] of the distribution `draw` draws from."""
        return Samplers([self]).log_probs(logits[None])[0]

    def __call__(self, logits: mx.array) -> mx.array:
        """Tokens [...] for logits [..., V]."""
        return Samplers([self]).sample(logits[None])[0]

    def draw(self, logprobs: mx.array, key: mx.array | None = None) -> mx.array:
        """Tokens [...] drawn from log-probabilities [..., V] with the next key (or `key`)."""
        samplers = Samplers([self])
        return samplers.draw(logprobs[None], samplers.take_keys() if key is None else key[None])[0]


class Samplers:
    """Several rows' samplers as one: their settings as columns and their keys as one array [R, 2], so
    that a pass samples all its rows in the same few operations whatever their number (a GPU's launches
    do not grow with the rows). Each operation on row r computes what it computes for that row alone,
    bit for bit: a request samples the same tokens alone or in a batch."""

    def __init__(self, samplers: list[Sampler]):
        self.members = list(samplers)
        self.greedy = all(s.greedy for s in self.members)

    def __len__(self) -> int:
        return len(self.members)

    def keys(self) -> mx.array:
        """The rows' random keys [R, 2]: the array they are rows of, where the last `Samplers` over these
        rows in this order left them (no copy), else stacked."""
        first = self.members[0]._key_row
        if first is not None and first[0].shape[0] == len(self.members):
            same = all(
                s._key_row is not None and s._key_row[0] is first[0] and s._key_row[1] == r and s.key is s._key_row[2]
                for r, s in enumerate(self.members)
            )
            if same:
                return first[0]
        return mx.stack([s.key for s in self.members])

    def set_keys(self, keys: mx.array):
        """Each row's stream continues from its row of keys [R, 2]."""
        for r, sampler in enumerate(self.members):
            sampler.key = keys[r]
            sampler._key_row = (keys, r, sampler.key)

    def take_keys(self) -> mx.array:
        """The next key of every row's stream [R, 2] (one split of each), the streams moved past it."""
        streams, taken = split_keys(self.keys())
        self.set_keys(streams)
        return taken

    def column(self, values: list, like: mx.array, dtype=mx.float32) -> mx.array:
        """Per-row values as [R, 1, ...] against `like` [R, ..., V]."""
        return mx.array(values, dtype).reshape(-1, *[1] * (like.ndim - 1))

    def log_probs(self, logits: mx.array) -> mx.array:
        """Each row's log-probabilities [R, ..., V] after its temperature (a greedy row's: 1), top-k, top-p
        and min-p; a filter enters the graph where some row asks for it, and leaves the other rows' values
        as they are."""
        members, vocab = self.members, logits.shape[-1]
        temps = [s.temp if not s.greedy else 1.0 for s in members]
        logits = logits.astype(mx.float32) / self.column(temps, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        keep = None
        if any(0 < s.top_k < vocab for s in members):
            kept = [s.top_k if 0 < s.top_k < vocab else vocab for s in members]
            at = mx.broadcast_to(self.column([vocab - k for k in kept], logits, mx.int32), (*logits.shape[:-1], 1))
            keep = logprobs >= mx.take_along_axis(mx.sort(logprobs, axis=-1), at, axis=-1)
        if any(s.top_p < 1.0 for s in members):
            order = mx.argsort(-logprobs, axis=-1)
            sorted_probs = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))
            # keep a token if the mass before it is below top_p (the first always stays; top_p 1: all)
            before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
            keep_sorted = before < self.column([s.top_p if s.top_p < 1.0 else mx.inf for s in members], logits)
            top_p = mx.take_along_axis(keep_sorted, mx.argsort(order, axis=-1), axis=-1)
            keep = top_p if keep is None else keep & top_p
        if any(s.min_p > 0.0 for s in members):
            top = logprobs.max(axis=-1, keepdims=True)
            min_p = logprobs >= top + mx.log(self.column([s.min_p for s in members], logits))
            keep = min_p if keep is None else keep & min_p
        filtered = logprobs if keep is None else mx.where(keep, logprobs, -mx.inf)
        return filtered - mx.logsumexp(filtered, axis=-1, keepdims=True)

    def draw(self, logprobs: mx.array, keys: mx.array) -> mx.array:
        """Tokens [R, ...] drawn from log-probabilities [R, ..., V], row r with keys[r] (the Gumbel-max
        draw: the same token for a row whatever the other rows)."""
        shape = logprobs.shape[1:]
        noise = mx.vmap(lambda key: mx.random.gumbel(shape=shape, key=key))(keys)
        return mx.argmax(logprobs + noise, axis=-1)

    def sample(self, logits: mx.array, logprobs: mx.array | None = None) -> mx.array:
        """Tokens [R, ...] for logits [R, ..., V]: greedy rows their argmax, the others drawn from their
        `log_probs` (given, or computed here), every row's stream moved one key on."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        drawn = self.draw(self.log_probs(logits) if logprobs is None else logprobs, self.take_keys())
        greedy = [s.greedy for s in self.members]
        if not any(greedy):
            return drawn
        return mx.where(self.column(greedy, drawn, mx.bool_), mx.argmax(logits, axis=-1), drawn)


def split_keys(keys: mx.array) -> tuple[mx.array, mx.array]:
    """Each key of keys [R, 2] split in two, as `mx.random.split` splits one: (the streams, the keys taken)."""
    pairs = mx.vmap(mx.random.split)(keys)
    return pairs[:, 0], pairs[:, 1]


def row_items(x: mx.array, index: mx.array) -> mx.array:
    """x[r, index[r]] for every row r of x [R, m, ...] (index [R]): one gather, whatever the rows."""
    at = index.reshape(-1, *[1] * (x.ndim - 1))
    return mx.take_along_axis(x, mx.broadcast_to(at, (x.shape[0], 1, *x.shape[2:])), axis=1)[:, 0]
