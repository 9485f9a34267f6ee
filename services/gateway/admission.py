"""Admission control: a bounded FIFO queue in front of the engines' concurrency slots.

A request takes a slot on an engine (at most `max_concurrency_per_engine` per engine) or waits in the queue
(at most `max_queue` requests); beyond both it gets a 429 at once, so overload never turns into unbounded
buffering. With no healthy engine at all the answer is a 503, also at once, and queued requests get it too
when the last engine goes down.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from services.gateway.engine_pool import EngineHandle, EnginePool
from services.gateway.errors import no_healthy_engine, overloaded


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future
    exclude: frozenset[EngineHandle]


class AdmissionController:
    def __init__(self, pool: EnginePool, max_queue: int, retry_after_s: int = 1) -> None:
        self.pool = pool
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self._waiters: deque[_Waiter] = deque()
        pool.add_listener(self._dispatch)

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.future.done())

    async def acquire(self, exclude: Iterable[EngineHandle] = ()) -> EngineHandle:
        """A slot on an engine not in `exclude`, queueing while all are busy; APIError 429/503 otherwise."""
        excluded = frozenset(exclude)
        if not self.pool.can_serve(excluded):
            raise no_healthy_engine()
        if not self._waiters:  # FIFO: nobody may overtake a queued request
            handle = self.pool.pick(excluded)
            if handle is not None:
                self.pool.acquire(handle)
                return handle
        if self.num_waiting >= self.max_queue:
            raise overloaded(self.retry_after_s)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), excluded)
        self._waiters.append(waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())  # granted just as the client went away: hand the slot on
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self, handle: EngineHandle) -> None:
        self.pool.release(handle)  # notifies the pool's listeners, i.e. _dispatch

    def _dispatch(self) -> None:
        """Hands free slots to queued requests in arrival order; fails them when no engine can serve."""
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():  # cancelled while queued
                self._waiters.popleft()
                continue
            if not self.pool.can_serve(waiter.exclude):
                self._waiters.popleft()
                waiter.future.set_exception(no_healthy_engine())
                continue
            handle = self.pool.pick(waiter.exclude)
            if handle is None:
                break
            self.pool.acquire(handle)
            self._waiters.popleft()
            waiter.future.set_result(handle)
