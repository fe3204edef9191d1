"""What acts on the model's logits before a token is chosen, per request: logit bias,
penalties, and a grammar (llguidance).

At every position where a token is chosen (the first after the prompt, and each position
of a verify pass), in this order, in float32:
1. logit_bias: the bias of each listed token is added to its logit (OpenAI);
2. repetition_penalty over the last `repetition_context_size` tokens of prompt and output
   (llama.cpp, mlx-lm): each such token's logit is divided by it where positive and
   multiplied by it where negative;
3. presence and frequency penalties over the output so far (OpenAI): a token generated
   c times has frequency_penalty * c + presence_penalty (when c > 0) subtracted;
4. the grammar: tokens it forbids next get -inf;
5. reasoning_budget: once that many tokens have been generated inside `<think>` (opened by the
   prompt, or by the output), the tokens of `</think>` are the only ones allowed, in turn.
The sampler (temperature, top-k, top-p, min-p) or greedy argmax then reads the result.

Under speculation, verify position j sees the output with that round's first j drafts in
it (counts, window and grammar alike), so speculative output is plain output exactly.
Drafters that compute distributions (the MTP head, a draft model) draw each draft from what
the grammar allows after the ones before it (`draft_mask`); a draft it forbids all the same
(an n-gram's) is cut, with the drafts after it, before the verify pass.
"""

from __future__ import annotations

import functools
import json
import weakref
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .errors import GenerationError

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
# JSON as json.dumps writes it: one space after ',' and ':', no other whitespace, so
# that a model cannot wander in whitespace (as OpenAI's structured outputs do)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated text.

    kind: "json_schema" (source: the schema, as JSON text or a dict), "json_object" (any
    JSON object; no source), "regex", "lark" (llguidance's Lark) or "gbnf" (llama.cpp's
    grammar format, converted to Lark).
    """

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise GenerationError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if isinstance(self.source, dict):
            object.__setattr__(self, "source", json.dumps(self.source))
        if not isinstance(self.source, str):
            raise GenerationError(f"a grammar's source must be text, got {type(self.source).__name__}")
        if self.kind != "json_object" and not self.source.strip():
            raise GenerationError(f"a {self.kind} grammar needs its text")
        self.compiled()  # a bad grammar is refused where it is given, before any model runs

    @functools.lru_cache(maxsize=256)  # a server sees the same schemas again and again
    def compiled(self) -> str:
        """The grammar as llguidance reads it, checked."""
        from llguidance import LLMatcher

        try:
            grammar = self._translated()
            error = LLMatcher.validate_grammar(grammar)
        except Exception as e:  # noqa: BLE001  (llguidance raises ValueError and others for bad text)
            error = str(e)
        if error:
            raise grammar_error(self.kind, error)
        return grammar

    def _translated(self) -> str:
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        return LLMatcher.grammar_from_lark(any_to_lark(self.source) if self.kind == "gbnf" else self.source)


def grammar_error(kind: str, error: str) -> GenerationError:
    """llguidance's message, on one line (it draws its errors over several)."""
    return GenerationError(f"invalid {kind} grammar: {' '.join(error.split())}")


def response_format_grammar(response_format) -> Grammar | None:
    """The grammar of an OpenAI `response_format`: {"type": "text"} (None), {"type":
    "json_object"}, or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise GenerationError("response_format: json_schema needs a schema ({'json_schema': {'schema': {...}}})")
        return Grammar("json_schema", schema)
    raise GenerationError(f"response_format: type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


_grammar_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _grammar_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of a tokenizer (about a second to build for a large vocabulary): once each."""
    from llguidance import LLTokenizer

    key = (vocab_size, tuple(tokenizer.eos_token_ids))
    per_tokenizer = _grammar_tokenizers.setdefault(tokenizer, {})
    if key not in per_tokenizer:
        per_tokenizer[key] = LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids)
        )
    return per_tokenizer[key]


