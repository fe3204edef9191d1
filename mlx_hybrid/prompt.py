"""Prompts in: token ids checked against the vocabulary and the context, chat prompts and
where they can be checkpointed, and the prefill.

Below both generation and speculation, which each prefill (the trunk, a draft model).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

import mlx.core as mx

from . import ops
from .errors import ContextOverflowError, GenerationError

# Prompts are prefilled this many tokens at a time, to bound activation memory.
PREFILL_STEP = 512


def prompt_ids(tokenizer, prompt, vocab_size: int) -> list[int]:
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise GenerationError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise GenerationError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    return ids


def check_text_fits(tokenizer, text: str, context: int):
    """Refuse a text that cannot fit a context of `context` tokens without tokenizing it: no token
    covers more than the tokenizer's longest token, so a text of n bytes is at least n / longest
    tokens (tokenizing megabytes takes minutes)."""
    fewest = len(text.encode("utf-8", "surrogatepass")) // tokenizer.longest_token_bytes
    if fewest >= context:
        raise ContextOverflowError(
            f"the prompt has at least {fewest} tokens ({len(text)} characters) but the model's context is "
            f"{context} tokens"
        )


def check_context(model, num_prompt: int) -> int:
    """Raise if the prompt does not fit; return how many tokens may follow it."""
    context = model.args.max_position_embeddings
    if num_prompt >= context:
        raise ContextOverflowError(f"the prompt has {num_prompt} tokens but the model's context is {context} tokens")
    return context - num_prompt


def request_ids(model, tokenizer, prompt, max_tokens: int) -> tuple[list[int], int]:
    """A request's prompt ids, checked, and how many tokens it may generate (max_tokens,
    or fewer where the context ends)."""
    ids = prompt_ids(tokenizer, prompt, model.args.vocab_size)
    return ids, min(max_tokens, check_context(model, len(ids)))  # max_tokens: checked by SamplingParams


def prefill(model, ids: list[int], cache, step: int = PREFILL_STEP) -> mx.array:
    """Run the prompt through the model; returns its hidden states [1, T, E] (before the final norm)."""
    tokens = mx.array(ids)[None]
    hidden = []
    for start in range(0, len(ids), step):
        chunk = tokens[:, start : start + step]
        hidden.append(model.hidden_states(chunk, cache, evaluate_each_layer=ops.prefill_layer_by_layer()))
        mx.eval(hidden[-1])
    return mx.concatenate(hidden, axis=1) if len(hidden) > 1 else hidden[0]


@dataclass
class ChatPrompt:
    """A conversation rendered by the chat template, ready for the engine."""

    text: str
    ids: list[int]
    # token counts at which the first message or one of the last few ends and the rendering of
    # the messages so far is a prefix of this one (templates that drop earlier reasoning break
    # it): where a checkpoint can serve the conversation's next turn
    boundaries: list[int]


def user_message(text: str, num_images: int = 0) -> dict:
    """A user message of `text`, after `num_images` image parts (which the template renders
    as the model's image placeholders)."""
    if not num_images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}


RECENT_BOUNDARIES = 4  # message ends near the conversation's end that may serve its next turn


def chat_prompt(tokenizer, messages: list[dict], context: int | None = None, marks=(), **template_kwargs) -> ChatPrompt:
    """Render messages with the generation prompt; template errors raise GenerationError. context:
    refuse (ContextOverflowError) a rendering that cannot fit that many tokens before tokenizing it.
    marks: (message index, characters of its text content, or None for the whole message) where the
    client marked a prefix worth a checkpoint (Anthropic's `cache_control`): boundaries too."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
    except Exception as e:  # jinja2's errors, raise_exception in a template, a model without one
        raise GenerationError(f"chat template: {e}") from None
    if context is not None:
        check_text_fits(tokenizer, text, context)
    ids, token_ends = tokenizer.encode_with_ends(text)
    # a boundary: where the rendering of the first messages ends, if that is a prefix of this
    # text and a token of it ends there (one encoding of the whole text, not one per prefix: a
    # long session's request would otherwise tokenize its history once per message)
    tokens_before = {end: i + 1 for i, end in enumerate(token_ends)}
    boundaries = set()
    # after the first message (a system prompt other conversations share) and the last few: the
    # earlier ends were the last few of the requests that came before in this conversation
    ends = {1, *range(max(1, len(messages) - RECENT_BOUNDARIES + 1), len(messages) + 1)}
    ends |= {index + 1 for index, chars in marks if chars is None}
    for end in sorted(ends):
        prefix = _rendered(tokenizer, messages[:end], template_kwargs)
        count = tokens_before.get(len(prefix)) if prefix and text.startswith(prefix) else None
        if count is not None and count < len(ids):
            boundaries.add(count)
    for index, chars in marks:
        if chars is None:
            continue
        cut = [*messages[:index], dict(messages[index], content=messages[index]["content"][:chars])]
        shared = os.path.commonprefix([_rendered(tokenizer, cut, template_kwargs), text])
        # the tokens that end within the shared text, less the last, which may belong to a word
        # the next request continues otherwise (the store compares tokens: a wrong guess only
        # makes a checkpoint no request resumes from)
        count = bisect.bisect_right(token_ends, len(shared)) - 1
        if count > 0:
            boundaries.add(count)
    return ChatPrompt(text, ids, sorted(boundaries))


def _rendered(tokenizer, messages: list[dict], template_kwargs) -> str:
    """The rendering of a conversation's first messages, without the generation prompt; "" where the
    template refuses a partial conversation."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    except Exception:  # noqa: BLE001
        return ""
