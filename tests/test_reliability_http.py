"""The gateway's HTTP edge: TCP_NODELAY, request read timeouts (slowloris), 499 on client disconnect, Allow on
405, body schemas in /openapi.json, --no-auth against configured keys, and the graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from services import cli
from services.gateway.engine_client import InProcessEngineClient
from services.gateway.server import HTTPServer, bind_socket
from tests.test_gateway_support import API_KEY, MODEL, running_gateway, sample_sum, scrape, started_engine

AUTH = {"Authorization": f"Bearer {API_KEY}"}


class HeldEngineClient(InProcessEngineClient):
    """Yields a request's outputs up to the first with text (the first SSE data line: a sampled token can
    detokenise to nothing), then holds the rest until `release` is set: a stream that is certainly still
    running while the test looks at the draining gateway."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.release = asyncio.Event()

    async def generate(self, request_id: str, prompt: Any, params: Any) -> AsyncIterator[Any]:
        first = True
        async for out in super().generate(request_id, prompt, params):
            yield out
            if first and out.delta_text:
                first = False
                await self.release.wait()


@pytest.fixture
async def engine(tiny_mixtral_dir: str) -> AsyncIterator[Any]:
    async with started_engine(tiny_mixtral_dir, max_num_seqs=4) as e:
        yield e


def test_accepted_sockets_have_tcp_nodelay() -> None:
    listener = bind_socket("127.0.0.1", 0)
    listener.listen()
    with socket.create_connection(listener.getsockname()):
        accepted, _ = listener.accept()
        assert accepted.proto == socket.IPPROTO_TCP  # what asyncio checks before setting TCP_NODELAY
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        accepted.close()
    listener.close()


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), 20)  # until the server closes the connection


async def test_slow_requests_get_408_and_disconnects_count_499(engine: Any, tiny_mixtral_dir: str) -> None:
    async with running_gateway([InProcessEngineClient(engine)], tiny_mixtral_dir) as (gateway, _):
        server = HTTPServer(gateway.app, "127.0.0.1", 0, read_timeout_s=0.3)
        await server.start()
        host, port = "127.0.0.1", server.port
        try:
            # Stalled mid-headers, then stalled mid-body: both get 408 and the connection is closed.
            headers = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Authorization: Bearer " + API_KEY.encode())
            for partial in (headers[:-3], headers + b'\r\nContent-Length: 100\r\n\r\n{"model"'):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(partial)
                assert (await _read_all(reader)).startswith(b"HTTP/1.1 408 ")
                writer.close()
            # A client that leaves while its body is being read: 499 in the metrics, no 500.
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(headers + b"\r\nContent-Length: 100\r\n\r\n{")
            await writer.drain()
            writer.close()
            await writer.wait_closed()
            # (The handler of the stalled body, cut off by the 408, counts as a disconnect too: 2.)
            for _ in range(200):  # the handler notices the disconnect on its next read
                samples = await scrape(server)
                if sample_sum(samples, "hintserve_http_requests_total", status="499") >= 2:
                    break
                await asyncio.sleep(0.02)
            assert (
                sample_sum(samples, "hintserve_http_requests_total", handler="/v1/completions", status="499")
                == 2
            )
            assert sample_sum(samples, "hintserve_http_requests_total", status="500") == -1
        finally:
            await server.stop()


async def test_allow_on_405_and_body_schemas_in_openapi(engine: Any, tiny_mixtral_dir: str) -> None:
    async with running_gateway([InProcessEngineClient(engine)], tiny_mixtral_dir) as (_, server):
        async with httpx.AsyncClient(base_url=server.url) as http:
            r = await http.get("/v1/completions", headers=AUTH)
            assert r.status_code == 405 and r.headers["allow"] == "POST"
            spec = (await http.get("/openapi.json")).json()
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "max_tokens" in spec["components"]["schemas"][model]["properties"]
    assert "ChatMessage" in spec["components"]["schemas"]  # nested models resolve


def test_no_auth_with_keys_configured_is_an_error(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setenv("HINTSERVE_API_KEYS", "k1")
    assert cli.main(["gateway", "--engines", "127.0.0.1:1", "--no-auth"]) == 2
    assert "--no-auth contradicts" in capsys.readouterr().err


async def _sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


@asynccontextmanager
async def _drain_begun_mid_stream(
    gateway: Any, server: HTTPServer, body: dict[str, Any]
) -> AsyncIterator[tuple[AsyncIterator[str], asyncio.Task]]:
    """A stream that has sent its first line, and the drain begun behind it (readiness off, listener closed):
    (the stream's remaining SSE lines, the drain task)."""
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = _sse_lines(response)
            await anext(lines)
            drain = asyncio.create_task(gateway.drain_and_stop(server))
            await asyncio.sleep(0)
            yield lines, drain


async def test_drain_lets_streams_finish_and_refuses_new_work(engine: Any, tiny_mixtral_dir: str) -> None:
    backend = HeldEngineClient(engine)
    async with running_gateway([backend], tiny_mixtral_dir, drain_timeout_s=60.0) as (gateway, server):
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as probe:
            assert (await probe.get("/ready")).status_code == 200  # a kept-alive connection for later
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "stream": True, "ignore_eos": True}
            async with _drain_begun_mid_stream(gateway, server, body) as (lines, drain):
                ready = await probe.get("/ready")
                assert ready.status_code == 503 and ready.json()["status"] == "draining"
                refused = await probe.post("/v1/completions", json={**body, "stream": False})
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "server_shutting_down"
                assert not drain.done()
                backend.release.set()
                rest = [line async for line in lines]
            assert rest[-1] == "[DONE]"
            assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
            await asyncio.wait_for(drain, 10)


async def test_a_second_signal_cuts_the_streams_and_still_shuts_the_app_down(
    engine: Any, tiny_mixtral_dir: str
) -> None:
    """Ctrl-C twice: the second ends every stream at once with an error event, and the server then stops
    the ordinary way, the app's shutdown included (uvicorn's forced exit skipped it: the gateway's engine
    pool was never stopped, and the lifespan task died cancelled, with a traceback)."""
    backend = HeldEngineClient(engine)
    async with running_gateway([backend], tiny_mixtral_dir, drain_timeout_s=60.0) as (gateway, server):
        app_stopped = asyncio.Event()
        stop_pool = gateway.stop

        async def stop() -> None:
            await stop_pool()
            app_stopped.set()

        gateway.stop = stop  # type: ignore[method-assign]
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with _drain_begun_mid_stream(gateway, server, body) as (lines, first):
            await asyncio.wait_for(gateway.drain_and_stop(server), 10)  # the first waits for the held stream
            backend.release.set()
            rest = [line async for line in lines]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "server_shutting_down"
        await asyncio.wait_for(first, 10)
        await asyncio.wait_for(server.serve_forever(), 10)
        assert app_stopped.is_set() and not server.server.force_exit
        assert engine.stats()["kv_blocks_used"] == 0


async def test_drain_timeout_cuts_streams_with_an_error_event(engine: Any, tiny_mixtral_dir: str) -> None:
    async with running_gateway([InProcessEngineClient(engine)], tiny_mixtral_dir, drain_timeout_s=0.0) as (
        gateway,
        server,
    ):
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with _drain_begun_mid_stream(gateway, server, body) as (lines, drain):
            rest = [line async for line in lines]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "server_shutting_down"
        await asyncio.wait_for(drain, 10)
        assert engine.stats()["kv_blocks_used"] == 0
