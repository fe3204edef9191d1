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

`OutputParser` does this as the text streams; `parse_output` on a whole output.
`tool_grammars` goes the other way: a grammar that holds the output to calls in one of these
formats.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_XML_FUNCTION = re.compile(r"^<function=([^>\n]+)>\s*(.*?)\s*</function>$", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
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


def _parse_kimi_section(body: str) -> list[dict] | None:
    calls = []
    for name, arguments in _KIMI_CALL.findall(body):
        try:
            parsed = json.loads(arguments) if arguments else {}
        except ValueError:
            return None
        calls.append(_call(name, parsed if isinstance(parsed, dict) else {}))
    return calls


# tool-call blocks: opener -> (closer, parse of the text between them -> calls or None)
_BLOCKS = {
    "<tool_call>": ("</tool_call>", lambda body, types: [c] if (c := _parse_qwen_block(body.strip(), types)) else None),
    "<|tool_calls_section_begin|>": ("<|tool_calls_section_end|>", lambda body, types: _parse_kimi_section(body)),
}


@dataclass
class Delta:
    """What a stretch of output adds: reasoning text, content text, complete tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self):
        return bool(self.reasoning or self.content or self.tool_calls)


class OutputParser:
    """Reasoning, content and tool calls of an output as it streams.

    `feed(text)` returns what is certain so far; text that may be the start of a tag
    (`</thi`, an unclosed `<tool_call>`) waits for the next piece, and `finish()` gives
    the rest (an unclosed block as text). Newlines around tags are dropped: a section's
    leading and trailing ones, those around tool calls; other text is kept as written.
    reasoning: look for reasoning at all (False: everything is content). tool_calls: parse
    tool-call blocks (False, where a request offered no tools: they stay text, markup and all,
    for a client that defined no function cannot answer a call).
    """

    def __init__(self, tools=None, reasoning_opened: bool = False, reasoning: bool = True, tool_calls: bool = True):
        self._types = _parameter_types(tools)
        self._blocks = list(_BLOCKS) if tool_calls else []
        self._mode = "reasoning" if reasoning_opened else ("start" if reasoning else "content")
        self._buffer = ""
        self._newlines = ""  # held back: dropped if a tag follows, written if text does
        self._section_start = True  # drop newlines at the start of a section and after a call
        self.saw_reasoning = self._mode == "reasoning"
        self.saw_tool_calls = False

    def feed(self, text: str) -> Delta:
        self._buffer += text
        delta = Delta()
        if self._mode == "start" and not self._decide_start():
            return delta
        while self._buffer:
            markers = self._blocks + ([THINK_CLOSE] if self._mode == "reasoning" else [])
            found = [(at, m) for m in markers if (at := self._buffer.find(m)) >= 0]
            if not found:
                keep = _partial_marker(self._buffer, markers)
                self._write(delta, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            at, marker = min(found)
            if marker == THINK_CLOSE:
                self._write(delta, self._buffer[:at])
                self._buffer = self._buffer[at + len(marker) :]
                self._mode, self._newlines, self._section_start = "content", "", True
                continue
            closer, parse = _BLOCKS[marker]
            end = self._buffer.find(closer, at + len(marker))
            if end < 0:  # the block is not complete yet
                self._write(delta, self._buffer[:at])
                self._buffer = self._buffer[at:]
                break
            self._write(delta, self._buffer[:at])
            block = self._buffer[at : end + len(closer)]
            self._buffer = self._buffer[end + len(closer) :]
            calls = parse(block[len(marker) : -len(closer)], self._types)
            if calls is None:  # not a call after all: it stays text
                self._write(delta, block)
            else:
                delta.tool_calls += calls
                self.saw_tool_calls = True
                self._newlines, self._section_start = "", True
        return delta

    def finish(self) -> Delta:
        """The rest of the output, once it has ended."""
        if self._mode == "start":
            self._mode = "content"
        delta = Delta()
        self._write(delta, self._buffer)
        self._buffer = ""
        if self._mode == "content" and not self.saw_tool_calls:
            self._write_text(delta, self._newlines)  # trailing newlines of an answer are the answer's
        return delta

    def _decide_start(self) -> bool:
        """Whether the output opens with `<think>` (then reasoning follows) or not; False
        while too little has come to tell."""
        stripped = self._buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buffer = stripped[len(THINK_OPEN) :]
            self._mode = "reasoning"
            self.saw_reasoning = True
        elif not THINK_OPEN.startswith(stripped):
            self._mode = "content"
        else:
            return False
        return True

    def _write(self, delta: Delta, text: str):
        """Text of the current section, holding trailing newlines back."""
        if self._section_start:
            text = text.lstrip("\n")
            if not text:
                return
            self._section_start = False
        body = text.rstrip("\n")
        if body:
            self._write_text(delta, self._newlines + body)
            self._newlines = ""
        self._newlines += text[len(body) :]

    def _write_text(self, delta: Delta, text: str):
        if self._mode == "reasoning":
            delta.reasoning += text
        else:
            delta.content += text


def _partial_marker(text: str, markers) -> int:
    """Length of the longest end of text that is a proper start of a marker."""
    for n in range(min(len(text), max((len(m) for m in markers), default=1) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _parse_all(text: str, **options) -> tuple[Delta, OutputParser]:
    parser = OutputParser(**options)
    whole = Delta()
    for delta in (parser.feed(text), parser.finish()):
        whole.reasoning += delta.reasoning
        whole.content += delta.content
        whole.tool_calls += delta.tool_calls
    return whole, parser


def extract_tool_calls(text: str, tools=None) -> tuple[str, list[dict]]:
    """(text without the tool calls, calls in order)."""
    whole, _ = _parse_all(text, tools=tools, reasoning=False)
    return whole.content, whole.tool_calls


def parse_output(text: str, tools=None, reasoning_opened: bool = False) -> ParsedOutput:
    """Reasoning, content and tool calls of one generated output."""
    whole, parser = _parse_all(text, tools=tools, reasoning_opened=reasoning_opened)
    return ParsedOutput(
        content=whole.content, reasoning=whole.reasoning if parser.saw_reasoning else None, tool_calls=whole.tool_calls
    )


class StopStrings:
    """Text cut before the first of some stop strings, as it streams: `feed` returns what is
    certain to come before any stop (a possible start of one waits), `finish` the rest."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self._held = ""

    def feed(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        text = self._held + text
        found = [(at, stop) for stop in self.stops if (at := text.find(stop)) >= 0]
        if found:
            at, self.matched = min(found)
            self.stopped, self._held = True, ""
            return text[:at]
        keep = _partial_marker(text, self.stops) if text else 0
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def finish(self) -> str:
        rest, self._held = self._held, ""
        return "" if self.stopped else rest
