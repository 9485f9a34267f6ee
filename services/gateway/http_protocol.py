"""uvicorn's h11 protocol with a deadline for reading each request (slowloris defence).

uvicorn bounds only idle keep-alive time: a client that sends half a header line, or a Content-Length and
then a trickle of body, holds its connection and a task forever. Here every request must arrive whole
(headers and body) within `read_timeout_s` of its first byte, else it gets 408 and the connection closes.
"""

from __future__ import annotations

import asyncio
import http
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.gateway.edge import MAX_HEADER_BYTES
from services.gateway.errors import APIError

_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class ReadTimeoutH11Protocol(H11Protocol):
    read_timeout_s: float = 30.0
    _read_deadline: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._cancel_read_deadline()  # the request is in; the next one's first byte arms a new one

    def send_400_response(self, msg: str) -> None:
        """What h11 refuses (malformed framing, a header block over MAX_HEADER_BYTES still arriving) is
        answered as every other error: OpenAI-shaped JSON, 431 for the oversized headers."""
        too_long = len(self.conn.trailing_data[0]) >= MAX_HEADER_BYTES
        error = (
            APIError(431, f"request headers exceed {MAX_HEADER_BYTES} bytes", code="request_header_fields_too_large")
            if too_long else APIError(400, "malformed HTTP request", code="invalid_http_request")
        )
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        response = h11.Response(status_code=error.status, headers=headers, reason=http.HTTPStatus(error.status).phrase)
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_deadline()
        super().connection_lost(exc)

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()  # a handler still reading the body sees a disconnect (499)


def protocol_with_read_timeout(read_timeout_s: float) -> type[ReadTimeoutH11Protocol]:
    return type("GatewayH11Protocol", (ReadTimeoutH11Protocol,), {"read_timeout_s": read_timeout_s})
