"""Redis as a trust boundary: a client that can write to Redis cannot crash the predictor, make it log a
traceback, take its model slots, get into its snapshots or (with HINTSERVE_BROKER_SECRET) feed it at all.
Real Redis, real service loop, hostile messages (random bytes, random protobuf, oversized shapes, slot
flooding, forged and unsigned batches)."""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import AsyncIterator

import pytest

from services.common.broker import Broker, hint_channel
from services.common.messages import MAX_CELLS, Shape
from services.common.protos import predictor_pb2 as pb
from services.common.signing import Sealer
from services.predictor.snapshots import Snapshotter
from tests.test_predictor_service import (
    REDIS_URL,
    _run_service,
    _stop,
    batch,
    iteration,
    open_broker,
    poll,
    unique,
)

SECRET = "broker-secret-for-tests"


@pytest.fixture
async def redis_broker() -> AsyncIterator[Broker]:
    b = await open_broker(REDIS_URL)
    yield b
    await b.close()


def _hostile(rng: random.Random, engine: str) -> list[bytes]:
    """Messages an attacker with write access to Redis might append to the context stream."""
    out: list[bytes] = [rng.randbytes(rng.randint(0, 64)) for _ in range(20)]
    for _ in range(20):  # random protobuf: every field drawn from the edges
        msg = pb.ContextBatch(engine_id=engine, sent_unix_ns=rng.choice([0, -1, 2**62]))
        msg.shape.model = rng.choice(["", "tiny", "x" * 300, f"fake-{rng.randint(0, 99)}"])
        msg.shape.num_layers = rng.choice([0, 1, 3, 512, 513, 1000, 2**31 - 1])
        msg.shape.num_experts = rng.choice([0, 1, 8, 4096, 10_000, 2**31 - 1])
        msg.shape.top_k = rng.choice([0, 1, 2, 2**31 - 1])
        msg.shape.hidden_size = rng.choice([0, 4, 1 << 17])
        for _ in range(rng.randint(0, 3)):
            c = msg.contexts.add(request_id=rng.choice(["", "r", "r" * 1000]), iteration=rng.choice([-1, 0, 5]))
            c.layers_seen = rng.choice([-1, 0, 3, 2**31 - 1])
            c.probs = rng.randbytes(rng.choice([0, 3, 96, 4096]))
            c.counts = b"\x00\x00\xc0\x7f" * rng.choice([0, 24])  # NaN
            c.embedding = rng.randbytes(rng.choice([0, 16, 17]))
        out.append(msg.SerializeToString())
    # 1000 layers x 10000 experts (an 80 GB lazy array before the bounds), and the largest allowed shape
    out.append(batch(engine, [iteration("big", 0)], Shape("huge", 1000, 10_000, 2, 4)).SerializeToString())
    out.append(batch(engine, [], Shape("flood", 1, MAX_CELLS, 1, 0)).SerializeToString())
    # slot flooding: many fake models, each with an empty or a mis-shaped batch
    out += [batch(engine, [], Shape(f"fake{i}", 3, 8, 2, 4)).SerializeToString() for i in range(20)]
    return out


def _no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]


