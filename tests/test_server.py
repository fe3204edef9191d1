"""`mlx_hybrid.server` as clients use it: a real server process on 127.0.0.1, driven by the
official `openai` client (and raw HTTP for what no client would send). Outputs are compared
with the model run alone in this process."""

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection

import openai
import pytest

import mlx_hybrid
from mlx.utils import tree_flatten
from conftest import FIXTURES, free_port, function_tool
from fixtures.make_assistant import template_messages
from mlx_hybrid.parsers import parse_output
from mlx_hybrid.prompt import chat_prompt

QWEN = FIXTURES / "qwen35" / "hf"
ASSISTANT = FIXTURES / "assistant"
API_KEY = "test-key"
MODEL = str(QWEN)  # the name the server gives it: --model as given


def http(method: str, url: str, body: bytes | None = None, headers=None):
    """(status, parsed JSON body) of one raw request."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Server:
    """A server process; launcher: what runs `python` (e.g. mlx.launch and its options), else python itself."""

    def __init__(self, *args, launcher=(sys.executable,)):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [*launcher, "-m", "mlx_hybrid.server", "--port", str(self.port), "--log-level", "warning"]
        self.process = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stdout.read()}")
            try:
                if http("GET", self.url + "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.process.kill()
        raise RuntimeError("the server did not come up")

    def health(self) -> dict:
        status, body = http("GET", self.url + "/health")
        assert status == 200
        return body

    def load(self) -> dict:
        return {key: self.health()[key] for key in ("status", "running", "waiting")}

    def stop(self):
        """Shut it down; whether it was still running (a server survives every request)."""
        alive = self.process.poll() is None
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        return alive


@pytest.fixture(scope="module")
def server():
    running = Server("--model", str(QWEN), "--max-batch", "8")  # MTP speculation: on by default
    yield running
    assert running.stop()  # it survived every request


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local():
    return mlx_hybrid.load(QWEN)


def alone(local, ids, max_tokens):
    """Greedy tokens of this prompt run by itself, no speculation, and their text."""
    model, tokenizer = local
    tokens = [r.token for r in mlx_hybrid.stream_generate(model, tokenizer, ids, max_tokens=max_tokens, draft="none")]
    text = tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])
    return tokens, text


def chat_ids(local, messages, **options):
    return chat_prompt(local[1], messages, **options).ids


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.load() == {"status": "ok", "running": 0, "waiting": 0}


def test_health_reports_the_memory_the_model_takes(server, local):
    memory = server.health()["memory"]
    assert memory["weights_bytes"] == sum(p.nbytes for _, p in tree_flatten(local[0].parameters()))
    # MLX's memory in use holds the weights and the engine's caches; its peak at least that
    assert memory["peak_bytes"] >= memory["active_bytes"] >= memory["weights_bytes"]


def test_health_reports_the_running_speculation_figures(server, client):
    before = server.health()["speculation"]
    client.completions.create(model=MODEL, prompt="def parse_args(", max_tokens=40, temperature=0)
    after = server.health()["speculation"]
    assert after["drafted"] > before["drafted"]
    assert after["acceptance_rate"] == pytest.approx(after["accepted"] / after["drafted"])
    rates = after["acceptance_by_position"]
    assert 1 <= len(rates) <= 3 and all(0.0 <= r <= 1.0 for r in rates)  # 2 or 3 drafts a round by default


def test_chat_equals_the_model_alone_plain_and_streamed(client, local):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse_args("}]
    tokens, text = alone(local, chat_ids(local, messages), 20)
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert response.choices[0].message.content == parse_output(text).content
    assert response.usage.completion_tokens == len(tokens)
    assert response.usage.prompt_tokens == len(chat_ids(local, messages))
    assert response.choices[0].finish_reason == ("stop" if tokens[-1] in local[1].eos_token_ids else "length")

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == parse_output(text).content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == response.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)


def test_completions_and_logprobs_equal_the_model_alone(client, local):
    model, tokenizer = local
    tokens, text = alone(local, tokenizer.encode("import os\nimport"), 12)
    response = client.completions.create(
        model=MODEL, prompt="import os\nimport", max_tokens=12, temperature=0, logprobs=3
    )
    choice = response.choices[0]
    assert choice.text == text
    # each token's log-probability is the model's at its position, and the greedy token is the top one
    import mlx.core as mx

    logits = model(mx.array(tokenizer.encode("import os\nimport") + tokens)[None])[0].astype(mx.float32)
    logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[-len(tokens) - 1 : -1]
    expected = [logprobs[i, t].item() for i, t in enumerate(tokens)]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-3)
    # (the legacy layout keys alternatives by text: tokens holding part of a character collide)
    assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x = "}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy: the top token
    # the tokens' bytes make up the text, also where a token holds part of a character
    text = bytes(b for t in content for b in t.bytes).decode(errors="replace")
    assert text == chat.choices[0].message.content


def test_stop_strings_cut_the_text_and_end_the_request(client, local):
    tokenizer = local[1]
    _, text = alone(local, tokenizer.encode("def parse_args("), 40)
    stop = text[10:13]  # a string the model will write
    expected = text[: text.index(stop)]
    response = client.completions.create(
        model=MODEL, prompt="def parse_args(", max_tokens=40, temperature=0, stop=[stop, "@@@"]
    )
    assert response.choices[0].text == expected and response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < 40
    streamed = client.completions.create(
        model=MODEL, prompt="def parse_args(", max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_eight_concurrent_clients_each_get_what_they_get_alone(client, local):
    prompts = [f"def f{i}(x):\n    return x {'+-*/%&|^'[i]} " + "y" * i for i in range(8)]
    expected = [
        parse_output(alone(local, chat_ids(local, [{"role": "user", "content": p}]), 16)[1]).content for p in prompts
    ]

    def ask(prompt):
        messages = [{"role": "user", "content": prompt}]
        return (
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
            .choices[0]
            .message.content
        )

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, prompts)) == expected


def test_a_client_that_leaves_mid_stream_frees_its_slot(server, client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "import"}], max_tokens=4000, stream=True
    )
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()
    deadline = time.time() + 15  # the 4000 tokens would take far longer
    while server.health()["running"] and time.time() < deadline:
        time.sleep(0.1)
    assert server.load() == {"status": "ok", "running": 0, "waiting": 0}
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert response.usage.completion_tokens >= 1


BAD_REQUESTS = [
    ("/v1/chat/completions", b'{"messages": [', 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 17}, 400, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 30000}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": -3}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    (
        "/v1/chat/completions",  # this model's template has no place for tools
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    # the template's variables only: what the server renders with is not a client's to set
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}, 400, "chat_template_kwargs"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [70000]}, 400, None),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    # every OpenAI field that would change the output and is not implemented: a 400 naming it
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, 400,
     "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "function_call": "auto"}, 400,
     "function_call"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}, 400,
     "modalities"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "x"}}, 400, "audio"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "web_search_options": {}}, 400,
     "web_search_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low"}, 400,
     "reasoning_effort"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "verbosity": "low"}, 400, "verbosity"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "string", "pattern": "(["}}}}, 400, None),
]  # fmt: skip


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_lives_on(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, response = http("POST", server.url + path, content)
    assert got == status, response
    error = response["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    if "x" * 30000 in content.decode(errors="ignore"):
        assert error["code"] == "context_length_exceeded"
    assert server.health()["status"] == "ok"


def test_unknown_routes_and_methods_are_json_errors(server):
    status, body = http("GET", server.url + "/v1/nothing")
    assert status == 404 and body["error"]["message"]
    status, body = http("GET", server.url + "/v1/chat/completions")
    assert status == 405 and body["error"]["message"]


def test_a_hybrid_model_with_a_draft_model_serves_what_it_generates_alone(local):
    """The leading MLX runner's server accepts --draft-model and fails on a hybrid model's first request."""
    target = FIXTURES / "qwen35moe" / "hf"
    running = Server("--model", str(target), "--draft-model", str(QWEN), "--draft-p-min", "0")
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model, tokenizer = mlx_hybrid.load(target)
        expected = alone((model, tokenizer), tokenizer.encode("def main():"), 16)[1]
        response = client.completions.create(model=str(target), prompt="def main():", max_tokens=16, temperature=0)
        assert response.choices[0].text == expected
    finally:
        assert running.stop()


def test_a_stop_signal_ends_the_requests_in_flight_after_a_grace_period():
    """SIGTERM (as Ctrl-C, or a service manager) while a long answer streams: the server stops within its
    5 s grace period plus an engine step, cutting the stream, rather than serving the answer to its end
    (4000 tokens, end tokens banned: tens of seconds here; uvicorn's own default waits for it)."""
    import signal

    running = Server("--model", str(ASSISTANT), "--served-model-name", "assistant")
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    eos = mlx_hybrid.load(ASSISTANT)[1].eos_token_ids
    chunks, first = [], threading.Event()

    def stream():
        try:
            for chunk in client.chat.completions.create(
                model="assistant",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4000,
                stream=True,
                logit_bias={str(t): -100 for t in eos},
            ):
                chunks.append(chunk)
                first.set()
        except openai.APIConnectionError:
            pass

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    start = time.perf_counter()
    running.process.send_signal(signal.SIGTERM)
    running.process.wait(timeout=60)
    reader.join(60)
    # 5 s of grace, the engine's step in progress, the lifespan's teardown: well within 20 s
    assert time.perf_counter() - start < 20
    assert not any(c.choices and c.choices[0].finish_reason for c in chunks)  # cut, not finished


def test_usage_errors_are_one_line_and_exit_2(server):
    command = [sys.executable, "-m", "mlx_hybrid.server"]
    for args, message in [
        (["--model", "/no/such/model"], "no such file"),
        (["--max-batch", "0"], "--max-batch"),
        (["--port", str(server.port)], "cannot listen"),  # taken by the running server
        (["--prefix-cache-bytes", "2X"], "--prefix-cache-bytes"),
        (["--prefix-cache-bytes", "-1G"], "--prefix-cache-bytes"),
    ]:
        result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and result.stderr.startswith("error: ") and message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    from mlx_hybrid.cli.common import byte_count

    sizes = ["0", "2147483648", "512M", "8G", "1.5G", "8GiB", "64kb"]
    assert [byte_count(size) for size in sizes] == [0, 2 << 30, 512 << 20, 8 << 30, 3 << 29, 8 << 30, 64 << 10]


# -- conversations: the bundled model, whose answers are text that reads back as the same tokens
# (a random model's bytes often are not UTF-8, and nothing can render those back as they were)


@pytest.fixture(scope="module")
def bundled():
    running = Server()
    yield running
    assert running.stop()


# the first turn ends at max_tokens, or with the model's end token (<|endoftext|>, where the template
# closes the turn with <|im_end|>), in both cases inside a round of MTP drafts
@pytest.mark.parametrize("question, max_tokens, finish", [("def parse_args(", 24, "length"), ("hi", 100, "stop")])
def test_second_turn_reads_only_the_new_message(bundled, question, max_tokens, finish):
    client = openai.OpenAI(base_url=bundled.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model, tokenizer = mlx_hybrid.load(mlx_hybrid.bundled_model_path())
    name = mlx_hybrid.bundled_model_path().stem
    first = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": question}]
    reply = client.chat.completions.create(model=name, messages=first, max_tokens=max_tokens, temperature=0)
    assert reply.choices[0].finish_reason == finish
    answer = reply.choices[0].message.content
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "class Config:"}]
    turn_1, turn_2 = chat_prompt(tokenizer, first).ids, chat_prompt(tokenizer, second).ids
    generated = alone((model, tokenizer), turn_1, max_tokens)[0]
    # the history repeats turn 1 token for token, but for an end token the template writes its own way
    assert turn_2[: len(turn_1) + len(generated) - 1] == turn_1 + generated[:-1]

    response = client.chat.completions.create(model=name, messages=second, max_tokens=24, temperature=0)
    # turn 1 was checkpointed at its end (its last token not fed yet): turn 2 reads the rest
    assert response.usage.prompt_tokens_details.cached_tokens == len(turn_1) + len(generated) - 1
    assert response.usage.prompt_tokens == len(turn_2)
    assert response.choices[0].message.content == parse_output(alone((model, tokenizer), turn_2, 24)[1]).content