class LogitsProcessor:
    """One request's processing of the logits (see the module's docstring), with what it needs
    to remember: the tokens generated so far, the prompt's tail, the grammar's state."""

    def __init__(self, params, prompt: list[int], vocab_size: int, tokenizer):
        bias = params.logit_bias or {}
        outside = [t for t in bias if not 0 <= t < vocab_size]
        if outside:
            raise GenerationError(f"logit_bias: token id {outside[0]} is outside the vocabulary (0..{vocab_size - 1})")
        self.bias_ids = mx.array(sorted(bias), dtype=mx.int32) if bias else None
        self.bias_values = mx.array([bias[t] for t in sorted(bias)], dtype=mx.float32) if bias else None
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.repetition, self.window = params.repetition_penalty, params.repetition_context_size
        self.prompt_tail = list(prompt[-self.window :]) if self.repetition != 1.0 else []
        self.generated: list[int] = []
        self.matcher, self.end_tokens = None, set()
        self.vocab_size = vocab_size
        self.budget = _ReasoningBudget(params.reasoning_budget, prompt, tokenizer) if params.reasoning_budget else None
        if params.grammar is not None:
            self.end_tokens = set(tokenizer.eos_token_ids)
            from llguidance import LLMatcher

            self.matcher = LLMatcher(_grammar_tokenizer(tokenizer, vocab_size), params.grammar.compiled(), log_level=0)
            if self.matcher.is_error():
                raise grammar_error(params.grammar.kind, self.matcher.get_error())

    @staticmethod
    def wanted(params) -> bool:
        """Whether `params` asks for any processing."""
        return bool(
            params.logit_bias
            or params.presence_penalty
            or params.frequency_penalty
            or params.repetition_penalty != 1.0
            or params.grammar is not None
            or params.reasoning_budget is not None
        )

    def allowed_drafts(self, drafts: list[int]) -> int:
        """How many of the drafts, from the first, the grammar allows after the output so far."""
        return len(drafts) if self.matcher is None else self.matcher.validate_tokens(drafts)

    def __call__(self, logits: mx.array, drafts: list[int]) -> mx.array:
        """Processed logits [P, V] (float32) for logits [P, V] at positions whose prefixes end
        with the output so far and then drafts[:j] (P <= len(drafts) + 1)."""
        logits = logits.astype(mx.float32)
        positions = logits.shape[0]
        if self.bias_ids is not None:
            logits = logits.at[:, self.bias_ids].add(self.bias_values)
        if self.repetition != 1.0:
            rows, cols = self._window_tokens(drafts, positions)
            seen = logits[rows, cols]
            logits[rows, cols] = mx.where(seen > 0, seen / self.repetition, seen * self.repetition)
        if self.presence or self.frequency:
            rows, cols, amounts = self._output_counts(drafts, positions)
            if rows.size:
                penalty = (self.frequency * amounts + self.presence).astype(np.float32)
                logits = logits.at[mx.array(rows), mx.array(cols)].subtract(mx.array(penalty))
        if self.matcher is not None:
            logits = mx.where(self._allowed(drafts, positions, logits.shape[1]), logits, -mx.inf)
        if self.budget is not None:
            forced = self.budget.forced(drafts, positions)
            if forced:
                rows, only = np.zeros((positions, 1), dtype=np.bool_), np.zeros((positions, 1), dtype=np.int64)
                for j, token in forced:
                    rows[j], only[j] = True, token
                others = mx.arange(logits.shape[1])[None] != mx.array(only)
                logits = mx.where(mx.array(rows) & others, -mx.inf, logits)
        return logits

    def _window_tokens(self, drafts, positions):
        rows, cols = [], []
        history = self.prompt_tail + self.generated
        for j in range(positions):
            window = np.unique(np.array((history + drafts[:j])[-self.window :], dtype=np.int64))
            rows.append(np.full(window.size, j))
            cols.append(window)
        return mx.array(np.concatenate(rows)), mx.array(np.concatenate(cols))

    def _output_counts(self, drafts, positions):
        rows, cols, amounts = [], [], []
        for j in range(positions):
            ids, counts = np.unique(np.array(self.generated + drafts[:j], dtype=np.int64), return_counts=True)
            rows.append(np.full(ids.size, j))
            cols.append(ids)
            amounts.append(counts)
        return np.concatenate(rows), np.concatenate(cols), np.concatenate(amounts).astype(np.float64)

    def draft_mask(self, drafts: list[int]) -> mx.array | None:
        """What the grammar allows [V] (bool) after the output and drafts, for a drafter to draw
        from; None without a grammar, or when it forbids one of the drafts (they will be cut)."""
        if self.matcher is None or self.allowed_drafts(drafts) < len(drafts) or self.end_tokens.intersection(drafts):
            return None
        return self._allowed(drafts, len(drafts) + 1, self.vocab_size, first=len(drafts))[0]

    def _allowed(self, drafts, positions, vocab_size, first: int = 0) -> mx.array:
        """The grammar's masks [P - first, V] (bool): for each position j from `first` on, what
        it allows after the output and drafts[:j]. Positions after a drafted end token allow
        everything: nothing chosen there is kept, and the matcher is not given the end token
        (llguidance cannot roll back over one)."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        words = allocate_token_bitmask(positions - first, vocab_size)
        consumed = 0
        for j in range(positions):
            if j >= first:
                fill_next_token_bitmask(self.matcher, words, j - first)
            if j == positions - 1:
                break
            if drafts[j] in self.end_tokens:
                words[max(j + 1 - first, 0) :] = -1  # every bit set
                break
            consumed += self.matcher.consume_token(drafts[j])
        if consumed:
            self.matcher.rollback(consumed)
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # token i: bit i % 32 of word i // 32
        return mx.array(bits[:, :vocab_size].astype(np.bool_))

    def accept(self, tokens: list[int]) -> bool:
        """The tokens the request emitted; whether the grammar took them."""
        self.generated += tokens
        if self.budget is not None:
            self.budget.advance(tokens)
        return self.matcher is None or self.matcher.consume_tokens(tokens)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (not even an end token)."""
        return self.matcher is not None and self.matcher.is_stopped()


