"""What the server serves (`ServedModel`), a request's run in its engine (`RequestRun`: the sequence,
as text cut at its stop strings) and that run's output as the chat and completion routes give it
(`ChatOutput`: reasoning, content and tool calls apart; `CompletionOutput`), whole or as stream
chunks; the Messages and Responses routes format `ChatOutput.parts` their own way."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request

from ..errors import ContextOverflowError, GenerationError
from ..images import ImageAccess
from ..parsers import Delta, OutputParser, StopStrings
from ..sampling import SamplingParams
from ..tokenizer import StreamingDetokenizer
from .protocol import MAX_IMAGES, SAMPLING_FIELDS, ApiError, Ending

PARAM_NAMES = {"temperature": "temp"}  # request field -> SamplingParams field, where they differ
# how often a stream waiting for the engine to take its request in looks again (the engine admits
# between steps: a few milliseconds while it runs, at once while idle)
STARTED_POLL_S = 0.005


@dataclass
class ServedModel:
    """What the server serves: one model, its tokenizer and the engine that runs it."""

    id: str  # the name clients use (`model` in requests)
    tokenizer: object
    engine: object
    default_max_tokens: int = 2048  # for requests that give none
    # for the sampling fields a request omits (SamplingParams names): the command's flags over
    # the checkpoint's recommendations; what neither gives is OpenAI's default
    sampling_defaults: dict = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    image_access: ImageAccess = ImageAccess(local=None)  # what image_url parts may reach: data URLs only
    max_images: int = MAX_IMAGES  # image parts a request may have
    context: int | None = None  # the model's context in tokens: longer prompts are refused before tokenizing


class Events:
    """Where the engine's thread puts a sequence's events: onto this request's event loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, event):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


@dataclass
class Piece:
    """Text that can be sent, the logprobs of the tokens behind it, and at the end why."""

    text: str
    logprobs: list
    finish_reason: str | None = None


