"""Several engine backends: health checks, stats polling, least-outstanding-requests routing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from services.common.rpc_errors import describe_error
from services.gateway.engine_client import EngineBackend

log = logging.getLogger(__name__)

MAX_DOWN_PROBE_INTERVAL_S = 1.0


@dataclass(eq=False)
class EngineHandle:
    """One backend and the gateway's view of it."""

    client: EngineBackend
    max_concurrency: int
    outstanding: int = 0  # requests holding one of this engine's concurrency slots
    healthy: bool = False
    model_info: dict[str, Any] | None = None  # fetched once the engine first answers
    stats: dict[str, float] = field(default_factory=dict)  # the latest Stats() reply
    last_error: str = ""
    failures: int = 0  # requests that failed over away from this engine
    retired: bool = False  # dropped by discovery: no new requests; the client closes once none is left
    steps: float = -1.0  # the engine's step counters as last seen ...
    progress_at: float = 0.0  # ... and when they last moved (monotonic): the engine is stepping, not hung

    def saw_stats(self, stats: dict[str, float]) -> None:
        self.stats = stats
        steps = sum(v for k, v in stats.items() if k.endswith("_steps_total"))
        if steps != self.steps:
            self.steps, self.progress_at = steps, time.monotonic()

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def has_capacity(self) -> bool:
        return self.healthy and not self.retired and self.outstanding < self.max_concurrency


