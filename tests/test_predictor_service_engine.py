"""Engine <-> predictor end to end: contexts out of a real engine, hints back in, over real Redis and the
in-process broker; a Redis restart under a generating engine; the hint prefetcher and link in isolation."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
import redis.asyncio as redis
import torch

from services.common.broker import CONTEXT_STREAM, make_broker
from services.common.inprocess_broker import InProcessBroker
from services.common.messages import Shape
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.offload.prefetch.hints import HintPrefetcher, HintStats
from services.engine.predictor_link import PredictorLink
from services.engine.sampling_params import SamplingParams
from services.engine.step_context import Phase, StepContext
from services.predictor.hub import PredictorHub
from services.predictor.service import PredictorService
from tests.test_predictor_service import REDIS_URL, counting_factory, poll

PREDICTOR = "tests.test_predictor_service:CountingPredictor"
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 7, 3], [11, 12, 13]]


def _engine(model_dir: str, **kw) -> LLMEngine:
    # A slow emulated link keeps steps long enough for hints to matter; finemoe prefetches from hints only.
    return LLMEngine(EngineConfig(model=model_dir, offload_policy="finemoe", predictor=PREDICTOR, link_gbps=0.5, **kw))


def _hints(engine: LLMEngine) -> HintPrefetcher:
    return next(p for p in engine.model.experts.prefetchers if isinstance(p, HintPrefetcher))


def _close(engine: LLMEngine) -> None:
    _hints(engine).close()
    engine.close()


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir: str) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir))
    try:
        return engine.generate(PROMPTS, GREEDY)
    finally:
        engine.close()


async def _service(url: str, engine_id: str, **kw) -> tuple[PredictorService, asyncio.Task]:
    broker = make_broker(url)
    service = PredictorService(
        broker, PredictorHub(counting_factory, "counting"), consumer="c1", group=f"test-{engine_id}",
        engines={engine_id}, start="$", backoff_s=(0.02, 0.2), **kw,
    )
    task = asyncio.create_task(service.run())
    return service, task


async def _stop_service(service: PredictorService, task: asyncio.Task) -> None:
    service.stop()
    await asyncio.wait_for(task, 10)
    await service.broker.close()


@pytest.mark.parametrize("where", ["redis", "inprocess"])
async def test_contexts_and_hints_flow_through_a_real_engine(where, tiny_mixtral_dir, expected) -> None:
    engine_id = f"e2e-{uuid.uuid4().hex[:8]}"
    service = task = None
    if where == "redis":
        service, task = await _service(REDIS_URL, engine_id)
        await asyncio.wait_for(service.ready.wait(), 5)
    engine = _engine(tiny_mixtral_dir, redis_url=REDIS_URL if where == "redis" else None, engine_id=engine_id)
    try:
        await poll(lambda: engine.stats()["predictor_link_connected"] == 1, what="link connected")
        tokens = await asyncio.to_thread(engine.generate, PROMPTS, GREEDY)
        assert tokens == expected  # hints steer prefetching only, never the outputs
        await poll(lambda: engine.stats()["offload_hints_received_total"] > 0, what="hints at the engine")
        stats = engine.stats()
        assert stats["predictor_contexts_published_total"] >= 2 * GREEDY.max_tokens
        assert stats["predictor_contexts_dropped_total"] == 0
        assert stats['predictor_hint_latency_ms{quantile="0.5"}'] > 0
        assert stats["offload_prefetches_issued_total"] > 0  # finemoe prefetches from hints only
        if service is not None:
            assert service.stats()["hints_published_total"] > 0
    finally:
        _close(engine)
        if service is not None:
            await _stop_service(service, task)
            client = redis.Redis.from_url(REDIS_URL)
            await client.xgroup_destroy(CONTEXT_STREAM, f"test-{engine_id}")
            await client.aclose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def private_redis() -> Iterator[tuple[str, callable, callable]]:
    """Our own redis-server on a free port (never the system one), with stop() and start()."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    port = _free_port()
    procs: list[subprocess.Popen] = []

    def start() -> None:
        cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise AssertionError("redis-server did not start")

    def stop() -> None:
        procs[-1].terminate()
        procs[-1].wait(10)

    start()
    yield f"redis://127.0.0.1:{port}", stop, start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


