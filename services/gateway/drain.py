"""Graceful drain on SIGTERM: readiness off and new requests refused first, in-flight ones may finish, and
streams still running at the drain timeout are cut with an SSE error event (never left without an end)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.gateway.config import env_seconds

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_ENV = "HINTSERVE_DRAIN_TIMEOUT_S"
DEFAULT_DRAIN_TIMEOUT_S = 30.0
CUT_GRACE_S = 2.0  # after the cut: time for the error events to reach the clients


def default_drain_timeout_s() -> float:
    return env_seconds(DRAIN_TIMEOUT_ENV, DEFAULT_DRAIN_TIMEOUT_S)


class Drain:
    """Counts requests in progress (the middleware reports them) and runs the drain sequence once."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def request_started(self) -> None:
        self.active += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self._idle.is_set()

    def begin(self) -> None:
        """Readiness false and new requests 503 from now on (the caller also stops accepting connections)."""
        self.draining = True
        log.warning("draining: %d request(s) in flight, up to %.0f s", self.active, self.timeout_s)
