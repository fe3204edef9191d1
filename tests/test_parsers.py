"""Reasoning and tool-call parsing of generated text (Qwen3 JSON, Qwen3.5 XML, Kimi)."""

import json

import numpy as np
import pytest
from conftest import function_tool

from mlx_hybrid.parsers import OutputParser, extract_tool_calls, parse_output, prompt_opens_reasoning

WEATHER = function_tool(
    "get_weather",
    {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "hours": {"type": "array"},
        "zip": {"type": "string"},
    },
)


def arguments(call):
    return json.loads(call["function"]["arguments"])


def test_reasoning_split_with_tags_without_and_opened_by_the_template():
    def split(text, opened=False):
        parsed = parse_output(text, reasoning_opened=opened)
        return parsed.reasoning, parsed.content

    assert split("<think>\nplan\n</think>\n\nAnswer.") == ("plan", "Answer.")
    assert split("Just an answer.") == (None, "Just an answer.")
    # the template ended the prompt with <think>: the output starts inside it
    assert split("plan\n</think>\n\nAnswer.", opened=True) == ("plan", "Answer.")
    # cut off while thinking: all reasoning, no content
    assert split("<think>\nstill going", opened=False) == ("still going", "")
    assert split("still going", opened=True) == ("still going", "")
    # text that only looks like a tag at first is text
    assert split("<thinking aloud> is not a tag") == (None, "<thinking aloud> is not a tag")
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_json_tool_calls():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>'
    )
    parsed = parse_output(text, tools=[WEATHER])
    assert parsed.content == "Let me check."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert arguments(parsed.tool_calls[0]) == {"city": "Paris", "days": 2}
    assert arguments(parsed.tool_calls[1]) == {"zone": "CET"}  # arguments written as a JSON string
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)
    assert len({c["id"] for c in parsed.tool_calls}) == 2


@pytest.mark.parametrize(
    "order", [["city", "days", "metric", "hours", "zip"], ["zip", "hours", "metric", "days", "city"]]
)
def test_qwen35_xml_parameters_become_typed_json_whatever_their_order(order):
    values = {"city": "New York", "days": "3", "metric": "true", "hours": "[9, 12]", "zip": "01234"}
    params = "".join(f"<parameter={k}>\n{values[k]}\n</parameter>\n" for k in order)
    text = f"<tool_call>\n<function=get_weather>\n{params}</function>\n</tool_call>"
    parsed = parse_output(text, tools=[WEATHER])
    assert parsed.content == "" and len(parsed.tool_calls) == 1
    # a string stays a string (the zip keeps its leading zero), the rest take their schema types
    assert arguments(parsed.tool_calls[0]) == {
        "city": "New York",
        "days": 3,
        "metric": True,
        "hours": [9, 12],
        "zip": "01234",
    }


def test_xml_parameters_without_a_schema_stay_text_and_multiline_values_keep_their_lines():
    text = "<tool_call>\n<function=write>\n<parameter=body>\nline 1\nline 2\n</parameter>\n</function>\n</tool_call>"
    parsed = parse_output(text)
    assert arguments(parsed.tool_calls[0]) == {"body": "line 1\nline 2"}