async def test_engine_keeps_generating_through_a_redis_restart(private_redis, tiny_mixtral_dir, expected) -> None:
    url, stop_redis, start_redis = private_redis
    engine_id = f"restart-{uuid.uuid4().hex[:8]}"
    service, task = await _service(url, engine_id)
    engine = _engine(tiny_mixtral_dir, redis_url=url, engine_id=engine_id)
    stats = engine.stats
    try:
        await poll(lambda: stats()["predictor_link_connected"] == 1 and service.connected, what="both connected")
        assert await asyncio.to_thread(engine.generate, PROMPTS, GREEDY) == expected
        await poll(lambda: stats()["offload_hints_received_total"] > 0, what="hints before the restart")

        await asyncio.to_thread(stop_redis)
        await poll(lambda: stats()["predictor_link_connected"] == 0, what="the link to notice")
        dropped = stats()["predictor_contexts_dropped_total"]
        assert await asyncio.to_thread(engine.generate, PROMPTS, GREEDY) == expected  # served locally
        assert stats()["predictor_contexts_dropped_total"] > dropped  # counted, never blocking

        await asyncio.to_thread(start_redis)
        await poll(lambda: stats()["predictor_link_connected"] == 1 and service.connected, what="reconnection")
        before = stats()["offload_hints_received_total"]
        assert await asyncio.to_thread(engine.generate, PROMPTS, GREEDY) == expected
        await poll(lambda: stats()["offload_hints_received_total"] > before, what="hints after the restart")
        assert stats()["predictor_link_reconnects_total"] >= 1
        assert service.stats()["broker_errors_total"] >= 1
    finally:
        _close(engine)
        await _stop_service(service, task)


# ---- the pieces in isolation ----
def _step(rids: list[str], iterations: list[int], layers: int = 3) -> StepContext:
    ctx = StepContext(Phase.DECODE, rids, len(rids), seq_lens=[1] * len(rids), iterations=iterations)
    ctx.embeddings = torch.zeros(len(rids), 4)
    for layer in range(layers):
        ctx.router_probs[layer] = torch.full((len(rids), 8), 1 / 8)
        ctx.selected_experts[layer] = torch.tensor([[0, 1]] * len(rids))
    return ctx


class _Hint:
    def __init__(self, rid: str, it: int, layer: int, experts: list[int], p: list[float]) -> None:
        self.request_id, self.iteration, self.layer, self.experts, self.priorities = rid, it, layer, experts, p


def test_hint_prefetcher_plans_ahead_and_counts_late_and_stale_hints() -> None:
    stats = HintStats(4)
    hints = HintPrefetcher((True,) * 4, stats, min_hops=2)
    ctx = _step(["a"], [3])
    hints.plan(0, ctx)  # request a, iteration 3, layer 0 routed
    accepted, late, stale = hints.submit([
        _Hint("a", 3, 0, [1], [0.9]),  # layer 0 already ran: late
        _Hint("a", 2, 3, [1], [0.9]),  # an iteration a has finished: stale
        _Hint("a", 3, 1, [4], [0.8]),  # one hop ahead: left to a local skip-gate (min_hops 2)
        _Hint("a", 3, 3, [5, 6], [0.6, 0.2]),
        _Hint("a", 4, 0, [7], [0.5]),  # next iteration, layer 0: wraps into the next step
    ])
    assert (accepted, late, stale) == (3, 1, 1)
    plan = {(r.layer, r.expert, r.next_step): r.priority for r in hints.plan(1, ctx)}
    assert plan == pytest.approx({(3, 5, False): 0.3, (3, 6, False): 0.1, (0, 7, True): 0.5 / 3})
    engine_stats = stats.as_engine_stats()
    assert engine_stats["offload_hints_received_total"] == 5
    assert engine_stats["offload_hints_late_total"] == 1 and engine_stats["offload_hints_stale_total"] == 1
    hints.on_step_end(ctx)
    assert hints.pending() == 1  # iteration 3's hints are used up; iteration 4's wait for the next step


class _StuckBroker(InProcessBroker):
    async def stream_append(self, stream, data, maxlen=10_000):
        await asyncio.Event().wait()  # a broker that never answers


