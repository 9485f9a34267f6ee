"""The predictor service without an engine: brokers (real Redis and in-process), the stream loop, snapshots.

Every test uses its own stream / group / engine id, so concurrent runs on the shared Redis do not interact.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

from services.common.broker import Broker, hint_channel, make_broker
from services.common.iteration_context import IterationContext, PredictionQuery
from services.common.messages import Shape, from_context, select_experts
from services.common.protos import predictor_pb2 as pb
from services.predictor.hub import PredictorHub
from services.predictor.predictors.base import Predictor
from services.predictor.service import PredictorService
from services.predictor.snapshots import Snapshotter, dumps, loads

REDIS_URL = "redis://127.0.0.1:6379"
SHAPE = Shape("tiny", num_layers=3, num_experts=8, top_k=2, hidden_size=4)


class CountingPredictor(Predictor):
    """The tiny predictor of these tests: per layer, how often each expert was routed to."""

    name = "counting"

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        super().__init__(num_layers, num_experts, top_k)
        self.counts = np.zeros((num_layers, num_experts), np.float32)
        self.observed = 0

    def observe(self, iteration: IterationContext) -> None:
        self.counts += iteration.counts
        self.observed += 1

    def predict(self, query: PredictionQuery) -> np.ndarray:
        return self.counts[query.target_layer] + 1e-3

    def snapshot(self) -> dict[str, Any]:
        return {"counts": self.counts.copy(), "observed": self.observed, "meta": {(1, 2): ("a", None)}}

    def restore(self, state: dict[str, Any]) -> None:
        self.counts, self.observed = state["counts"], state["observed"]


def counting_factory(shape: Shape) -> Predictor:
    return CountingPredictor(shape.num_layers, shape.num_experts, shape.top_k)


def iteration(rid: str, it: int, hot: tuple[int, int] = (1, 5), layers_seen: int = 3) -> IterationContext:
    counts = np.zeros((3, 8), np.float32)
    counts[:, list(hot)] = 1.0
    probs = counts / counts.sum(axis=1, keepdims=True)
    return IterationContext(rid, it, probs, counts, np.full(4, it, np.float32), layers_seen)


def batch(engine_id: str, contexts: list[IterationContext], shape: Shape = SHAPE) -> pb.ContextBatch:
    return pb.ContextBatch(
        engine_id=engine_id, shape=shape.to_pb(), sent_unix_ns=time.time_ns(),
        contexts=[from_context(c) for c in contexts],
    )


async def poll(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Synchronise on observable state: poll with a deadline, never sleep a fixed time."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


async def open_broker(url: str | None) -> Broker:
    """A broker that answers, or the test skipped (no Redis on 127.0.0.1:6379)."""
    b = make_broker(url)
    try:
        await b.ping()
    except ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    return b


@pytest.fixture(params=["redis", "inprocess"])
async def broker(request) -> AsyncIterator[Broker]:
    b = await open_broker(REDIS_URL if request.param == "redis" else None)
    yield b
    await b.close()


def unique(prefix: str) -> str:
    return f"test:{prefix}:{uuid.uuid4().hex[:10]}"


# ---- brokers ----
async def test_pubsub_delivers_in_order_and_times_out(broker: Broker) -> None:
    channel = unique("chan")
    sub = await broker.subscribe(channel)
    assert await sub.get(timeout=0.01) is None
    for i in range(3):
        assert await broker.publish(channel, f"m{i}".encode()) == 1
    assert [await sub.get(timeout=1.0) for _ in range(3)] == [b"m0", b"m1", b"m2"]
    await sub.close()


async def test_stream_is_bounded_by_maxlen(broker: Broker) -> None:
    stream = unique("stream")
    for i in range(600):
        await broker.stream_append(stream, str(i).encode(), maxlen=100)
    # Redis trims approximately (whole 100-entry nodes), the in-process broker exactly.
    assert 100 <= await broker.stream_len(stream) <= 200


async def test_consumer_group_resumes_after_a_restart(broker: Broker) -> None:
    stream, group = unique("stream"), "g"
    await broker.ensure_group(stream, group, start="$")
    ids = [await broker.stream_append(stream, f"e{i}".encode()) for i in range(5)]
    first = await broker.stream_read_group(stream, group, "c1", count=3, block_ms=100)
    assert [d for _, d in first] == [b"e0", b"e1", b"e2"]
    await broker.stream_ack(stream, group, ids[:2])  # e2 delivered but not acknowledged: a crash mid-batch
    # A restarted consumer (same name) first redoes its unacknowledged entries, then continues.
    pending = await broker.stream_read_group(stream, group, "c1", pending=True)
    assert [d for _, d in pending] == [b"e2"]
    new = await broker.stream_read_group(stream, group, "c1", count=10, block_ms=100)
    assert [d for _, d in new] == [b"e3", b"e4"]
    assert await broker.stream_read_group(stream, group, "c1", count=10, block_ms=10) == []


# ---- the stream loop ----
async def _run_service(broker: Broker, stream: str, **kw) -> tuple[PredictorService, asyncio.Task]:
    hub = PredictorHub(counting_factory, "counting")
    service = PredictorService(broker, hub, stream=stream, consumer="c1", group="g", backoff_s=(0.01, 0.05), **kw)
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 5)
    return service, task


async def _stop(service: PredictorService, task: asyncio.Task) -> None:
    service.stop()
    await asyncio.wait_for(task, 5)


async def test_contexts_in_protobuf_hints_out(broker: Broker) -> None:
    stream, engine = unique("ctx"), uuid.uuid4().hex[:8]
    service, task = await _run_service(broker, stream)
    sub = await broker.subscribe(hint_channel(engine))
    try:
        await broker.stream_append(stream, batch(engine, [iteration("r1", 0)]).SerializeToString())
        raw = await sub.get(timeout=5.0)
        hints = pb.HintBatch.FromString(raw)  # a protobuf message on the wire
        assert hints.engine_id == engine and hints.ctx_sent_unix_ns > 0
        # A finished iteration 0 is answered with hints for iteration 1, every layer, learned experts first.
        assert [(h.request_id, h.iteration, h.layer) for h in hints.hints] == [("r1", 1, 0), ("r1", 1, 1), ("r1", 1, 2)]
        assert all(sorted(h.experts[:2]) == [1, 5] for h in hints.hints)
        # A partial context (one layer routed) is answered for its own remaining layers.
        await broker.stream_append(stream, batch(engine, [iteration("r1", 1, layers_seen=1)]).SerializeToString())
        hints = pb.HintBatch.FromString(await sub.get(timeout=5.0))
        assert [(h.iteration, h.layer) for h in hints.hints] == [(1, 1), (1, 2)]
        # Garbage and wrong shapes are counted and skipped; the loop keeps going.
        await broker.stream_append(stream, b"\xff\xff not protobuf")
        bad = batch(engine, [iteration("r2", 0)], Shape("tiny", 3, 6, 2, 4))
        await broker.stream_append(stream, bad.SerializeToString())
        await broker.stream_append(stream, batch(engine, [iteration("r3", 0)]).SerializeToString())
        assert pb.HintBatch.FromString(await sub.get(timeout=5.0)).hints[0].request_id == "r3"
        stats = service.stats()
        assert stats['contexts_rejected_total{reason="undecodable"}'] == 1
        assert stats['contexts_rejected_total{reason="invalid"}'] == 1
        assert stats["contexts_consumed_total"] == 3
        metrics = service.metrics.registry
        assert metrics.get_sample_value("hintserve_predictor_broker_connected") == 1.0
        assert metrics.get_sample_value("hintserve_predictor_contexts_consumed_total") == 3
        assert metrics.get_sample_value("hintserve_predictor_hints_published_total") == 3 + 2 + 3
        assert metrics.get_sample_value("hintserve_predictor_search_seconds_count", {"source": "stream"}) == 3
    finally:
        await sub.close()
        await _stop(service, task)


async def test_old_contexts_are_observed_but_not_answered(broker: Broker) -> None:
    stream, engine = unique("ctx"), uuid.uuid4().hex[:8]
    service, task = await _run_service(broker, stream, max_context_age_s=0.5)
    try:
        old = batch(engine, [iteration("r1", 0)])
        old.sent_unix_ns -= 10**10  # 10 s ago: a backlog after downtime
        await broker.stream_append(stream, old.SerializeToString())
        await poll(lambda: service.stats().get("contexts_consumed_total") == 1, what="consumption")
        assert service.stats()["contexts_too_old_total"] == 1
        assert service.stats().get("hints_published_total", 0) == 0
        assert service.hub.models["tiny"].predictor.observed == 1
    finally:
        await _stop(service, task)


async def test_restarted_service_resumes_from_its_group_and_snapshot(broker: Broker, tmp_path) -> None:
    stream, engine = unique("ctx"), uuid.uuid4().hex[:8]
    service, task = await _run_service(broker, stream, snapshotter=None)
    service.snapshotter = Snapshotter(str(tmp_path), service.hub)
    for i in range(3):
        await broker.stream_append(stream, batch(engine, [iteration(f"r{i}", 0)]).SerializeToString())
    await poll(lambda: service.stats().get("contexts_consumed_total") == 3, what="first three")
    await _stop(service, task)  # stop = final snapshot
    assert (tmp_path / "tiny.snapshot.npz").is_file()
    for i in range(3, 5):  # appended while the predictor is down
        await broker.stream_append(stream, batch(engine, [iteration(f"r{i}", 0)]).SerializeToString())
    hub = PredictorHub(counting_factory, "counting")
    restored = Snapshotter(str(tmp_path), hub).restore_all()
    assert [s.model for s in restored] == ["tiny"] and hub.models["tiny"].predictor.observed == 3
    service2 = PredictorService(broker, hub, stream=stream, consumer="c1", group="g")
    task2 = asyncio.create_task(service2.run())
    try:
        await poll(lambda: service2.stats().get("contexts_consumed_total") == 2, what="the two missed")
        assert hub.models["tiny"].predictor.observed == 5  # 3 restored + 2 resumed, none twice
        assert np.all(hub.models["tiny"].predictor.counts[:, [1, 5]] == 5)
    finally:
        await _stop(service2, task2)


async def test_periodic_snapshots_and_metrics_endpoint(tmp_path) -> None:
    import urllib.request

    stream, engine = unique("ctx"), uuid.uuid4().hex[:8]
    broker = make_broker(None)
    hub = PredictorHub(counting_factory, "counting")
    service = PredictorService(
        broker, hub, stream=stream, snapshotter=Snapshotter(str(tmp_path), hub), snapshot_interval_s=0.05
    )
    port = service.metrics.serve(0)
    task = asyncio.create_task(service.run())
    try:
        await broker.stream_append(stream, batch(engine, [iteration("r1", 0)]).SerializeToString())
        await poll(lambda: (tmp_path / "tiny.snapshot.npz").is_file(), what="a periodic snapshot")
        url = f"http://127.0.0.1:{port}/metrics"
        body = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode()
        assert "hintserve_predictor_broker_connected 1.0" in body
        assert "hintserve_predictor_contexts_consumed_total 1.0" in body
        assert 'hintserve_predictor_search_seconds_bucket{le="0.001",source="stream"}' in body
    finally:
        await _stop(service, task)
        service.metrics.close()


# ---- units ----
def test_snapshot_encoding_round_trips_without_pickle() -> None:
    state = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "n": 3, "t": (1, "x"), "m": {(1, 2): [None, 2.5]}}
    meta, back = loads(dumps({"k": "v"}, state))
    assert meta == {"k": "v"} and back["n"] == 3 and back["t"] == (1, "x") and back["m"] == {(1, 2): [None, 2.5]}
    np.testing.assert_array_equal(back["a"], state["a"])
    with pytest.raises(TypeError):
        dumps({}, {"bad": object()})


def test_select_experts_takes_the_fewest_covering_the_mass() -> None:
    scores = np.array([[0.05, 0.6, 0.05, 0.3], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    experts, probs, conf = select_experts(scores, top_k=1, mass=0.85, max_experts=3)
    assert experts[0] == [1, 3] and np.isclose(sum(probs[0]), 0.9) and np.isclose(conf[0], 0.6)
    assert len(experts[1]) == 3 and len(experts[2]) == 3  # capped; all-zero scores count as uniform
