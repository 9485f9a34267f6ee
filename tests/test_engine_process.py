"""The engine core in its own process: same tokens as the in-thread core, text and stop strings made in the
frontend, its death turns health NOT_SERVING and the server exits 1, and shutdown reaps it."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys

import pytest

from services.engine.async_engine import AsyncLLMEngine
from services.engine.cli import until_stopped_or_dead
from services.engine.config import EngineConfig
from services.engine.errors import EngineDeadError
from services.engine.grpc_client import EngineClient
from services.engine.grpc_server import serve_engine, stop_server
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from tests.live_processes import LiveProcess

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = "The quick brown fox"


async def _text_and_tokens(engine: AsyncLLMEngine, rid: str, params: SamplingParams) -> tuple[str, list[int], str]:
    text, tokens, reason = "", [], ""
    async for out in engine.generate(rid, PROMPT, params):
        text += out.delta_text
        tokens += out.delta_token_ids
        reason = out.finish_reason or reason
    return text, tokens, reason


async def test_core_process_matches_the_offline_engine_and_is_reaped(tiny_mixtral_dir: str) -> None:
    offline = LLMEngine(EngineConfig(model=tiny_mixtral_dir))
    want_tokens = offline.generate([PROMPT], GREEDY)[0]
    want_text = offline.tokenizer.decode(want_tokens, skip_special_tokens=True)
    # A stop string is found by the frontend (the core has no text) and ends the request there.
    stop_at = want_text[len(want_text) // 2 :][:3]
    engine = AsyncLLMEngine(EngineConfig(model=tiny_mixtral_dir))
    await engine.start()
    core = engine._core
    try:
        assert engine.core_pid not in (None, os.getpid()) and engine.is_running
        text, tokens, reason = await _text_and_tokens(engine, "a", GREEDY)
        assert (tokens, text, reason) == (want_tokens, want_text, "length")
        stopped = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop_at])
        text, _, reason = await _text_and_tokens(engine, "b", stopped)
        assert reason == "stop" and text == want_text[: want_text.index(stop_at)]
        finished_stop = 'requests_finished_total{reason="stop"}'
        for _ in range(500):  # the core reports the stop it was told about with its next stats
            if engine.stats().get(finished_stop, 0) >= 1:
                break
            await asyncio.sleep(0.01)
        assert engine.stats()[finished_stop] == 1 and engine.stats()["kv_blocks_used"] == 0
    finally:
        await engine.shutdown()
    assert not core.is_alive() and core.exitcode == 0
    assert core not in multiprocessing.active_children()


async def test_core_process_death_means_not_serving_and_exit_1(tiny_mixtral_dir: str) -> None:
    engine = AsyncLLMEngine(EngineConfig(model=tiny_mixtral_dir))
    await engine.start()
    server, port = await serve_engine(engine, "127.0.0.1", 0)
    try:
        stream = engine.generate("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine.core_pid, signal.SIGKILL)  # type: ignore[arg-type]
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not engine.is_running
        async with EngineClient(f"127.0.0.1:{port}") as client:
            assert not await client.health()
        assert await asyncio.wait_for(until_stopped_or_dead(asyncio.Event(), engine), 10) == 1
        with pytest.raises(EngineDeadError):
            await engine.generate("after", PROMPT, GREEDY).__anext__()
    finally:
        await stop_server(server, grace=0.1)
        await engine.shutdown()
    assert multiprocessing.active_children() == []


def test_serve_exits_1_when_its_core_dies(demo_model_dir: str) -> None:
    serve = LiveProcess(
        "serve", [sys.executable, "-m", "services.cli", "serve", "--model", demo_model_dir, "--port", "0"],
        env={"HINTSERVE_API_KEYS": ""},
    )
    try:
        serve.wait_for_line("serving demo-moe", timeout_s=180)
        children = _children(serve.proc.pid)  # the engine core and multiprocessing's resource tracker
        cores = [pid for pid, cmd in children.items() if "spawn_main" in cmd]
        assert len(cores) == 1, children
        os.kill(cores[0], signal.SIGKILL)
        assert serve.proc.wait(timeout=60) == 1
        assert "engine core" in serve.output()
    finally:
        serve.stop()


def _children(pid: int) -> dict[int, str]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        pids = [int(p) for p in f.read().split()]
    return {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in pids}