async def test_hostile_stream_entries_never_crash_or_take_slots(
    redis_broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a secret: everything is validated; nothing bad takes a slot, logs a traceback or stops the loop."""
    stream, engine = unique("trust"), uuid.uuid4().hex[:8]
    service, task = await _run_service(redis_broker, stream, sealer=Sealer(None))
    service.hub.max_models = 4
    sub = await redis_broker.subscribe(hint_channel(engine))
    caplog.set_level(logging.DEBUG, "services.predictor")
    try:
        for data in _hostile(random.Random(30), engine):
            await redis_broker.stream_append(stream, data)
        await redis_broker.stream_append(stream, batch(engine, [iteration("real", 0)]).SerializeToString())
        hints = pb.HintBatch.FromString(await sub.get(timeout=10.0))
        while not any(h.request_id == "real" for h in hints.hints):  # hostile but valid contexts answer too
            hints = pb.HintBatch.FromString(await sub.get(timeout=10.0))
        assert set(service.hub.models) <= {"tiny"} | {f"fake-{i}" for i in range(100)}
        assert "huge" not in service.hub.models and "flood" not in service.hub.models
        assert not any(name.startswith("fake") and name[4:].isdigit() for name in service.hub.models)
        stats = service.stats()
        assert stats['contexts_rejected_total{reason="invalid"}'] >= 20
        assert stats.get('contexts_rejected_total{reason="error"}', 0) == 0
        _no_tracebacks(caplog)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) <= 5  # one line per reason per interval, not one per message
    finally:
        await sub.close()
        await _stop(service, task)


async def test_with_a_secret_only_signed_batches_count(
    redis_broker: Broker, caplog: pytest.LogCaptureFixture, tmp_path
) -> None:
    stream, engine = unique("trust"), uuid.uuid4().hex[:8]
    sealer = Sealer(SECRET)
    service, task = await _run_service(redis_broker, stream, sealer=sealer)
    service.snapshotter = Snapshotter(str(tmp_path), service.hub)
    sub = await redis_broker.subscribe(hint_channel(engine))
    caplog.set_level(logging.DEBUG, "services.predictor")
    try:
        forged = Sealer("not-the-secret").seal(batch(engine, [iteration("f", 0)], Shape("forged", 3, 8, 2, 4))
                                               .SerializeToString())
        for data in [*_hostile(random.Random(31), engine), forged]:
            await redis_broker.stream_append(stream, data)
        # Valid protobuf for a fresh model, but unsigned: dropped like the rest.
        await redis_broker.stream_append(stream, batch(engine, [iteration("u", 0)], Shape("unsigned", 3, 8, 2, 4))
                                         .SerializeToString())
        await redis_broker.stream_append(stream, sealer.seal(batch(engine, [iteration("real", 0)]).SerializeToString()))
        raw = await sub.get(timeout=10.0)
        assert Sealer(None).open(raw)[0] == raw and sealer.open(raw)[0] is not None  # hints are signed
        assert pb.HintBatch.FromString(sealer.open(raw)[0]).hints[0].request_id == "real"
        assert list(service.hub.models) == ["tiny"]  # no slot for anything unsigned
        stats = service.stats()
        assert stats['contexts_rejected_total{reason="unsigned"}'] >= 40
        assert stats['contexts_rejected_total{reason="bad_signature"}'] == 1
        await service.snapshot()
        assert [p.name for p in tmp_path.iterdir()] == ["tiny.snapshot.npz"]  # nothing unverified on disk
        _no_tracebacks(caplog)
    finally:
        await sub.close()
        await _stop(service, task)


def test_sealer_round_trip_and_tampering() -> None:
    sealer = Sealer(SECRET)
    sealed = sealer.seal(b"payload")
    assert sealer.open(sealed) == (b"payload", "")
    assert sealer.open(sealed[:-1] + b"X") == (None, "bad_signature")
    assert sealer.open(b"payload") == (None, "unsigned")
    assert Sealer(None).seal(b"payload") == b"payload"  # off: the wire format is unchanged


async def test_shutdown_snapshot_failure_is_one_line_and_leaves_no_temp_file(
    redis_broker: Broker, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    stream, engine = unique("trust"), uuid.uuid4().hex[:8]
    service, task = await _run_service(redis_broker, stream, sealer=Sealer(None))
    directory = tmp_path / "snapshots"
    service.snapshotter = Snapshotter(str(directory), service.hub)
    await redis_broker.stream_append(stream, batch(engine, [iteration("r", 0)]).SerializeToString())
    await poll(lambda: "tiny" in service.hub.models, what="a model to snapshot")
    (directory / "tiny.snapshot.npz").mkdir()  # the rename onto it fails, as on a read-only or full disk
    caplog.set_level(logging.INFO, "services.predictor")
    await _stop(service, task)  # returns normally: the CLI then exits 0
    assert [r.getMessage() for r in caplog.records if "snapshot on shutdown failed" in r.getMessage()]
    assert not [p for p in directory.iterdir() if ".tmp-" in p.name]
    _no_tracebacks(caplog)
