"""`sluice serve`: an OpenAI-compatible HTTP server on the batching engine.

    from sluice.server import ServerConfig, serve
    serve(sluice.load(), ServerConfig(port=8000))          # blocks; Ctrl-C stops it

`create_app(model, config)` gives the FastAPI app (its engine thread runs while the app does); `Server` runs one in a
background thread (tests, benchmarks). Files: `app.py` (routes, key, limits, errors), `protocol.py` (request models,
response shapes), `generate.py` (prompt, engine options, replies and streams), `loop.py` (the engine's thread),
`listen.py` (uvicorn with header deadlines, a connection cap and a shutdown that ends the streams first), `chat.py`
(reasoning and tool calls out of the reply), `grammar.py` (structured output), `logprobs.py`.
"""

from __future__ import annotations

import socket
import threading
import time

from sluice.errors import UnsupportedError
from sluice.server.config import ServerConfig

__all__ = ["Server", "ServerConfig", "create_app", "serve"]


def _require_server_packages() -> None:
    try:
        import fastapi  # noqa: F401
        import llguidance  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UnsupportedError(f"the server needs packages that are not installed ({e.name}): "
                               "pip install 'sluice[serve]'") from None


def create_app(model, config: ServerConfig):
    _require_server_packages()
    from sluice.server.app import create_app as _create_app

    return _create_app(model, config)


def _uvicorn_server(model, config: ServerConfig):
    _require_server_packages()
    from sluice.server.listen import uvicorn_server

    return uvicorn_server(model, config)


def serve(model, config: ServerConfig) -> None:
    """Serve until interrupted."""
    _uvicorn_server(model, config).run()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Server:
    """A server in a background thread: `with Server(model, config) as s: ... s.url ...` (port 0: a free one)."""

    def __init__(self, model, config: ServerConfig):
        from dataclasses import replace

        if config.port == 0:
            config = replace(config, port=free_port(config.host))
        self.config = config
        self.url = f"http://{config.host}:{config.port}"
        self._server = _uvicorn_server(model, config)
        self._thread = threading.Thread(target=self._server.run, name="sluice-http", daemon=True)

    def __enter__(self) -> Server:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(30)
