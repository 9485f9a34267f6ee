"""The predictor's gRPC API (status codes on bad input) and the standalone service (SIGTERM snapshot)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis.asyncio as redis

from services.common.broker import hint_channel, make_broker
from services.common.inprocess_broker import InProcessBroker
from services.common.messages import Shape, from_context
from services.common.protos import predictor_pb2 as pb
from services.common.protos import predictor_pb2_grpc as pb_grpc
from services.predictor.hub import PredictorHub
from services.predictor.server import serve_predictor
from services.predictor.service import PredictorService
from services.predictor.snapshots import Snapshotter, loads
from tests.test_predictor_service import (
    REDIS_URL,
    SHAPE,
    CountingPredictor,
    batch,
    counting_factory,
    iteration,
)

REPO = Path(__file__).resolve().parents[1]


class SlowPredictor(CountingPredictor):
    def predict(self, query):
        time.sleep(0.3)
        return super().predict(query)


@pytest.fixture
async def api(tmp_path) -> AsyncIterator[tuple[pb_grpc.PredictorStub, PredictorService]]:
    hub = PredictorHub(counting_factory, "counting", max_models=2)
    service = PredictorService(InProcessBroker(), hub, snapshotter=Snapshotter(str(tmp_path), hub))
    server, port = await serve_predictor(service, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.PredictorStub(channel), service
    await server.stop(grace=0.5)


async def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code()


def _search(ctx=None, shape: Shape = SHAPE, **kw) -> pb.SearchRequest:
    return pb.SearchRequest(shape=shape.to_pb(), context=from_context(ctx or iteration("q", 1, layers_seen=1)), **kw)


async def test_search_observe_stats_health(api) -> None:
    stub, service = api
    assert await _code(stub.Search(_search(), timeout=5)) == grpc.StatusCode.NOT_FOUND  # model never seen
    reply = await stub.Observe(iter([batch("e", [iteration("r1", 0), iteration("r2", 0)])]), timeout=5)
    assert (reply.batches, reply.contexts) == (1, 2)
    found = await stub.Search(_search(target_layers=[2]), timeout=5)
    assert [(h.request_id, h.layer) for h in found.hints] == [("q", 2)] and sorted(found.hints[0].experts[:2]) == [1, 5]
    assert found.latency_us > 0
    everything = await stub.Search(_search(), timeout=5)  # no targets: every layer from layers_seen on
    assert [h.layer for h in everything.hints] == [1, 2]
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.counters["searches_total"] == 2 and [m.model for m in stats.models] == ["tiny"]
    health = await stub.Health(pb.HealthRequest(), timeout=5)
    assert health.status == pb.HealthResponse.SERVING


async def test_bad_input_gets_clear_status_codes(api) -> None:
    stub, _ = api
    await stub.Observe(iter([batch("e", [iteration("r1", 0)])]), timeout=5)
    wrong_probs = from_context(iteration("q", 1))
    wrong_probs.probs = wrong_probs.probs[:-12]  # three floats short
    request = pb.SearchRequest(shape=SHAPE.to_pb(), context=wrong_probs)
    assert await _code(stub.Search(request, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    other_shape = Shape("tiny", 3, 6, 2, 4)  # the known model with another expert count
    assert await _code(stub.Search(_search(shape=other_shape), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    assert await _code(stub.Search(_search(target_layers=[7]), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    assert await _code(stub.Search(pb.SearchRequest(), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    bad_batch = batch("e", [iteration("r9", 0)])
    bad_batch.contexts[0].embedding += b"\x00\x00\x80?"  # one float too many
    assert await _code(stub.Observe(iter([bad_batch]), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    # The service holds at most two models: a third is refused.
    await stub.Observe(iter([batch("e", [iteration("r1", 0)], Shape("second", 3, 8, 2, 4))]), timeout=5)
    third = batch("e", [iteration("r1", 0)], Shape("third", 3, 8, 2, 4))
    assert await _code(stub.Observe(iter([third]), timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Snapshot / Restore names stay inside the snapshot directory.
    assert await _code(stub.Snapshot(pb.SnapshotRequest(model="nope"), timeout=5)) == grpc.StatusCode.NOT_FOUND
    bad_name = pb.RestoreRequest(file="../etc.snapshot.npz")
    assert await _code(stub.Restore(bad_name, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    assert await _code(stub.Restore(pb.RestoreRequest(model="nope"), timeout=5)) == grpc.StatusCode.NOT_FOUND


async def test_deadline_exceeded_and_no_snapshot_dir() -> None:
    hub = PredictorHub(lambda s: SlowPredictor(s.num_layers, s.num_experts, s.top_k), "slow")
    service = PredictorService(InProcessBroker(), hub)
    server, port = await serve_predictor(service, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.PredictorStub(channel)
            await stub.Observe(iter([batch("e", [iteration("r1", 0)])]), timeout=5)
            call = stub.Search(_search(target_layers=[2]), timeout=0.1)
            assert await _code(call) == grpc.StatusCode.DEADLINE_EXCEEDED
            no_dir = stub.Snapshot(pb.SnapshotRequest(), timeout=5)
            assert await _code(no_dir) == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await server.stop(grace=0.5)


async def test_snapshot_and_restore_rpcs(api) -> None:
    stub, service = api
    await stub.Observe(iter([batch("e", [iteration("r1", 0), iteration("r2", 0)])]), timeout=5)
    saved = await stub.Snapshot(pb.SnapshotRequest(model="tiny"), timeout=5)
    assert list(saved.files) == ["tiny.snapshot.npz"] and saved.bytes > 0
    service.hub.models["tiny"].predictor.counts[:] = 0  # lose the state ...
    restored = await stub.Restore(pb.RestoreRequest(model="tiny"), timeout=5)  # ... and get it back
    assert restored.file == "tiny.snapshot.npz" and restored.shape.num_experts == 8
    assert service.hub.models["tiny"].predictor.observed == 2


def _start_cli(redis_url: str, snapshot_dir: Path, engine: str, stream: str) -> tuple[subprocess.Popen, int]:
    # The same flags and run function as `hintserve predictor`, without importing the engine CLI (torch).
    cmd = [
        sys.executable, "-m", "services.predictor.service_cli", "--redis-url", redis_url,
        "--predictor", "tests.test_predictor_service:CountingPredictor", "--engine-id", engine,
        "--snapshot-dir", str(snapshot_dir), "--snapshot-interval-s", "0", "--grpc-port", "0",
        "--metrics-port", "0", "--consumer", "c1", "--stream", stream,
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()  # type: ignore[union-attr]
        match = re.search(r"gRPC 127\.0\.0\.1:(\d+)", line)
        if match:
            return proc, int(match.group(1))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"predictor did not start (rc {proc.poll()})")


async def test_standalone_service_snapshots_on_sigterm_and_restores(tmp_path) -> None:
    broker = make_broker(REDIS_URL)
    try:
        await broker.ping()
    except ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    engine = f"sigterm-{uuid.uuid4().hex[:8]}"
    stream = f"test:ctx:{engine}"  # its own stream: no backlog from other runs, nothing left behind
    proc, port = _start_cli(REDIS_URL, tmp_path, engine, stream)
    sub = await broker.subscribe(hint_channel(engine))
    try:
        for i in range(3):
            await broker.stream_append(stream, batch(engine, [iteration(f"r{i}", 0)]).SerializeToString())
            assert pb.HintBatch.FromString(await sub.get(timeout=10)).engine_id == engine
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        await sub.close()
        if proc.poll() is None:
            proc.kill()
    meta, state = loads((tmp_path / "tiny.snapshot.npz").read_bytes())
    assert meta["shape"]["model"] == "tiny" and state["observed"] == 3
    # A new process restores the snapshot at start and answers Search from it.
    proc, port = _start_cli(REDIS_URL, tmp_path, engine, stream)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            found = await pb_grpc.PredictorStub(channel).Search(_search(target_layers=[0]), timeout=5)
        assert sorted(found.hints[0].experts[:2]) == [1, 5]
        np.testing.assert_array_equal(state["counts"][:, [1, 5]], 3)
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 15)
        client = redis.Redis.from_url(REDIS_URL)  # leave nothing behind on the shared Redis
        await client.delete(stream)
        await client.aclose()
        await broker.close()
