"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) translated onto the
chat path: a request becomes the Chat Completions request of the same conversation (so both give
the same tokens), and the chat output becomes Anthropic's content blocks or its stream of events.

What maps where:
- `system` (text or text blocks) is the system message; `messages` turn by turn: `text` and
  `image` blocks (base64 or URL, under the server's image rules) are the message's parts,
  `tool_result` blocks become tool messages before the user's other blocks (`is_error`: the
  content follows "Error: "), an assistant's `thinking` blocks its reasoning (which the chat
  template keeps or drops as it does any history), `tool_use` blocks its tool calls.
- `tools` (`input_schema`) are functions; `tool_choice` `auto` / `any` / `tool` / `none` are
  `auto` / `required` / the named function / `none` (`any` and `tool` held to the model's call
  format by a grammar), `disable_parallel_tool_use` holds them to one call.
- `thinking`: `enabled` and `adaptive` switch the template's thinking on, `disabled` off (models
  whose template has no such switch refuse it); `budget_tokens` ends the reasoning with `</think>`
  once spent (`SamplingParams.reasoning_budget`); `display: "omitted"` sends thinking blocks empty.
- `stop_sequences`, `temperature`, `top_p`, `top_k` (in the body: the 2.x SDK has no parameters for
  them), `output_config.format` (a JSON schema, through the grammars).
- `cache_control` marks a checkpoint where its block ends (a text block inside a message: there,
  so that a long document before a changing question is read once; a tool_result, image or
  assistant block: at its message's end), at most 4 as Anthropic allows; every turn's end is one
  already, and so is the system prompt's (tools render in it). The top-level field and the
  tools' marks change nothing. `usage.cache_read_input_tokens` says how much of the prompt a
  checkpoint served.
- Harmless fields (`metadata`, `service_tier`, `speed`, ...) are accepted; fields that would change
  the output and are not built (`output_config.effort`, `container`, `mcp_servers`,
  `context_management`, server tools) are 400s that name them, as is any unknown field.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from .protocol import ApiError, ChatCompletionRequest, Strict, translated_chat_request

STOP_REASONS = {"length": "max_tokens", "cancelled": "end_turn"}  # else end_turn, stop_sequence or tool_use


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations

    type: Literal["text"]
    text: str


class InputMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict]]


class CountTokensRequest(Strict):
    """The conversation of a Messages request (what `count_tokens` takes)."""

    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None
    # accepted, changing nothing computed here (see the module's docstring)
    cache_control: Any = None
    speed: Any = None
    inference_geo: Any = None
    diagnostics: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None
    # refused unless empty
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)


# Chat Completions fields -> the Messages fields they came from (to name them in errors)
_FIELD_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format", "messages": "messages"}


