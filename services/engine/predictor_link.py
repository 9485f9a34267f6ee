"""The engine's link to the predictor service: iteration contexts out, prefetch hints in.

The decode loop only enqueues: a step's StepContext (finished, at step end) or a few layers into it
(partial, from HintPrefetcher.plan) goes into a bounded queue; when the queue is full or the broker is
down the context is dropped and counted. A background thread with its own event loop turns contexts into
protobuf (per request: router probabilities and routed-token counts per layer, mean input embedding),
appends them to the Stream `hintserve:ctx`, and feeds hints from `hintserve:hints:<engine_id>` into the
HintPrefetcher. If the broker goes away the engine keeps serving with its local prefetchers; the link
reconnects with exponential backoff and logs each state change once.

Without --redis-url the link runs the predictor service itself (the factory the command line installed,
embedded_predictor.py), on an in-process broker in its thread.
`start_predictor_link` wires one up: it watches the model runner's steps (ModelRunner.step_observers and
layer_observers, the one observer mechanism) and feeds the offload policy's HintPrefetcher.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from google.protobuf.message import DecodeError

from services.common.broker import (
    CONTEXT_STREAM,
    DEFAULT_STREAM_MAXLEN,
    Broker,
    BrokerUnavailable,
    check_broker_url,
    hint_channel,
    make_broker,
)
from services.common.messages import Shape
from services.common.protos import predictor_pb2 as pb
from services.common.signing import Sealer
from services.engine.embedded_predictor import EmbeddedPredictorFactory, EmbeddedService, embedded_predictor
from services.engine.models.geometry import ExpertGeometry
from services.engine.offload.prefetch.hints import HintPrefetcher, HintStats
from services.engine.offload.settings import PredictorSettings
from services.engine.step_context import StepContext
from services.engine.step_records import encode_step

log = logging.getLogger(__name__)
_ids = itertools.count()
_LATENCY_WINDOW = 2048  # recent hint batches behind the latency quantiles


def default_engine_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{next(_ids)}"


class PredictorLink:
    def __init__(
        self,
        broker_factory: Callable[[], Broker],
        engine_id: str,
        shape: Shape,
        hints: HintPrefetcher,
        *,
        predictor: str = "",
        embedded: Callable[[Broker], EmbeddedService] | None = None,  # the service to run in our thread
        partial_layers: tuple[int, ...] = (0,),
        queue_size: int = 64,
        stream: str = CONTEXT_STREAM,
        stream_maxlen: int = DEFAULT_STREAM_MAXLEN,
        backoff_s: tuple[float, float] = (0.05, 2.0),
    ) -> None:
        self.broker_factory = broker_factory
        self.engine_id = engine_id
        self.shape = shape
        # Weak: if the engine is dropped without close(), the link notices and stops its thread.
        self._hints = weakref.ref(hints)
        self.predictor = predictor
        self.embedded = embedded
        self.partial_layers = set(partial_layers)
        self.queue_size = queue_size
        self.stream = stream
        self.stream_maxlen = stream_maxlen
        self.backoff_s = backoff_s
        self._sealer = Sealer.from_env()  # HINTSERVE_BROKER_SECRET: sign contexts, accept only signed hints
        self.connected = False
        self.service: EmbeddedService | None = None  # the embedded predictor service, once running
        self.counts = {"published": 0, "dropped": 0, "hint_batches": 0, "sessions": 0, "invalid": 0}  # link thread
        self.dropped_in_loop = 0  # written by the decode loop only (no lost updates across threads)
        self._queue: deque[tuple[int, StepContext, int]] = deque()
        self._latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self._lat_lock = threading.Lock()
        self._last_hint = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()  # bound to the link thread's loop on first use there
        self._stop = asyncio.Event()
        self._closing = False
        self._ending = False  # the current connected session is winding down
        self._thread = threading.Thread(target=self._thread_main, name=f"predictor-link-{engine_id}", daemon=True)

    def attach(self, runner) -> PredictorLink:
        """Watches `runner`'s steps (anything with ModelRunner's step_observers and layer_observers)."""
        runner.step_observers.append(self.observe)
        for layer in sorted(self.partial_layers):
            runner.layer_observers.setdefault(layer, []).append(self.observe_layer)
        return self

    # ---- the decode loop's side: enqueue only ----
    def observe(self, ctx: StepContext) -> None:
        """Step observer: the step's finished iterations."""
        self._enqueue(ctx, self.shape.num_layers)

    def observe_layer(self, layer: int, ctx: StepContext) -> None:
        """After `layer`'s router: a partial context. Decode steps only, as the hint policies prefetch in
        decode only (prefill touches nearly every expert)."""
        if layer in self.partial_layers and not ctx.is_prefill:
            self._enqueue(ctx, layer + 1)

    def _enqueue(self, ctx: StepContext, layers_seen: int) -> None:
        loop = self._loop
        if not self.connected or loop is None or len(self._queue) >= self.queue_size:
            self.dropped_in_loop += len(ctx.request_ids)
            return
        self._queue.append((time.time_ns(), ctx, layers_seen))
        try:
            loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop closed under us (shutdown)
            pass

    # ---- lifecycle ----
    def start(self) -> PredictorLink:
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _thread_main(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._closing:
            return
        broker = self.broker_factory()
        service_task = None
        if self.embedded is not None:
            self.service = service = self.embedded(broker)
            service_task = asyncio.create_task(service.run())
        delay = self.backoff_s[0]
        try:
            while not self._stop.is_set():
                try:
                    await self._connected_session(broker)
                    delay = self.backoff_s[0]
                except BrokerUnavailable as exc:
                    self._set_connected(False, str(exc))
                except Exception as exc:  # a bug must not kill the link: log it, reconnect
                    log.exception("predictor link failed")
                    self._set_connected(False, repr(exc))
                if self._stop.is_set():
                    break
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, self.backoff_s[1])
        finally:
            self._set_connected(False, "closed", quiet=True)
            if service_task is not None and self.service is not None:
                self.service.stop()
                await asyncio.gather(service_task, return_exceptions=True)
            await broker.close()

    async def _connected_session(self, broker: Broker) -> None:
        await broker.ping()
        sub = await broker.subscribe(hint_channel(self.engine_id))
        try:
            self.counts["sessions"] += 1
            self._set_connected(True)
            self._ending = False
            loops = [asyncio.create_task(self._publish_loop(broker)), asyncio.create_task(self._receive_loop(sub))]
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([*loops, stop], return_when=asyncio.FIRST_COMPLETED)
            # Both loops notice `_ending` within one short read; cancelling a blocked redis-py read instead
            # can strand it, so cancelling is only the fallback.
            self._ending = True
            self._wake.set()
            await asyncio.wait(loops, timeout=2.0)
            for task in [*loops, stop]:
                task.cancel()
            await asyncio.gather(*loops, stop, return_exceptions=True)
            for task in loops:
                failure = None if task.cancelled() else task.exception()
                if failure is not None:
                    raise failure
        finally:
            await sub.close()

    def _set_connected(self, up: bool, reason: str = "", quiet: bool = False) -> None:
        if up != self.connected and not quiet:  # each state change logged once, not every retry
            if up:
                log.info("predictor link %s connected to %s", self.engine_id, self.predictor_url)
            else:
                log.warning(
                    "predictor link %s lost %s (%s): serving with local prefetchers, reconnecting",
                    self.engine_id, self.predictor_url, reason,
                )
        self.connected = up
        if not up:  # contexts queued for a dead broker would be stale by the time it returns
            self.counts["dropped"] += sum(len(ctx.request_ids) for _, ctx, _ in self._queue)
            self._queue.clear()

    @property
    def predictor_url(self) -> str:
        return "the embedded predictor" if self.embedded is not None else "the broker"

    # ---- the link thread's side ----
    async def _publish_loop(self, broker: Broker) -> None:
        while not self._ending:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and not self._ending:
                sent_ns, ctx, layers_seen = self._queue[0]
                batch = pb.ContextBatch(
                    engine_id=self.engine_id, shape=self.shape.to_pb(), sent_unix_ns=sent_ns,
                    step=ctx.step_index, contexts=encode_step(ctx, layers_seen, self.shape), predictor=self.predictor,
                )
                await broker.stream_append(self.stream, self._sealer.seal(batch.SerializeToString()), self.stream_maxlen)
                self._queue.popleft()  # only once sent: a failure counts it as dropped
                self.counts["published"] += len(ctx.request_ids)

    async def _receive_loop(self, sub) -> None:
        while not self._ending:
            data = await sub.get(timeout=0.25)
            hints = self._hints()
            if hints is None:  # the engine is gone
                self._stop.set()
                return
            if data is None:
                continue
            payload, _ = self._sealer.open(data)  # HINTSERVE_BROKER_SECRET set: unsigned hints are dropped
            try:
                batch = pb.HintBatch.FromString(payload) if payload is not None else None
            except DecodeError:
                batch = None
            if batch is None:
                self.counts["invalid"] += 1
                continue
            with self._lat_lock:
                self._latencies.append((time.time_ns() - batch.ctx_sent_unix_ns) / 1e6)
            self.counts["hint_batches"] += 1
            self._last_hint = time.monotonic()
            hints.submit(batch.hints)

    # ---- stats ----
    def latencies_ms(self) -> list[float]:
        with self._lat_lock:
            return list(self._latencies)

    def engine_stats(self) -> dict[str, float]:
        lat = sorted(self.latencies_ms())
        out = {
            "predictor_link_connected": 1.0 if self.connected else 0.0,
            "predictor_contexts_published_total": float(self.counts["published"]),
            "predictor_contexts_dropped_total": float(self.counts["dropped"] + self.dropped_in_loop),
            "predictor_hint_batches_received_total": float(self.counts["hint_batches"]),
            "predictor_hint_batches_invalid_total": float(self.counts["invalid"]),  # undecodable or unsigned
            "predictor_link_reconnects_total": float(max(0, self.counts["sessions"] - 1)),
            "predictor_hint_age_seconds": time.monotonic() - self._last_hint if self._last_hint else -1.0,
        }
        for q in (0.5, 0.99):
            value = lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0
            out[f'predictor_hint_latency_ms{{quantile="{q}"}}'] = value
        return out


