"""The asyncio face of the engine: a dedicated thread runs the step loop; requests stream through queues."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from services.engine.config import EngineConfig
from services.engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence

log = logging.getLogger(__name__)

_STOP = object()


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", seq) | ("abort", (id, serial)) | _STOP
        # request id -> (serial of the sequence the stream belongs to, its queue)
        self._streams: dict[str, tuple[int, asyncio.Queue]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._dead: asyncio.Event | None = None  # set when the loop fails: the process should exit

    # ---- lifecycle ----
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._dead = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="hintserve-engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.engine.close()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._error is None

    # ---- requests ----
    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's deltas; closing the iterator early aborts the request."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop stopped: {self._error}")
        if self._thread is None:
            raise EngineDeadError("engine not started")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        seq = self.engine.make_sequence(request_id, prompt, params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (seq.serial, stream)
        self._inbox.put(("add", seq))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, InvalidRequestError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine loop failed: {item}") from item
                if item.finish_reason == "error":
                    finished = True  # the engine already dropped it: nothing to abort
                    raise RequestFailedError(item.error)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", (request_id, seq.serial)))

    def abort(self, request_id: str) -> bool:
        """Aborts an in-flight request; its stream ends with finish_reason "abort"."""
        entry = self._streams.get(request_id)
        if entry is None:
            return False
        self._inbox.put(("abort", (request_id, entry[0])))
        return True

    # ---- the loop thread ----
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished()
                while True:
                    try:
                        item = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    if item is _STOP:
                        self._abort_all()
                        return
                    self._handle(item)
                    block = False
                if engine.has_unfinished():
                    outputs = engine.step()
                    if outputs:
                        self._loop.call_soon_threadsafe(self._dispatch, outputs)  # type: ignore[union-attr]
        except Exception as exc:  # a bug or device failure: fail every in-flight request, loudly
            log.exception("engine loop failed")
            self._error = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)  # type: ignore[union-attr]

    def _handle(self, item: tuple[str, object]) -> None:
        kind, payload = item
        if kind == "add":
            seq: Sequence = payload  # type: ignore[assignment]
            try:
                self.engine.add_sequence(seq)
            except InvalidRequestError as exc:
                self._loop.call_soon_threadsafe(self._deliver, seq.request_id, seq.serial, exc)  # type: ignore[union-attr]
        elif kind == "abort":
            out = self.engine.abort_request(*payload)  # type: ignore[misc]
            if out is not None:  # delivered only if its stream is still open (serials must match)
                self._loop.call_soon_threadsafe(self._dispatch, [out])  # type: ignore[union-attr]

    def _abort_all(self) -> None:
        outputs = [self.engine.abort_request(rid) for rid in list(self.engine._streams)]
        self._loop.call_soon_threadsafe(self._dispatch, [o for o in outputs if o])  # type: ignore[union-attr]

    # ---- event-loop side ----
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out.request_id, out.seq_serial, out)

    def _deliver(self, request_id: str, serial: int, item: object) -> None:
        entry = self._streams.get(request_id)
        if entry is not None and entry[0] == serial:
            entry[1].put_nowait(item)

    def _fail_all(self, exc: BaseException) -> None:
        for _, stream in self._streams.values():
            stream.put_nowait(exc)
        if self._dead is not None:
            self._dead.set()

    async def wait_dead(self) -> BaseException:
        """Returns the loop's failure once it has stopped for good (the serving process then exits)."""
        assert self._dead is not None, "engine not started"
        await self._dead.wait()
        assert self._error is not None
        return self._error

    # ---- information ----
    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def model_info(self) -> dict[str, object]:
        return self.engine.model_info()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def has_chat_template(self) -> bool:
        return self.engine.has_chat_template

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.engine.apply_chat_template(messages)
