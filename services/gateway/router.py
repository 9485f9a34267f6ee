"""One engine request's life in the gateway: admit, batch, submit, fail over, stream, account, abort."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from services.common.rpc_errors import describe_error
from services.engine.sampling_params import SamplingParams
from services.gateway.admission import AdmissionController
from services.gateway.batching import RequestBatcher
from services.gateway.engine_pool import EngineHandle, EnginePool
from services.gateway.errors import APIError, from_engine_error, is_engine_down
from services.gateway.metrics import GatewayMetrics, ModelMetrics
from services.gateway.stream_watch import StreamWatch, Watched


def _engine_aborted() -> APIError:
    # The engine ended the request itself (shutdown, admin abort): the text so far is not a full answer, so
    # the client gets an error rather than a finish_reason that would pass truncated text off as complete.
    return APIError(
        503,
        "the engine aborted the request before it finished (engine shutting down?)",
        code="engine_aborted",
        retriable=True,
    )


def _shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down: this stream was cut at the end of the drain timeout",
        code="server_shutting_down",
    )


async def _close(stream: AsyncGenerator[Any, None] | None) -> None:
    # Closing the backend's generator aborts an unfinished engine request (KV blocks freed). The backends'
    # cleanup never suspends, so this completes even inside a task that is being cancelled.
    if stream is not None:
        try:
            await stream.aclose()
        except Exception:
            pass


class EngineRouter:
    def __init__(
        self,
        pool: EnginePool,
        admission: AdmissionController,
        batcher: RequestBatcher,
        metrics: GatewayMetrics,
        stream_idle_timeout_s: float = 0.0,
    ) -> None:
        self.pool = pool
        self.admission = admission
        self.batcher = batcher
        self.metrics = metrics
        self.in_flight: dict[str, EngineHandle] = {}  # engine request id -> its engine, once it streams
        self.cutting = False  # set by the drain: aborts from here on are the gateway's own
        self.watch = StreamWatch(pool, stream_idle_timeout_s)  # 0: no idle deadline (health cuts stay)

    async def _open(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        prompt_param: str | None,
        m: ModelMetrics,
    ) -> tuple[EngineHandle, AsyncGenerator[Any, None], Any, float, Watched]:
        """Submits to an engine and waits for its first output, failing over while none has come.

        Returns (engine, stream, first output, submission time, watch entry); the caller owns the slot, the
        stream and the entry, and the request counts as running. Raises APIError: 429/503 from admission,
        4xx from the engine's validation, 503 when every engine that could serve failed, 504 when the engine
        said nothing within the idle deadline.
        """
        excluded: list[EngineHandle] = []
        m.waiting.inc()
        running = False  # which gauge counts the request now
        try:
            while True:
                handle = await self.admission.acquire(excluded)  # 503 once every healthy engine is excluded
                stream = None
                try:
                    await self.batcher.wait_turn(handle)
                    # No await between the batch wake-up and the submission in anext(): see RequestBatcher.
                    stream = handle.client.generate(request_id, prompt, params)
                    submitted = time.monotonic()
                    m.waiting.dec()
                    m.running.inc()
                    running = True
                    entry = self.watch.add(request_id, handle, m)
                    first = await self.watch.next_output(entry, stream)
                    if first.finished and first.finish_reason == "abort" and not first.delta_token_ids:
                        raise _engine_aborted()
                    return handle, stream, first, submitted, entry
                except BaseException as exc:
                    self.watch.remove(request_id)
                    if running:
                        m.running.dec()
                        m.waiting.inc()
                        running = False
                    self.admission.release(handle)
                    await _close(stream)
                    if not isinstance(exc, Exception):
                        raise
                    if isinstance(exc, StopAsyncIteration):
                        error = APIError(502, "engine closed the stream without output", retriable=True)
                    else:
                        error = from_engine_error(exc, prompt_param)
                    if not error.retriable:
                        raise error from exc
                    if is_engine_down(exc):
                        self.pool.mark_unhealthy(handle, describe_error(exc))
                    handle.failures += 1
                    excluded.append(handle)
        except BaseException as exc:
            m.waiting.dec()
            if not isinstance(exc, Exception):  # cancelled, queued or submitted: the client went away
                m.finished("abort")
            raise

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        model_name: str,
        arrival: float,
        prompt_param: str | None = None,
    ) -> AsyncGenerator[Any, None]:
        """Yields the engine's outputs (proto GenerateResponse or RequestOutput; same field names).

        The last output has finished=True and finish_reason "stop" or "length". Errors are APIError: before
        the first output they carry the right HTTP status; after it they end the stream. Closing the
        iterator early (client disconnect) aborts the engine request.
        """
        m = self.metrics.model(model_name)
        handle, stream, out, submitted, entry = await self._open(request_id, prompt, params, prompt_param, m)
        m.queue.observe(submitted - arrival)
        self.in_flight[request_id] = handle
        first_token = last_token = 0.0
        prompt_tokens = completion_tokens = 0
        finish_reason = "abort"  # unless the engine says otherwise: closed early or failed
        try:
            while True:
                now = time.monotonic()
                if out.delta_token_ids:
                    if not first_token:
                        first_token = now
                        m.ttft.observe(now - arrival)
                    else:
                        m.itl.observe(now - last_token)
                    last_token = now
                prompt_tokens, completion_tokens = out.prompt_tokens, out.completion_tokens
                if out.finished:
                    if out.finish_reason == "abort":
                        raise _shutting_down() if self.cutting else _engine_aborted()
                    finish_reason = out.finish_reason or "stop"
                    if completion_tokens > 1:
                        m.tpot.observe((last_token - first_token) / (completion_tokens - 1))
                    m.e2e.observe(now - arrival)
                    yield out
                    return
                yield out
                try:
                    out = await self.watch.next_output(entry, stream)
                except StopAsyncIteration:
                    raise APIError(502, "engine stream ended before the request finished") from None
                except Exception as exc:  # tokens already went out: no failover, the stream ends in an error
                    if is_engine_down(exc):
                        self.pool.mark_unhealthy(handle, describe_error(exc))
                    raise from_engine_error(exc, prompt_param) from exc
        finally:
            self.in_flight.pop(request_id, None)
            self.watch.remove(request_id)
            m.running.dec()
            m.finished(finish_reason)
            m.prompt_tokens.inc(prompt_tokens)
            m.generation_tokens.inc(completion_tokens)
            self.admission.release(handle)
            await _close(stream)

    async def cut_all(self) -> None:
        """Aborts every streaming engine request: each stream ends with a server_shutting_down error."""
        self.cutting = True
        aborts = [handle.client.abort(rid) for rid, handle in list(self.in_flight.items())]
        await asyncio.gather(*aborts, return_exceptions=True)  # NOT_FOUND: it finished meanwhile
