"""Request batching: requests bound for the same engine within a short window are submitted together.

The engine drains its whole inbox before each step and prefills everything waiting in one batch, so
requests submitted in the same event-loop turn land in the same prefill step. Without a window, a burst of
arrivals a millisecond apart becomes several one-request prefills, each delaying the running decodes.
The window costs at most `window_s` of TTFT; `max_batch` arrivals flush it early. A request that finds its
engine with nothing else in flight goes at once: no step is running for it to batch behind, and a lone
request (every request at concurrency 1) would otherwise pay the whole window for nothing.
"""

from __future__ import annotations

import asyncio

from services.gateway.engine_pool import EngineHandle


class _Batch:
    __slots__ = ("ready", "size", "timer")

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.size = 0
        self.timer: asyncio.TimerHandle | None = None


class RequestBatcher:
    def __init__(self, window_s: float, max_batch: int) -> None:
        self.window_s = window_s
        self.max_batch = max_batch
        self._open: dict[EngineHandle, _Batch] = {}
        self.batches_flushed = 0
        self.requests_batched = 0

    @property
    def enabled(self) -> bool:
        return self.window_s > 0 and self.max_batch > 1

    async def wait_turn(self, engine: EngineHandle) -> None:
        """Returns when this request's batch for `engine` is due; the caller then submits at once.

        All members of a batch wake in the same event-loop turn (one Event), and the caller must not await
        anything between this and starting its engine request, so the submissions are back to back.
        """
        if not self.enabled or engine.outstanding <= 1:  # the engine's only request (admission counted it)
            return
        batch = self._open.get(engine)
        if batch is None:
            batch = self._open[engine] = _Batch()
            batch.timer = asyncio.get_running_loop().call_later(self.window_s, self._flush, engine, batch)
        batch.size += 1
        if batch.size >= self.max_batch:
            self._flush(engine, batch)
            # The others wake in the next loop turn; resume there too rather than submitting now, or the
            # loop's select() in between would let the engine thread start a step with this request alone.
            await asyncio.sleep(0)
            return
        await batch.ready.wait()

    def _flush(self, engine: EngineHandle, batch: _Batch) -> None:
        if self._open.get(engine) is batch:
            del self._open[engine]
        if batch.timer is not None:
            batch.timer.cancel()
        if not batch.ready.is_set():
            self.batches_flushed += 1
            self.requests_batched += batch.size
            batch.ready.set()
