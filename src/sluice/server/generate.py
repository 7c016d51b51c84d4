"""From an OpenAI request to the engine and back: the prompt (chat template, tools), the engine options (sampling,
limits, logprobs, grammar), then the reply as one JSON object or as server-sent events. A client that goes away
aborts its request: the stream's close or a watcher of the connection (non-streaming) calls `abort`.

Before any work, a request's text is checked at the edge: every string valid Unicode, the prompt's text no longer than
the length limit's tokens could hold (`max_chars`), and chat_template_kwargs free of the template's own names. The
chat template, tokenization and grammars run in the server's own thread pool (`PROMPT_THREADS`), never on the event
loop or the engine thread; tokenization releases the GIL, so a long prompt does not stall other requests."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from sluice.engine.sampling import SamplingParams
from sluice.errors import InvalidOptionError, SluiceError
from sluice.formats.tokenizer import check_text
from sluice.server.chat import ReplyParser, prompt_opens_reasoning
from sluice.server.config import ServerConfig
from sluice.server.grammar import Grammars
from sluice.server.logprobs import TokenTexts
from sluice.server.loop import EngineFailure, EngineLoop, RequestStream
from sluice.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    new_id,
    sse,
    usage,
    usage_chunk,
)


PROMPT_THREADS = 4
MAX_DEPTH = 32  # levels of nesting in a request's JSON
RESERVED_TEMPLATE_ARGS = ("messages", "add_generation_prompt", "bos_token", "eos_token", "special_in_text")


def served_name(path: Path) -> str:
    return path.name if path.is_dir() else path.stem


def strings(value, path: str = "", depth: int = 0):
    """(path, string) for every string in a request's JSON (dict keys included), paths as `messages.0.content`; a
    400 past MAX_DEPTH levels of nesting (the template and the tokenizer walk the values recursively)."""
    if depth > MAX_DEPTH:
        raise APIError(400, f"{path} is nested more than {MAX_DEPTH} levels deep.", param=path, code="invalid_value")
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            yield where, str(key)
            yield from strings(item, where, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from strings(item, f"{path}.{i}" if path else str(i), depth + 1)


def check_texts(req, prompt_fields: tuple[str, ...], max_length: int, max_chars: int) -> None:
    """Every string of the request valid Unicode (400 naming the first that is not), and the strings that become the
    prompt no longer than max_chars together, the most that max_length tokens can hold (400 before any
    tokenizing)."""
    chars = 0
    for path, text in strings(req.model_dump(exclude_none=True)):
        try:
            check_text(text, path)
        except InvalidOptionError as e:
            raise APIError(400, str(e), param=path, code="invalid_value") from None
        if path.split(".", 1)[0] in prompt_fields:
            chars += len(text)
    if chars > max_chars:
        raise APIError(400, f"The prompt's text has {chars} characters, more than the {max_length} tokens a sequence "
                            f"may hold can take ({max_chars} characters at most); shorten it.",
                       param=prompt_fields[0], code="context_length_exceeded")


class EventStream(StreamingResponse):
    """Server-sent events that abort their request however the response ends (finished, client gone, error)."""

    def __init__(self, events, stream: RequestStream):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.abort()


async def collect(stream: RequestStream, request: Request) -> list | None:
    """All of a request's outputs, or None when the client disconnected first (the request is aborted)."""
    async def outputs():
        return [out async for out in stream]

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(outputs()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        return work.result() if work.done() else None
    finally:
        work.cancel()
        watch.cancel()
        stream.abort()


class Generation:
    """The endpoints' work for one model behind one engine loop."""

    def __init__(self, model, config: ServerConfig, loop: EngineLoop):
        self.model, self.config, self.loop = model, config, loop
        self.name = config.model_name or served_name(Path(model.path))
        self.grammars = Grammars(model.tokenizer, model.config.vocab_size)
        self.texts = TokenTexts(model.tokenizer)
        self.max_length = model.engine.max_length  # the one length limit: positions a sequence holds, prompt included
        self.max_chars = self.max_length * model.tokenizer.max_token_chars
        self.pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="sluice-prompt")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn, *args):
        """fn(*args) in the prompt pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise APIError(404, f"The model {name!r} does not exist: this server serves {self.name!r}.",
                           param="model", code="model_not_found")

    def options(self, req, prompt: list[int], max_tokens: int | None, logprobs: int | None, constraint,
                param: str) -> dict:
        """add_request's keyword arguments, the sampling values validated and max_tokens measured against the length
        limit (None: what it leaves); the engine checks them again (its errors become 400s too)."""
        room = self.max_length - len(prompt)
        if room < 1:
            raise APIError(400, f"The prompt has {len(prompt)} tokens; a sequence holds at most {self.max_length} "
                                "positions, prompt and reply together: shorten the prompt.", param=param,
                           code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"{len(prompt)} prompt tokens + max_tokens={max_tokens} need "
                                f"{len(prompt) + max_tokens} positions, more than the {self.max_length} a sequence "
                                "may hold; lower max_tokens or shorten the prompt.", param=param,
                           code="context_length_exceeded")
        sampling = req.sampling()
        SamplingParams(**sampling).validate()  # a bad value is refused here, never queued for the engine
        return dict(max_tokens=room if max_tokens is None else max_tokens, stop=req.stop_strings(),
                    logprobs=logprobs, constraint=constraint, **sampling)

    # -- /v1/chat/completions -------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request: Request):
        check_texts(req, ("messages", "tools", "chat_template_kwargs"), self.max_length, self.max_chars)
        self.check_model(req.model)
        req.check_supported()
        reserved = sorted(set(req.chat_template_kwargs or ()) & set(RESERVED_TEMPLATE_ARGS))
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them.",
                           param="chat_template_kwargs")
        choice = req.tool_choice or ("auto" if req.tools else "none")
        tools = req.tools if choice != "none" else None
        text, prompt, points = await self.off_loop(self._render, req, tools)
        constraint = await self.off_loop(self._chat_constraint, req, choice)
        stream = await self.loop.open(prompt, snapshot_at=points, **self.options(
            req, prompt, req.token_limit, req.logprobs_count, constraint, "messages"))
        parser = ReplyParser(tools=tools is not None, in_reasoning=prompt_opens_reasoning(text))
        rid = new_id("chatcmpl")
        if req.stream:
            return EventStream(self._chat_events(rid, req, stream, parser, len(prompt)), stream)
        outs = await collect(stream, request)
        if outs is None:
            return Response(status_code=499)
        reply = parser.feed("".join(o.text for o in outs))
        reply += parser.finish()
        message = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        logprobs = [self.texts.chat(o) for o in outs if o.token is not None] if req.logprobs else None
        seq = stream.seq
        return chat_response(rid, self.name, message, _finish_reason(seq, len(reply.tool_calls)), logprobs,
                             usage(len(prompt), len(seq.output), seq.cached))

    def _render(self, req: ChatCompletionRequest, tools) -> tuple[str, list[int], tuple[int, ...]]:
        """The prompt through the model's chat template (as Model.encode_prompt renders it; special-token texts in
        the messages as plain text unless allow_special_tokens): text, token ids, and where the leading system
        message ends in them (a snapshot point for the prefix cache: other conversations share it), if it does."""
        messages = [m.for_template() for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        encode = self.model.tokenizer.encode_chat
        text, ids = encode(messages, add_generation_prompt=True, special_in_text=self.config.allow_special_tokens,
                           **kwargs)
        points = ()
        if len(messages) > 1 and messages[0].get("role") == "system" and self.model.engine.prefix_caching:
            try:
                _, head = encode(messages[:1], add_generation_prompt=False,
                                 special_in_text=self.config.allow_special_tokens, **kwargs)
            except SluiceError:  # a template that wants more than a system message: no point
                head = []
            if 0 < len(head) < len(ids) and ids[:len(head)] == head:
                points = (len(head),)
        return text, ids, points

    def _chat_constraint(self, req: ChatCompletionRequest, choice):
        forced = choice == "required" or not isinstance(choice, str)
        fmt = req.response_format if req.response_format and req.response_format.type != "text" else None
        if forced and fmt:
            raise APIError(400, "response_format and a forced tool_choice cannot be combined.",
                           param="response_format")
        if forced:
            name = None if isinstance(choice, str) else choice.function.name
            return self.grammars.constraint(self.grammars.for_tool_call(req.tools, name), "tool_choice")
        grammar = self.grammars.for_response_format(fmt)
        return None if grammar is None else self.grammars.constraint(grammar, "response_format")

    async def _chat_events(self, rid: str, req, stream: RequestStream, parser: ReplyParser, prompt_tokens: int):
        with_usage, calls = req.include_usage, 0
        yield sse(chat_chunk(rid, self.name, {"role": "assistant", "content": ""}, with_usage=with_usage))
        try:
            async for out in stream:
                piece = parser.feed(out.text)
                if out.finished:
                    piece += parser.finish()
                delta = {}
                if piece.reasoning:
                    delta["reasoning_content"] = piece.reasoning
                if piece.content:
                    delta["content"] = piece.content
                if piece.tool_calls:
                    delta["tool_calls"] = [{"index": calls + i, **c} for i, c in enumerate(piece.tool_calls)]
                    calls += len(piece.tool_calls)
                logprobs = [self.texts.chat(out)] if req.logprobs and out.token is not None else None
                if delta or logprobs:
                    yield sse(chat_chunk(rid, self.name, delta, None, logprobs, with_usage))
                if out.finished:
                    yield sse(chat_chunk(rid, self.name, {}, _finish_reason(out.seq, calls), None, with_usage))
                    if with_usage:
                        yield sse(usage_chunk(rid, self.name, "chat.completion.chunk",
                                              usage(prompt_tokens, len(out.seq.output), out.seq.cached)))
        except EngineFailure as e:
            yield sse(error_body(str(e), "server_error"))
        yield sse("[DONE]")

    # -- /v1/completions ------------------------------------------------------------------------------------
    async def complete(self, req: CompletionRequest, request: Request):
        check_texts(req, ("prompt",), self.max_length, self.max_chars)
        self.check_model(req.model)
        req.check_supported()
        prompt = req.single_prompt()
        if isinstance(prompt, str):  # the client's own raw text: special-token texts in it are the tokens
            prompt = await self.off_loop(self.model.tokenizer.encode, prompt)
        stream = await self.loop.open(prompt, **self.options(req, prompt, req.max_tokens, req.logprobs, None,
                                                              "prompt"))
        rid = new_id("cmpl")
        if req.stream:
            return EventStream(self._completion_events(rid, req, stream, len(prompt)), stream)
        outs = await collect(stream, request)
        if outs is None:
            return Response(status_code=499)
        tokens = [o for o in outs if o.token is not None]
        logprobs = self.texts.completion(tokens, 0) if req.logprobs is not None else None
        seq = stream.seq
        return completion_response(rid, self.name, "".join(o.text for o in outs), seq.finish_reason, logprobs,
                                   usage(len(prompt), len(seq.output), seq.cached))

    async def _completion_events(self, rid: str, req, stream: RequestStream, prompt_tokens: int):
        with_usage, offset = req.include_usage, 0
        try:
            async for out in stream:
                logprobs = None
                if req.logprobs is not None and out.token is not None:
                    logprobs = self.texts.completion([out], offset)
                offset += len(out.text)
                if out.text or logprobs or out.finished:
                    reason = out.seq.finish_reason if out.finished else None
                    yield sse(completion_chunk(rid, self.name, out.text, reason, logprobs, with_usage))
                if out.finished and with_usage:
                    yield sse(usage_chunk(rid, self.name, "text_completion", usage(prompt_tokens,
                                                                                   len(out.seq.output),
                                                                                   out.seq.cached)))
        except EngineFailure as e:
            yield sse(error_body(str(e), "server_error"))
        yield sse("[DONE]")


def _finish_reason(seq, tool_calls: int) -> str:
    return "tool_calls" if tool_calls and seq.finish_reason == "stop" else seq.finish_reason
