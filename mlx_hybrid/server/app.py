"""The HTTP API over one engine: OpenAI's Chat Completions and Completions, and, translated onto
the same chat path, Anthropic's Messages (`anthropic`) and OpenAI's Responses (`responses`).
Requests in, engine sequences out as JSON or server-sent events. It translates and holds no
generation logic: the engine schedules, `prompt.chat_prompt` renders, `parsers` split reasoning
and tool calls."""

from __future__ import annotations

import json
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..errors import ContextOverflowError, GenerationError
from ..images import ImageAccess, ImageError, read_image
from ..parsers import OutputParser, prompt_opens_reasoning
from ..prompt import chat_prompt, check_text_fits
from ..tool_grammars import TOOL_CALL_STYLES, tool_call_grammar, tool_call_style
from . import anthropic, responses
from .outputs import ChatOutput, CompletionOutput, RequestRun, ServedModel
from .protocol import MAX_CACHE_MARKS, MAX_REQUEST_MIB, ApiError, ChatCompletionRequest, CompletionRequest


class _BodyLimit:
    """ASGI middleware: a request body past `limit` bytes is a 413 when the route reads it, before any
    work on it (a declared Content-Length at once, a chunked body as it passes the limit)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        # a declared length counts whole from the first read; a chunked body as its parts come
        received = int(declared) if declared is not None and declared.isdigit() else 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if declared is None:
                received += len(message.get("body", b""))
            if received > self.limit:  # an HTTPException: FastAPI passes those on from reading a body
                raise HTTPException(
                    413, f"the request body is over {self.limit >> 20} MiB (the server's --max-request-mib)"
                )
            return message

        return await self.app(scope, limited_receive, send)


def create_app(served: ServedModel, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_MIB << 20):
    """The ASGI app; it starts and stops the engine's thread with its own lifespan. A request body over
    max_request_bytes is refused (413)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        served.engine.start()
        try:
            yield
        finally:
            served.engine.stop()

    app = FastAPI(title="mlx-hybrid", lifespan=lifespan)
    app.add_middleware(_BodyLimit, limit=max_request_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return error.response(_anthropic_route(request))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, error: RequestValidationError):
        return _validation_error(error).response(_anthropic_route(request))

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return ApiError(error.status_code, str(error.detail)).response(_anthropic_route(request))

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return ApiError(500, f"internal error: {type(error).__name__}: {error}").response(_anthropic_route(request))

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
            given = bearer.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
            if not secrets.compare_digest(given.encode(), api_key.encode()):
                message = "a valid API key is needed: Authorization: Bearer KEY (or x-api-key: KEY)"
                return ApiError(401, message, "invalid_api_key").response(_anthropic_route(request))
        return await call_next(request)

    @app.get("/health")
    async def health():
        health = {
            "status": "ok",
            **served.engine.occupancy,
            "memory": served.engine.memory,
            "prefix_cache": served.engine.checkpoints,
        }
        if served.engine.drafter is not None:  # over the requests finished so far
            health["speculation"] = served.engine.speculation_stats.summary()
        if served.engine.kv_bits is not None:
            health["kv_cache"] = {"bits": served.engine.kv_bits, "group_size": served.engine.kv_group_size}
        return health

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(served)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(served, model_id)
        return _model_card(served)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        chat = await _start_chat(served, body)
        if body.stream:
            return _event_stream(chat.chunks(body.include_usage))
        return await chat.response(request)

    @app.post("/v1/messages")
    async def messages(body: anthropic.MessagesRequest, request: Request):
        return await _translated(served, anthropic, body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: anthropic.CountTokensRequest):
        chat_body, _ = anthropic.chat_request(body, served.tokenizer)
        return {"input_tokens": len((await _render_chat(served, chat_body))[0].ids)}

    @app.post("/v1/responses")
    async def create_response(body: responses.ResponsesRequest, request: Request):
        return await _translated(served, responses, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(served, body.model)
        prompt = await run_in_threadpool(_prompt_ids, served, body.prompt)  # tokenized off the event loop
        run = RequestRun.submit(served, body, prompt, body.logprobs)
        completion = CompletionOutput(run)
        if body.stream:
            return _event_stream(completion.chunks(body.include_usage))
        return await completion.response(request)

    return app


def _validation_error(error: RequestValidationError) -> ApiError:
    first = error.errors()[0] if error.errors() else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON")
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    return ApiError(400, f"{where}: {message}" if where else message, param=where or None)


def _model_card(served: ServedModel) -> dict:
    card = {"id": served.id, "object": "model", "created": served.created, "owned_by": "mlx-hybrid"}
    return card | {"sampling_defaults": served.sampling_defaults, "max_tokens_default": served.default_max_tokens}


def _check_model(served: ServedModel, name: str | None):
    if name is not None and name != served.id:
        raise ApiError(
            404, f"the model {name!r} is not served here; this server serves {served.id!r}", "model_not_found"
        )


def _anthropic_route(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


async def _render_chat(served: ServedModel, body: ChatCompletionRequest):
    """The request's prompt, rendered off the event loop: (ChatPrompt, tools, image URLs)."""
    _check_model(served, body.model)
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.tool_choice != "none" else []
    options = dict(body.chat_template_kwargs)
    if tools:
        options["tools"] = tools
    images = []  # the image_url parts' URLs, in order
    messages, marks = [], []
    for index, message in enumerate(body.messages):
        message, ends = _template_message(message.model_dump(exclude_none=True), images)
        messages.append(message)
        marks += [(index, chars) for chars in ends]
    if len(images) > served.max_images:
        raise ApiError(
            400,
            f"{len(images)} images: a request may have {served.max_images} (the server's --max-images)",
            param="messages",
        )
    if len(marks) > MAX_CACHE_MARKS:
        raise ApiError(
            400,
            f"A maximum of {MAX_CACHE_MARKS} blocks with cache_control may be provided. Found {len(marks)}.",
            param="messages",
        )
    rendered = await run_in_threadpool(_render, served.tokenizer, messages, options, served.context, marks)
    return rendered, tools, images


async def _start_chat(served: ServedModel, body: ChatCompletionRequest, reasoning_budget: int | None = None):
    """A chat request's run (every chat-shaped route's): rendered, constrained where tool_choice asks,
    submitted; its output to be read through the returned `ChatOutput`."""
    rendered, tools, images = await _render_chat(served, body)
    reasoning_opened = prompt_opens_reasoning(rendered.text)
    grammar = _tool_choice_grammar(served.tokenizer, body, tools, reasoning_opened)
    top = (body.top_logprobs or 0) if body.logprobs else None
    if images:  # decoded off the event loop
        images = await run_in_threadpool(_read_images, images, served.image_access)
    run = RequestRun.submit(
        served,
        body,
        rendered.ids,
        top,
        checkpoint_at=rendered.boundaries,
        grammar=grammar,
        images=images,
        reasoning_budget=reasoning_budget,
    )
    one_call = bool(tools) and not body.parallel_tool_calls and grammar is None
    # no tools offered (or tool_choice "none"): the model's call markup comes back as text
    parser = OutputParser(tools=tools, reasoning_opened=reasoning_opened, tool_calls=bool(tools))
    return ChatOutput(run, parser, one_call)


async def _translated(served: ServedModel, api, body, request: Request):
    """A request of another API (`anthropic`, `responses`: each with chat_request, events, reply) run on
    the chat path: its events streamed, or its whole reply."""
    chat = await _start_chat(served, *api.chat_request(body, served.tokenizer))
    if body.stream:
        return _event_stream(api.events(chat, body), named=True)
    return await api.reply(chat, body, request)


def _template_message(message: dict, images: list) -> tuple[dict, list[int | None]]:
    """An OpenAI message as chat templates expect it: text content (with images, a list of
    text and `{"type": "image"}` parts, their URLs added to `images`), tool-call arguments as
    objects (the templates iterate them) rather than JSON strings. And where the client marked
    it with `cache_control` (on text parts, as OpenRouter passes Anthropic's marks, or on the
    message): the characters of its text that end at a mark, None for the whole message."""
    marks = [None] if message.pop("cache_control", None) else []
    content = message.setdefault("content", "")  # an assistant turn of tool calls only may have none
    if isinstance(content, list):
        kinds = {part.get("type") for part in content}
        if "image_url" in kinds:  # a mark among images: at the message's end
            marks += [None] * sum(1 for part in content if part.get("cache_control"))
            message["content"] = [_template_part(part, images) for part in content]
        else:
            texts, chars = [], 0
            for part in content:
                if part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                    chars += len(texts[-1])
                    if part.get("cache_control"):
                        marks.append(chars)
            message["content"] = "".join(texts)
            marks = [None if chars == len(message["content"]) else chars for chars in marks]
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                raise ApiError(400, "tool call arguments must be a JSON object", param="messages") from None
    return message, list(dict.fromkeys(marks))  # a part's mark at the end and the message's are one


def _template_part(part: dict, images: list) -> dict:
    if part.get("type") == "text":
        return {"type": "text", "text": str(part.get("text", ""))}
    if part.get("type") != "image_url":
        raise ApiError(400, f"content parts of type {part.get('type')!r} are not supported", param="messages")
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise ApiError(400, "an image_url part needs image_url.url", param="messages")
    images.append(url)
    return {"type": "image"}


def _read_images(urls: list[str], access: ImageAccess) -> list:
    images = []
    for i, url in enumerate(urls):
        try:
            images.append(read_image(url, access))
        except ImageError as e:
            raise ApiError(400, f"image {i + 1}: {e}", param="messages") from None
    return images


def _render(tokenizer, messages, options, context, marks=()):
    try:
        if options.get("tools") and not tokenizer.renders_tools:
            raise ApiError(
                400, "this model's chat template does not render tools: it would never see them", param="tools"
            )
        return chat_prompt(tokenizer, messages, context=context, marks=marks, **options)
    except ContextOverflowError as e:
        raise ApiError(400, str(e), "context_length_exceeded", "messages") from None
    except GenerationError as e:
        raise ApiError(400, str(e), param="messages") from None


def _prompt_ids(served: ServedModel, prompt):
    """A completion's prompt as token ids (a text refused first where it cannot fit the context)."""
    if not isinstance(prompt, str):
        return prompt
    try:
        if served.context is not None:
            check_text_fits(served.tokenizer, prompt, served.context)
        return served.tokenizer.encode(prompt)
    except ContextOverflowError as e:
        raise ApiError(400, str(e), "context_length_exceeded", "prompt") from None


def _tool_choice_grammar(tokenizer, body, tools: list[dict], reasoning_opened: bool):
    """For tool_choice "required" or a named function, the grammar that holds the output to
    calls (of that function) in the model's own tool-call format; else None."""
    choice = body.tool_choice
    if choice in (None, "auto", "none"):
        return None  # parallel_tool_calls false: the output ends at its first call (`ChatOutput`)
    if not tools:
        raise ApiError(400, "tool_choice asks for a tool call, but the request gives no tools", param="tool_choice")
    if choice != "required":
        tools = [tool for tool in tools if tool["function"]["name"] == choice.function.name]
        if not tools:
            raise ApiError(
                400, f"tool_choice names {choice.function.name!r}, which is not among the tools", param="tool_choice"
            )
    if (body.response_format or {}).get("type", "text") != "text":
        raise ApiError(
            400, "tool_choice and response_format both constrain the output: give one", param="response_format"
        )
    style = tool_call_style(tokenizer.rendered_tool_call)
    if style is None:
        raise ApiError(
            400,
            f"tool_choice {'required' if choice == 'required' else 'naming a function'} needs the "
            "model's tool-call format, and this chat template writes none the server knows "
            f"({', '.join(TOOL_CALL_STYLES)})",
            param="tool_choice",
        )
    try:
        return tool_call_grammar(style, tools, reasoning_opened, tokenizer.is_special_token, body.parallel_tool_calls)
    except GenerationError as e:
        raise ApiError(400, str(e), param="tools") from None


def _event_stream(chunks, named: bool = False) -> StreamingResponse:
    """Server-sent events: one `data:` line per chunk, then `[DONE]` (OpenAI's chat and completions);
    named: chunks are (event, data), each sent with its `event:` line and no `[DONE]` (Anthropic's
    and the Responses API's events). An error after the stream has started can only be told in the
    stream."""

    async def lines():
        try:
            async for chunk in chunks:
                if named:
                    event, chunk = chunk
                    yield f"event: {event}\ndata: {json.dumps(chunk, ensure_ascii=False)}\n\n"
                else:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except ApiError as e:
            if named:
                body = {"type": "error", "error": {"type": "api_error", "message": e.message}}
                yield f"event: error\ndata: {json.dumps(body)}\n\n"
                return
            body = {"error": {"message": e.message, "type": "server_error", "code": e.code}}
            yield f"data: {json.dumps(body)}\n\n"
        if not named:
            yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