async def test_link_never_blocks_the_decode_loop() -> None:
    hints = HintPrefetcher((True,) * 3)
    broker = _StuckBroker()
    link = PredictorLink(lambda: broker, "stuck", Shape("m", 3, 8, 2, 4), hints, queue_size=4).start()
    try:
        await poll(lambda: link.connected, what="link up")
        ctx = _step(["a", "b"], [1, 1])
        start = time.perf_counter()
        for _ in range(100):
            link.observe(ctx)
        per_step = (time.perf_counter() - start) / 100
        assert per_step < 1e-3, f"observing a step took {per_step * 1e3:.2f} ms"
        stats = link.engine_stats()
        assert stats["predictor_contexts_dropped_total"] >= 2 * (100 - 5)  # queue of 4 + one in flight
    finally:
        link.close()


def test_knobs_have_one_name_everywhere(tiny_mixtral_dir, monkeypatch) -> None:
    from services.cli import build_parser
    from services.engine.cli import engine_config
    from services.engine.offload.policies import POLICIES

    assert {"moe-infinity", "promoe", "finemoe", "hintserve"} <= set(POLICIES)
    parser = build_parser()
    flags = ["--redis-url", "redis://h:1", "--engine-id", "e1", "--predictor", "eamc"]
    config = engine_config(parser.parse_args(["engine", "--model", tiny_mixtral_dir, *flags]))
    assert (config.redis_url, config.engine_id, config.predictor) == ("redis://h:1", "e1", "eamc")
    monkeypatch.setenv("HINTSERVE_REDIS_URL", "redis://h:2")
    assert engine_config(parser.parse_args(["engine", "--model", tiny_mixtral_dir])).redis_url == "redis://h:2"
    with pytest.raises(ValueError, match="unsupported broker URL"):
        engine_config(parser.parse_args(["engine", "--model", tiny_mixtral_dir, "--redis-url", "http://x"]))
    service = parser.parse_args(["predictor", "--redis-url", "redis://h:1", "--snapshot-dir", "/tmp/s"])
    assert service.func.__name__ == "run_service" and service.snapshot_dir == "/tmp/s"


async def test_link_stops_when_its_engine_is_dropped() -> None:
    import gc

    hints = HintPrefetcher((True,) * 3)
    link = PredictorLink(lambda: InProcessBroker(), "dropped", Shape("m", 3, 8, 2, 4), hints).start()
    await poll(lambda: link.connected, what="link up")
    del hints
    gc.collect()
    await poll(lambda: not link._thread.is_alive(), what="the link thread to exit")


async def test_signed_contexts_and_hints_with_a_broker_secret(tiny_mixtral_dir, expected, monkeypatch) -> None:
    """HINTSERVE_BROKER_SECRET on both sides: contexts and hints are signed and flow as before; a hint batch
    someone else writes to the engine's channel, unsigned, is dropped and counted."""
    from services.common.broker import hint_channel
    from services.common.protos import predictor_pb2 as pb
    from services.common.signing import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "e2e-secret")
    engine_id = f"signed-{uuid.uuid4().hex[:8]}"
    service, task = await _service(REDIS_URL, engine_id)
    await asyncio.wait_for(service.ready.wait(), 5)
    engine = _engine(tiny_mixtral_dir, redis_url=REDIS_URL, engine_id=engine_id)
    try:
        await poll(lambda: engine.stats()["predictor_link_connected"] == 1, what="link connected")
        assert await asyncio.to_thread(engine.generate, PROMPTS, GREEDY) == expected
        await poll(lambda: engine.stats()["offload_hints_received_total"] > 0, what="signed hints at the engine")
        assert service.stats().get('contexts_rejected_total{reason="unsigned"}', 0) == 0
        forged = pb.HintBatch(engine_id=engine_id, hints=[pb.Hint(request_id="x", iteration=1, layer=0, experts=[1])])
        await service.broker.publish(hint_channel(engine_id), forged.SerializeToString())
        await poll(lambda: engine.stats()["predictor_hint_batches_invalid_total"] == 1, what="the forged batch dropped")
    finally:
        _close(engine)
        await _stop_service(service, task)
        client = redis.Redis.from_url(REDIS_URL)
        await client.xgroup_destroy(CONTEXT_STREAM, f"test-{engine_id}")
        await client.aclose()
