"""The OpenAI wire format: pydantic models of the requests (unknown fields are ignored, as OpenAI clients send many),
the error body, and builders of the response objects and stream chunks (plain dicts, serialised once)."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sluice.errors import InvalidOptionError


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- requests ---------------------------------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class JSONSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates read it: text content, tool-call arguments as objects."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise InvalidOptionError(f"{self.role} message: only text content parts are supported.")
            msg["content"] = "".join(p.text or "" for p in self.content)
        else:
            msg["content"] = self.content or ""
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                for c in self.tool_calls]
        return msg


def _arguments_object(arguments: str | dict) -> Any:
    """Tool-call arguments arrive as a JSON string; templates (Qwen3's) want the object."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


SAMPLING_DEFAULTS = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                         frequency_penalty=0.0)


class _Generation(_Request):
    """The parameters both endpoints share."""

    model: str
    max_tokens: int | None = None
    # None (sent as null, or absent) is OpenAI's default: SAMPLING_DEFAULTS
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 (vLLM's "off") is taken as 0
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None

    def sampling(self) -> dict:
        """The engine's sampling options (validated by the engine)."""
        given = {k: getattr(self, k) for k in SAMPLING_DEFAULTS if getattr(self, k) is not None}
        options = {**SAMPLING_DEFAULTS, **given, "seed": self.seed}
        if options["top_k"] == -1:
            options["top_k"] = 0
        return options

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise APIError(400, f"n={self.n}: sluice returns one choice per request; use n=1.", param="n")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported.", param="logit_bias")


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported.", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported.", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of={self.best_of}: only 1 is supported.", param="best_of")

    def single_prompt(self) -> str | list[int]:
        """The prompt: a string or token ids (a list of one of those is taken apart; more are refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"{len(p)} prompts: send one prompt per request.", param="prompt")
            p = p[0]
        return p


# -- responses --------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache held (not prefilled)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_response(rid: str, model: str, message: dict, finish_reason: str | None, logprobs: list | None,
                  use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                         "logprobs": None if logprobs is None else {"content": logprobs}}],
            "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None = None, logprobs: list | None = None,
               with_usage: bool = False) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                          "logprobs": None if logprobs is None else {"content": logprobs}}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def completion_response(rid: str, model: str, text: str, finish_reason: str | None, logprobs: dict | None,
                        use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
            "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None = None, logprobs: dict | None = None,
                     with_usage: bool = False) -> dict:
    chunk = completion_response(rid, model, text, finish_reason, logprobs, None)
    if not with_usage:
        del chunk["usage"]
    return chunk


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}


# what Python's str.splitlines (and so some SSE clients, e.g. httpx's aiter_lines) takes for a line end, that JSON
# leaves raw inside strings: escaped, or a generated "\u2028" cuts an event in two
_LINE_ENDS = {ord(c): f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"}


def sse(data: dict | str) -> str:
    """One server-sent event: one line of JSON whatever text it carries."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False).translate(_LINE_ENDS)
    return f"data: {text}\n\n"