# -- tools and reasoning: a model taught one tool-using conversation (tests/fixtures/make_assistant.py)


@pytest.fixture(scope="module")
def assistant():
    running = Server("--model", str(ASSISTANT), "--api-key", API_KEY, "--served-model-name", "assistant")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def conversations():
    return json.loads((ASSISTANT / "conversations.json").read_text())


def test_the_api_key_is_required(assistant):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, body = http("GET", assistant.url + "/v1/models", headers=headers)
        assert status == 401 and body["error"]["type"] == "authentication_error"
    wrong = openai.OpenAI(base_url=assistant.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert assistant.health()["status"] == "ok"  # /health needs no key


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_with_the_call_inside_reasoning(assistant, conversations, stream):
    client = openai.OpenAI(base_url=assistant.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    tools, expected = conversations["tools"], conversations["expected"]
    turn_1 = dict(model="assistant", messages=conversations["turn_1"]["messages"], tools=tools, temperature=0)
    message, finish = _answer(client, turn_1, stream)
    # the template opened <think>: the call was made while thinking, and still comes out as a call
    assert message["reasoning_content"] == expected["turn_1"]["reasoning"]
    assert not message["content"]
    assert finish == "tool_calls" and len(message["tool_calls"]) == 1
    call = message["tool_calls"][0]
    assert call["function"]["name"] == expected["turn_1"]["tool_call"]["name"]
    assert json.loads(call["function"]["arguments"]) == expected["turn_1"]["tool_call"]["arguments"]
    assert json.loads(call["function"]["arguments"])["days"] == 2  # the schema's integer, not "2"

    # the client runs the tool and sends its result back
    turn_2_messages = conversations["turn_1"]["messages"] + [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": message["reasoning_content"],
            "tool_calls": [{"id": call["id"], "type": "function", "function": call["function"]}],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": conversations["turn_2"]["messages"][-1]["content"]},
    ]
    message, finish = _answer(client, {**turn_1, "messages": turn_2_messages}, stream)
    assert message["reasoning_content"] == expected["turn_2"]["reasoning"]
    assert message["content"] == expected["turn_2"]["content"]
    assert finish == "stop" and not message.get("tool_calls")


# tools whose arguments a small model can finish (bounded strings), for tool_choice
UNITS = function_tool(
    "set_units",
    {
        "units": {"type": "string", "enum": ["metric", "imperial"]},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    ["units"],
)
CITY = function_tool(
    "get_weather",
    {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    ["city", "days"],
)


def assert_valid_calls(message, tools, finish, name=None):
    """At least one call, each to one of tools (to `name` when given) with arguments its schema takes."""
    import jsonschema

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    assert finish == "tool_calls" and message["tool_calls"], message
    for call in message["tool_calls"]:
        assert call["function"]["name"] in ([name] if name else schemas)
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_or_named_always_gives_valid_calls(assistant, conversations, stream):
    """The template opens <think>: reasoning stays free; then the output can only be calls. A
    request the model would answer in prose gets a call too; a named function is the one called."""
    client = openai.OpenAI(base_url=assistant.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    tools = conversations["tools"] + [UNITS]
    weather = conversations["turn_1"]["messages"]
    prose = [weather[0], {"role": "user", "content": "Thanks! Tell me a story."}]
    for messages in (weather, prose):
        for temperature in (0.0, 1.0):
            request = dict(model="assistant", messages=messages, tools=tools, temperature=temperature, seed=5)
            message, finish = _answer(client, {**request, "tool_choice": "required"}, stream)
            assert_valid_calls(message, tools, finish)
            named = {"type": "function", "function": {"name": "set_units"}}
            message, finish = _answer(client, {**request, "tool_choice": named}, stream)
            assert_valid_calls(message, tools, finish, name="set_units")
    for choice, extra, param in [
        ({"type": "function", "function": {"name": "nope"}}, {}, "tool_choice"),
        ("required", {"response_format": {"type": "json_object"}}, "response_format"),
    ]:
        body = dict(model="assistant", messages=weather, tools=tools, tool_choice=choice, **extra)
        status, response = http(
            "POST",
            assistant.url + "/v1/chat/completions",
            json.dumps(body).encode(),
            {"Authorization": f"Bearer {API_KEY}"},
        )
        assert status == 400 and response["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_with_auto_ends_the_output_at_its_call(assistant, conversations, stream):
    """No grammar holds an "auto" output to one call: the server ends the run at the first call
    (Codex sends parallel_tool_calls false with tool_choice auto)."""
    client = openai.OpenAI(base_url=assistant.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    request = dict(
        model="assistant",
        messages=conversations["turn_1"]["messages"],
        tools=conversations["tools"],
        temperature=0,
        tool_choice="auto",
        parallel_tool_calls=False,
    )
    message, finish = _answer(client, request, stream)
    free, _ = _answer(client, {**request, "parallel_tool_calls": True}, stream)
    assert finish == "tool_calls" and len(message["tool_calls"]) == 1
    assert message["tool_calls"][0]["function"] == free["tool_calls"][0]["function"]


@pytest.mark.parametrize("style", ["json", "kimi"])
def test_tool_choice_holds_a_random_model_to_its_own_call_format(tmp_path, style):
    """Qwen3's JSON calls and Kimi's, on the random Qwen3-Next fixture with MTP drafting: only the
    grammar makes its output calls. One call each (parallel_tool_calls false): a random model,
    free to go on, would call again and again."""
    import shutil

    from conftest import TOOL_TEMPLATES

    checkpoint = tmp_path / "model"
    shutil.copytree(FIXTURES / "qwen3next" / "hf", checkpoint)
    settings = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template": TOOL_TEMPLATES[style]}))
    running = Server("--model", str(checkpoint), "--served-model-name", "m")
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        tools = [CITY, UNITS]
        for temperature in (0.0, 1.0):
            request = dict(
                model="m",
                messages=[{"role": "user", "content": "Weather?"}],
                tools=tools,
                temperature=temperature,
                seed=3,
                max_tokens=200,
                parallel_tool_calls=False,
            )
            message, finish = _answer(client, {**request, "tool_choice": "required"}, stream=False)
            assert_valid_calls(message, tools, finish)
            assert len(message["tool_calls"]) == 1
            named = {"type": "function", "function": {"name": "get_weather"}}
            message, finish = _answer(client, {**request, "tool_choice": named}, stream=True)
            assert_valid_calls(message, tools, finish, name="get_weather")
            assert len(message["tool_calls"]) == 1
    finally:
        assert running.stop()


def _answer(client, request, stream):
    """(message as a dict, finish_reason), put together from the chunks when streaming."""
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        return choice.message.model_dump(), choice.finish_reason
    message = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = None
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta.model_dump()
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls") or []:
            assert call["index"] == len(message["tool_calls"])
            message["tool_calls"].append({k: call[k] for k in ("id", "type", "function")})
        finish = chunk.choices[0].finish_reason or finish
    return message, finish


def test_reasoning_dropped_from_the_history_is_not_claimed_as_cached(assistant, conversations):
    """Turn 3: the template now drops the earlier turns' reasoning, so the conversation only
    repeats up to the question; that is what may come from a checkpoint."""
    client = openai.OpenAI(base_url=assistant.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    tools = conversations["tools"]
    turn_2 = conversations["turn_2"]["messages"]
    for messages in (conversations["turn_1"]["messages"], turn_2):  # turns 1 and 2 leave their checkpoints
        client.chat.completions.create(model="assistant", messages=messages, tools=tools, temperature=0, max_tokens=60)
    turn_3 = turn_2 + [
        {"role": "assistant", "content": conversations["expected"]["turn_2"]["content"], "reasoning_content": "x"},
        {"role": "user", "content": "Thanks!"},
    ]
    response = client.chat.completions.create(
        model="assistant", messages=turn_3, tools=tools, temperature=0, max_tokens=4
    )
    model, tokenizer = mlx_hybrid.load(ASSISTANT)
    rendered_turn_2, rendered_turn_3 = (
        tokenizer.apply_chat_template(template_messages(turn), add_generation_prompt=True, tools=tools, tokenize=False)
        for turn in (turn_2, turn_3)
    )
    question = tokenizer.apply_chat_template(template_messages(turn_2[:2]), tools=tools, tokenize=False)
    assert rendered_turn_3.startswith(question) and not rendered_turn_3.startswith(
        rendered_turn_2[: len(question) + 30]
    )
    assert response.usage.prompt_tokens_details.cached_tokens == len(tokenizer.encode(question))
    assert response.usage.prompt_tokens == len(tokenizer.encode(rendered_turn_3))


# -- logit processors and structured output


def test_logit_bias_and_penalties_change_the_text_as_a_single_run_does(client, local):
    model, tokenizer = local
    ids = tokenizer.encode("def parse_args(")
    plain, _ = alone(local, ids, 24)
    settings = dict(logit_bias={str(plain[0]): -100, str(plain[2]): -5}, presence_penalty=1.0, frequency_penalty=1.5)
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, **settings)
    want = mlx_hybrid.generate(
        model,
        tokenizer,
        ids,
        max_tokens=24,
        draft=None,
        presence_penalty=1.0,
        frequency_penalty=1.5,
        logit_bias={plain[0]: -100, plain[2]: -5},
    )
    assert response.choices[0].text == want.removesuffix(tokenizer.decode(tokenizer.eos_token_ids[:1]))
    assert response.choices[0].text != tokenizer.decode([t for t in plain if t not in tokenizer.eos_token_ids])


def schemas(n=50):
    """n different schemas: nested objects, bounded arrays, enums, ranged numbers, required and
    optional fields, strings with patterns; every string bounded, as a schema for a small model must be."""
    leaves = [
        {"type": "integer", "minimum": -5, "maximum": 500},
        {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
        {"type": "string", "maxLength": 8},
        {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{2}$"},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
        {"type": "null"},
    ]
    made = []
    for i in range(n):
        names = [f"f{i}_{j}" for j in range(1 + i % 4)]
        properties = {name: leaves[(i + 3 * j) % len(leaves)] for j, name in enumerate(names)}
        if i % 3 == 0:  # nested
            properties["inner"] = {
                "type": "object",
                "properties": {"k": leaves[i % len(leaves)], "v": leaves[(i + 1) % len(leaves)]},
                "required": ["k"] if i % 2 else ["k", "v"],
                "additionalProperties": False,
            }
        if i % 5 == 0:  # an array of objects
            properties["items"] = {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"id": leaves[0]},
                    "required": ["id"],
                    "additionalProperties": False,
                },
            }
        required = list(properties)[: 1 + i % len(properties)]
        made.append({"type": "object", "properties": properties, "required": required, "additionalProperties": False})
    assert len({json.dumps(s, sort_keys=True) for s in made}) == n
    return made


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_50_json_schemas_8_at_a_time_with_mtp_give_valid_answers(client, temperature):
    import jsonschema

    def ask(schema):
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a thing in JSON."}],
            max_tokens=300,
            temperature=temperature,
            seed=7,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}},
        )
        return response.choices[0]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, schemas()))
    for schema, answer in zip(schemas(), answers):
        assert answer.finish_reason == "stop", answer.message.content
        jsonschema.validate(json.loads(answer.message.content), schema)


def test_json_object_gives_an_object_and_the_defaults_are_shown(server, client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    content = response.choices[0].message.content
    if response.choices[0].finish_reason == "stop":  # a random model may wander inside a string
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")
    status, card = http("GET", server.url + "/v1/models/" + MODEL)
    assert status == 200 and card["sampling_defaults"] == {} and card["max_tokens_default"] == 2048


def test_omitted_sampling_fields_come_from_the_checkpoint_then_the_flags(tmp_path, local):
    """generation_config.json recommends greedy decoding (do_sample false) and top_k 5; --top-p
    overrides what it does not say. A request that omits temperature is then greedy."""
    import shutil

    checkpoint = tmp_path / "model"
    shutil.copytree(QWEN, checkpoint)
    config = json.loads((checkpoint / "generation_config.json").read_text())
    (checkpoint / "generation_config.json").write_text(json.dumps(config | {"do_sample": False, "top_k": 5}))
    running = Server("--model", str(checkpoint), "--top-p", "0.9")
    try:
        status, card = http("GET", running.url + "/v1/models/" + str(checkpoint))
        assert card["sampling_defaults"] == {"top_k": 5, "temp": 0.0, "top_p": 0.9}
        model, tokenizer = local
        ids = tokenizer.encode("import os\n")
        body = json.dumps({"prompt": ids, "max_tokens": 16}).encode()
        status, response = http("POST", running.url + "/v1/completions", body)
        assert status == 200 and response["choices"][0]["text"] == alone(local, ids, 16)[1]
    finally:
        assert running.stop()


def test_a_request_bounded_and_refused_before_its_work_leaves_the_server_answering():
    """A body over --max-request-mib is a 413, more images than --max-images a 400, each naming its
    limit; a 20 MiB prompt (under the body limit, over the context) is refused without being
    tokenized, and while it is, /health and a small request answer within a second."""
    server = Server("--model", MODEL, "--no-mtp", "--max-request-mib", "24", "--max-images", "1")
    try:
        url = server.url + "/v1/completions"
        # a body declared over the limit: refused once its headers are in (a client still sending is
        # cut off, as servers do; this one sends a little and reads the answer)
        connection = HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(25 << 20))
        connection.endheaders(b'{"model": "x", "prompt": "' + b"x" * 1024)
        response = connection.getresponse()
        message = json.loads(response.read())["error"]["message"]
        connection.close()
        assert response.status == 413 and "24 MiB" in message and "--max-request-mib" in message
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        messages = [{"role": "user", "content": [image, image, {"type": "text", "text": "hi"}]}]
        status, body = http(
            "POST", server.url + "/v1/chat/completions", json.dumps({"model": MODEL, "messages": messages}).encode()
        )
        assert status == 400 and "a request may have 1" in body["error"]["message"]

        refused = {}
        huge = json.dumps({"model": MODEL, "prompt": "def f(x):\n    return x\n" * (20 << 20 >> 5), "max_tokens": 1})

        def send_huge():
            start = time.time()
            refused["reply"], refused["seconds"] = http("POST", url, huge.encode()), time.time() - start

        sender = threading.Thread(target=send_huge)
        sender.start()
        waits = []
        while sender.is_alive():
            start = time.time()
            assert server.health()["status"] == "ok"
            small = http("POST", url, json.dumps({"model": MODEL, "prompt": "def", "max_tokens": 2}).encode())
            assert small[0] == 200
            waits.append(time.time() - start)
        sender.join()
        (status, body), seconds = refused["reply"], refused["seconds"]
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        # the refusal takes what parsing 20 MiB of JSON takes, no tokenizing (minutes for 20 MiB)
        assert seconds < 30 and max(waits, default=0) < 1.0, (seconds, waits)
        assert http("POST", url, json.dumps({"model": MODEL, "prompt": "def", "max_tokens": 2}).encode())[0] == 200
    finally:
        assert server.stop()
