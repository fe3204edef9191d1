"""Text generation: `stream_generate` and `generate`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx

from . import ops
from .drafting import AUTO, DEFAULT_DRAFT_P_MIN, make_drafter
from .prompt import prefill, request_ids
from .sampling import Sampler
from .speculative import SpeculativeDecoder, check_num_draft_tokens

__all__ = ["GenerationResponse", "generate", "prefill", "stream_generate"]


@dataclass
class GenerationResponse:
    text: str  # new text since the previous response
    token: int
    from_draft: bool  # accepted from a draft rather than sampled from the trunk
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop", "length" or None while generating
    acceptance_rate: float | None = None  # speculative decoding: accepted / drafted
    tokens_per_pass: float | None = None  # speculative decoding: tokens per trunk pass
    # speculative decoding: per draft position in a round, the share of drafts accepted
    acceptance_by_position: list[float] | None = None


def decode_rate(generated: int, first_at: float | None, end: float) -> float:
    """Tokens/s after the first token (which the prompt's time pays for)."""
    return (generated - 1) / (end - first_at) if first_at and end > first_at and generated > 1 else 0.0


class StreamingDetokenizer:
    """Emits new text as tokens arrive, holding back incomplete UTF-8 sequences. End tokens
    add no text (what ends a generation is not part of it)."""

    # byte-level BPE decodes piecewise, so a segment can restart after any clean emission
    SEGMENT = 16

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.end_tokens = set(tokenizer.eos_token_ids)
        self.segment: list[int] = []
        self.segment_text = ""

    def add(self, token: int) -> str:
        if token in self.end_tokens:
            return ""
        self.segment.append(token)
        text = self.tokenizer.decode(self.segment)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self.segment_text) :]
        self.segment_text = text
        if len(self.segment) >= self.SEGMENT:
            self.segment, self.segment_text = [], ""
        return new

    def finalize(self) -> str:
        """What is still held back at the end (an incomplete character decodes as U+FFFD)."""
        rest = self.tokenizer.decode(self.segment)[len(self.segment_text) :] if self.segment else ""
        self.segment, self.segment_text = [], ""
        return rest


def _plain_tokens(model, sampler, prompt_hidden, cache) -> Iterator[tuple[int, bool]]:
    """Plain decoding: one trunk step per token."""

    def step(token):
        return sampler(model(token.reshape(1, 1), cache)[:, -1])

    token = sampler(model.logits_from_hidden(prompt_hidden[:, -1:])[:, -1])
    if not ops.overlap_decode_steps():
        while True:
            yield int(token.reshape(-1)[0]), False
            token = step(token)
    mx.async_eval(token)
    while True:
        following = step(token)
        mx.async_eval(following)  # build and queue the next step while this token is handed out
        yield int(token.reshape(-1)[0]), False
        token = following


def _speculative_tokens(decoder, first: int, max_tokens) -> Iterator[tuple[int, bool]]:
    """Speculative decoding: each round yields the accepted drafts, then the trunk's token."""
    yield first, False
    emitted = 1
    while True:
        accepted = decoder.step(max_new=max_tokens - emitted)
        for i, token in enumerate(accepted):
            yield token, i + 1 < len(accepted)
        emitted += len(accepted)


def stream_generate(
    model,
    tokenizer,
    prompt,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    draft: str | None = AUTO,
    draft_model=None,
    num_draft_tokens: int = 3,
    draft_vocab: int | None = None,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
) -> Iterator[GenerationResponse]:
    """Generate from `prompt` (a string or token ids), yielding a response per token.

    temp=0 is greedy. The last response has `finish_reason` "stop" (an end token)
    or "length" (max_tokens or the model's context reached).

    Speculative decoding is on by default where the model has an MTP head
    (`draft="auto"`); `draft=None` turns it off. `draft="mtp"` drafts with the model's
    own MTP head, `draft="ngram"` by looking the last tokens up in the prompt and output,
    `draft_model=` with another model of the same vocabulary; up to
    `num_draft_tokens` per round. The MTP head and draft models project onto the
    `draft_vocab` most frequent tokens (default: 32768 when the vocabulary is larger
    than 65536, else all; 0: all; see `draft_vocab`). Drafting adapts: it stops when
    the draft's top probability falls below `draft_p_min`, and backs off after
    rejections; `draft_p_min=0` drafts exactly `num_draft_tokens` every round. The
    output follows the model's distribution exactly (greedy: token for token).
    Responses then carry `from_draft`, `acceptance_rate`, `tokens_per_pass` and
    `acceptance_by_position`.
    """
    ids, max_tokens = request_ids(model, tokenizer, prompt, max_tokens)
    sampler = Sampler(temp, top_p, top_k, min_p, seed)
    drafter = make_drafter(model, tokenizer, draft, draft_model, draft_vocab, draft_p_min)
    if drafter is not None:
        check_num_draft_tokens(num_draft_tokens)
    if max_tokens == 0:
        return
    mx.reset_peak_memory()
    cache = model.make_cache()
    start = time.perf_counter()
    prompt_hidden = prefill(model, ids, cache)
    if drafter is None:
        stats = None
        tokens = _plain_tokens(model, sampler, prompt_hidden, cache)
    else:
        decoder = SpeculativeDecoder(model, drafter, sampler, num_draft_tokens, cache, adaptive=draft_p_min > 0)
        stats = decoder.stats
        first = decoder.start(ids, prompt_hidden)  # drafters take in the prompt as part of the prefill
        tokens = _speculative_tokens(decoder, first, max_tokens)
    prompt_tps = len(ids) / (time.perf_counter() - start)
    detokenizer = StreamingDetokenizer(tokenizer)
    eos = set(tokenizer.eos_token_ids)
    start = time.perf_counter()
    for n, (token, from_draft) in enumerate(tokens, start=1):
        finish = "stop" if token in eos else ("length" if n >= max_tokens else None)
        elapsed = time.perf_counter() - start
        text = detokenizer.add(token)
        if finish:
            text += detokenizer.finalize()
        yield GenerationResponse(
            text=text,
            token=token,
            from_draft=from_draft,
            prompt_tokens=len(ids),
            prompt_tps=prompt_tps,
            generation_tokens=n,
            generation_tps=n / elapsed if elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            acceptance_rate=stats.acceptance_rate if stats else None,
            tokens_per_pass=stats.tokens_per_pass if stats else None,
            acceptance_by_position=stats.acceptance_by_position if stats else None,
        )
        if finish:
            break


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """The whole generated text (see `stream_generate` for the arguments)."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))
