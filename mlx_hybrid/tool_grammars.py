"""Output held to tool calls (tool_choice "required" or a named function): a grammar that lets
the model write only calls, in the format its chat template writes them (the formats
`parsers` reads back), each call's arguments following its tool's schema."""

from __future__ import annotations

import json
import re

from .parsers import THINK_CLOSE

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


def tool_call_grammar(
    style: str, tools: list[dict], reasoning_opened: bool, is_special=lambda text: False, parallel: bool = True
):
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