def chat_request(body: CountTokensRequest, tokenizer) -> tuple[ChatCompletionRequest, int | None]:
    """The Chat Completions request of the same conversation, and the reasoning budget."""
    for name in ("container", "mcp_servers", "context_management"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    config = body.output_config or {}
    if config.get("effort") is not None:
        raise ApiError(400, "output_config.effort is not supported by this server", param="output_config.effort")
    unknown = sorted(set(config) - {"effort", "format"})
    if unknown:
        raise ApiError(400, f"output_config.{unknown[0]} is not supported by this server", param="output_config")
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body)}
    if body.tools:
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(body.tools)]
    chat.update(_tool_choice(body.tool_choice))
    options, budget = _thinking(body, tokenizer)
    if options:
        chat["chat_template_kwargs"] = options
    if config.get("format") is not None:
        chat["response_format"] = _response_format(config["format"])
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stop=body.stop_sequences, stream=body.stream)
        chat.update(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    return translated_chat_request(chat, _FIELD_NAMES), budget


def _messages(body: CountTokensRequest) -> list[dict]:
    messages = []
    if isinstance(body.system, str) and body.system:
        messages.append({"role": "system", "content": body.system})
    elif body.system:  # blocks: their texts joined by a blank line, their marks kept
        last = len(body.system) - 1
        parts = [
            _marked({"type": "text", "text": b.text + ("\n\n" if k < last else "")}, b.model_extra)
            for k, b in enumerate(body.system)
        ]
        messages.append({"role": "system", "content": parts})
    for i, message in enumerate(body.messages):
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        where = f"messages.{i}.content"
        if message.role == "user":
            messages += _user_turn(blocks, where)
        else:
            messages.append(_assistant_turn(blocks, where))
    return messages


def _user_turn(blocks: list[dict], where: str) -> list[dict]:
    """Tool results first (as tool messages, in order), then the user's own parts, if any."""
    results, parts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "tool_result":
            content = block.get("content", "")
            if isinstance(content, list):
                content = [_part(b, f"{where}.{j}.content.{k}") for k, b in enumerate(content)]
            if block.get("is_error"):
                content = "Error: " + content if isinstance(content, str) else [_part(ERROR), *content]
            if not isinstance(block.get("tool_use_id"), str):
                raise ApiError(400, f"{where}.{j}: a tool_result block needs tool_use_id", param=where)
            results.append(_marked({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}, block))
        else:
            parts.append(_part(block, f"{where}.{j}"))
    if parts:
        results.append({"role": "user", "content": parts})
    return results


ERROR = {"type": "text", "text": "Error: "}  # what an is_error tool result's content follows


def _marked(item: dict, source: dict | None) -> dict:
    """`item` (a message or a part) with the `cache_control` mark of the block it came from, if any:
    the chat path checkpoints where a marked part or message ends."""
    if source and source.get("cache_control"):
        item["cache_control"] = source["cache_control"]
    return item


def _part(block: dict, where: str) -> dict:
    """A text or image block as a Chat Completions content part."""
    kind = block.get("type")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}: a text block needs text", param=where)
        return _marked({"type": "text", "text": block["text"]}, block)
    if kind == "image":
        source = block.get("source") or {}
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
        elif source.get("type") == "url" and isinstance(source.get("url"), str):
            url = source["url"]
        else:
            raise ApiError(400, f"{where}: an image block needs a base64 or url source", param=where)
        return _marked({"type": "image_url", "image_url": {"url": url}}, block)
    raise ApiError(400, f"{where}: content blocks of type {kind!r} are not supported here", param=where)


def _assistant_turn(blocks: list[dict], where: str) -> dict:
    reasoning, text, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "thinking":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":  # Anthropic's encrypted reasoning: nothing a template can show
            continue
        elif kind == "text":
            text.append(_part(block, f"{where}.{j}")["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise ApiError(400, f"{where}.{j}: a tool_use block needs a name and an object input", param=where)
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            call_id = str(block.get("id") or f"toolu_{uuid.uuid4().hex[:24]}")
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        else:
            raise ApiError(400, f"{where}.{j}: assistant blocks of type {kind!r} are not supported here", param=where)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return _marked(message, next((b for b in blocks if b.get("cache_control")), None))  # a mark: at its end


def _tool(i: int, tool: dict) -> dict:
    if tool.get("type") not in (None, "custom"):
        raise ApiError(
            400,
            f"tools.{i}: tools of type {tool['type']!r} (Anthropic's server tools) are not supported",
            param=f"tools.{i}.type",
        )
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise ApiError(400, f"tools.{i}: a tool needs a name and an input_schema object", param=f"tools.{i}")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict | None) -> dict:
    if choice is None:
        return {}
    kind = choice.get("type")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ApiError(400, "tool_choice: type 'tool' needs the tool's name", param="tool_choice.name")
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    if mapped is None:
        raise ApiError(400, f"tool_choice: type must be auto, any, tool or none, got {kind!r}", param="tool_choice")
    return {"tool_choice": mapped, "parallel_tool_calls": not choice.get("disable_parallel_tool_use", False)}


def _thinking(body: CountTokensRequest, tokenizer) -> tuple[dict, int | None]:
    """The template's thinking switch and the reasoning budget the request's `thinking` asks for."""
    thinking = body.thinking
    if thinking is None:
        return {}, None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ApiError(400, f"thinking.type must be enabled, disabled or adaptive, got {kind!r}", param="thinking.type")
    if "enable_thinking" not in (tokenizer.chat_template or ""):
        raise ApiError(400, "thinking: this model's chat template has no thinking switch", param="thinking")
    budget = thinking.get("budget_tokens") if kind == "enabled" else None
    if kind == "enabled":
        max_tokens = getattr(body, "max_tokens", None)
        if not isinstance(budget, int) or budget < 1 or (max_tokens is not None and budget >= max_tokens):
            raise ApiError(
                400,
                "thinking.budget_tokens must be an integer >= 1 and less than max_tokens",
                param="thinking.budget_tokens",
            )
    if thinking.get("display") not in (None, "summarized", "omitted"):
        raise ApiError(400, "thinking.display must be summarized or omitted", param="thinking.display")
    return {"enable_thinking": kind != "disabled"}, budget


def _response_format(output_format) -> dict:
    if not isinstance(output_format, dict) or output_format.get("type") != "json_schema":
        raise ApiError(400, "output_config.format: only type json_schema is supported", param="output_config.format")
    if not isinstance(output_format.get("schema"), dict):
        raise ApiError(400, "output_config.format needs a schema object", param="output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": output_format["schema"]}}


