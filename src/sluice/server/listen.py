"""uvicorn, with what it lacks for a server that faces careless or hostile clients:

* `Protocol`, its h11 protocol with a deadline for a request's headers (a client that connects and sends nothing, or
  sends its headers slowly, is disconnected after `read_timeout` seconds; idle keep-alive connections close after
  uvicorn's `timeout_keep_alive`), a cap on open connections (a request on one more is answered 503 and its connection
  closed), and its own parse errors (a malformed request line, headers over h11's 16 KiB) answered in JSON;
* `UvicornServer`, whose shutdown (Ctrl-C, SIGTERM) first ends the engine's requests, so that each stream gets an
  error event and [DONE] and each waiting reply a 503 before uvicorn waits for the connections to close.
"""

from __future__ import annotations

import asyncio
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from sluice.server.config import ServerConfig
from sluice.server.protocol import error_body

KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this
GRACEFUL_S = 5  # after the engine's requests ended, how long shutdown waits for connections to close


def uvicorn_server(model, config: ServerConfig) -> UvicornServer:
    from sluice.server.app import create_app

    app = create_app(model, config)
    server = UvicornServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                          http=protocol_for(config), timeout_keep_alive=KEEP_ALIVE_S,
                                          timeout_graceful_shutdown=GRACEFUL_S))
    server.engine_loop = app.state.loop
    return server


class UvicornServer(uvicorn.Server):
    engine_loop = None

    async def shutdown(self, sockets=None) -> None:
        if self.engine_loop is not None:
            await asyncio.to_thread(self.engine_loop.stop)  # off the event loop: it must deliver the endings
        await super().shutdown(sockets)


def _json_response(status: int, reason: bytes, body: dict) -> list:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
               (b"connection", b"close")]
    return [h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=data), h11.EndOfMessage()]


async def _too_many_connections(scope, receive, send) -> None:
    body = json.dumps(error_body("The server has too many open connections; retry shortly.", type="server_error",
                                 code="too_many_connections")).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def protocol_for(config: ServerConfig) -> type:
    class Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > config.max_connections:
                self.app = _too_many_connections  # this connection's request is answered 503, then it closes
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._await_headers()

        def connection_lost(self, exc) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            """Arm the header deadline while a request's headers are awaited, disarm it once they are in."""
            waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
            if not waiting:
                self._stop_header_timer()
            elif self._header_timer is None:
                self._header_timer = self.loop.call_later(config.read_timeout, self._headers_too_slow)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            body = error_body(f"{msg} The request is not valid HTTP/1.1 (or its headers exceed 16 KiB).",
                              code="invalid_http")
            try:
                for event in _json_response(400, b"Bad Request", body):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # a response had begun: nothing more can be said
                pass
            self.transport.close()

    return Protocol
