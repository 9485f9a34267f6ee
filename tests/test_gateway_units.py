"""Gateway parts on their own: engine-stat export, routing, admission, error mapping, health rounds."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
)
from services.gateway.admission import AdmissionController
from services.gateway.engine_pool import EnginePool
from services.gateway.engine_stats_collector import EngineStatsCollector, parse_stat_key
from services.gateway.errors import APIError, from_engine_error
from tests.test_gateway_support import wait_for


class FakeBackend:
    def __init__(self, address: str, healthy: bool = True, stats: dict[str, float] | None = None) -> None:
        self.address = address
        self.healthy = healthy
        self.stats_value = stats or {}

    async def health(self) -> bool:
        if self.healthy is None:
            raise ConnectionError("unreachable")
        return self.healthy

    async def model_info(self) -> dict[str, Any]:
        return {"model": "m", "max_model_len": 64}

    async def stats(self) -> dict[str, float]:
        return self.stats_value

    async def close(self) -> None:
        pass


async def _pool(*backends: FakeBackend, slots: int = 2, interval: float = 60.0) -> EnginePool:
    pool = EnginePool(backends, slots, health_interval_s=interval)
    await pool.start()
    return pool


@pytest.mark.parametrize(
    ("key", "parsed"),
    [
        ("kv_blocks_used", ("kv_blocks_used", {})),
        ('expert_hits_total{layer="3"}', ("expert_hits_total", {"layer": "3"})),
        (
            'bytes_moved_total{kind="h2d", link="pcie"}',
            ("bytes_moved_total", {"kind": "h2d", "link": "pcie"}),
        ),
        ('x{a="q\\"uote",b="back\\\\slash"}', ("x", {"a": 'q"uote', "b": "back\\slash"})),
        ("x{}", ("x", {})),
        ("9lives", None),
        ("bad-name", None),
        ("x{layer=3}", None),
        ('x{layer="3"', None),
    ],
)
def test_parse_stat_key(key: str, parsed: Any) -> None:
    assert parse_stat_key(key) == parsed


async def test_engine_stats_become_series_of_the_right_type() -> None:
    stats = {
        "kv_blocks_used": 3.0,
        'expert_hits_total{layer="0"}': 10.0,
        'expert_hits_total{layer="1"}': 7.0,
        'expert_queries_total{layer="0"}': 12.0,
        "cache_occupancy": 0.5,
        "bad key!": 1.0,
        "clash": 1.0,
        "clash_total": 2.0,
    }
    pool = await _pool(FakeBackend("e1:1", stats=stats), FakeBackend("e2:2", stats={"kv_blocks_used": 1.0}))
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(pool))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert families["hintserve_engine_kv_blocks_used"].type == "gauge"
    assert {(s.labels["engine"], s.value) for s in families["hintserve_engine_kv_blocks_used"].samples} == {
        ("e1:1", 3.0),
        ("e2:2", 1.0),
    }
    hits = families["hintserve_engine_expert_hits"]
    assert hits.type == "counter"
    assert {(s.name, s.labels["layer"], s.value) for s in hits.samples} == {
        ("hintserve_engine_expert_hits_total", "0", 10.0),
        ("hintserve_engine_expert_hits_total", "1", 7.0),
    }
    assert families["hintserve_engine_expert_queries"].type == "counter"
    assert families["hintserve_engine_cache_occupancy"].samples[0].value == 0.5
    assert families["hintserve_engine_clash"].type == "gauge"  # the first spelling wins; the other is dropped
    assert len(families["hintserve_engine_clash"].samples) == 1
    assert not any("bad" in name for name in families)
    assert families["hintserve_gateway_engine_healthy"].samples[0].value == 1.0
    await pool.stop()


async def test_pick_least_outstanding_with_rotating_ties() -> None:
    pool = await _pool(FakeBackend("a"), FakeBackend("b"), FakeBackend("c"), slots=2)
    a, b, c = pool.engines
    assert [pool.pick().address for _ in range(3)] == ["a", "b", "c"]  # ties rotate
    a.outstanding, b.outstanding, c.outstanding = 1, 0, 1
    assert pool.pick() is b
    assert pool.pick(exclude=[b]) in (a, c)
    b.outstanding = 2  # full
    c.healthy = False
    assert pool.pick() is a
    a.outstanding = 2
    assert pool.pick() is None
    await pool.stop()


async def test_admission_queue_fifo_429_and_cancel() -> None:
    pool = await _pool(FakeBackend("a"), slots=1)
    admission = AdmissionController(pool, max_queue=2)
    first = await admission.acquire()
    waiters = [asyncio.create_task(admission.acquire()) for _ in range(2)]
    await wait_for(lambda: admission.num_waiting == 2)
    with pytest.raises(APIError) as err:
        await admission.acquire()
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
    waiters[0].cancel()  # a client that gives up leaves the queue
    await asyncio.gather(waiters[0], return_exceptions=True)
    assert admission.num_waiting == 1
    admission.release(first)
    assert await waiters[1] is first  # the slot went to the next in line
    admission.release(first)
    assert pool.total_outstanding == 0
    await pool.stop()


async def test_admission_503_when_last_engine_goes_down() -> None:
    backend = FakeBackend("a")
    pool = await _pool(backend, slots=1)
    admission = AdmissionController(pool, max_queue=4)
    held = await admission.acquire()
    queued = asyncio.create_task(admission.acquire())
    await wait_for(lambda: admission.num_waiting == 1)
    pool.mark_unhealthy(held, "test")
    with pytest.raises(APIError) as err:
        await queued
    assert err.value.status == 503
    with pytest.raises(APIError) as err:
        await admission.acquire()
    assert err.value.status == 503 and err.value.code == "no_healthy_engine"
    await pool.stop()


async def test_periodic_health_round_marks_down_and_up() -> None:
    backend = FakeBackend("a")
    pool = await _pool(backend, interval=0.02)
    handle = pool.engines[0]
    assert handle.healthy and handle.model_info == {"model": "m", "max_model_len": 64}
    backend.healthy = None  # unreachable
    await wait_for(lambda: not handle.healthy, what="marked unhealthy by the health loop")
    assert "unreachable" in handle.last_error
    backend.healthy = True
    await wait_for(lambda: handle.healthy, what="healthy again")
    await pool.stop()


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    ("exc", "status", "code", "retriable"),
    [
        (
            ContextLengthExceededError("This model's maximum context length is 8"),
            400,
            "context_length_exceeded",
            False,
        ),
        (InvalidRequestError("top_p must be in (0, 1]"), 400, None, False),
        (EngineDeadError("loop stopped"), 503, "engine_unavailable", True),
        (
            _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "This model's maximum context length is 8 tokens"),
            400,
            "context_length_exceeded",
            False,
        ),
        (_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty"), 400, None, False),
        (_rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect"), 503, "engine_unavailable", True),
        (_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy"), 429, "rate_limit_exceeded", False),
        (_rpc_error(grpc.StatusCode.INTERNAL, "boom"), 500, "request_failed", False),  # never retried
        (RequestFailedError("sampler raised"), 500, "request_failed", False),
        (_rpc_error(grpc.StatusCode.UNKNOWN, "boom"), 500, "engine_error", False),
        (RuntimeError("bug"), 500, "internal_error", False),
    ],
)
def test_engine_errors_map_to_http(
    exc: BaseException, status: int, code: str | None, retriable: bool
) -> None:
    error = from_engine_error(exc, "prompt")
    assert (error.status, error.code, error.retriable) == (status, code, retriable)
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
