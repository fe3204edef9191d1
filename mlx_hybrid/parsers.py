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
`tool_call_grammar` goes the other way: a grammar that holds the output to calls in one of
these formats (for tool_choice "required" or a named function).
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
    reasoning: look for reasoning at all (False: everything is content).
    """

    def __init__(self, tools=None, reasoning_opened: bool = False, reasoning: bool = True):
        self._types = _parameter_types(tools)
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
            markers = list(_BLOCKS) + ([THINK_CLOSE] if self._mode == "reasoning" else [])
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
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
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


# -- output held to tool calls (tool_choice "required" or a named function) --------------

TOOL_CALL_STYLES = ("json", "xml", "kimi")  # Qwen3 / Qwen3-Next, Qwen3.5, Kimi (above)


def tool_call_style(rendered: str) -> str | None:
    """Which of TOOL_CALL_STYLES a chat template writes, from its rendering of an assistant
    turn with a tool call; None when it is none of them."""
    if "<function=" in rendered:
        return "xml"
    if "<|tool_call_begin|>" in rendered:
        return "kimi"
    if re.search(r"<tool_call>\s*\{", rendered):
        return "json"
    return None


def tool_call_grammar(style: str, tools: list[dict], reasoning_opened: bool, is_special=lambda text: False,
                      parallel: bool = True):  # fmt: skip
    """A `processors.Grammar` (Lark) for output that is one or more calls (one: not `parallel`) to
    `tools` written in `style`, and nothing after them, so that the request ends with its calls.

    Arguments follow each tool's parameter schema; the XML style writes parameters in the
    schema's order, as llguidance's JSON writes properties. reasoning_opened: the prompt left
    the model inside `<think>`: free text comes first, ended by `</think>` (then a line break
    or two and the calls) or by the first call (models call tools while thinking).
    is_special(text): whether a marker (`<|...|>`) is one special token, which Lark writes
    bare (ordinary tokens cannot spell it)."""
    from .processors import Grammar

    if style not in TOOL_CALL_STYLES:
        raise ValueError(f"unknown tool-call style {style!r}")
    functions = [tool.get("function", tool) for tool in tools]

    def marker(text: str) -> str:
        return text if is_special(text) else _lark_string(text)  # Lark names a special token by its text

    alternatives = " | ".join(f"function_{i}" for i in range(len(functions)))
    if style == "json":
        opener = "<tool_call>"
        schema = _lark_json({"anyOf": [_json_call_schema(f) for f in functions]})
        rules = [f'after_opener: "\\n" {schema} "\\n" {marker("</tool_call>")} more']
    elif style == "xml":
        opener = "<tool_call>"
        rules = [f'after_opener: "\\n" ({alternatives}) "</function>\\n" {marker("</tool_call>")} more']
        rules += [rule for i, f in enumerate(functions) for rule in _xml_function_rules(i, f)]
        rules.append("text_value[lazy]: /(?s:.*)\\n<\\/parameter>\\n/")
    else:
        opener = "<|tool_calls_section_begin|>"
        repeat = "+" if parallel else ""
        rules = [f"after_opener: ({alternatives}){repeat} {marker('<|tool_calls_section_end|>')}"]
        for i, function in enumerate(functions):
            name = _lark_string(f"functions.{function['name']}:")
            rules.append(
                f"function_{i}: {marker('<|tool_call_begin|>')} {name} /[0-9]+/ "
                f"{marker('<|tool_call_argument_begin|>')} {_lark_json(_parameters(function))} "
                f"{marker('<|tool_call_end|>')}"
            )
    if style != "kimi":  # each further call is its own block
        rules.append(f"more: (BREAK {marker(opener)} after_opener)?" if parallel else 'more: ""')
    rules.append("BREAK: /\\n{1,2}/")  # as templates write between blocks; bounded, or a model may wander
    if not reasoning_opened:
        start = [f"start: {marker(opener)} after_opener"]
    elif is_special(opener):  # free text (</think> and all) cannot run into a special token: it ends there
        start = [f"start: REASONING? {marker(opener)} after_opener", "REASONING: /(?s:.*)/"]
    else:  # lazy: free text up to the first `</think>` or the first opener
        start = [
            f"start: (reasoning_to_call | reasoning_closed BREAK? {marker(opener)}) after_opener",
            f"reasoning_to_call[lazy]: /(?s:.*){_regex_literal(opener)}/",
            f"reasoning_closed[lazy]: /(?s:.*){_regex_literal(THINK_CLOSE)}/",
        ]
    return Grammar("lark", "\n".join(start + rules))


def _parameters(function: dict) -> dict:
    parameters = function.get("parameters") or {"type": "object"}
    if "properties" in parameters and "additionalProperties" not in parameters:
        # a function takes the arguments it declares: no others, unless its schema says so
        parameters = {**parameters, "additionalProperties": False}
    return parameters


def _json_call_schema(function: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": _parameters(function)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _xml_function_rules(i: int, function: dict) -> list[str]:
    """Qwen3.5's `<function=NAME>` block up to `</function>`: `<parameter=KEY>\\nVALUE\\n
    </parameter>\\n` per parameter; string values free text (or one of their enum), others
    the JSON their schema describes (which `_typed` reads back)."""
    parameters = _parameters(function)
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    rules, body = [], []
    for j, (key, schema) in enumerate(properties.items()):
        schema = schema if isinstance(schema, dict) else {}
        values = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if schema.get("type", "string") == "string" and values is None:
            value = "text_value"
        elif schema.get("type", "string") == "string" and all(isinstance(v, str) for v in values):
            value = f'({" | ".join(_lark_string(v) for v in values)}) "\\n</parameter>\\n"'
        else:
            value = f'{_lark_json(schema)} "\\n</parameter>\\n"'
        opening = _lark_string(f"<parameter={key}>\n")
        rules.append(f"parameter_{i}_{j}: {opening} {value}")
        body.append(f"parameter_{i}_{j}" + ("" if key in required else "?"))
    if not properties and parameters.get("additionalProperties", True) is not False:
        body.append('("<parameter=" /[^>\\n]+/ ">\\n" text_value)*')  # no schema: any keys, text values
    name = _lark_string(f"<function={function['name']}>\n")
    rules.append(f"function_{i}: {name} {' '.join(body)}")
    return rules


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _lark_json(schema: dict) -> str:
    """An inline JSON schema, written as `processors.Grammar` writes JSON (no stray whitespace)."""
    from .processors import JSON_OPTIONS

    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _regex_literal(text: str) -> str:
    return re.escape(text).replace("/", "\\/")
