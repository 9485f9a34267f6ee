"""Shared helpers of the gateway tests (no tests here): a real gateway on a loopback port, engines, probes."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from services.engine.async_engine import AsyncLLMEngine
from services.engine.config import EngineConfig
from services.gateway.config import GatewayConfig
from services.gateway.engine_client import InProcessEngineClient
from services.gateway.server import Gateway, HTTPServer, load_tokenizer

API_KEY = "test-key-1"
MODEL = "tiny-mixtral"


@functools.lru_cache(maxsize=4)
def cached_tokenizer(model_dir: str) -> Any:
    return load_tokenizer(model_dir)


@asynccontextmanager
async def started_engine(model_dir: str, **config: Any) -> AsyncIterator[AsyncLLMEngine]:
    # The core on a thread of the test process: starts in a blink, and faults injected here reach it (the
    # core process itself is tested in test_engine_core.py and test_engine_process.py).
    engine = AsyncLLMEngine(EngineConfig(model=model_dir, **config), core_in_thread=True)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


class GatedEngineClient(InProcessEngineClient):
    """The in-process backend, holding every request until `gate` opens: makes "all slots busy" a state the
    test controls instead of a race with requests finishing."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.gate = asyncio.Event()

    async def generate(self, request_id: str, prompt: Any, params: Any) -> AsyncIterator[Any]:
        await self.gate.wait()
        async for out in super().generate(request_id, prompt, params):
            yield out


@asynccontextmanager
async def running_gateway(
    backends: list[Any], model_dir: str, **overrides: Any
) -> AsyncIterator[tuple[Gateway, HTTPServer]]:
    settings: dict[str, Any] = dict(
        model_name=MODEL, api_keys=[API_KEY], batch_window_ms=0.0, health_interval_s=60.0, tokenizer=model_dir
    )
    settings.update(overrides)
    tokenizer = cached_tokenizer(model_dir) if settings.get("tokenizer") else None
    gateway = Gateway(GatewayConfig(**settings), backends, tokenizer)
    server = HTTPServer(gateway.app, "127.0.0.1", 0)
    await server.start()
    try:
        yield gateway, server
    finally:
        await server.stop()


def openai_client(server: HTTPServer, api_key: str = API_KEY) -> openai.AsyncOpenAI:
    # No retries: the tests look at the first answer (the client would retry 429 and 5xx).
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60.0)


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Polls `predicate()` until true, yielding to the loop in between (the deadline is the only timing)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        await asyncio.sleep(0.01)


def stat(stats: dict[str, float], name: str, **labels: str) -> float:
    """An engine stat by name, whether the engine reports `name` or `name_total`, bare or with labels."""
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for key in (name, f"{name}_total"):
        full = f"{key}{{{label_text}}}" if labels else key
        if full in stats:
            return stats[full]
    if labels:  # older flat spelling: requests_finished_abort
        return stats.get(f"{name}_{'_'.join(labels.values())}", 0.0)
    return 0.0


def aborted(engine: Any) -> float:
    return stat(engine.stats(), "requests_finished", reason="abort")


async def scrape(server: HTTPServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics parsed with prometheus_client's parser: {(sample name, sorted labels): value}."""
    async with httpx.AsyncClient() as client:
        response = await client.get(server.url + "/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample_sum(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """Sum of the samples named `name` whose labels include `labels` (-1 if there is none)."""
    values = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    return sum(values) if values else -1.0
