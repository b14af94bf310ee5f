"""Every route of our vLLM servers but /health requires the key (loaded into the server by path).

vLLM 0.32's own `AuthenticationMiddleware` (entrypoints/serve/middleware/authenticate.py) guards
only paths under /v1, /v2, /inference and /cohere. The development routes our engine drives with
VLLM_SERVER_DEV_MODE=1 (/update_weights, /start_weight_update, /reset_prefix_cache, /pause,
/abort_requests, /collective_rpc, /sleep, ...) change the served weights or the server's state and
answered anyone on the host. The launch adds this class with `--middleware` (vLLM adds a class
there with no arguments), and the key comes from VLLM_API_KEY in the server's environment (which
vLLM's own middleware reads too), never from its command line: /proc/<pid>/cmdline is readable by
every user of the node, /proc/<pid>/environ by the owner only.

This module is imported by the vLLM server process; it needs nothing of megatron-dapo.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Any

__all__ = ["OPEN_PATHS", "RequireKey", "authorized"]

OPEN_PATHS = ("/health",)
"""What answers without the key: liveness only (the engine's health checks, a scheduler's probe)."""


def authorized(headers: list[tuple[bytes, bytes]], key_digest: bytes) -> bool:
    """Whether an ASGI header list carries `Authorization: Bearer <key>` (constant-time compare)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and secrets.compare_digest(
                hashlib.sha256(token.strip().encode()).digest(), key_digest)
    return False


class RequireKey:
    """Pure ASGI middleware: 401 for any HTTP or WebSocket request without the key, of any method, except
    OPEN_PATHS."""

    def __init__(self, app: Any) -> None:
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError("megatron-dapo's RequireKey middleware needs VLLM_API_KEY in the server's environment")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        # Every method, OPTIONS included: vLLM's own middleware lets OPTIONS through for browsers'
        # CORS preflight, which no client of ours sends, and the app answers it on any route
        # (OPTIONS /metrics answered 200 without the key).
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or authorized(scope.get("headers", []), self._digest):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