def test_kimi_tool_calls():
    text = (
        "I'll look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
    )
    parsed = parse_output(text)
    assert parsed.content == "I'll look."
    assert [(c["function"]["name"], arguments(c)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]


def test_tool_calls_inside_reasoning_are_found_and_removed():
    text = (
        '<think>\nI need the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        "</tool_call>\n</think>\n\n"
    )
    parsed = parse_output(text)
    assert parsed.reasoning == "I need the weather." and parsed.content == ""
    assert arguments(parsed.tool_calls[0]) == {"city": "Rome"}
    # the same, with the template having opened <think>
    opened = parse_output(text[len("<think>") :], reasoning_opened=True)
    assert opened.reasoning == "I need the weather." and arguments(opened.tool_calls[0]) == {"city": "Rome"}


def test_malformed_blocks_stay_in_the_text():
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    text, calls = extract_tool_calls("before " + broken)
    assert calls == [] and text == "before " + broken
    kimi = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{oops"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    assert extract_tool_calls(kimi) == (kimi, [])
    assert parse_output("plain text, no calls").tool_calls == []


STREAMED = [
    ("<think>\nplan A\n\nplan B\n</think>\n\nAnswer\n\nwith lines.\n", False),
    ("plan\n</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n", True),
    ("thinking <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call> still", True),
    ('before <tool_call>\n{"name": broken\n</tool_call> after </tool_call', False),
    ("I'll look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>', False),
    ("an unclosed <tool_call>\n{\"name\": \"f\"", False),
    ("x < y and a <tool b>", False),
]  # fmt: skip


@pytest.mark.parametrize("text,opened", STREAMED)
def test_streamed_output_parses_as_the_whole_whatever_the_pieces(text, opened):
    whole = parse_output(text, tools=[WEATHER], reasoning_opened=opened)
    rng = np.random.default_rng(len(text))
    for cuts in [range(1, len(text)), sorted(rng.choice(range(1, len(text)), size=5, replace=False))]:
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        parser = OutputParser(tools=[WEATHER], reasoning_opened=opened)
        reasoning = content = ""
        calls = []
        for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
            reasoning, content, calls = reasoning + delta.reasoning, content + delta.content, calls + delta.tool_calls
        assert content == whole.content and reasoning == (whole.reasoning or "")
        assert [(c["function"]["name"], arguments(c)) for c in calls] == [
            (c["function"]["name"], arguments(c)) for c in whole.tool_calls
        ]


@pytest.mark.parametrize("text,opened", STREAMED)
def test_without_tools_a_call_is_the_text_it_was_written_as(text, opened):
    """tool_calls=False (a request that offered no tools): no calls, every block's markup where it
    was written, whatever the pieces; the reasoning still apart."""
    parser = OutputParser(reasoning_opened=opened, tool_calls=False)
    deltas = [parser.feed(text[i : i + 3]) for i in range(0, len(text), 3)] + [parser.finish()]
    written = "".join(d.reasoning + d.content for d in deltas)
    assert not any(d.tool_calls for d in deltas)
    for marker in ("<tool_call>", "</tool_call>", "<|tool_calls_section_begin|>", '"name": "get_time"', "Paris"):
        assert written.count(marker) == text.count(marker)
    assert "</think>" not in written and ("plan" not in text or "plan" in "".join(d.reasoning for d in deltas))


def test_streaming_holds_back_only_what_may_be_a_tag():
    parser = OutputParser(reasoning_opened=True)
    assert parser.feed("step one</thi").reasoning == "step one"
    delta = parser.feed("nk>\n\nDone <tool")
    assert (delta.reasoning, delta.content) == ("", "Done ")
    delta = parser.feed('_call>\n{"name": "f", "arguments": {"a": 1}}')
    assert not delta  # inside an unclosed call
    delta = parser.feed("\n</tool_call>")
    assert delta.tool_calls[0]["function"]["name"] == "f" and delta.content == ""
    assert parser.feed("<").content == "" and parser.finish().content == "<"


# -- grammars that hold the output to tool calls (tool_choice "required" or a named function)

WEATHER_REQUIRED = function_tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city"])
MODE = function_tool(
    "set_mode",
    {
        "mode": {"type": "string", "enum": ["fast", "slow"]},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
        "note": {"type": "string"},
    },
    ["mode", "level"],
)
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("set_mode", {"mode": "fast", "level": 3})]


def written(style: str, calls) -> str:
    """Calls as each model family writes them (the templates in conftest.TOOL_TEMPLATES)."""
    if style == "json":
        blocks = [f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>" for name, args in calls]
        return "\n".join(blocks)
    if style == "xml":
        return "\n".join(
            f"<tool_call>\n<function={name}>\n"
            + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
            + "</function>\n</tool_call>"
            for name, args in calls
        )
    return (
        "<|tool_calls_section_begin|>"
        + "".join(
            f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{json.dumps(args)}<|tool_call_end|>"
            for i, (name, args) in enumerate(calls)
        )
        + "<|tool_calls_section_end|>"
    )


def takes(grammar, tokenizer, text: str, encoded_by=None) -> bool:
    """Whether the grammar takes text (as `encoded_by` encodes it) and then the end token, as
    the engine would run it."""
    from mlx_hybrid.sampling import SamplingParams

    processor = SamplingParams(grammar=grammar).processor([], tokenizer.vocab_size, tokenizer)
    ids = (encoded_by or tokenizer).encode(text) + tokenizer.eos_token_ids[:1]
    return processor.accept(ids) and processor.finished


@pytest.fixture(scope="module")
def tool_tokenizer():
    """The fixtures' tokenizer, and one where Kimi's tool-call markers are special tokens as in
    Kimi's own vocabulary."""
    import copy

    from conftest import FIXTURES
    from tokenizers import AddedToken

    from mlx_hybrid.tokenizer import Tokenizer

    plain = Tokenizer.from_hf_dir(FIXTURES / "qwen3next" / "hf", {})
    backend = copy.deepcopy(plain.backend)
    markers = [
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ]
    backend.add_special_tokens([AddedToken(m, special=True) for m in markers])
    return plain, Tokenizer(backend, plain.eos_token_ids)


@pytest.mark.parametrize("style", ["json", "xml", "kimi"])
@pytest.mark.parametrize("opened", [False, True])
def test_a_tool_call_grammar_takes_calls_and_nothing_else(tool_tokenizer, style, opened):
    from mlx_hybrid.tool_grammars import tool_call_grammar

    tokenizer = tool_tokenizer[0]
    grammar = tool_call_grammar(style, [WEATHER_REQUIRED, MODE], opened)
    reasoning = "I need the weather.\n</think>\n\n" if opened else ""
    text = reasoning + written(style, CALLS)
    assert takes(grammar, tokenizer, text)
    parsed = parse_output(text, tools=[WEATHER_REQUIRED, MODE], reasoning_opened=opened)
    assert [(c["function"]["name"], arguments(c)) for c in parsed.tool_calls] == CALLS
    assert takes(grammar, tokenizer, reasoning + written(style, CALLS[:1]))
    if opened:  # a call made while thinking ends the free text too
        assert takes(grammar, tokenizer, "I need the weather.\n" + written(style, CALLS))
    wrong = [
        written(style, [("get_time", {"city": "Paris"})]),  # not a tool
        written(style, [("set_mode", {"mode": "fast"})]),  # a required parameter missing
        written(style, [("set_mode", {"mode": "fast", "level": 12})]),  # out of range
        written(style, [("set_mode", {"mode": "quick", "level": 1})]),  # not in the enum
        written(style, [("set_mode", {"mode": "fast", "level": 1, "speed": 2})]),  # not a declared parameter
        written(style, CALLS) + "\nDone.",  # text after the calls
        "Sure. " + written(style, CALLS),  # an answer instead of (or before) the calls
        "",  # no call at all
    ]
    for text in wrong:
        assert not takes(grammar, tokenizer, reasoning + text), text
    single = tool_call_grammar(style, [WEATHER_REQUIRED, MODE], opened, parallel=False)
    assert takes(single, tokenizer, reasoning + written(style, CALLS[1:]))
    assert not takes(single, tokenizer, reasoning + written(style, CALLS))
    named = tool_call_grammar(style, [MODE], opened)  # tool_choice naming set_mode
    assert takes(named, tokenizer, reasoning + written(style, CALLS[1:]))
    assert not takes(named, tokenizer, reasoning + written(style, CALLS[:1]))


@pytest.mark.parametrize("opened", [False, True])
def test_kimi_markers_that_are_special_tokens_are_written_as_such(tool_tokenizer, opened):
    from mlx_hybrid.tool_grammars import tool_call_grammar

    plain, special = tool_tokenizer
    assert special.is_special_token("<|tool_call_begin|>") and not plain.is_special_token("<|tool_call_begin|>")
    assert not special.is_special_token("<tool_call>") and special.is_special_token("<|im_end|>")
    grammar = tool_call_grammar("kimi", [WEATHER_REQUIRED, MODE], opened, special.is_special_token)
    reasoning = "Thinking </think> still free " if opened else ""
    assert takes(grammar, special, reasoning + written("kimi", CALLS))
    assert not takes(grammar, special, reasoning + written("kimi", CALLS) + "x")
    # the same characters spelled with ordinary tokens are not the markers
    assert not takes(grammar, special, reasoning + written("kimi", CALLS), encoded_by=plain)


@pytest.mark.parametrize("style", ["json", "xml", "kimi"])
def test_the_tool_call_style_is_read_from_the_chat_template(tool_tokenizer, style):
    from conftest import TOOL_TEMPLATES
    from fixtures.make_assistant import TEMPLATE

    from mlx_hybrid.tool_grammars import tool_call_style
    from mlx_hybrid.tokenizer import Tokenizer

    plain = tool_tokenizer[0]
    assert tool_call_style(plain.rendered_tool_call) is None  # the fixtures' own template writes no calls
    template = TEMPLATE if style == "xml" else TOOL_TEMPLATES[style]
    assert tool_call_style(Tokenizer(plain.backend, plain.eos_token_ids, template).rendered_tool_call) == style
