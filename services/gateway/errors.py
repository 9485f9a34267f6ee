"""OpenAI-shaped API errors, and the one place engine errors (gRPC or in-process) become HTTP errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from services.engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
)

# The engine's ContextLengthExceededError message starts this way; over gRPC only the text survives
# (both kinds of InvalidRequestError become INVALID_ARGUMENT), so the text is what tells them apart.
_CONTEXT_LENGTH_MARKER = "maximum context length"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    501: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
        retriable: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = dict(headers or {})
        # True when another engine may succeed where this one failed (failover before the first token).
        self.retriable = retriable

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def no_healthy_engine(detail: str = "") -> APIError:
    message = "no healthy engine is available" + (f": {detail}" if detail else "")
    return APIError(503, message, code="no_healthy_engine", headers={"Retry-After": "1"}, retriable=True)


def overloaded(retry_after_s: int = 1) -> APIError:
    return APIError(
        429,
        "the server is overloaded: the admission queue is full; retry later",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def context_length_exceeded(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="context_length_exceeded")


def request_failed(message: str) -> APIError:
    # Never retried on another engine: the same content would fail (or poison) that one too.
    return APIError(500, message, code="request_failed", retriable=False)


def from_engine_error(exc: BaseException, prompt_param: str | None = None) -> APIError:
    """Maps what an engine backend raised to the HTTP error the client sees.

    Both backends go through here: the gRPC client raises `grpc.aio.AioRpcError` (check `.code()`), the
    in-process adapter raises the engine's own exceptions. `retriable` marks failures of the engine rather
    than of the request, which the router fails over to another engine while no token has been produced.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        return context_length_exceeded(str(exc), prompt_param)
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, RequestFailedError):
        return request_failed(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"engine failed: {exc}", code="engine_unavailable", retriable=True)
    if isinstance(exc, grpc.aio.AioRpcError):
        return _from_rpc_error(exc, prompt_param)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def _from_rpc_error(exc: grpc.aio.AioRpcError, prompt_param: str | None) -> APIError:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if _CONTEXT_LENGTH_MARKER in details:
            return context_length_exceeded(details, prompt_param)
        return bad_request(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(
            429, f"engine overloaded: {details}", code="rate_limit_exceeded", headers={"Retry-After": "1"}
        )
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        # Connection refused or reset, engine shutting down: the engine, not the request, is at fault.
        return APIError(503, f"engine unavailable: {details}", code="engine_unavailable", retriable=True)
    if code == grpc.StatusCode.INTERNAL:
        return request_failed(details)
    return APIError(500, f"engine error {code.name}: {details}", code="engine_error")


def is_engine_down(exc: BaseException) -> bool:
    """Whether the failure says the engine itself is unreachable or dead (mark it unhealthy at once)."""
    if isinstance(exc, EngineDeadError):
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