class RequestRun:
    """One request's sequence, as text cut at its stop strings."""

    def __init__(self, served: ServedModel, sequence, events: Events, stops: list[str]):
        self.served, self.sequence, self.events = served, sequence, events
        self.id = uuid.uuid4().hex
        self.detokenizer = StreamingDetokenizer(served.tokenizer)
        self.stops = StopStrings(stops)
        self.completion_tokens = 0

    @classmethod
    def submit(
        cls,
        served: ServedModel,
        body,
        prompt,
        logprobs: int | None,
        checkpoint_at=(),
        grammar=None,
        images=(),
        reasoning_budget=None,
    ) -> "RequestRun":
        events = Events()
        asked = {PARAM_NAMES.get(name, name): getattr(body, name) for name in SAMPLING_FIELDS}
        sampling = served.sampling_defaults | {name: value for name, value in asked.items() if value is not None}
        if "top_k" in sampling:
            sampling["top_k"] = max(sampling["top_k"], 0)
        try:
            params = SamplingParams(temp=1.0).replace(
                max_tokens=body.token_limit or served.default_max_tokens,
                seed=body.seed,
                logprobs=logprobs,
                logit_bias=body.logit_bias,  # SamplingParams reads JSON's string token ids
                response_format=body.response_format,
                grammar=grammar,
                reasoning_budget=reasoning_budget,
                **sampling,
            )
            sequence = served.engine.submit(
                prompt, params=params, checkpoint_at=checkpoint_at, events=events, images=images
            )
        except ContextOverflowError as e:
            raise ApiError(400, str(e), "context_length_exceeded", "messages") from None
        except GenerationError as e:
            raise ApiError(400, str(e)) from None
        return cls(served, sequence, events, body.stops)

    async def pieces(self, request: Request | None = None):
        """The output as it comes. request: poll it for a client that went away (streams
        learn that from their response being cancelled instead)."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self.events.queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if request is not None and await request.is_disconnected():
                        return
                    continue
                piece = self._piece(event)
                yield piece
                if piece.finish_reason is not None:
                    return
        finally:
            self.sequence.cancel()  # a no-op once it ended; frees the slot when the client left

    def _piece(self, event) -> Piece:
        if event.finish_reason == "error":
            raise ApiError(500, f"generation failed: {event.error}")
        text, logprobs = "", []
        for i, token in enumerate(event.tokens):
            self.completion_tokens += 1
            if event.logprobs is not None:
                logprobs.append(event.logprobs[i])
            text += self.stops.feed(self.detokenizer.add(token))
            if self.stops.stopped:
                return Piece(text, logprobs, "stop")
        if event.finish_reason is None:
            return Piece(text, logprobs)
        text += self.stops.feed(self.detokenizer.finalize())
        if self.stops.stopped:
            return Piece(text, logprobs, "stop")
        return Piece(text + self.stops.finish(), logprobs, event.finish_reason)

    def ending(self, finish_reason: str) -> Ending:
        return Ending(finish_reason, self.stops.matched)

    async def started(self):
        """Once the engine has taken the request in: from then on usage() says how much of the prompt
        came from a checkpoint (a stream that reports usage before any token waits for this)."""
        while not (self.sequence.started.is_set() or self.sequence.done):
            await asyncio.sleep(STARTED_POLL_S)

    def usage(self) -> dict:
        prompt = len(self.sequence.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.sequence.cached_tokens},
        }

    def envelope(self, kind: str, choices: list[dict], usage: bool = False) -> dict:
        prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
        body = {"id": f"{prefix}-{self.id}", "object": kind, "created": int(time.time()), "model": self.served.id}
        body["choices"] = choices
        if usage:
            body["usage"] = self.usage()
        return body

    def token_text(self, token: int) -> str:
        return self.served.tokenizer.decode([token])


class ChatOutput:
    """A run as chat completion(s): reasoning, content and tool calls apart. one_call: the output
    ends with its first tool call (parallel_tool_calls false, where no grammar holds it to one)."""

    def __init__(self, run: RequestRun, parser: OutputParser, one_call: bool = False):
        self.run, self.parser, self.one_call = run, parser, one_call
        self.calls = 0

    async def response(self, request: Request) -> dict:
        reasoning = content = ""
        calls, logprobs, finish = [], [], None
        async for piece in self.run.pieces(request):
            for delta in self._deltas(piece):
                reasoning, content = reasoning + delta.reasoning, content + delta.content
                calls += delta.tool_calls
            logprobs += piece.logprobs
            finish = piece.finish_reason
        message = {"role": "assistant", "content": content if content or not calls else None}
        if self.parser.saw_reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(logprobs), "finish_reason": None}
        choice["finish_reason"] = "tool_calls" if calls and finish == "stop" else finish
        return self.run.envelope("chat.completion", [choice], usage=True)

    async def chunks(self, include_usage: bool):
        kind = "chat.completion.chunk"
        yield self.run.envelope(kind, [self._choice({"role": "assistant", "content": ""})])
        async for piece in self.run.pieces():
            for delta in self._deltas(piece):
                for name, value in (("reasoning_content", delta.reasoning), ("content", delta.content)):
                    if value:
                        yield self.run.envelope(kind, [self._choice({name: value}, piece.logprobs)])
                        piece.logprobs = []
                if delta.tool_calls:
                    indexed = [{"index": self.calls + i, **call} for i, call in enumerate(delta.tool_calls)]
                    self.calls += len(indexed)
                    yield self.run.envelope(kind, [self._choice({"tool_calls": indexed}, piece.logprobs)])
                    piece.logprobs = []
            if piece.finish_reason is not None:
                finish = "tool_calls" if self.calls and piece.finish_reason == "stop" else piece.finish_reason
                yield self.run.envelope(kind, [self._choice({}, piece.logprobs, finish)])
            elif piece.logprobs:  # tokens whose text is still held back
                yield self.run.envelope(kind, [self._choice({}, piece.logprobs)])
        if include_usage:
            yield {**self.run.envelope(kind, []), "usage": self.run.usage()}

    async def parts(self, request: Request | None = None):
        """(Delta, Ending or None) as the output comes: a piece's reasoning, content and complete tool
        calls, the last one with why the output ended (for the routes that format it their own way)."""
        async for piece in self.run.pieces(request):
            merged = Delta()
            for delta in self._deltas(piece):
                merged.reasoning += delta.reasoning
                merged.content += delta.content
                merged.tool_calls += delta.tool_calls
            ending = None if piece.finish_reason is None else self.run.ending(piece.finish_reason)
            if merged or ending is not None:
                yield merged, ending

    def usage(self) -> dict:
        return self.run.usage()

    async def started(self):
        await self.run.started()

    @property
    def model(self) -> str:
        return self.run.served.id

    def count_tokens(self, text: str) -> int:
        return len(self.run.served.tokenizer.encode(text))

    def _deltas(self, piece: Piece):
        deltas = [self.parser.feed(piece.text)]
        if piece.finish_reason is not None:
            deltas.append(self.parser.finish())
        deltas = [d for d in deltas if d]
        if self.one_call and any(d.tool_calls for d in deltas):
            # the first call ends the output: what follows it is dropped, and the run stops
            # (`pieces` returns after a piece with a finish reason, cancelling the sequence)
            first = next(i for i, d in enumerate(deltas) if d.tool_calls)
            deltas[first].tool_calls = deltas[first].tool_calls[:1]
            deltas = deltas[: first + 1]
            piece.finish_reason = "stop"
        return deltas

    def _choice(self, delta: dict, logprobs=(), finish_reason=None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}

    def _logprobs(self, logprobs) -> dict | None:
        if not logprobs:
            return None
        return {
            "content": [
                {**self._token(lp.token, lp.logprob), "top_logprobs": [self._token(t, v) for t, v in lp.top]}
                for lp in logprobs
            ]
        }

    def _token(self, token: int, logprob: float) -> dict:
        tokenizer = self.run.served.tokenizer
        return {"token": tokenizer.decode([token]), "logprob": logprob, "bytes": list(tokenizer.token_bytes(token))}


class CompletionOutput:
    """A run as text completion(s), logprobs in the legacy completions layout."""

    def __init__(self, run: RequestRun):
        self.run = run
        self.offset = 0  # text offset of the next token, for logprobs

    async def response(self, request: Request) -> dict:
        text, logprobs, finish = "", [], None
        async for piece in self.run.pieces(request):
            text, finish = text + piece.text, piece.finish_reason
            logprobs += piece.logprobs
        return self.run.envelope("text_completion", [self._choice(text, logprobs, finish)], usage=True)

    async def chunks(self, include_usage: bool):
        async for piece in self.run.pieces():
            if piece.text or piece.logprobs or piece.finish_reason:
                yield self.run.envelope(
                    "text_completion", [self._choice(piece.text, piece.logprobs, piece.finish_reason)]
                )
        if include_usage:
            yield {**self.run.envelope("text_completion", []), "usage": self.run.usage()}

    def _choice(self, text: str, logprobs, finish_reason) -> dict:
        return {"index": 0, "text": text, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}

    def _logprobs(self, logprobs) -> dict | None:
        if not logprobs and self.run.sequence.logprobs is None:
            return None
        tokens = [self.run.token_text(lp.token) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.run.token_text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }
