"""Liveness: a silent engine never hangs a client. The gateway's idle deadline cuts a stream (SSE error event +
[DONE]) or answers 504 before the first byte, an engine turning unhealthy cuts its streams at once, each cut
aborts the engine request (KV blocks freed) and is counted; the engine's own watchdog stops a core whose step
loop stalls."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from services.gateway.engine_client import InProcessEngineClient
from tests.test_gateway_support import (
    API_KEY,
    MODEL,
    GatedEngineClient,
    running_gateway,
    sample_sum,
    scrape,
    started_engine,
    wait_for,
)
from tests.test_reliability_http import HeldEngineClient

AUTH = {"Authorization": f"Bearer {API_KEY}"}
STREAM = {"model": MODEL, "prompt": "Hello", "max_tokens": 64, "stream": True, "ignore_eos": True}


@pytest.fixture
async def engine(tiny_mixtral_dir: str) -> AsyncIterator[Any]:
    async with started_engine(tiny_mixtral_dir, max_num_seqs=4) as e:
        yield e


async def _stream_lines(server: Any, body: dict[str, Any]) -> list[str]:
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


async def test_a_silent_engine_mid_stream_is_cut_at_the_idle_deadline(engine: Any, tiny_mixtral_dir: str) -> None:
    backend = HeldEngineClient(engine)  # sends one output, then nothing
    async with running_gateway([backend], tiny_mixtral_dir, stream_idle_timeout_s=0.5) as (gateway, server):
        lines = await _stream_lines(server, STREAM)
        assert lines[-1] == "[DONE]"
        error = json.loads(lines[-2])["error"]
        assert error["code"] == "engine_timeout" and "0.5 s" in error["message"]
        assert json.loads(lines[0])["choices"][0]["text"]  # the stream had begun
        await wait_for(lambda: engine.stats()["kv_blocks_used"] == 0, what="the aborted request's blocks freed")
        samples = await scrape(server)
        assert sample_sum(samples, "hintserve_stream_cuts_total", reason="idle_timeout") == 1
        assert sample_sum(samples, "hintserve_request_success_total", finished_reason="abort") == 1
        assert not gateway.router.watch.entries and gateway.pool.engines[0].outstanding == 0


async def test_a_silent_engine_before_the_first_byte_is_a_504(engine: Any, tiny_mixtral_dir: str) -> None:
    backend = GatedEngineClient(engine)  # holds every request before the engine sees it
    async with running_gateway([backend], tiny_mixtral_dir, stream_idle_timeout_s=0.3) as (gateway, server):
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as http:
            for stream in (False, True):
                response = await http.post("/v1/completions", json={**STREAM, "stream": stream})
                assert response.status_code == 504
                assert response.json()["error"]["code"] == "engine_timeout"
            backend.gate.set()  # the engine answers again: so does the gateway
            response = await http.post("/v1/completions", json={**STREAM, "stream": False, "max_tokens": 4})
            assert response.status_code == 200
        samples = await scrape(server)
        assert sample_sum(samples, "hintserve_stream_cuts_total", reason="idle_timeout") == 2
        assert gateway.pool.engines[0].outstanding == 0


async def test_a_request_queued_in_a_busy_engine_is_not_cut(demo_model_dir: str) -> None:
    """Silent is not hung: with one sequence slot, the second request waits in the engine's queue (no output)
    for longer than the idle deadline while the engine steps for the first; it must not be cut. (The demo
    model: slow enough per token on a CPU that the first request outlasts the deadline several times.)"""
    timeout = 1.0  # the engine reports its step counters about every 0.25 s
    async with started_engine(demo_model_dir, max_num_seqs=1) as engine:
        async with running_gateway([InProcessEngineClient(engine)], demo_model_dir, model_name=MODEL,
                                   stream_idle_timeout_s=timeout, health_interval_s=0.1) as (_, server):
            first = asyncio.create_task(_stream_lines(server, {**STREAM, "max_tokens": 300}))
            await wait_for(lambda: engine.stats().get("num_running", 0) == 1, what="the first request running")
            start = time.monotonic()
            queued = await _stream_lines(server, {**STREAM, "max_tokens": 4})
            waited = time.monotonic() - start
            assert json.loads(queued[-2])["choices"][0]["finish_reason"] == "length", queued[-2:]
            assert json.loads((await first)[-2])["choices"][0]["finish_reason"] == "length"
            if waited < 2 * timeout:
                pytest.skip(f"the first request ran only {waited:.2f} s: too fast to exercise the deadline here")
            samples = await scrape(server)
            assert sample_sum(samples, "hintserve_stream_cuts_total") == -1  # no cut at all


async def test_streams_on_an_engine_turning_unhealthy_are_cut_at_once(engine: Any, tiny_mixtral_dir: str) -> None:
    backend = HeldEngineClient(engine)
    # No idle deadline: only the health change can end the held stream.
    async with running_gateway([backend], tiny_mixtral_dir, stream_idle_timeout_s=0.0) as (gateway, server):
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=STREAM) as response:
                lines = response.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                handle = gateway.pool.engines[0]
                gateway.pool.mark_unhealthy(handle, "health check timed out")  # what the health round does
                rest = [line[6:] async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "engine_unavailable" and "health check timed out" in error["message"]
        await wait_for(lambda: engine.stats()["kv_blocks_used"] == 0, what="the aborted request's blocks freed")
        samples = await scrape(server)
        assert sample_sum(samples, "hintserve_stream_cuts_total", reason="engine_unhealthy") == 1


def test_the_idle_deadline_is_a_flag_and_an_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.cli import build_parser
    from services.gateway.cli import gateway_config

    parser = build_parser()
    args = parser.parse_args(["gateway", "--engines", "127.0.0.1:1", "--no-auth"])
    assert gateway_config(args, None, None).stream_idle_timeout_s == 30.0
    monkeypatch.setenv("HINTSERVE_STREAM_IDLE_TIMEOUT_S", "7.5")
    assert gateway_config(args, None, None).stream_idle_timeout_s == 7.5
    args = parser.parse_args(["gateway", "--engines", "127.0.0.1:1", "--no-auth", "--stream-idle-timeout-s", "2"])
    assert gateway_config(args, None, None).stream_idle_timeout_s == 2.0
    args = parser.parse_args(["gateway", "--engines", "127.0.0.1:1", "--no-auth", "--stream-idle-timeout-s", "-1"])
    with pytest.raises(ValueError, match="--stream-idle-timeout-s"):
        gateway_config(args, None, None)


async def test_a_frozen_core_trips_the_step_watchdog_and_ends_every_stream(tiny_mixtral_dir: str) -> None:
    """`hintserve serve`'s layout (gateway + engine frontend in one process, core in its own): the core frozen
    mid-stream (SIGSTOP) -> the watchdog kills it, the streams end with an error event, the engine is dead
    (the CLI then exits 1) and reports not running."""
    from services.engine.async_engine import AsyncLLMEngine
    from services.engine.config import EngineConfig

    engine = AsyncLLMEngine(EngineConfig(model=tiny_mixtral_dir, max_num_seqs=4, step_watchdog_s=1.0))
    await engine.start()
    try:
        async with running_gateway([InProcessEngineClient(engine)], tiny_mixtral_dir) as (gateway, server):
            async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as http:
                body = {**STREAM, "max_tokens": 400}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    lines = response.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")
                    os.kill(engine.core_pid, signal.SIGSTOP)
                    rest = [line[6:] async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "[DONE]"
            error = json.loads(rest[-2])["error"]
            assert error["code"] == "engine_unavailable" and "step watchdog" in error["message"]
            assert "step watchdog" in str(await asyncio.wait_for(engine.wait_dead(), 10))
            assert not engine.is_running
    finally:
        await engine.shutdown()  # reaps the killed core