def start_predictor_link(
    runner, hints: HintPrefetcher, predictor: PredictorSettings, spec: ExpertGeometry
) -> PredictorLink | None:
    """Feeds `hints` from the predictor and publishes `runner`'s step contexts to it: over Redis when
    `predictor.redis_url` is set, else from an embedded service on an in-process broker. Contexts go out
    after the first MoE layer (its routing sharpens the far-layer guesses) and at the end of every step.
    Returns the started link, or None when no predictor can run here."""
    shape = Shape(predictor.model_name, spec.num_layers, spec.num_experts, spec.top_k, spec.hidden_size)
    first_moe = spec.moe_layers.index(True)
    link = make_predictor_link(hints, shape, predictor.name, predictor.redis_url, predictor.engine_id, (first_moe,))
    return None if link is None else link.attach(runner).start()


def make_predictor_link(
    hints: HintPrefetcher, shape: Shape, predictor: str, redis_url: str | None, engine_id: str | None,
    partial_layers: tuple[int, ...] = (0,), embedded_factory: EmbeddedPredictorFactory | None = None,
) -> PredictorLink | None:
    """A link (not started, not attached) over Redis when `redis_url` is set, else to an embedded service
    (`embedded_factory`, by default the one installed) on an in-process broker; None when there is no
    embedded predictor or it cannot be built here."""
    engine_id = engine_id or default_engine_id()
    embedded = None
    if redis_url:
        check_broker_url(redis_url)  # a bad URL fails at start-up, not in the link thread

        def factory() -> Broker:
            return make_broker(redis_url)
    else:
        from services.common.inprocess_broker import InProcessBroker

        make_embedded = embedded_factory or embedded_predictor()
        if make_embedded is None:
            log.warning("no embedded predictor installed: serving with local prefetchers only")
            return None
        try:
            embedded = make_embedded(predictor, engine_id)
        except (ValueError, ImportError) as exc:
            log.warning("no embedded predictor (%s): serving with local prefetchers only", exc)
            return None
        shared = InProcessBroker()

        def factory() -> Broker:
            return shared

    link = PredictorLink(
        factory, engine_id, shape, hints, predictor=predictor, embedded=embedded, partial_layers=partial_layers
    )
    if isinstance(hints.stats, HintStats):
        hints.stats.sources.append(link.engine_stats)
    hints.add_closer(link.close)
    return link
