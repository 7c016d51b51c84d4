"""The HTTP side: the FastAPI app, its routes, the gate every request passes first (the API key, the body-size limit,
the body's read deadline: all before the body is parsed), and every error as OpenAI's
`{"error": {"message", "type", "param", "code"}}` with its status (400 bad values, 401 no key, 404 unknown model or
route, 405 wrong method, 408 body too slow, 413 body too large, 422 a body of the wrong shape, 500 a bug or an engine
failure, 503 shutting down or too many connections)."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.errors import ContextLengthError, SluiceError
from sluice.server.config import ServerConfig
from sluice.server.generate import Generation
from sluice.server.loop import EngineFailure, EngineLoop
from sluice.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body

_REQUEST_PREFIX = re.compile(r"request \d+: ")  # the engine names its request; the client knows which it sent
_OPTION = re.compile(r"(\w+)=")  # the engine's and the sampler's messages start "name=value ..."
_OPEN_PATHS = ("/health",)  # answered without the API key


def create_app(model, config: ServerConfig) -> FastAPI:
    """The server of one loaded model; its engine thread runs while the app does (lifespan)."""
    loop = EngineLoop(model.engine)
    gen = Generation(model, config, loop)

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()
            gen.close()

    app = FastAPI(title="sluice", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.generation, app.state.loop = gen, loop
    app.add_middleware(Gate, api_key=config.api_key, max_bytes=config.max_body_bytes, timeout=config.read_timeout)
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        out = {"status": "ok", "model": gen.name, **loop.stats(), "memory": model.engine.memory_plan(make=False)}
        if model.placement is not None:  # streamed experts: where they are, the hit rate so far (read off-loop)
            out["experts"] = await asyncio.to_thread(model.placement.summary)
        return out

    api = APIRouter(prefix="/v1")

    @api.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": gen.name, "object": "model", "created": 0, "owned_by": "sluice",
                                            "max_model_len": model.engine.max_length}]}

    @api.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await gen.chat(req, request)

    @api.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await gen.complete(req, request)

    app.include_router(api)
    return app


def key_matches(header: str | None, api_key: str) -> bool:
    """`Authorization: Bearer <key>`, the scheme in any case (RFC 7235), the key compared in constant time."""
    scheme, _, given = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


# -- errors -----------------------------------------------------------------------------------------------------
def _json_error(status: int, body: dict) -> Response:
    """An error as ASCII JSON: a message that quotes the client's text can always be encoded."""
    return Response(json.dumps(body), status_code=status, media_type="application/json")


_HTTP_CODES = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed", 408: "timeout",
               413: "body_too_large"}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _json_error(e.status, e.body())

    @app.exception_handler(SluiceError)
    async def sluice_error(request, e: SluiceError):
        message = _REQUEST_PREFIX.sub("", str(e), count=1)
        if isinstance(e, ContextLengthError):
            param = "prompt" if request.url.path == "/v1/completions" else "messages"
            return _json_error(400, error_body(message, param=param, code="context_length_exceeded"))
        named = _OPTION.match(message)
        return _json_error(400, error_body(message, param=named.group(1) if named else None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid" or tuple(first.get("loc", ())) == ("body",):
            return _json_error(400, error_body("The request body is not a JSON object: send one, with "
                                               "'Content-Type: application/json'.", code="invalid_json"))
        where = ".".join(str(p) for p in first.get("loc", ())[1:])  # without the leading "body"
        message = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ())[1:]) or 'body'}: {err.get('msg')}"
                            for err in errors[:5])
        return _json_error(422, error_body(message, param=where or None, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        message = str(e.detail)
        if e.status_code == 400:  # FastAPI could not read the body as JSON (not UTF-8, nested too deeply)
            message = "The request body could not be parsed: send a JSON object in UTF-8."
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _json_error(e.status_code, error_body(message, type=kind, code=_HTTP_CODES.get(e.status_code)))

    @app.exception_handler(EngineFailure)
    async def engine_failure(request, e: EngineFailure):
        return _json_error(e.status, error_body(str(e), type="server_error"))

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):  # never plain text, even for a bug (Starlette logs its traceback)
        return _json_error(500, error_body(f"internal error ({type(e).__name__}); the server logged it.",
                                           type="server_error"))


# -- the gate ---------------------------------------------------------------------------------------------------
class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"The request body is larger than the server's limit of {limit} bytes.")


class BodyTooSlow(HTTPException):
    def __init__(self, timeout: float):
        super().__init__(408, f"The request body did not arrive within {timeout:g} s.")


class Gate:
    """What every HTTP request passes before the app reads its body: the API key (401, except on /health), the
    body's size (413: by Content-Length at once, else while it is read) and its read deadline (408: the whole body
    within `timeout` seconds of the headers, so a client trickling bytes cannot hold a request open)."""

    def __init__(self, app, api_key: str | None, max_bytes: int, timeout: float):
        self.app, self.api_key, self.max_bytes, self.timeout = app, api_key, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope["path"] not in _OPEN_PATHS:
            if not key_matches(headers.get(b"authorization", b"").decode("latin-1"), self.api_key):
                return await _send_json(send, 401, error_body(
                    "Missing or wrong API key: send 'Authorization: Bearer <key>'.", type="authentication_error",
                    code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await _send_json(send, 413, error_body(BodyTooLarge(self.max_bytes).detail, code="body_too_large"))
        deadline, received, complete = time.monotonic() + self.timeout, 0, False

        async def limited():
            nonlocal received, complete
            if complete:  # the body is in: what follows is waiting for a disconnect, which has no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise BodyTooSlow(self.timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited, send)


async def _send_json(send, status: int, body: dict) -> None:
    response = _json_error(status, body)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
