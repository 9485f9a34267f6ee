"""The gateway over real gRPC engines: two engines in the pool, load spreading, failover, 503, recovery."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from services.engine.grpc_client import EngineClient
from services.engine.grpc_server import serve_engine, stop_server
from tests.test_gateway_support import (
    MODEL,
    openai_client,
    running_gateway,
    sample_sum,
    scrape,
    started_engine,
    stat,
)

PROMPT = "The quick brown fox"


@pytest.fixture
async def two_engines(tiny_mixtral_dir: str) -> AsyncIterator[list[SimpleNamespace]]:
    async with (
        started_engine(tiny_mixtral_dir, max_num_seqs=8) as e1,
        started_engine(tiny_mixtral_dir, max_num_seqs=8) as e2,
    ):
        engines = []
        for engine in (e1, e2):
            server, port = await serve_engine(engine, "127.0.0.1", 0)
            engines.append(
                SimpleNamespace(engine=engine, server=server, port=port, address=f"127.0.0.1:{port}")
            )
        yield engines
        for e in engines:
            await stop_server(e.server, grace=0.5)


def received(engine: Any) -> float:
    return stat(engine.stats(), "requests_received")


async def _complete(client: openai.AsyncOpenAI, max_tokens: int = 4) -> openai.types.Completion:
    return await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, extra_body={"ignore_eos": True}
    )


async def test_least_outstanding_routing_spreads_load(
    two_engines: list[SimpleNamespace], tiny_mixtral_dir: str
):
    clients = [EngineClient(e.address) for e in two_engines]
    async with running_gateway(clients, tiny_mixtral_dir) as (gateway, server):
        assert all(h.healthy for h in gateway.pool.engines)
        client = openai_client(server)
        results = await asyncio.gather(*[_complete(client) for _ in range(8)])
        assert all(r.usage.completion_tokens == 4 for r in results)
        counts = [received(e.engine) for e in two_engines]
        assert sum(counts) == 8 and min(counts) >= 2, counts  # both engines served
        # Sequential requests alternate (ties rotate): one more each.
        for _ in range(2):
            await _complete(client)
        assert [received(e.engine) for e in two_engines] == [c + 1 for c in counts]
        await client.close()


async def test_failover_then_503_then_recovery(two_engines: list[SimpleNamespace], tiny_mixtral_dir: str):
    a, b = two_engines
    async with running_gateway([EngineClient(a.address), EngineClient(b.address)], tiny_mixtral_dir) as (
        gateway,
        server,
    ):
        client = openai_client(server)
        handle_a, handle_b = gateway.pool.engines
        await stop_server(a.server, grace=0.1)  # the pool does not know yet: no health round in between
        before_b = received(b.engine)
        for _ in range(2):  # one of the two is routed to A (ties rotate), fails to connect, fails over to B
            r = await _complete(client)
            assert r.choices[0].finish_reason == "length"
        assert received(b.engine) - before_b == 2
        assert not handle_a.healthy and handle_a.failures == 1 and handle_b.healthy
        samples = await scrape(server)
        assert sample_sum(samples, "hintserve_gateway_engine_failovers_total", engine=a.address) == 1
        assert sample_sum(samples, "hintserve_gateway_engine_healthy", engine=a.address) == 0

        await stop_server(b.server, grace=0.1)
        with pytest.raises(openai.InternalServerError) as err:  # B fails too: nowhere left to go
            await _complete(client)
        assert err.value.status_code == 503
        with pytest.raises(openai.InternalServerError) as err:  # both known down: refused at admission
            await _complete(client)
        assert err.value.code == "no_healthy_engine"
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.get("/ready")).status_code == 503

        # A comes back on its port; the periodic health round (run here directly) brings it back.
        a.server, _ = await serve_engine(a.engine, "127.0.0.1", a.port)

        # (gRPC reconnects with backoff, so the first rounds may still fail: poll with a deadline.)
        deadline = time.monotonic() + 15
        while not handle_a.healthy:
            assert time.monotonic() < deadline, "engine A not healthy again"
            await gateway.pool.check_all()
            await asyncio.sleep(0.05)
        r = await _complete(client)
        assert r.usage.completion_tokens == 4
        await client.close()


async def test_engine_validation_errors_over_grpc(two_engines: list[SimpleNamespace], tiny_mixtral_dir: str):
    """Without a tokenizer in the gateway the engine checks the context window; its INVALID_ARGUMENT maps to
    the same 400 context_length_exceeded, and chat explains that it needs the tokenizer."""
    async with running_gateway([EngineClient(two_engines[0].address)], tiny_mixtral_dir, tokenizer=None) as (
        gateway,
        server,
    ):
        client = openai_client(server)
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model=MODEL, prompt="fox " * 600, max_tokens=2)
        assert err.value.code == "context_length_exceeded" and err.value.body["param"] == "prompt"
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model=MODEL, prompt=[10_000], max_tokens=2)  # out of vocabulary
        assert "out of range" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert "--tokenizer" in err.value.message
        r = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 3
        await client.close()
