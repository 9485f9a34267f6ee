"""Predictor persistence between snapshots: a crashed predictor (no final snapshot, as with kill -9) learns
again, on restart, from the stream entries it had consumed after its last snapshot; none is observed twice."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np

from services.common.broker import Broker
from services.predictor.hub import PredictorHub
from services.predictor.service import PredictorService
from services.predictor.snapshots import Snapshotter
from tests.test_predictor_service import _stop, batch, broker, counting_factory, iteration, poll, unique

__all__ = ["broker"]  # the fixture (Redis and in-process)


async def test_restart_after_a_crash_replays_what_the_snapshot_missed(broker: Broker, tmp_path) -> None:
    stream, engine = unique("ctx"), uuid.uuid4().hex[:8]
    hub = PredictorHub(counting_factory, "counting")
    snapshotter = Snapshotter(str(tmp_path), hub)
    service = PredictorService(broker, hub, stream=stream, consumer="c1", group="g", snapshotter=snapshotter)
    consume = asyncio.create_task(service._consume_forever())  # no run(): no snapshot on the way out

    async def append(first: int, n: int) -> None:
        for i in range(first, first + n):
            await broker.stream_append(stream, batch(engine, [iteration(f"r{i}", 0)]).SerializeToString())

    await append(0, 3)
    await poll(lambda: service.stats().get("contexts_consumed_total") == 3, what="first three")
    await service.snapshot()  # the periodic snapshot
    await append(3, 4)
    await poll(lambda: service.stats().get("contexts_consumed_total") == 7, what="four more")
    service.stop()  # the crash: the consumer ends, nothing is saved after the snapshot
    await asyncio.wait_for(consume, 5)
    await append(7, 1)  # appended while the predictor is down

    hub2 = PredictorHub(counting_factory, "counting")
    snapshotter2 = Snapshotter(str(tmp_path), hub2)
    snapshotter2.restore_all()
    assert hub2.models["tiny"].predictor.observed == 3  # what the snapshot holds
    service2 = PredictorService(broker, hub2, stream=stream, consumer="c1", group="g", snapshotter=snapshotter2)
    task2 = asyncio.create_task(service2.run())
    try:
        await poll(lambda: hub2.models["tiny"].predictor.observed == 8, what="replay + the missed one")
        assert service2.stats()["contexts_replayed_batches_total"] == 4
        assert np.all(hub2.models["tiny"].predictor.counts[:, [1, 5]] == 8)  # none twice, none lost
    finally:
        await _stop(service2, task2)
    # The final snapshot records the replayed position: a third start replays nothing more.
    hub3 = PredictorHub(counting_factory, "counting")
    snapshotter3 = Snapshotter(str(tmp_path), hub3)
    snapshotter3.restore_all()
    service3 = PredictorService(broker, hub3, stream=stream, consumer="c1", group="g", snapshotter=snapshotter3)
    task3 = asyncio.create_task(service3.run())
    await asyncio.wait_for(service3.ready.wait(), 5)
    assert hub3.models["tiny"].predictor.observed == 8
    assert service3.stats().get("contexts_replayed_batches_total", 0) == 0
    await _stop(service3, task3)
