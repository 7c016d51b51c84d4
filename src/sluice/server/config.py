"""Every server setting in one object."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice.errors import InvalidOptionError


@dataclass(frozen=True)
class ServerConfig:
    """How `sluice serve` listens and whom it answers.

    host, port: where it listens (127.0.0.1 by default: only this machine; port 0 picks a free one).
    api_key: when set, every endpoint but /health needs `Authorization: Bearer <api_key>`.
    model_name: the name /v1/models lists and requests must use (None: the model file's or directory's name).
    max_body_bytes: the largest request body accepted (413 beyond).
    read_timeout: seconds a client has to send a request's headers, and then its whole body (408 beyond).
    max_connections: open connections at most; a request on one more is answered 503 and the connection closed.
    allow_special_tokens: read special-token texts (`<|im_start|>`) in chat messages as the special tokens, not as
        plain text (which is the default: a user's text cannot open a turn of another role).
    log_level: uvicorn's ("warning" keeps the per-request access lines out).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    max_body_bytes: int = 8 << 20
    read_timeout: float = 30.0
    max_connections: int = 1024
    allow_special_tokens: bool = False
    log_level: str = "info"

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidOptionError(f"port={self.port!r}: use an integer in [0, 65535].")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise InvalidOptionError(f"max_body_bytes={self.max_body_bytes!r}: use a positive integer.")
        if not isinstance(self.read_timeout, (int, float)) or not (0 < self.read_timeout < math.inf):
            raise InvalidOptionError(f"read_timeout={self.read_timeout!r}: use a positive number of seconds.")
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise InvalidOptionError(f"max_connections={self.max_connections!r}: use a positive integer.")
        if self.api_key is not None and not self.api_key:
            raise InvalidOptionError("api_key is empty: give a key, or none to serve without one.")
