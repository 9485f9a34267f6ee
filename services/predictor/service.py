"""The predictor service loop: contexts from the Stream `hintserve:ctx` -> observe + predict -> hints on
`hintserve:hints:<engine_id>`, with its own Prometheus /metrics and periodic snapshots.

Reads through a consumer group: on start it first redoes what it had been given but never acknowledged
(a crash mid-batch), then takes new entries. Contexts older than `max_context_age_s` (a backlog after
downtime) are only observed: their hints would be stale at the engine. Broker outages are retried with
exponential backoff; state changes are logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

from google.protobuf.message import DecodeError

from services.common.broker import (
    CONTEXT_STREAM,
    PREDICTOR_GROUP,
    Broker,
    BrokerUnavailable,
    entry_key,
    hint_channel,
)
from services.common.messages import InvalidInput
from services.common.protos import predictor_pb2 as pb
from services.common.signing import Sealer
from services.predictor.hub import CapacityExceeded, PredictorHub
from services.predictor.metrics import ServiceMetrics
from services.predictor.snapshots import Snapshotter

log = logging.getLogger(__name__)
MAX_CONTEXTS_PER_BATCH = 4096  # an engine sends one context per running sequence: max_num_seqs, in the hundreds
REJECT_LOG_INTERVAL_S = 10.0  # a flood of bad messages is one log line per reason this often, with the count


class PredictorService:
    def __init__(
        self,
        broker: Broker,
        hub: PredictorHub,
        *,
        consumer: str = "predictor-1",
        group: str = PREDICTOR_GROUP,
        stream: str = CONTEXT_STREAM,
        max_context_age_s: float = 0.25,
        snapshotter: Snapshotter | None = None,
        snapshot_interval_s: float = 60.0,
        metrics: ServiceMetrics | None = None,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        read_count: int = 64,
        engines: set[str] | None = None,
        start: str = "0",
        sealer: Sealer | None = None,
    ) -> None:
        self.broker = broker
        self.hub = hub
        self.consumer = consumer
        self.group = group
        self.stream = stream
        self.max_context_age_s = max_context_age_s
        self.snapshotter = snapshotter
        self.snapshot_interval_s = snapshot_interval_s
        self.metrics = metrics or ServiceMetrics()
        self.backoff_s = backoff_s
        self.read_count = read_count
        self.engines = engines  # answer only these engines (None: all)
        # Where a new group starts: "0" also reads what engines appended before the predictor first
        # started (observed for learning; too old to answer); "$" only what comes next.
        self.start = start
        self.sealer = sealer or Sealer.from_env()  # HINTSERVE_BROKER_SECRET: only signed batches are read
        self.counters: Counter[str] = Counter()
        self._reject_logged: dict[str, tuple[float, int]] = {}  # reason -> (last log time, count then)
        self.connected = False
        self.ready = asyncio.Event()  # set once the consumer group exists (tests synchronise on it)
        self._stop = asyncio.Event()
        self.last_entry_id: str | None = None  # the newest stream entry the predictors have learned from
        self._replayed = False

    # ---- lifecycle ----
    async def run(self) -> None:
        """Until `stop()`: consume, and snapshot every `snapshot_interval_s`; a final snapshot on exit."""
        consume = asyncio.create_task(self._consume_forever(), name="predictor-consume")
        tasks = [consume]
        if self.snapshotter is not None and self.snapshot_interval_s > 0:
            tasks.append(asyncio.create_task(self._snapshot_periodically(), name="predictor-snapshots"))
        try:
            await self._stop.wait()
            # The consume loop sees the stop within one blocking read; cancelling a blocked redis-py read
            # instead can strand it (observed with redis-py 8), so cancelling is only the fallback.
            await asyncio.wait([consume], timeout=2.0)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.snapshotter is not None:
                try:
                    saved = self.snapshotter.save_all(self.last_entry_id)
                except OSError as exc:  # the service still stops cleanly; the last periodic snapshot stands
                    log.error("snapshot on shutdown failed, the previous snapshots are kept: %s", exc)
                    saved = []
                if saved:
                    log.info("snapshot on shutdown: %s", ", ".join(f"{n} ({b} B)" for n, b in saved))
                self.counters["snapshots_total"] += len(saved)

    def stop(self) -> None:
        self._stop.set()

    def _set_connected(self, up: bool, reason: str = "") -> None:
        if up != self.connected:  # log state changes once, not every retry
            if up:
                log.info("predictor connected to broker %s", self.broker.url)
            else:
                log.warning("predictor lost broker %s (%s); retrying with backoff", self.broker.url, reason)
        self.connected = up
        self.metrics.broker_connected.set(1.0 if up else 0.0)

    # ---- the stream ----
    async def _consume_forever(self) -> None:
        delay = self.backoff_s[0]
        while not self._stop.is_set():
            try:
                await self.broker.ensure_group(self.stream, self.group, start=self.start)
                self._set_connected(True)
                if not self._replayed:
                    await self._replay_since_snapshots()
                    self._replayed = True
                self.ready.set()
                await self._consume(pending=True)  # what a previous run of this consumer left unacknowledged
                delay = self.backoff_s[0]
                while not self._stop.is_set():
                    await self._consume(pending=False)
            except BrokerUnavailable as exc:
                self._set_connected(False, str(exc))
                self.counters["broker_errors_total"] += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                delay = min(delay * 2, self.backoff_s[1])

    async def _consume(self, pending: bool) -> None:
        while True:
            entries = await self.broker.stream_read_group(
                self.stream, self.group, self.consumer, count=self.read_count, block_ms=200, pending=pending
            )
            if not entries:
                return
            decoded = [(entry_id, self._decode(data)) for entry_id, data in entries]
            kept = [(entry_id, b) for entry_id, b in decoded if b is not None]
            batches = [b for _, b in kept]
            for (entry_id, batch), superseded in zip(kept, _superseded(batches)):
                await self._process(batch, superseded, entry_id)
            # Acknowledge after the hints went out: the ack is off the latency path, and a crash before it
            # means the entries are redone (observed twice at worst), never lost.
            await self.broker.stream_ack(self.stream, self.group, [entry_id for entry_id, _ in entries])
            self._advance(max((entry_id for entry_id, _ in entries), key=entry_key))
            if not pending or self._stop.is_set():
                return

    def _decode(self, data: bytes) -> pb.ContextBatch | None:
        payload, why = self.sealer.open(data)
        if payload is None:
            self._reject(why, f"a context batch failed the signature check ({why})")
            return None
        try:
            batch = pb.ContextBatch.FromString(payload)
        except DecodeError:
            self._reject("undecodable", "a context batch is not a ContextBatch message")
            return None
        if len(batch.contexts) > MAX_CONTEXTS_PER_BATCH:
            self._reject("invalid", f"a context batch holds {len(batch.contexts)} contexts (> {MAX_CONTEXTS_PER_BATCH})")
            return None
        if self.engines is not None and batch.engine_id not in self.engines:
            self.counters["batches_skipped_total"] += 1
            return None
        return batch

    async def _process(
        self, batch: pb.ContextBatch, superseded: frozenset[str] = frozenset(), entry_id: str | None = None
    ) -> None:
        age = time.time() - batch.sent_unix_ns / 1e9
        fresh = age <= self.max_context_age_s
        start = time.perf_counter()
        try:
            hints = self.hub.handle(batch, predict=fresh, superseded=superseded)
            if entry_id is not None:  # before any await: a snapshot taken from now on includes this entry
                self._advance(entry_id)
        except (InvalidInput, CapacityExceeded) as exc:
            self._reject("invalid" if isinstance(exc, InvalidInput) else "capacity",
                         f"context batch from {batch.engine_id[:64]!r}: {exc}")
            return
        except Exception as exc:  # a predictor bug (or memory) must not stop the loop; engines prefetch locally
            self._reject("error", f"predictor failed on a context batch from {batch.engine_id[:64]!r}: {exc!r}")
            return
        self.metrics.search_seconds.labels("stream").observe(time.perf_counter() - start)
        self.metrics.contexts_consumed.inc(len(batch.contexts))
        self.metrics.models.set(len(self.hub.models))
        self.counters["contexts_consumed_total"] += len(batch.contexts)
        self.counters["batches_consumed_total"] += 1
        self.counters["contexts_superseded_total"] += len(superseded)
        if not fresh:
            self.counters["contexts_too_old_total"] += len(batch.contexts)
            return
        if not hints or not batch.engine_id:
            return
        out = pb.HintBatch(
            engine_id=batch.engine_id, ctx_sent_unix_ns=batch.sent_unix_ns, sent_unix_ns=time.time_ns(),
            step=batch.step, hints=hints,
        )
        await self.broker.publish(hint_channel(batch.engine_id), self.sealer.seal(out.SerializeToString()))
        self.metrics.hints_published.inc(len(hints))
        self.counters["hints_published_total"] += len(hints)
        self.counters["hint_batches_published_total"] += 1

    def _reject(self, reason: str, detail: str) -> None:
        """Counted, and one log line per reason every REJECT_LOG_INTERVAL_S (a flood is not a log flood)."""
        self.metrics.contexts_rejected.labels(reason).inc()
        key = f'contexts_rejected_total{{reason="{reason}"}}'
        self.counters[key] += 1
        now, total = time.monotonic(), self.counters[key]
        last, logged = self._reject_logged.get(reason, (-REJECT_LOG_INTERVAL_S, 0))
        if now - last >= REJECT_LOG_INTERVAL_S:
            more = f" (+{total - logged - 1} more since the last line)" if total - logged > 1 else ""
            log.warning("dropped: %s%s", detail[:300], more)
            self._reject_logged[reason] = (now, total)

    def _advance(self, entry_id: str) -> None:
        if self.last_entry_id is None or entry_key(entry_id) > entry_key(self.last_entry_id):
            self.last_entry_id = entry_id

    async def _replay_since_snapshots(self) -> None:
        """Learns again from what the last run had learned after its snapshots (a kill -9 skips the final
        one): the entries after each model's snapshot id that the group already handed out and that are
        not pending (the pending pass redoes those). Observe-only: their hints would be long stale."""
        if self.snapshotter is None or not self.snapshotter.stream_ids:
            return
        since = self.snapshotter.stream_ids
        until = await self.broker.group_last_delivered(self.stream, self.group)
        if until is None:
            return
        pending = await self.broker.stream_read_group(
            self.stream, self.group, self.consumer, count=1 << 20, block_ms=None, pending=True
        )
        skip = {entry_id for entry_id, _ in pending}
        cursor = min(since.values(), key=entry_key)
        replayed = 0
        while entry_key(cursor) < entry_key(until):
            entries = await self.broker.stream_range(self.stream, cursor, count=self.read_count)
            if not entries:
                break
            for entry_id, data in entries:
                if entry_key(entry_id) > entry_key(until):
                    break
                batch = None if entry_id in skip else self._decode(data)
                snapshot_id = since.get(batch.shape.model, "0-0") if batch is not None else None
                if batch is not None and entry_key(entry_id) > entry_key(snapshot_id or "0-0"):
                    await self._process(batch, entry_id=entry_id)  # old: observed, not predicted for
                    replayed += 1
                self._advance(entry_id)
            cursor = entries[-1][0]
        self.counters["contexts_replayed_batches_total"] += replayed
        if replayed:
            log.info("replayed %d context batch(es) learned after the last snapshots", replayed)

    # ---- snapshots ----
    async def snapshot(self, models: list[str] | None = None) -> list[tuple[str, int]]:
        """Encodes on the loop (a consistent state), writes on a thread (the loop keeps serving)."""
        assert self.snapshotter is not None
        out = []
        for model in models if models is not None else list(self.hub.models):
            name, data = self.snapshotter.encode(model, self.last_entry_id)
            await asyncio.to_thread(self.snapshotter.write, name, data)
            out.append((name, len(data)))
        self.counters["snapshots_total"] += len(out)
        return out

    async def _snapshot_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            try:
                await self.snapshot()
            except OSError as exc:  # a full disk must not stop predictions
                log.warning("periodic snapshot failed: %s", exc)

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.hub.counters.items()}
        out.update({k: float(v) for k, v in self.counters.items()})
        out["broker_connected"] = 1.0 if self.connected else 0.0
        out["models"] = float(len(self.hub.models))
        return out


def _superseded(batches: list[pb.ContextBatch]) -> list[frozenset[str]]:
    """Per batch, the requests with a newer context later in the same read: under a backlog only the
    newest context of a request is worth predicting for (load shedding); the older ones are observed."""
    last: dict[tuple[str, str], int] = {}
    for i, batch in enumerate(batches):
        for c in batch.contexts:
            last[(batch.engine_id, c.request_id)] = i
    return [
        frozenset(c.request_id for c in b.contexts if last[(b.engine_id, c.request_id)] > i)
        for i, b in enumerate(batches)
    ]
