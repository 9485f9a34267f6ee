"""Liveness of engine streams: a request whose engine stays silent past the idle deadline, or turns unhealthy,
is cut (engine request aborted, the client told) instead of waiting for as long as the engine hangs.

"Silent" is judged per stream and per engine: a stream is cut for idleness only when its engine's step
counters (polled with its stats) have not moved either. The per-token path only stores a timestamp; one sweeper task per gateway checks the deadlines, and the
engine pool's health changes cut the streams of an engine that went down at once. A cut cancels the task
that awaits the engine's next output: the cancellation runs the backend's cleanup (gRPC call cancelled,
in-process request aborted) and `next_output` turns it into the APIError the client sees.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from services.gateway.engine_pool import EngineHandle, EnginePool
from services.gateway.errors import APIError
from services.gateway.metrics import ModelMetrics

MAX_SWEEP_INTERVAL_S = 1.0  # a cut comes at most this late after the deadline


def idle_timeout_error(timeout_s: float) -> APIError:
    return APIError(
        504,
        f"the engine produced no output for {timeout_s:g} s (--stream-idle-timeout-s); the request was aborted",
        code="engine_timeout",
    )


def engine_down_error(address: str, reason: str) -> APIError:
    # Retriable: before the first output the router fails over to another engine.
    return APIError(
        503, f"engine {address} became unhealthy ({reason}); the request was aborted",
        code="engine_unavailable", retriable=True,
    )


@dataclass(eq=False)
class Watched:
    """One engine request: which engine, which task awaits its output and since when."""

    handle: EngineHandle
    metrics: ModelMetrics
    task: asyncio.Task | None = None
    waiting_since: float | None = None  # set while awaiting the engine (not while the client is slow)
    cut: APIError | None = None
    cancelled: bool = False


class StreamWatch:
    def __init__(self, pool: EnginePool, idle_timeout_s: float) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.entries: dict[str, Watched] = {}
        self._sweeper: asyncio.Task | None = None
        pool.add_down_listener(self._engine_down)

    def add(self, request_id: str, handle: EngineHandle, metrics: ModelMetrics) -> Watched:
        if self._sweeper is None and self.idle_timeout_s > 0:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="hintserve-stream-watch")
        entry = self.entries[request_id] = Watched(handle, metrics)
        if not handle.healthy:  # it went down between admission and now
            self._cut(entry, engine_down_error(handle.address, handle.last_error or "unhealthy"), "engine_unhealthy")
        return entry

    def remove(self, request_id: str) -> None:
        self.entries.pop(request_id, None)

    async def next_output(self, entry: Watched, stream: AsyncGenerator[Any, None]) -> Any:
        """The stream's next output; the cut's APIError once the engine is silent too long or goes down."""
        if entry.cut is not None:
            raise entry.cut
        entry.task = asyncio.current_task()
        entry.waiting_since = time.monotonic()
        try:
            return await anext(stream)
        except BaseException:
            if entry.cut is None:
                raise
            if entry.cancelled and hasattr(entry.task, "uncancel"):  # 3.11+: our own cancel, now handled
                entry.task.uncancel()
            raise entry.cut from None
        finally:
            entry.waiting_since = None

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None

    # ---- cutting ----
    def _cut(self, entry: Watched, error: APIError, reason: str) -> None:
        if entry.cut is None:
            entry.cut = error
            entry.metrics.stream_cut(reason)
        # Only a task waiting on the engine is cancelled: one writing to a slow client sees the cut on its
        # next call to next_output.
        if entry.waiting_since is not None and entry.task is not None and not entry.cancelled:
            entry.cancelled = True
            entry.task.cancel()

    def _engine_down(self, handle: EngineHandle) -> None:
        error = engine_down_error(handle.address, handle.last_error or "unhealthy")
        for entry in list(self.entries.values()):
            if entry.handle is handle:
                self._cut(entry, error, "engine_unhealthy")

    async def _sweep(self) -> None:
        timeout = self.idle_timeout_s
        interval = min(MAX_SWEEP_INTERVAL_S, timeout / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for entry in list(self.entries.values()):
                since = entry.waiting_since
                # Silent past the deadline, and so is its engine: a request queued or preempted inside an
                # engine that keeps stepping (its step counters move) is waiting its turn, not hung.
                if (since is not None and now - since > timeout and entry.cut is None
                        and now - entry.handle.progress_at > timeout):
                    self._cut(entry, idle_timeout_error(timeout), "idle_timeout")
