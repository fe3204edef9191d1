"""The OpenAI request bodies the server accepts, validated by pydantic, and the errors it answers.

Every field that changes the output does what OpenAI documents, or is a 400 that names it
(`UNSUPPORTED`). Fields that change nothing a model computes (`IGNORED_FIELDS`: `user`,
`metadata`, `store`, `service_tier`, ...) are allowed and ignored, as clients send them unasked;
any other field is a 400 that names it, as OpenAI's own API answers ("Unrecognized request
argument supplied"), so that a misspelt setting is not silently dropped. Values out of range are
400s. Sampling fields a request omits are None here: the server fills them from the model's
defaults (`ServedModel.sampling_defaults`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ..chat_template import RENDERING_KEYWORDS
from ..errors import GenerationError
from ..sampling import SEED_LIMIT, SamplingParams

MAX_STOP_STRINGS = 16
# what one request may bring by default (the server's --max-request-mib, --max-images)
MAX_REQUEST_MIB = 32
MAX_IMAGES = 16
MAX_TOP_LOGPROBS = 20  # as the OpenAI API


# fields clients send that change nothing the server computes: accepted on every route and ignored.
# `cache_prompt` (llama.cpp's): prompts are always resumed from the longest checkpoint that matches
# content blocks a request may mark with `cache_control` (a checkpoint each where it ends), as Anthropic allows
MAX_CACHE_MARKS = 4

IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "cache_prompt",
    }
)


class ApiError(Exception):
    """An error answer: OpenAI's shape, or Anthropic's on its routes."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self, anthropic: bool = False) -> JSONResponse:
        if anthropic:
            kind = _ANTHROPIC_ERRORS.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
            return JSONResponse({"type": "error", "error": {"type": kind, "message": self.message}}, self.status)
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


_ANTHROPIC_ERRORS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class Strict(BaseModel):
    """A request body: its declared fields, IGNORED_FIELDS, and nothing else."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _no_unknown_fields(self):
        unknown = sorted(set(self.model_extra or ()) - IGNORED_FIELDS)
        if unknown:
            raise ValueError(f"Unrecognized request argument supplied: {', '.join(unknown)}")
        return self


@dataclass(frozen=True)
class Ending:
    """Why an output ended: finish_reason as OpenAI's ("stop", "length", ...), and the stop
    string that ended it (None: an end token or a limit)."""

    finish_reason: str
    stop_sequence: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI fields that would change the output and that the server does not implement, with
# the values that change nothing (a 400 names any other value)
UNSUPPORTED = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None,),  # the deprecated forms of tools and tool_choice
    "function_call": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
}
# the sampling fields a request may omit, taken then from the model's defaults
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip


class _Sampling(Strict):
    """What both endpoints share: sampling, length, stops, streaming, processors."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 and 0: off (vLLM spells off as -1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)  # vLLM's and llama.cpp's extension
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    n: int = Field(1, ge=1, le=1)  # one choice per request: send several requests for more
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: Any = None
    suffix: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        harmless = UNSUPPORTED[info.field_name]
        if value not in harmless:
            only = f" (only {json.dumps(harmless[-1])})" if harmless[-1] is not None else ""
            raise ValueError(f"{info.field_name} is not supported by this server{only}")
        return value

    @field_validator("logit_bias", "response_format")
    @classmethod
    def _checked_by_sampling(cls, value, info: ValidationInfo):
        """SamplingParams' own check: token ids and biases; the response format's grammar."""
        try:
            SamplingParams().replace(**{info.field_name: value})
        except GenerationError as e:
            raise ValueError(str(e).removeprefix(f"{info.field_name}: ")) from None
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @property
    def stops(self) -> list[str]:
        return self.stop or []

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class Function(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: Function


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, reasoning_content, ... go to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None
    tool_calls: list[dict] | None = None

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict = Field(default_factory=dict)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, variables: dict):
        taken = sorted(set(variables) & RENDERING_KEYWORDS)
        if taken:  # tokenize, chat_template, ...: the server renders; a client sets the template's variables
            raise ValueError(f"{taken[0]} is a setting of the rendering, not a variable of the chat template")
        return variables

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False  # echoing the prompt back is not supported

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("one prompt per request: send several requests for more")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


def translated_chat_request(chat: dict, field_names: dict[str, str]) -> ChatCompletionRequest:
    """The Chat Completions request another API's request translates to (`anthropic`, `responses`),
    checked as one; a field it refuses is named as that API names it (field_names: ours -> theirs)."""
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        error = e.errors()[0]
        where = [str(part) for part in error.get("loc", ())]
        name = ".".join([field_names.get(where[0], where[0]), *where[1:]]) if where else None
        message = error.get("msg", "invalid request").removeprefix("Value error, ")
        raise ApiError(400, f"{name}: {message}" if name else message, param=name) from None
