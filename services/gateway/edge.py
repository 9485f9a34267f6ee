"""The strict HTTP edge (RFC 9110 / 9112 where it matters for safety), checked on the headers before any route:

* header block at most MAX_HEADER_BYTES (431), no Content-Length beside Transfer-Encoding (ambiguous framing:
  400, connection closed), one Authorization header (one set of credentials per request);
* request bodies only as `application/json` (415): a browser can send text/plain or a form cross-site
  without a CORS preflight, never application/json;
* with authentication off on loopback, the `Host` must be a loopback name (DNS rebinding: a page of
  evil.example resolving its name to 127.0.0.1) and an `Origin`, if any, a loopback origin (a web page the
  user visits must not drive the server), as local LLM servers had to learn.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from services.common.hosts import is_loopback_host
from services.gateway.errors import APIError

MAX_HEADER_BYTES = 16 << 10
JSON_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/admin/replay")


def _loopback_origin(origin: str) -> bool:
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and is_loopback_host(parts.netloc)


def edge_error(scope: dict[str, Any], guard_loopback: bool) -> APIError | None:
    """The first rule the request's headers break, or None. `guard_loopback`: authentication is off and the
    server listens on loopback only, so Host and Origin must say loopback too."""
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    if sum(len(k) + len(v) + 4 for k, v in headers) > MAX_HEADER_BYTES:
        return APIError(431, f"request headers exceed {MAX_HEADER_BYTES} bytes",
                        code="request_header_fields_too_large", headers={"Connection": "close"})
    names = [k for k, _ in headers]
    if b"transfer-encoding" in names and b"content-length" in names:
        return APIError(400, "a request must not carry both Content-Length and Transfer-Encoding",
                        code="ambiguous_framing", headers={"Connection": "close"})
    if names.count(b"authorization") > 1:
        return APIError(400, "send one Authorization header", code="invalid_request")
    values = {k: v.decode("latin-1") for k, v in headers}
    if scope.get("method") == "POST" and scope.get("path") in JSON_ROUTES:
        media = values.get(b"content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            return APIError(415, f"request bodies must be sent as application/json, not {media or 'untyped'}",
                            code="unsupported_media_type")
    if guard_loopback:
        if not is_loopback_host(values.get(b"host", "")):
            return APIError(403, "this server answers only to a loopback Host while authentication is off "
                            "(DNS rebinding protection)", code="host_not_allowed")
        origin = values.get(b"origin")
        if origin is not None and not _loopback_origin(origin):
            return APIError(403, "cross-origin requests are refused while authentication is off",
                            code="origin_not_allowed")
    return None
