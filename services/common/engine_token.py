"""The engines' gRPC port accepts only callers that know a shared token (HINTSERVE_ENGINE_TOKEN, set on the
engines and on the gateways that call them, as the API keys are set on the gateway): in compose and
Kubernetes anything on the network can reach port 50051. The token travels as `authorization: Bearer <token>`
call metadata. Health stays open, for probes; it tells nothing but SERVING / NOT_SERVING."""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable

ENGINE_TOKEN_ENV = "HINTSERVE_ENGINE_TOKEN"


def engine_token() -> str | None:
    return os.environ.get(ENGINE_TOKEN_ENV, "").strip() or None


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata a client sends (None: no token configured)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def token_matches(metadata: Iterable[tuple[str, object]] | None, token: str) -> bool:
    """Whether the call's metadata carries `token` (compared in constant time)."""
    sent = ""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            sent = value[len("Bearer ") :]
    return hmac.compare_digest(sent.encode(), token.encode())
