"""ASGI middleware in front of every route: API-key check, body size limit, HTTP status counting.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which would re-wrap every streamed SSE chunk.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.auth import Authenticator
from services.gateway.drain import Drain
from services.gateway.edge import edge_error
from services.gateway.errors import APIError
from services.gateway.metrics import GatewayMetrics

ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/admin/replay",
    "/health",
    "/ready",
    "/metrics",
)
_KNOWN = frozenset(ROUTES)


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def send_error(send: Any, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")


def shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down; send the request to another replica",
        code="server_shutting_down",
        headers={"Retry-After": "1", "Connection": "close"},
    )


class GatewayMiddleware:
    def __init__(
        self, app: Any, auth: Authenticator, metrics: GatewayMetrics, max_body_bytes: int, drain: Drain,
        guard_loopback: bool = False,
    ) -> None:
        self.app = app
        self.guard_loopback = guard_loopback  # auth off on loopback: Host and Origin must be loopback too
        self.auth = auth
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.drain = drain

    def _precheck(self, scope: dict[str, Any]) -> APIError | None:
        path = scope["path"]
        error = edge_error(scope, self.guard_loopback)
        if error is not None:
            return error
        if self.drain.draining and path.startswith("/v1/"):
            return shutting_down()
        # The admin routes check the admin key themselves; probes and /metrics stay open, as in vLLM.
        if path.startswith("/v1/") and not path.startswith("/v1/admin/"):
            try:
                self.auth.check(_header(scope, b"authorization"))
            except APIError as err:
                return err
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return body_too_large(self.max_body_bytes)
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        received = 0
        limit = self.max_body_bytes

        async def limited_receive() -> dict[str, Any]:
            # Chunked uploads carry no Content-Length: count what actually arrives.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise body_too_large(limit)
            return message

        self.drain.request_started()
        try:
            error = self._precheck(scope)
            if error is not None:
                await send_error(counting_send, error)
                return
            await self.app(scope, limited_receive, counting_send)
        finally:
            self.drain.request_finished()
            path = scope["path"]
            handler = path if path in _KNOWN else "other"
            self.metrics.http_request(handler, scope["method"], status or 500)
