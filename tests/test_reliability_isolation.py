"""Step-loop isolation: a request whose step raises fails alone (its error reaches the client, its KV blocks
are freed) and the engine goes on serving; the gateway does not retry it on another engine; a loop that
cannot go on stops the engine (NOT_SERVING) and the serving process exits non-zero."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

import services.engine.model_runner as model_runner
from services.engine.cli import until_stopped_or_dead
from services.engine.errors import EngineDeadError, RequestFailedError
from services.engine.grpc_client import EngineClient
from services.engine.grpc_server import serve_engine, stop_server
from services.engine.sampling_params import SamplingParams
from tests.test_gateway_support import MODEL, openai_client, running_gateway, started_engine, stat

POISON = "POISON"  # a stop string the injected fault recognises: any real request could carry it


@pytest.fixture
def poisoned_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler raises for any batch holding a poisoned sequence (as an out-of-vocab index once did)."""
    real = model_runner.sample

    def sample(logits: Any, seqs: list[Any], *args: Any) -> list[int]:
        if any(POISON in s.params.stop for s in seqs):
            raise IndexError("index 999999 is out of bounds for dimension 1")
        return real(logits, seqs, *args)

    monkeypatch.setattr(model_runner, "sample", sample)


async def _drain(stream: AsyncIterator[Any]) -> list[Any]:
    return [out async for out in stream]


async def test_poisoned_sequence_fails_alone(tiny_mixtral_dir: str, poisoned_sampler: None) -> None:
    async with started_engine(tiny_mixtral_dir, max_num_seqs=4) as engine:
        good = [
            engine.generate(f"good-{i}", "The quick brown fox", SamplingParams(max_tokens=6, ignore_eos=True))
            for i in range(3)
        ]
        poisoned = engine.generate(
            "poison", "The quick brown fox", SamplingParams(max_tokens=6, stop=[POISON])
        )
        results = await asyncio.gather(*(_drain(s) for s in good), _drain(poisoned), return_exceptions=True)
        assert all(isinstance(r, list) and r[-1].completion_tokens == 6 for r in results[:3]), results
        assert isinstance(results[3], RequestFailedError) and "IndexError" in str(results[3])
        assert engine.is_running
        stats = engine.stats()
        assert stats["kv_blocks_used"] == 0  # the failed request's blocks are back
        assert stat(stats, "requests_finished", reason="error") == 1


async def test_poison_request_behind_a_gateway_with_two_engines(
    tiny_mixtral_dir: str, poisoned_sampler: None
) -> None:
    async with (
        started_engine(tiny_mixtral_dir, max_num_seqs=8) as e1,
        started_engine(tiny_mixtral_dir, max_num_seqs=8) as e2,
    ):
        servers = [await serve_engine(e, "127.0.0.1", 0) for e in (e1, e2)]
        clients = [EngineClient(f"127.0.0.1:{port}") for _, port in servers]
        async with running_gateway(clients, tiny_mixtral_dir) as (gateway, server):
            client = openai_client(server)

            async def normal() -> str | None:
                r = await client.completions.create(
                    model=MODEL, prompt="Hello", max_tokens=8, extra_body={"ignore_eos": True}
                )
                return r.choices[0].finish_reason

            async def poisoned() -> openai.APIStatusError:
                with pytest.raises(openai.APIStatusError) as err:
                    await client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, stop=[POISON])
                return err.value

            outcome = await asyncio.gather(
                *(normal() for _ in range(4)), poisoned(), *(normal() for _ in range(2))
            )
            error = outcome[4]
            assert error.status_code == 500 and error.code == "request_failed"
            assert [r for i, r in enumerate(outcome) if i != 4] == ["length"] * 6
            received = [stat(e.stats(), "requests_received") for e in (e1, e2)]
            assert sum(received) == 7  # the poisoned request reached one engine only: never retried
            assert all(h.healthy and h.failures == 0 for h in gateway.pool.engines)
            assert e1.is_running and e2.is_running
            await client.close()
        for s, _ in servers:
            await stop_server(s, grace=0.5)


async def test_unrecoverable_loop_failure_stops_the_engine(
    tiny_mixtral_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> list[int]:
        raise RuntimeError("device lost")

    monkeypatch.setattr(model_runner, "sample", broken)
    async with started_engine(tiny_mixtral_dir, max_num_seqs=4) as engine:
        server, port = await serve_engine(engine, "127.0.0.1", 0)
        streams = [engine.generate(f"r{i}", "Hello", SamplingParams(max_tokens=4)) for i in range(6)]
        results = await asyncio.gather(*(_drain(s) for s in streams), return_exceptions=True)
        # Every sequence failing on its own blames the engine: in-flight requests get EngineDeadError
        # (the gateway retries those elsewhere), the loop stops, health says NOT_SERVING.
        assert any(isinstance(r, EngineDeadError) for r in results), results
        assert not engine.is_running
        async with EngineClient(f"127.0.0.1:{port}") as client:
            assert not await client.health()
        code = await asyncio.wait_for(until_stopped_or_dead(asyncio.Event(), engine), 10)
        assert code == 1  # `hintserve engine` / `serve` exit with it, so an orchestrator restarts them
        await stop_server(server, grace=0.1)
