"""Reasoning and tool calls out of generated text: pure functions from text to structure.

Reasoning: `<think>...</think>` at the start of the output, or, when the chat template
already opened `<think>` in the prompt, everything up to `</think>`. Output cut off
while still thinking is all reasoning.

Tool calls, found in the content and inside the reasoning alike (models do call tools
while thinking), and removed from both:
- Qwen3 / Qwen3-Next: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- Qwen3.5: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`,
  where values are text: each becomes the JSON type the tool's schema gives its
  parameter (a string when the schema says string or says nothing);
- Kimi: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`.
Calls come out in the OpenAI shape, arguments as a JSON string. A block that does not
parse stays in the text as it was.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_XML_FUNCTION = re.compile(r"^<function=([^>\n]+)>\s*(.*?)\s*</function>$", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_KIMI_SECTION = re.compile(r"<\|tool_calls_section_begin\|>(.*?)<\|tool_calls_section_end\|>", re.DOTALL)
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?:functions\.)?([^:<\s]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>\s*(.*?)\s*"
    r"<\|tool_call_end\|>",
    re.DOTALL,
)


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None = None  # None: the output had no reasoning part
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI: id, type, function {name, arguments}


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content). opened: the prompt already ended in `<think>`."""
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return None, text
        text = stripped[len(THINK_OPEN) :]
    reasoning, closed, content = text.partition(THINK_CLOSE)
    return reasoning.strip("\n"), content.lstrip("\n") if closed else ""


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves the model inside `<think>` (templates that open it)."""
    stripped = prompt.rstrip()
    return stripped.endswith(THINK_OPEN)


def _call(name: str, arguments: dict) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _parameter_types(tools) -> dict[str, dict[str, str]]:
    """{function name: {parameter: JSON schema type}} from OpenAI `tools`."""
    types = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name")] = {k: v.get("type") for k, v in properties.items() if isinstance(v, dict)}
    return types


def _typed(value: str, schema_type):
    """A Qwen3.5 parameter's text as the JSON value its schema type asks for."""
    if schema_type in (None, "string") or isinstance(schema_type, list) and "string" in schema_type:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value  # the model wrote something else: keep its text rather than lose it


def _parse_qwen_block(body: str, types) -> dict | None:
    if body.startswith("{"):
        try:
            call = json.loads(body)
        except ValueError:
            return None
        arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        return _call(call["name"], arguments if isinstance(arguments, dict) else {})
    function = _XML_FUNCTION.match(body)
    if function is None:
        return None
    name = function[1].strip()
    schema = types.get(name, {})
    arguments = {
        key.strip(): _typed(value, schema.get(key.strip())) for key, value in _XML_PARAMETER.findall(function[2])
    }
    return _call(name, arguments)


def extract_tool_calls(text: str, tools=None) -> tuple[str, list[dict]]:
    """(text without the tool calls, calls in order)."""
    types = _parameter_types(tools)
    calls = []

    def qwen(match):
        call = _parse_qwen_block(match[1], types)
        if call is None:
            return match[0]
        calls.append(call)
        return ""

    def kimi(match):
        found = []
        for name, arguments in _KIMI_CALL.findall(match[1]):
            try:
                parsed = json.loads(arguments) if arguments else {}
            except ValueError:
                return match[0]
            found.append(_call(name, parsed if isinstance(parsed, dict) else {}))
        calls.extend(found)
        return ""

    text = _QWEN_CALL.sub(qwen, text)
    text = _KIMI_SECTION.sub(kimi, text)
    return text, calls


def parse_output(text: str, tools=None, reasoning_opened: bool = False) -> ParsedOutput:
    """Reasoning, content and tool calls of one generated output."""
    reasoning, content = split_reasoning(text, reasoning_opened)
    calls = []
    if reasoning is not None:
        reasoning, calls = extract_tool_calls(reasoning, tools)
        reasoning = reasoning.strip("\n")
    content, content_calls = extract_tool_calls(content, tools)
    calls += content_calls
    return ParsedOutput(content=content.strip() if calls else content, reasoning=reasoning, tool_calls=calls)
