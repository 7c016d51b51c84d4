"""The HTTP side: the FastAPI app, its routes, the API key, the body-size limit, and every error as OpenAI's
`{"error": {"message", "type", "param", "code"}}` with its status (400 bad values, 401 no key, 404 unknown model or
route, 413 body too large, 422 a body of the wrong shape, 500 an engine failure)."""

from __future__ import annotations

import asyncio

import hmac
import re
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.errors import ContextLengthError, SluiceError
from sluice.server.config import ServerConfig
from sluice.server.generate import Generation
from sluice.server.loop import EngineFailure, EngineLoop
from sluice.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body

_OPTION = re.compile(r"(?:request \d+: )?(\w+)=")


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

    app = FastAPI(title="sluice", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.generation, app.state.loop = gen, loop
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        out = {"status": "ok", "model": gen.name, **loop.stats()}
        if model.placement is not None:  # streamed experts: where they are, the hit rate so far (read off-loop)
            out["experts"] = await asyncio.to_thread(model.placement.summary)
        return out

    api = APIRouter(prefix="/v1", dependencies=[Depends(_key_check(config.api_key))])

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


def _key_check(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request):
        if expected is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise APIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.",
                               type="authentication_error", code="invalid_api_key")
    return check


# -- errors -----------------------------------------------------------------------------------------------------
def _json_error(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _json_error(e.status, e.body())

    @app.exception_handler(SluiceError)
    async def sluice_error(request, e: SluiceError):
        if isinstance(e, ContextLengthError):
            return _json_error(400, error_body(str(e), param="messages", code="context_length_exceeded"))
        named = _OPTION.match(str(e))  # the engine's messages start "name=value ..."
        return _json_error(400, error_body(str(e), param=named.group(1) if named else None))

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
        kind = {404: "not_found_error", 413: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return _json_error(e.status_code, error_body(str(e.detail), type=kind))

    @app.exception_handler(EngineFailure)
    async def engine_failure(request, e: EngineFailure):
        return _json_error(500, error_body(str(e), type="server_error"))


# -- the body-size limit ----------------------------------------------------------------------------------------
class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"The request body is larger than the server's limit of {limit} bytes.")


class BodyLimit:
    """Refuses (413) a body over max_bytes: by its Content-Length header at once, else while it is read."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            e = BodyTooLarge(self.max_bytes)
            return await _send_json(send, 413, error_body(e.detail, code="body_too_large"))
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


async def _send_json(send, status: int, body: dict) -> None:
    response = JSONResponse(body, status_code=status)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