class EnginePool:
    """Tracks which engines are healthy and how loaded; picks one for each request.

    Health comes from a periodic Health + ModelInfo + Stats round to every engine (an engine is healthy when
    it answers SERVING and its model info is known) and from requests: a request that finds the engine
    unreachable marks it unhealthy at once, so the next requests fail over without waiting for the round.
    """

    def __init__(
        self,
        clients: Iterable[EngineBackend],
        max_concurrency_per_engine: int,
        health_interval_s: float = 2.0,
        check_timeout_s: float = 2.0,
    ) -> None:
        self.max_concurrency_per_engine = max_concurrency_per_engine
        self.engines = [EngineHandle(c, max_concurrency_per_engine) for c in clients]
        if not self.engines:
            raise ValueError("the engine pool needs at least one engine")
        self.health_interval_s = health_interval_s
        self.check_timeout_s = check_timeout_s
        self._next = 0  # rotates ties between equally loaded engines
        self._listeners: list[Callable[[], None]] = []
        self._down_listeners: list[Callable[[EngineHandle], None]] = []
        self._task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()  # clients of retired engines being closed

    # ---- lifecycle ----
    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._health_loop(), name="hintserve-engine-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        closes = [h.client.close() for h in self.engines]
        await asyncio.gather(*closes, *self._closing, return_exceptions=True)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs whenever capacity may have appeared or an engine's health changed."""
        self._listeners.append(callback)

    def add_down_listener(self, callback: Callable[[EngineHandle], None]) -> None:
        """`callback(handle)` runs when an engine turns unhealthy (its streams are cut at once)."""
        self._down_listeners.append(callback)

    # ---- health ----
    async def _health_loop(self) -> None:
        while True:
            # While an engine is down, probe at least every second so a restarted one is re-admitted quickly.
            down = any(not h.healthy for h in self.engines)
            interval = self.health_interval_s
            await asyncio.sleep(min(interval, MAX_DOWN_PROBE_INTERVAL_S) if down else interval)
            try:
                await self.check_all()
            except Exception:  # never let the loop die: it is the only way back to healthy
                log.exception("engine health round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(h) for h in self.engines))

    async def _check(self, handle: EngineHandle) -> None:
        timeout = self.check_timeout_s
        try:
            ok = await asyncio.wait_for(handle.client.health(), timeout)
            if ok and (handle.model_info is None or not handle.healthy):  # (re)started: maybe another model
                handle.model_info = await asyncio.wait_for(handle.client.model_info(), timeout)
            if ok:
                handle.saw_stats(await asyncio.wait_for(handle.client.stats(), timeout))
            reason = "" if ok else "engine reports NOT_SERVING"
        except Exception as exc:  # unreachable, timed out, or dead: all mean "do not route here"
            ok, reason = False, describe_error(exc)
        self._set_health(handle, ok, reason)

    async def poll_stats(self) -> None:
        """Refreshes every healthy engine's stats now (a /metrics scrape wants current values)."""

        async def one(handle: EngineHandle) -> None:
            try:
                handle.saw_stats(await asyncio.wait_for(handle.client.stats(), self.check_timeout_s))
            except Exception:
                pass  # the health round decides about health; a scrape just keeps the last values

        await asyncio.gather(*(one(h) for h in self.engines if h.healthy))

    # ---- membership (engine discovery) ----
    async def add(self, client: EngineBackend) -> EngineHandle:
        """A new engine, health-checked before it is routed to."""
        handle = EngineHandle(client, self.max_concurrency_per_engine)
        self.engines.append(handle)
        await self._check(handle)
        return handle

    def retire(self, handle: EngineHandle) -> None:
        """Stops routing to `handle`; its client closes when its last in-flight request releases it."""
        if handle in self.engines:
            self.engines.remove(handle)
        handle.retired = True
        self._next = 0
        if handle.outstanding == 0:
            self._close_later(handle)

    def _close_later(self, handle: EngineHandle) -> None:
        task = asyncio.get_running_loop().create_task(handle.client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def mark_unhealthy(self, handle: EngineHandle, reason: str) -> None:
        self._set_health(handle, False, reason)

    def _set_health(self, handle: EngineHandle, ok: bool, reason: str) -> None:
        handle.last_error = reason
        if handle.healthy == ok:
            return
        handle.healthy = ok
        if ok:
            log.info("engine %s is healthy", handle.address)
        else:
            log.warning("engine %s is unhealthy: %s", handle.address, reason)
            for callback in self._down_listeners:
                callback(handle)
        self._notify()

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    # ---- routing ----
    def pick(self, exclude: Iterable[EngineHandle] = ()) -> EngineHandle | None:
        """The healthy engine with a free slot and the fewest outstanding requests; ties rotate."""
        excluded = set(exclude)
        best: EngineHandle | None = None
        best_index = 0
        n = len(self.engines)
        for k in range(n):
            i = (self._next + k) % n
            handle = self.engines[i]
            if handle in excluded or not handle.has_capacity:
                continue
            if best is None or handle.outstanding < best.outstanding:
                best, best_index = handle, i
        if best is not None:
            self._next = (best_index + 1) % n
        return best

    def acquire(self, handle: EngineHandle) -> None:
        handle.outstanding += 1

    def release(self, handle: EngineHandle) -> None:
        handle.outstanding -= 1
        if handle.retired and handle.outstanding == 0:
            self._close_later(handle)
        self._notify()

    # ---- views ----
    @property
    def healthy_engines(self) -> list[EngineHandle]:
        return [h for h in self.engines if h.healthy]

    @property
    def any_healthy(self) -> bool:
        return any(h.healthy for h in self.engines)

    def can_serve(self, exclude: Iterable[EngineHandle] = ()) -> bool:
        """Whether some healthy engine outside `exclude` exists (maybe busy): worth queueing for."""
        excluded = set(exclude)
        return any(h.healthy and h not in excluded for h in self.engines)

    @property
    def total_outstanding(self) -> int:
        return sum(h.outstanding for h in self.engines)

    def model_info(self) -> dict[str, Any] | None:
        """Model info of a healthy engine, else of any engine that ever answered."""
        for handle in sorted(self.engines, key=lambda h: not h.healthy):
            if handle.model_info is not None:
                return handle.model_info
        return None

    def max_model_len(self) -> int | None:
        """The smallest context window among the engines that reported one (a request must fit any)."""
        lens: list[int] = [n for h in self.engines if h.model_info and (n := h.model_info.get("max_model_len"))]
        return min(lens) if lens else None
