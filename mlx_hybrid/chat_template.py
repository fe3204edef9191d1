"""Chat templates rendered as Hugging Face's `apply_chat_template` renders them: its keywords with
their meanings and defaults (as transformers 4 and mlx-lm return them: token ids unless
`tokenize=False`, a dict only with `return_dict=True`), in jinja2's sandbox. A keyword whose effect
this cannot give is refused by name, never ignored."""

from __future__ import annotations

import functools
import inspect
import json

import numpy as np

# HF's marker for continue_final_message: appended to the final message, found in the rendering,
# and the text from it on cut away
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_TENSOR_TYPES = ("np", "mlx")
_NO_PADDING = (False, None, "do_not_pad", "longest", True)  # on a single conversation or equal lengths


def apply_chat_template(
    tokenizer,
    conversation,
    tools=None,
    documents=None,
    chat_template: str | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    tokenize: bool = True,
    padding=False,
    truncation: bool = False,
    max_length: int | None = None,
    return_tensors: str | None = None,
    return_dict: bool = False,
    return_assistant_tokens_mask: bool = False,
    tokenizer_kwargs: dict | None = None,
    **template_variables,
):
    """A conversation (a list of messages; a list of them: one result each) rendered by the chat
    template: its text with tokenize=False, else its token ids (the text encoded without special
    tokens added, as HF does), or with return_dict=True {"input_ids", "attention_mask"};
    return_tensors "np" or "mlx" gives arrays with a batch axis. Other keywords are the template's
    variables (enable_thinking=False, ...)."""
    if return_assistant_tokens_mask:
        raise ValueError("return_assistant_tokens_mask is not supported here (no {% generation %} spans)")
    if tokenizer_kwargs:
        raise ValueError(f"tokenizer_kwargs are not supported here (got {sorted(tokenizer_kwargs)})")
    if return_tensors is not None and return_tensors not in _TENSOR_TYPES:
        raise ValueError(f"return_tensors must be one of {', '.join(_TENSOR_TYPES)}, got {return_tensors!r}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible: give one")
    if any(callable(tool) for tool in tools or []):
        raise ValueError("tools are JSON schemas (dicts) here, not Python functions")
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError("a conversation is a non-empty list of messages (or a list of such lists)")
    batched = isinstance(conversation[0], (list, tuple))
    template = chat_template or tokenizer.chat_template
    if not template:
        raise ValueError("this model has no chat template")
    variables = (
        dict(
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.decode(tokenizer.eos_token_ids[:1]) if tokenizer.eos_token_ids else "",
        )
        | template_variables
    )
    conversations = conversation if batched else [conversation]
    texts = [_render(template, list(messages), continue_final_message, variables) for messages in conversations]
    if not tokenize:
        return texts if batched else texts[0]
    ids = [tokenizer.backend.encode(text, add_special_tokens=False).ids for text in texts]
    if truncation and max_length is not None:
        ids = [row[:max_length] for row in ids]
    if padding not in _NO_PADDING or ((padding or return_tensors) and len({len(row) for row in ids}) > 1):
        raise ValueError(f"padding={padding!r} is not supported here: conversations keep their own lengths")
    masks = [[1] * len(row) for row in ids]
    if return_tensors is not None:  # a batch axis even for one conversation, as HF's
        ids, masks = _tensor(ids, return_tensors), _tensor(masks, return_tensors)
    elif not batched:
        ids, masks = ids[0], masks[0]
    return {"input_ids": ids, "attention_mask": masks} if return_dict else ids


# names a template variable cannot have: the rendering's own keywords, and the messages
RENDERING_KEYWORDS = (frozenset(inspect.signature(apply_chat_template).parameters) | {"messages"}) - {
    "tokenizer",
    "template_variables",
}


def _tensor(rows: list[list[int]], kind: str):
    array = np.array(rows, dtype=np.int64)
    if kind == "mlx":
        import mlx.core as mx

        return mx.array(array.astype(np.int32))
    return array


def _render(template: str, messages: list, continue_final_message: bool | str, variables: dict) -> str:
    if not continue_final_message:
        return compiled(template).render(messages=messages, **variables)
    # continue the final message's field (its content, or the field named): render it with a tag at
    # its end and cut the rendering there, so the model continues that message
    field = continue_final_message if isinstance(continue_final_message, str) else "content"
    final = dict(messages[-1])
    value = final.get(field)
    if isinstance(value, (list, tuple)):  # content blocks: continue the last text block
        at = next((i for i in reversed(range(len(value))) if "text" in value[i]), None)
        if at is None:
            raise ValueError("continue_final_message: the final message has no text to continue")
        value = list(value)
        value[at] = dict(value[at], text=value[at]["text"] + _CONTINUE_TAG)
        final[field] = value
    elif isinstance(value, str):
        final[field] = value + _CONTINUE_TAG
    else:
        raise ValueError(f"continue_final_message: the final message has no {field!r} to continue")
    text = compiled(template).render(messages=[*messages[:-1], final], **variables)
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not show the final message as given")
    # where the template kept the tag's trailing space, the text before it is the message's as written;
    # else the template trimmed the message's end, and so is the cut
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


@functools.lru_cache(maxsize=8)
def compiled(source: str):
    """A chat template compiled in jinja2's sandbox with the helpers HF's templates use."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
