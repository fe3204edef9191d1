"""Anthropic's Messages API and OpenAI's Responses API as coding agents use them: a real server
process on 127.0.0.1 driven by the official `anthropic` and `openai` clients. The reference for
every output is the same conversation through Chat Completions (greedy: the same tokens), and
the model taught one tool-using conversation (tests/fixtures/make_assistant.py)."""

import base64
import json
from pathlib import Path

import openai
import pytest

import mlx_hybrid
from conftest import FIXTURES
from fixtures.make_assistant import template_messages
from mlx_hybrid.prompt import chat_prompt
from mlx_hybrid.tokenizer import Tokenizer
from test_server import API_KEY, ASSISTANT, UNITS, Server, http

anthropic = pytest.importorskip("anthropic")  # a test dependency; skipped where an old install lacks it


@pytest.fixture(scope="module")
def assistant():
    running = Server("--model", str(ASSISTANT), "--api-key", API_KEY, "--served-model-name", "assistant")
    yield running
    assert running.stop()  # it survived every request


@pytest.fixture(scope="module")
def conversations():
    return json.loads((ASSISTANT / "conversations.json").read_text())


@pytest.fixture(scope="module")
def claude(assistant):
    return anthropic.Anthropic(base_url=assistant.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(assistant):
    return openai.OpenAI(base_url=assistant.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def anthropic_tools(tools):
    return [
        {"name": t["function"]["name"], "description": t["function"].get("description", ""),
         "input_schema": t["function"]["parameters"]}
        for t in tools
    ]  # fmt: skip


def blocks_of(claude, stream: bool, **request) -> tuple[list[dict], str, dict]:
    """(content blocks as dicts, stop_reason, usage), from the reply or put together from the stream's events."""
    if not stream:
        reply = claude.messages.create(**request)
        return [b.model_dump(exclude_none=True) for b in reply.content], reply.stop_reason, reply.usage.model_dump()
    kinds = []
    with claude.messages.stream(**request) as events:
        for event in events:
            kinds.append(event.type)
        reply = events.get_final_message()
    # Anthropic's order: message_start first, message_stop last, blocks opened and closed in turn
    raw = [k for k in kinds if k in ("message_start", "content_block_start", "content_block_stop", "message_stop")]
    assert raw[0] == "message_start" and raw[-1] == "message_stop"
    assert raw[1:-1] == ["content_block_start", "content_block_stop"] * len(reply.content)
    return [b.model_dump(exclude_none=True) for b in reply.content], reply.stop_reason, reply.usage.model_dump()


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_round_trip_equals_chat_completions(claude, oai, conversations, stream, assistant):
    tools, expected = conversations["tools"], conversations["expected"]
    system, question = (m["content"] for m in conversations["turn_1"]["messages"])
    request = dict(
        model="assistant",
        max_tokens=200,
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        tools=anthropic_tools(tools),
        messages=[{"role": "user", "content": question}],
        extra_body={"temperature": 0},
    )
    blocks, stop, usage = blocks_of(claude, stream, **request)
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"] and stop == "tool_use"
    assert blocks[0]["thinking"] == expected["turn_1"]["reasoning"]
    assert blocks[1]["name"] == "get_weather" and blocks[1]["input"] == expected["turn_1"]["tool_call"]["arguments"]
    chat = oai.chat.completions.create(
        model="assistant", messages=conversations["turn_1"]["messages"], tools=tools, temperature=0, max_tokens=200
    )
    assert usage["output_tokens"] == chat.usage.completion_tokens
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == chat.usage.prompt_tokens

    # the agent runs the tool and sends the result back, with the thinking and the call in the history
    result = conversations["turn_2"]["messages"][-1]["content"]
    turn_2 = request["messages"] + [
        {"role": "assistant", "content": blocks},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": blocks[1]["id"], "content": result}]},
    ]
    blocks, stop, usage = blocks_of(claude, stream, **{**request, "messages": turn_2})
    assert [b["type"] for b in blocks] == ["thinking", "text"] and stop == "end_turn"
    assert blocks[0]["thinking"] == expected["turn_2"]["reasoning"]
    assert blocks[1]["text"] == expected["turn_2"]["content"]
    # this model called the tool without closing its reasoning, and the template writes `</think>` before
    # the call in the history: the history departs from what was generated, so turn 2 resumes from the
    # last boundary that still matches: the end of the question, or a later one an earlier request of the
    # same conversation left (this server's cache outlives a test)
    _, tokenizer = mlx_hybrid.load(ASSISTANT)
    turn_1, turn_2 = (
        chat_prompt(tokenizer, template_messages(conversations[turn]["messages"]), tools=tools)
        for turn in ("turn_1", "turn_2")
    )
    assert usage["cache_read_input_tokens"] in [b for b in turn_2.boundaries if b >= turn_1.boundaries[-1]]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(turn_2.ids)
    chat = oai.chat.completions.create(
        model="assistant", messages=conversations["turn_2"]["messages"], tools=tools, temperature=0, max_tokens=200
    )
    assert (
        chat.choices[0].message.content == blocks[1]["text"] and usage["output_tokens"] == chat.usage.completion_tokens
    )
    held = assistant.health()["prefix_cache"]  # what serves the session, as /health shows it
    assert held["checkpoints"] >= 2 and 0 < held["bytes"] <= held["budget_bytes"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_and_named_give_valid_calls(claude, conversations, stream):
    import jsonschema

    tools = anthropic_tools(conversations["tools"] + [UNITS])
    schemas = {t["name"]: t["input_schema"] for t in tools}
    prose = [{"role": "user", "content": "Thanks! Tell me a story."}]
    for choice, names in (({"type": "any"}, set(schemas)), ({"type": "tool", "name": "set_units"}, {"set_units"})):
        blocks, stop, _ = blocks_of(
            claude,
            stream,
            model="assistant",
            max_tokens=200,
            tools=tools,
            messages=prose,
            tool_choice=choice,
            extra_body={"temperature": 0},
        )
        calls = [b for b in blocks if b["type"] == "tool_use"]
        assert stop == "tool_use" and calls
        for call in calls:
            assert call["name"] in names
            jsonschema.validate(call["input"], schemas[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_offers_no_tools_gets_no_tool_call(claude, oai, conversations, stream):
    """The assistant calls get_weather when asked about the weather, tools offered or not (inside its
    reasoning, which it does not close before the call). A client that offered no tools cannot answer
    a call: the markup comes back as the text it is part of on every route (as llama-server and vLLM
    return it), the reasoning still apart; offered, it is a call."""
    tools, messages = conversations["tools"], conversations["turn_1"]["messages"]
    system, question = (m["content"] for m in messages)
    markup = "<tool_call>\n<function=get_weather>"
    chat = dict(model="assistant", messages=messages, temperature=0, max_tokens=200)
    plain = oai.chat.completions.create(**chat).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "stop"
    assert markup in plain.message.model_extra["reasoning_content"]  # what the model wrote, where it wrote it
    for choice in ("none", None):  # tool_choice "none" with tools offered: as if none were offered
        offered = dict(tools=tools, tool_choice=choice) if choice else dict(tools=tools)
        reply = oai.chat.completions.create(**chat, **offered).choices[0]
        assert (reply.message.tool_calls is None) == (choice == "none")

    messages_request = dict(
        model="assistant",
        max_tokens=200,
        system=system,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": question}],
    )
    blocks, stop, _ = blocks_of(claude, stream, **messages_request)
    assert [b["type"] for b in blocks] == ["thinking"] and stop == "end_turn" and markup in blocks[0]["thinking"]
    blocks, stop, _ = blocks_of(claude, stream, **messages_request, tools=anthropic_tools(tools))
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"] and stop == "tool_use"

    responses_request = dict(
        model="assistant", instructions=system, input=question, temperature=0, max_output_tokens=200
    )
    response = responses_create(oai, stream, **responses_request)
    assert [item.type for item in response.output] == ["reasoning"] and markup in response.output[0].content[0].text
    functions = [{"type": "function", **t["function"]} for t in tools]
    response = responses_create(oai, stream, **responses_request, tools=functions)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]


def test_thinking_disabled_and_a_budget_that_ends_it(claude, conversations, assistant):
    system, question = (m["content"] for m in conversations["turn_1"]["messages"])
    request = dict(
        model="assistant",
        max_tokens=40,
        system=system,
        messages=[{"role": "user", "content": question}],
        extra_body={"temperature": 0},
    )
    off = claude.messages.create(**request, thinking={"type": "disabled"})
    assert all(b.type != "thinking" for b in off.content)
    _, tokenizer = mlx_hybrid.load(ASSISTANT)
    rendered = chat_prompt(tokenizer, template_messages(conversations["turn_1"]["messages"]), enable_thinking=False)
    assert off.usage.input_tokens + off.usage.cache_read_input_tokens == len(rendered.ids)  # the template's off switch

    budget = 3
    reply = claude.messages.create(**request, thinking={"type": "enabled", "budget_tokens": budget})
    thinking = reply.content[0]
    assert thinking.type == "thinking"
    # the reasoning is the first `budget` tokens of what the model would think unbounded, then </think>
    full = conversations["expected"]["turn_1"]["reasoning"]
    assert tokenizer.encode(thinking.thinking) == tokenizer.encode(full)[:budget]
    omitted = claude.messages.create(
        **request, thinking={"type": "enabled", "budget_tokens": budget, "display": "omitted"}
    )
    assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == ""
    assert [b.model_dump() for b in omitted.content[1:]] == [b.model_dump() for b in reply.content[1:]]


def test_stop_sequences_count_tokens_and_the_same_tokens_as_chat(claude, oai, conversations):
    messages = conversations["turn_1"]["messages"]
    request = dict(
        model="assistant",
        max_tokens=30,
        system=messages[0]["content"],
        messages=[{"role": "user", "content": messages[1]["content"]}],
        extra_body={"temperature": 0},
    )
    plain = claude.messages.create(**request, thinking={"type": "disabled"})
    chat = oai.chat.completions.create(
        model="assistant",
        messages=messages,
        max_tokens=30,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    text = plain.content[0].text
    assert text == chat.choices[0].message.content and plain.usage.output_tokens == chat.usage.completion_tokens
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = claude.messages.create(**request, thinking={"type": "disabled"}, stop_sequences=["@@", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]

    counted = claude.messages.count_tokens(
        model="assistant", system=messages[0]["content"], messages=[{"role": "user", "content": messages[1]["content"]}]
    )
    _, tokenizer = mlx_hybrid.load(ASSISTANT)
    assert counted.input_tokens == len(chat_prompt(tokenizer, messages).ids)


def test_messages_errors_in_anthropics_shape_and_the_server_lives_on(claude, assistant):
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ({"messages": user}, "max_tokens"),  # required, as Anthropic requires it
        ({"max_tokens": 5, "messages": user, "max_token": 5}, "max_token"),
        ({"max_tokens": 5, "messages": user, "tools": [{"type": "web_search_20250305", "name": "s"}]}, "tools"),
        ({"max_tokens": 5, "messages": user, "output_config": {"effort": "high"}}, "effort"),
        ({"max_tokens": 5, "messages": user, "thinking": {"type": "enabled", "budget_tokens": 9}}, "budget_tokens"),
        ({"max_tokens": 5, "messages": user, "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"max_tokens": 5, "messages": user, "temperature": 3}, "temperature"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, "document"),
        ({"max_tokens": 5, "messages": user, "stop_sequences": [""]}, "stop_sequences"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [MARKED_TEXT] * 5}]}, "cache_control"),
    ]
    for body, named in cases:
        status, reply = http("POST", assistant.url + "/v1/messages", json.dumps(body).encode(), {"x-api-key": API_KEY})
        assert status == 400 and reply["type"] == "error", (body, reply)
        assert reply["error"]["type"] == "invalid_request_error" and named in reply["error"]["message"], reply
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-x", max_tokens=5, messages=user)
    wrong = anthropic.Anthropic(base_url=assistant.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="assistant", max_tokens=5, messages=user)
    status, reply = http("POST", assistant.url + "/v1/messages", b"{not json", {"x-api-key": API_KEY})
    assert status == 400 and reply["type"] == "error"
    assert assistant.load()["status"] == "ok"


MARKED_TEXT = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}


@pytest.mark.parametrize("route", ["messages", "chat_completions"])
def test_a_cache_control_mark_inside_a_message_is_resumed_from_by_another_question(assistant, route):
    """Anthropic's prompt-caching pattern: a long document block marked with cache_control, then a question
    block, in one user message (on Chat Completions the same mark on a text part, as OpenRouter passes it).
    A second request with another question reads the document from the checkpoint at the mark: all but at
    most two of the tokens the two prompts share (their longest common token prefix, computed from the two
    renderings), where the first read none of the document; and its reply is that of a server that keeps
    no checkpoints."""
    words = ("file", "test", "branch", "commit", "build", "path", "value", "line")
    step = 7 if route == "messages" else 5  # a document no earlier request has read
    document = " ".join(words[(i * step + i // 8) % len(words)] for i in range(400)) + "."
    system, questions = "You answer.", (" Which file?", " Does a test fail?")

    def ask(server_url, question) -> tuple[object, int]:
        """(the reply's content, prompt tokens read from a checkpoint)"""
        mark = {"cache_control": {"type": "ephemeral"}}
        content = [{"type": "text", "text": document, **mark}, {"type": "text", "text": question}]
        if route == "messages":
            client = anthropic.Anthropic(base_url=server_url, api_key=API_KEY, max_retries=0, timeout=120)
            reply = client.messages.create(
                model="assistant",
                max_tokens=8,
                system=system,
                extra_body={"temperature": 0},
                messages=[{"role": "user", "content": content}],
            )
            return reply.content, reply.usage.cache_read_input_tokens
        client = openai.OpenAI(base_url=server_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="assistant",
            max_tokens=8,
            temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": content}],
        )
        return reply.choices[0].message, reply.usage.prompt_tokens_details.cached_tokens

    tokenizer = Tokenizer.from_hf_dir(ASSISTANT, {})
    prompts = [
        chat_prompt(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": document + q}])
        for q in questions
    ]
    shared = next(i for i, (a, b) in enumerate(zip(*(p.ids for p in prompts))) if a != b)
    (_, first_cached), (second, second_cached) = (ask(assistant.url, q) for q in questions)
    assert first_cached < shared - 300  # at most the system prompt
    assert shared - 2 <= second_cached <= shared
    fresh = Server(
        "--model", str(ASSISTANT), "--served-model-name", "assistant", "--api-key", API_KEY, "--prefix-cache-bytes", "0"
    )
    try:
        reference, cached = ask(fresh.url, questions[1])
        assert cached == 0 and reference == second
    finally:
        assert fresh.stop()


def test_an_unknown_field_is_refused_by_name_on_every_route(assistant):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    user = [{"role": "user", "content": "hi"}]
    for path, body in (
        ("/v1/chat/completions", {"messages": user, "max_token": 5}),
        ("/v1/completions", {"prompt": "hi", "max_token": 5}),
        ("/v1/responses", {"input": "hi", "max_token": 5}),
    ):
        status, reply = http("POST", assistant.url + path, json.dumps(body).encode(), headers)
        assert status == 400 and "Unrecognized request argument supplied: max_token" in reply["error"]["message"]
    # what clients send unasked and changes nothing is accepted
    body = {"messages": user, "max_tokens": 1, "user": "u", "store": False, "metadata": {"a": "b"}}
    assert http("POST", assistant.url + "/v1/chat/completions", json.dumps(body).encode(), headers)[0] == 200


# -- the Responses API


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_round_trip_equals_chat_completions(oai, conversations, stream):
    tools = [{"type": "function", **t["function"]} for t in conversations["tools"]]
    system, question = (m["content"] for m in conversations["turn_1"]["messages"])
    request = dict(model="assistant", instructions=system, tools=tools, temperature=0, max_output_tokens=200)
    response = responses_create(oai, stream, input=question, **request)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"] and response.status == "completed"
    expected = conversations["expected"]
    assert response.output[0].content[0].text == expected["turn_1"]["reasoning"]
    call = response.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == expected["turn_1"]["tool_call"]["arguments"]

    result = conversations["turn_2"]["messages"][-1]["content"]
    items = [
        {"role": "user", "content": question},
        *[item.model_dump(exclude_none=True) for item in response.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    response = responses_create(oai, stream, input=items, **request)
    assert response.output_text == expected["turn_2"]["content"]
    assert response.usage.input_tokens_details.cached_tokens > 0
    chat = oai.chat.completions.create(
        model="assistant",
        messages=conversations["turn_2"]["messages"],
        tools=conversations["tools"],
        temperature=0,
        max_tokens=200,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens == chat.usage.completion_tokens


def responses_create(oai, stream: bool, **request):
    if not stream:
        return oai.responses.create(**request)
    kinds, final = [], None
    for event in oai.responses.create(**request, stream=True):
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and final is not None
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(final.output)
    return final


def test_responses_text_format_json_schema_and_refusals(oai, assistant):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response = oai.responses.create(
        model="assistant",
        input="Where?",
        max_output_tokens=60,
        temperature=0,
        reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
    )
    import jsonschema

    jsonschema.validate(json.loads(response.output_text), schema)
    truncated = oai.responses.create(model="assistant", input="Where?", max_output_tokens=2, temperature=0)
    assert truncated.status == "incomplete" and truncated.incomplete_details.reason == "max_output_tokens"
    for extra, named in (
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
    ):
        with pytest.raises(openai.BadRequestError, match=named):
            oai.responses.create(model="assistant", input="hi", **extra)
    assert assistant.load()["status"] == "ok"


# -- an image, through Messages and Chat Completions alike


def test_an_image_block_gives_what_the_image_url_part_gives():
    vision = FIXTURES / "qwen35vl" / "hf"
    running = Server("--model", str(vision), "--served-model-name", "vl", "--draft", "none")
    try:
        data = base64.b64encode((FIXTURES / "qwen35vl" / "image_a.png").read_bytes()).decode()
        claude = anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
        reply = claude.messages.create(
            model="vl",
            max_tokens=8,
            extra_body={"temperature": 0},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                        {"type": "text", "text": "What is this?"},
                    ],
                }
            ],
        )
        oai = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        chat = oai.chat.completions.create(
            model="vl",
            max_tokens=8,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                        {"type": "text", "text": "What is this?"},
                    ],
                }
            ],
        )
        assert reply.usage.output_tokens == chat.usage.completion_tokens == 8
        text = "".join(b.text for b in reply.content if b.type == "text")
        assert text == (chat.choices[0].message.content or "")
        assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    finally:
        assert running.stop()


# -- Claude Code's and Codex's own request shapes (tests/fixtures/agents), replayed as raw HTTP


def sse_events(response) -> list[tuple[str, dict]]:
    """(event name, data) of a server-sent event stream."""
    events, name = [], None
    for raw in response:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
    return events


def post(url: str, body: dict):
    """The open response to a raw JSON POST with the test key (as either header)."""
    import urllib.request

    headers = {"Content-Type": "application/json", "x-api-key": API_KEY, "Authorization": f"Bearer {API_KEY}"}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    return urllib.request.urlopen(request, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_claude_codes_and_codexs_requests_replay(assistant, stream):
    """The request bodies as these agents send them, with their fields (metadata, cache_control, thinking
    with a budget, is_error results, system reminders; developer messages, reasoning items, include,
    prompt_cache_key, client_metadata), the model renamed and the length bounded to keep the test short."""
    claude = json.loads((FIXTURES / "agents" / "claude_code_messages.json").read_text())
    claude |= {
        "model": "assistant",
        "max_tokens": 48,
        "stream": stream,
        "thinking": {"type": "enabled", "budget_tokens": 8},
    }
    codex = json.loads((FIXTURES / "agents" / "codex_responses.json").read_text())
    codex |= {"model": "assistant", "max_output_tokens": 48, "stream": stream}
    with post(assistant.url + "/v1/messages", claude) as response:
        assert response.status == 200
        if stream:
            events = sse_events(response)
            names = [name for name, _ in events]
            assert names == [data["type"] for _, data in events]
            assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
            stop_reason = events[-2][1]["delta"]["stop_reason"]
            starts = [data["content_block"]["type"] for name, data in events if name == "content_block_start"]
        else:
            reply = json.loads(response.read())
            stop_reason, starts = reply["stop_reason"], [block["type"] for block in reply["content"]]
    # thinking on, ended by its budget of 8 tokens; then the answer, cut at 48 tokens or ended
    assert starts[0] == "thinking" and stop_reason in ("end_turn", "max_tokens", "tool_use")

    with post(assistant.url + "/v1/responses", codex) as response:
        assert response.status == 200
        if stream:
            events = sse_events(response)
            assert [name for name, _ in events] == [data["type"] for _, data in events]
            assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
            assert events[-1][0] in ("response.completed", "response.incomplete")
            final = events[-1][1]["response"]
        else:
            final = json.loads(response.read())
    assert final["object"] == "response" and final["output"] and final["status"] in ("completed", "incomplete")
    assert len([item for item in final["output"] if item["type"] == "function_call"]) <= 1  # parallel_tool_calls false
    assert assistant.load()["status"] == "ok"


def long_context_assistant(directory: Path) -> Path:
    """The assistant in `directory`, its config allowing 16k positions: agents' prompts (their tools'
    schemas, their instructions) run to 8k tokens in its small vocabulary, and what the tests below check
    is resumption and the wire format, not the words."""
    for path in ASSISTANT.iterdir():
        (directory / path.name).symlink_to(path)
    config = json.loads((ASSISTANT / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 16384
    (directory / "config.json").unlink()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# The previous prompt ends with the generation prompt where the next one has the assistant's message (or,
# repeated, the same prompt): the shared prefix, and the last checkpoint in it, end where it begins
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n"


def test_a_captured_claude_code_session_reads_only_what_is_new(tmp_path):
    """A real Claude Code session (tests/fixtures/agents/claude_code_session.json: seven requests as the
    client sent them, long strings cut) replayed in order, streamed as it was: every request answers, and
    each one after the first reads from a checkpoint all of the previous request's prompt that it repeats."""
    session = json.loads((FIXTURES / "agents" / "claude_code_session.json").read_text())
    generation_prompt = len(Tokenizer.from_hf_dir(ASSISTANT, {}).encode(GENERATION_PROMPT))
    model = long_context_assistant(tmp_path)
    server, previous = Server("--model", str(model), "--served-model-name", "assistant"), None
    try:
        for body in session:
            with post(server.url + "/v1/messages", body | {"model": "assistant", "max_tokens": 4}) as response:
                assert response.status == 200
                events = sse_events(response)
            assert [name for name, _ in events][-2:] == ["message_delta", "message_stop"]
            usage = events[0][1]["message"]["usage"]
            prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
            if previous is not None:
                assert usage["cache_read_input_tokens"] == previous - generation_prompt, (usage, previous)
            previous = prompt
    finally:
        assert server.stop()


def test_a_published_codex_cli_request_replays(tmp_path):
    """Codex CLI 0.46's first request of a session as a published proxy records it
    (tests/fixtures/agents/codex_cli_request.json: Codex's 10k-character instructions, a user's instructions
    and environment context as input messages, its shell, update_plan and view_image tools, reasoning,
    store false, include, prompt_cache_key, streamed), the model renamed and the length bounded: Responses
    events in order, and the same request again reads all of its prompt but the generation prompt from a
    checkpoint (usage.input_tokens_details.cached_tokens)."""
    body = json.loads((FIXTURES / "agents" / "codex_cli_request.json").read_text())
    body |= {"model": "assistant", "max_output_tokens": 8}
    generation_prompt = len(Tokenizer.from_hf_dir(ASSISTANT, {}).encode(GENERATION_PROMPT))
    server = Server("--model", str(long_context_assistant(tmp_path)), "--served-model-name", "assistant")
    try:
        usages = []
        for _ in range(2):
            with post(server.url + "/v1/responses", body) as response:
                assert response.status == 200
                events = sse_events(response)
            assert [name for name, _ in events] == [data["type"] for _, data in events]
            assert events[0][0] == "response.created" and events[-1][0] in ("response.completed", "response.incomplete")
            usages.append(events[-1][1]["response"]["usage"])
        first, again = usages
        assert first["input_tokens"] > 7000 and first["input_tokens"] == again["input_tokens"]
        assert again["input_tokens_details"]["cached_tokens"] == again["input_tokens"] - generation_prompt, usages
    finally:
        assert server.stop()
