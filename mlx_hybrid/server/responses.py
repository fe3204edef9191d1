"""OpenAI's Responses API (`POST /v1/responses`) translated onto the chat path, as `anthropic` does
for Messages: the request becomes the Chat Completions request of the same conversation, the chat
output becomes the response's output items or its stream of events.

What maps where: `instructions` is the system message; `input` a string (one user message) or items:
messages (`input_text`, `input_image`, `output_text` parts), `function_call` (the assistant's tool
calls), `function_call_output` (tool messages), `reasoning` (the next assistant message's reasoning).
`tools` of type `function`, `tool_choice`, `parallel_tool_calls`, `max_output_tokens`,
`temperature`, `top_p` and `text.format` (`json_schema`, `json_object`: as `response_format`) as in
Chat Completions; `reasoning.effort` switches the template's thinking (`none`: off, any other
effort: on; models without such a switch refuse it).

The server keeps no responses: `previous_response_id` and `conversation` are 400s (send the whole
conversation in `input`), as are `background`, `truncation: "auto"`, built-in tools and the other
fields that would change the output; `store`, `include`, `metadata` and the like are accepted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import Field

from .protocol import ApiError, ChatCompletionRequest, Strict, translated_chat_request


class ResponsesRequest(Strict):
    model: str | None = None
    input: Union[str, list[dict]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: bool = True
    text: dict | None = None
    reasoning: dict | None = None
    stream: bool = False
    include: list[str] | None = None  # accepted: what it asks for (encrypted reasoning) is never needed here
    stream_options: dict | None = None
    client_metadata: Any = None  # Codex's identifiers of its installation and window
    # refused unless absent or their neutral value
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    truncation: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    context_management: Any = None


_REFUSED = {
    "previous_response_id": "this server keeps no responses: send the whole conversation in input",
    "conversation": "this server keeps no conversations: send the whole conversation in input",
    "background": "background responses are not supported by this server",
    "max_tool_calls": "max_tool_calls is not supported by this server",
    "prompt": "stored prompts are not supported by this server",
    "top_logprobs": "top_logprobs is not supported on this route (Chat Completions has logprobs)",
    "context_management": "context_management is not supported by this server",
}
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def chat_request(body: ResponsesRequest, tokenizer) -> tuple[ChatCompletionRequest, None]:
    """The Chat Completions request of the same conversation (and no reasoning budget)."""
    for name, why in _REFUSED.items():
        if getattr(body, name) not in (None, False, 0):
            raise ApiError(400, f"{name}: {why}", param=name)
    if body.truncation not in (None, "disabled"):
        raise ApiError(400, "truncation: only 'disabled' (the conversation is never cut)", param="truncation")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    messages += _messages(items)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens}
    chat.update(temperature=body.temperature, top_p=body.top_p, stream=body.stream)
    if body.tools:
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    chat["parallel_tool_calls"] = body.parallel_tool_calls
    if body.text is not None:
        chat["response_format"] = _response_format(body.text)
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        if "enable_thinking" not in (tokenizer.chat_template or ""):
            raise ApiError(
                400, "reasoning.effort: this model's chat template has no thinking switch", param="reasoning.effort"
            )
        chat["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    return translated_chat_request(chat, _FIELD_NAMES), None


def _messages(items: list[dict]) -> list[dict]:
    messages: list[dict] = []
    reasoning = []  # reasoning items wait for the assistant message they precede

    def assistant() -> dict:
        """The assistant message that function calls and output text join (a new one after others)."""
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        if reasoning:
            messages[-1]["reasoning_content"] = messages[-1].get("reasoning_content", "") + "".join(reasoning)
            reasoning.clear()
        return messages[-1]

    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"{where}.role must be user, system, developer or assistant", param=where)
            parts = _parts(item.get("content"), where)
            if role == "assistant":
                message = assistant()
                message["content"] += "".join(p["text"] for p in parts)
            else:
                text_only = all(p["type"] == "text" for p in parts)
                messages.append({"role": role, "content": "".join(p["text"] for p in parts) if text_only else parts})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise ApiError(400, f"{where}: a function_call needs name and arguments", param=where)
            call = {
                "id": str(item.get("call_id") or item.get("id")),
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
            if not isinstance(output, str) or not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"{where}: a function_call_output needs call_id and output", param=where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            texts = item.get("content") or item.get("summary") or []
            reasoning += [str(t.get("text", "")) for t in texts if isinstance(t, dict)]
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported", param=where)
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls") and not message["content"]:
            message["content"] = None
    return messages


def _parts(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be text or a list of parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        else:
            raise ApiError(400, f"{where}.content.{j}: parts of type {kind!r} are not supported here", param=where)
    return parts


def _tool(i: int, tool: dict) -> dict:
    if tool.get("type") != "function":
        raise ApiError(
            400,
            f"tools.{i}: tools of type {tool.get('type')!r} are not supported (only function)",
            param=f"tools.{i}.type",
        )
    if not isinstance(tool.get("name"), str):
        raise ApiError(400, f"tools.{i}: a function tool needs a name", param=f"tools.{i}.name")
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "tool_choice: none, auto, required or {type: function, name}", param="tool_choice")


def _response_format(text: dict) -> dict:
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown or text.get("verbosity") not in (None, "medium"):
        name = unknown[0] if unknown else "verbosity"
        raise ApiError(400, f"text.{name} is not supported by this server", param=f"text.{name}")
    fmt = text.get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


# -- the response -------------------------------------------------------------------------


def _usage(chat, reasoning_tokens: int = 0) -> dict:
    usage = chat.usage()
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _reasoning_item(text: str) -> dict:
    return {
        "type": "reasoning",
        "id": _item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _message_item(text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": _item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _call_item(call: dict) -> dict:
    function = call["function"]
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": "completed",
    }


class _Envelope:
    """The response object around the output items, as it stands."""

    def __init__(self, chat, body: ResponsesRequest):
        self.chat, self.body = chat, body
        self.id, self.created = _item_id("resp"), int(time.time())

    def __call__(self, status: str, output: list, ending=None) -> dict:
        incomplete = ending is not None and ending.finish_reason == "length"
        if incomplete:
            status = "incomplete"
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.chat.model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls, "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning, "store": False, "usage": self.usage(output) if status != "in_progress" else None,
        }  # fmt: skip

    def usage(self, output: list) -> dict:
        # the reasoning's tokens as the tokenizer encodes its text (the model's own split is not kept apart)
        reasoning = "".join(item["content"][0]["text"] for item in output if item["type"] == "reasoning")
        return _usage(self.chat, reasoning_tokens=self.chat.count_tokens(reasoning) if reasoning else 0)


async def reply(chat, body: ResponsesRequest, request) -> dict:
    """The whole response: reasoning, message and function-call items in the order the output gave them."""
    output, ending = [], None
    async for delta, end in chat.parts(request):
        if delta.reasoning:
            if not output or output[-1]["type"] != "reasoning":
                output.append(_reasoning_item(""))
            output[-1]["content"][0]["text"] += delta.reasoning
        if delta.content:
            if not output or output[-1]["type"] != "message":
                output.append(_message_item(""))
            output[-1]["content"][0]["text"] += delta.content
        output += [_call_item(call) for call in delta.tool_calls]
        ending = end or ending
    return _Envelope(chat, body)("completed", output, ending)


async def events(chat, body: ResponsesRequest):
    """The response as the Responses API's stream: (event type, data), each with its sequence number."""
    envelope, output, number = _Envelope(chat, body), [], 0
    ending, open_item = None, None  # the reasoning or message item text is streaming into

    def event(kind: str, **data):
        nonlocal number
        number += 1
        return kind, {"type": kind, "sequence_number": number - 1, **data}

    def close():
        item, index = output[-1], len(output) - 1
        text = item["content"][0]["text"]
        if item["type"] == "reasoning":
            yield event(
                "response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text
            )
        else:
            part = item["content"][0]
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text)
            yield event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
            )
            item["status"] = "completed"
        yield event("response.output_item.done", output_index=index, item=item)

    def opened(item: dict):
        output.append(item)
        index = len(output) - 1
        yield event("response.output_item.added", output_index=index, item=item)
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            yield event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
            )

    yield event("response.created", response=envelope("in_progress", []))
    yield event("response.in_progress", response=envelope("in_progress", []))
    async for delta, end in chat.parts():
        for kind, text in (("reasoning", delta.reasoning), ("message", delta.content)):
            if not text:
                continue
            if open_item != kind:
                if open_item is not None:
                    for e in close():
                        yield e
                item = _reasoning_item("") if kind == "reasoning" else _message_item("", "in_progress")
                for e in opened(item):
                    yield e
                open_item = kind
            item, index = output[-1], len(output) - 1
            item["content"][0]["text"] += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            yield event(name, item_id=item["id"], output_index=index, content_index=0, delta=text)
        for call in delta.tool_calls:
            if open_item is not None:
                for e in close():
                    yield e
                open_item = None
            item = _call_item(call)
            arguments = item["arguments"]
            for e in opened(item | {"arguments": "", "status": "in_progress"}):
                yield e
            output[-1] = item
            index = len(output) - 1
            yield event(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments
            )
            yield event(
                "response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=arguments
            )
            yield event("response.output_item.done", output_index=index, item=item)
        ending = end or ending
    if open_item is not None:
        for e in close():
            yield e
    final = envelope("completed", output, ending)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