# -- the reply ----------------------------------------------------------------------------


def _usage(chat) -> dict:
    usage = chat.usage()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": usage["prompt_tokens"] - cached,  # Anthropic's: the tokens not read from a cache
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage["completion_tokens"],
    }


def _stop(ending, called: bool) -> tuple[str, str | None]:
    if ending.stop_sequence is not None:
        return "stop_sequence", ending.stop_sequence
    if ending.finish_reason == "stop":
        return ("tool_use" if called else "end_turn"), None
    return STOP_REASONS.get(ending.finish_reason, "end_turn"), None


def _tool_use(call: dict) -> dict:
    function = call["function"]
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": function["name"],
        "input": json.loads(function["arguments"]),
    }


def _omitted(body) -> bool:
    return (body.thinking or {}).get("display") == "omitted"


def _envelope(chat) -> dict:
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": chat.model,
        "content": [],
    }


async def reply(chat, body: MessagesRequest, request) -> dict:
    """The whole reply: content blocks in the order the output gave them."""
    blocks, ending = [], None
    async for delta, end in chat.parts(request):
        if delta.reasoning:
            if not blocks or blocks[-1]["type"] != "thinking":
                blocks.append({"type": "thinking", "thinking": "", "signature": ""})
            blocks[-1]["thinking"] += "" if _omitted(body) else delta.reasoning
        if delta.content:
            if not blocks or blocks[-1]["type"] != "text":
                blocks.append({"type": "text", "text": ""})
            blocks[-1]["text"] += delta.content
        blocks += [_tool_use(call) for call in delta.tool_calls]
        ending = end or ending
    stop_reason, stop_sequence = _stop(ending, any(b["type"] == "tool_use" for b in blocks))
    reply = _envelope(chat) | {"content": blocks}
    return reply | {"stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(chat)}


async def events(chat, body: MessagesRequest):
    """The reply as Anthropic's stream: (event name, data) in its order."""
    start = _envelope(chat) | {"stop_reason": None, "stop_sequence": None}
    await chat.started()  # message_start's usage says what was read from a checkpoint
    yield "message_start", {"type": "message_start", "message": start | {"usage": _usage(chat)}}
    yield "ping", {"type": "ping"}
    index, open_kind, called, ending = -1, None, False, None

    def opened(kind: str, block: dict):
        nonlocal index, open_kind
        events = [("content_block_stop", {"type": "content_block_stop", "index": index})] if open_kind else []
        index, open_kind = index + 1, kind
        return events + [
            ("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})
        ]

    def delta_event(delta: dict):
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}

    async for delta, end in chat.parts():
        if delta.reasoning:
            if open_kind != "thinking":
                for event in opened("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                    yield event
            if not _omitted(body):
                yield delta_event({"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.content:
            if open_kind != "text":
                for event in opened("text", {"type": "text", "text": ""}):
                    yield event
            yield delta_event({"type": "text_delta", "text": delta.content})
        for call in delta.tool_calls:
            block = _tool_use(call)
            for event in opened("tool_use", block | {"input": {}}):
                yield event
            yield delta_event({"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
            called = True
        ending = end or ending
    if open_kind:
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    stop_reason, stop_sequence = _stop(ending, called)
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(chat),
        },
    )
    yield "message_stop", {"type": "message_stop"}
