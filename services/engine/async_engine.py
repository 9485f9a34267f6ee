"""The asyncio frontend of the engine: tokenises and validates, streams text, and drives the engine core.

The core (services/engine/engine_core.py) runs LLMEngine's step loop in its own process, so the model never
waits on HTTP, SSE or gRPC work for the GIL; requests go to it and token ids come back over two pipes, and
text (detokenisation, stop strings) is made here. `core_in_thread=True` hosts the same core loop on a thread
of this process instead: for tests and tools that want no second process, never for serving.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

from services.engine import core_messages
from services.engine.config import EngineConfig
from services.engine.embedded_predictor import embedded_predictor
from services.engine.engine_core import engine_core_main, run_engine_core
from services.engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from services.engine.input_processor import (
    INLINE_TOKENIZE_CHARS,
    InputProcessor,
    apply_chat_template,
    has_chat_template,
)
from services.engine.output_processor import RequestStream, text_delta
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.engine.startup_checks import load_tokenizer
from services.engine.watchdog import StepWatchdog

log = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 30.0


@dataclass
class _Request:
    serial: int
    queue: asyncio.Queue
    text: RequestStream
    stop: list[str]
    finished: bool = False


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, core_in_thread: bool = False) -> None:
        config.validate()
        self.config = config
        self.core_in_thread = core_in_thread
        self.tokenizer = load_tokenizer(config.model)  # ValueError naming the directory if it does not load
        self.input_processor: InputProcessor | None = None
        self._requests: dict[str, _Request] = {}
        self._model_info: dict[str, object] = {}
        self._stats: dict[str, float] = {}
        self._core: multiprocessing.process.BaseProcess | threading.Thread | None = None
        self._to_core: Connection | None = None
        self._from_core: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: EngineDeadError | None = None
        self._dead: asyncio.Event | None = None  # set when the core fails: the serving process should exit
        self._watchdog: StepWatchdog | None = None
        # One thread: long prompts are tokenized off the event loop, one at a time (the tokenizer's Python
        # wrapper is not meant for concurrent calls; the loop thread only decodes with it).
        self._tokenize_pool: ThreadPoolExecutor | None = None  # made on the first long prompt
        self._watchdog_task: asyncio.Task | None = None

    # ---- lifecycle ----
    async def start(self) -> None:
        """Starts the core and waits until its model is loaded; raises ValueError (a bad model or setting) or
        RuntimeError if it cannot load."""
        if self._core is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._dead = asyncio.Event()
        from_core, core_out = multiprocessing.Pipe(duplex=False)
        core_in, to_core = multiprocessing.Pipe(duplex=False)
        if self.core_in_thread:
            self._core = threading.Thread(
                target=run_engine_core, args=(self.config, core_in, core_out), name="hintserve-engine-core",
                daemon=True,
            )
        else:
            ctx = multiprocessing.get_context("spawn")  # fork would copy this process's threads and locks
            self._core = ctx.Process(
                # The embedded predictor's factory goes along: a spawned process starts without it.
                target=engine_core_main, args=(self.config, core_in, core_out, embedded_predictor()),
                name="hintserve-engine-core",
                daemon=True,
            )
        self._core.start()
        if not self.core_in_thread:  # the child holds its own ends: EOF on ours means it exited
            core_in.close()
            core_out.close()
        self._to_core, self._from_core = to_core, from_core
        try:
            ready = await asyncio.to_thread(core_messages.recv_message, from_core)
        except EOFError:
            ready = core_messages.CoreDead("engine core process exited while loading the model", False)
        if not isinstance(ready, core_messages.CoreReady):
            await self._reap()
            user_error = isinstance(ready, core_messages.CoreDead) and ready.user_error
            message = ready.message if isinstance(ready, core_messages.CoreDead) else f"engine core sent {ready!r}"
            raise (ValueError if user_error else RuntimeError)(message)
        self._model_info, self._stats = ready.model_info, ready.stats
        self.input_processor = InputProcessor(self.tokenizer, ready.limits)
        self._loop.add_reader(from_core.fileno(), self._on_core_message)
        if self.config.step_watchdog_s:
            self._watchdog = StepWatchdog(self.config.step_watchdog_s, lambda: bool(self._requests), self._stalled)
            self._watchdog_task = self._loop.create_task(self._watchdog.run(), name="hintserve-step-watchdog")

    async def shutdown(self) -> None:
        """Stops the core in order (in-flight requests end with finish_reason "abort") and reaps it."""
        if self._core is None:
            return
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
            await asyncio.gather(self._watchdog_task, return_exceptions=True)
        self._stop_reading()
        if self._to_core is not None:
            try:
                core_messages.send(self._to_core, core_messages.StopCore())
            except (BrokenPipeError, OSError):
                pass
        for request_id, req in list(self._requests.items()):
            self._finish_locally(request_id, req, "abort")
        if self._tokenize_pool is not None:
            self._tokenize_pool.shutdown(wait=False)
            self._tokenize_pool = None
        await self._reap()

    async def _reap(self) -> None:
        core, self._core = self._core, None
        if core is not None:
            await asyncio.to_thread(core.join, _SHUTDOWN_GRACE_S)
            if isinstance(core, multiprocessing.process.BaseProcess) and core.is_alive():
                log.warning("engine core did not stop in %.0f s; terminating it", _SHUTDOWN_GRACE_S)
                core.terminate()
                await asyncio.to_thread(core.join, 5.0)
                if core.is_alive():
                    core.kill()
                    await asyncio.to_thread(core.join)
        for conn in (self._to_core, self._from_core):
            if conn is not None:
                conn.close()
        self._to_core = self._from_core = None

    @property
    def core_pid(self) -> int | None:
        """The engine core process's id (None: not started, or the core runs on a thread here)."""
        return getattr(self._core, "pid", None)

    @property
    def is_running(self) -> bool:
        return self._core is not None and self._from_core is not None and self._error is None

    async def wait_dead(self) -> BaseException:
        """Returns the core's failure once it has stopped for good (the serving process then exits)."""
        assert self._dead is not None, "engine not started"
        await self._dead.wait()
        assert self._error is not None
        return self._error

    # ---- requests ----
    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's deltas; closing the iterator early aborts the request."""
        if self._error is not None:
            raise self._error
        if self.input_processor is None or self._core is None:
            raise EngineDeadError("engine not started")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        make = self.input_processor.make_sequence
        if isinstance(prompt, str) and len(prompt) > INLINE_TOKENIZE_CHARS:
            if self._tokenize_pool is None:
                self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="hintserve-tokenize")
            seq = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, make, request_id, prompt, params)
            if self._error is not None:  # the core died meanwhile
                raise self._error
            if request_id in self._requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        else:
            seq = make(request_id, prompt, params)
        req = _Request(seq.serial, asyncio.Queue(), RequestStream(seq, self.tokenizer), list(params.stop))
        if self._watchdog is not None:
            self._watchdog.work_arrived(was_idle=not self._requests)
        self._requests[request_id] = req
        self._send(core_messages.AddRequest(request_id, seq.serial, seq.token_ids, params))
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason == "error":
                    raise RequestFailedError(item.error)
                yield item
                if item.finished:
                    return
        finally:
            if self._requests.get(request_id) is req:
                del self._requests[request_id]
            if not req.finished and self._error is None:
                self._send(core_messages.AbortRequest(request_id, req.serial, "abort"))

    def abort(self, request_id: str) -> bool:
        """Aborts an in-flight request; its stream ends with finish_reason "abort"."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return False
        self._send(core_messages.AbortRequest(request_id, req.serial, "abort"))
        return True

    def _send(self, msg: core_messages.CoreRequest) -> None:
        try:
            if self._to_core is None:
                raise BrokenPipeError("the pipe to the core is closed")
            core_messages.send(self._to_core, msg)
        except (BrokenPipeError, OSError) as exc:
            self._core_died(f"engine core is gone: {exc!r}")
            assert self._error is not None  # _core_died set it
            raise self._error from exc

    # ---- what the core sends ----
    def _on_core_message(self) -> None:
        conn = self._from_core
        if self._watchdog is not None:
            self._watchdog.progress()
        try:
            while conn is not None and conn.poll():
                msg = core_messages.recv_message(conn)
                if isinstance(msg, core_messages.CoreOutputs):
                    for out in msg.outputs:
                        self._on_output(out)
                    if msg.stats is not None:
                        self._stats = msg.stats
                elif isinstance(msg, core_messages.CoreStats):
                    self._stats = msg.stats
                elif isinstance(msg, core_messages.CoreDead):
                    self._core_died(msg.message)
                    return
        except (EOFError, OSError):
            self._core_died("engine core process exited")

    def _on_output(self, out: core_messages.CoreOutput) -> None:
        request_id, serial, token, reason = out.request_id, out.serial, out.token_id, out.finish_reason
        req = self._requests.get(request_id)
        if req is None or req.serial != serial or req.finished:
            return  # a stream already closed (or reused under the same id): nothing waits for this
        text = ""
        if token is not None and reason != "error":
            text, text_reason = text_delta(req.text, req.stop, token, reason)
            if text_reason != reason:  # a stop string the core cannot see: end the request there
                reason = text_reason
                self._send(core_messages.AbortRequest(request_id, serial, "stop"))
        req.finished = reason is not None
        tokens = [] if token is None else [token]
        req.queue.put_nowait(RequestOutput(
            request_id, text, tokens, out.prompt_tokens, out.completion_tokens, req.finished, reason, serial,
            error=out.error,
        ))

    def _finish_locally(self, request_id: str, req: _Request, reason: str) -> None:
        if not req.finished:
            req.finished = True
            req.queue.put_nowait(RequestOutput(request_id, "", [], 0, 0, True, reason, req.serial))

    def _stop_reading(self) -> None:
        if self._from_core is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._from_core.fileno())

    def _stalled(self, message: str) -> None:
        """The step watchdog fired: the core is stuck, so it is killed (SIGKILL reaches a stopped process
        too) and the engine fails as if the core had died."""
        core = self._core
        if isinstance(core, multiprocessing.process.BaseProcess) and core.is_alive():
            core.kill()
        self._core_died(message)

    def _core_died(self, message: str) -> None:
        if self._error is not None:
            return
        log.error("engine core failed: %s", message)
        self._error = EngineDeadError(message)
        self._stop_reading()
        for req in self._requests.values():
            req.finished = True
            req.queue.put_nowait(self._error)
        if self._dead is not None:
            self._dead.set()

    # ---- information ----
    def stats(self) -> dict[str, float]:
        """The core's counters as of its last report (sent with outputs, and whenever it goes idle)."""
        return dict(self._stats)

    def model_info(self) -> dict[str, object]:
        return dict(self._model_info)

    @property
    def has_chat_template(self) -> bool:
        return has_chat_template(self.tokenizer)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return apply_chat_template(self.tokenizer, messages)