class _ReasoningBudget:
    """Counts the tokens generated inside `<think>`, to end the reasoning once `limit` have been
    spent: from then on the tokens of `</think>` (as the tokenizer writes the tag) are the only
    ones allowed, one by one, until the output ends with it."""

    def __init__(self, limit: int, prompt: list[int], tokenizer):
        self.open, self.close = (tuple(tokenizer.encode(tag)) for tag in ("<think>", "</think>"))
        if not self.open or not self.close:
            raise GenerationError("reasoning_budget: this model's tokenizer does not write <think> and </think>")
        self.limit, self.keep = limit, max(len(self.open), len(self.close))
        self.state = self._after(prompt, (False, 0, ()))
        self.state = (self.state[0], 0, self.state[2])  # only the output's reasoning counts

    def _after(self, tokens, state):
        inside, spent, tail = state
        for token in tokens:
            tail = (*tail, token)[-self.keep :]
            if tail[-len(self.close) :] == self.close:
                inside = False
            elif inside:
                spent += 1
            elif tail[-len(self.open) :] == self.open:
                inside, spent = True, 0
        return inside, spent, tail

    def advance(self, tokens: list[int]):
        self.state = self._after(tokens, self.state)

    def forced(self, drafts: list[int], positions: int) -> list[tuple[int, int]]:
        """(position j, the only token allowed there) for the positions j < positions where, after the
        output and drafts[:j], the budget is spent: the next token of `</think>`."""
        forced = []
        for j in range(positions):
            inside, spent, tail = self._after(drafts[:j], self.state)
            if inside and spent >= self.limit:
                # how much of the tag the output already ends with (what was forced so far, or written)
                done = max(k for k in range(len(self.close)) if k == 0 or tail[-k:] == self.close[:k])
                forced.append((j, self.close[done]))
        return forced
