"""The strict HTTP edge (issue 30, item 7): ambiguous framing, duplicate credentials, oversized headers and
non-JSON bodies are refused with OpenAI-shaped JSON; 401 carries WWW-Authenticate; /ready's engine details
need a key; with authentication off on loopback, a foreign Host (DNS rebinding) or Origin (a web page) is
refused; gRPC ids are bounded before they are echoed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest

from services.common.protos import engine_pb2
from services.engine.grpc_client import EngineClient
from services.engine.grpc_server import serve_engine, stop_server
from services.gateway.engine_client import InProcessEngineClient
from tests.test_gateway_support import API_KEY, MODEL, running_gateway, started_engine

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()


@pytest.fixture
async def engine(tiny_mixtral_dir: str) -> AsyncIterator[Any]:
    async with started_engine(tiny_mixtral_dir, max_num_seqs=2) as e:
        yield e


async def _raw(port: int, request: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    """Sends bytes as they are (no client normalises them) -> (status, headers, JSON body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)  # every refusal here closes the connection
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


POST = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + API_KEY.encode() + b"\r\n"
RAW_CASES = [
    ("content-length-and-chunked", POST + b"Content-Type: application/json\r\nContent-Length: 5\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "ambiguous_framing"),
    ("two-content-lengths", POST + b"Content-Type: application/json\r\nContent-Length: 2\r\nContent-Length: 3"
     b"\r\n\r\n{}x", 400, "invalid_http_request"),
    ("two-authorizations", POST + b"Authorization: Bearer other\r\nContent-Type: application/json\r\n"
     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}", 400, "invalid_request"),
    ("headers-too-large", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431,
     "request_header_fields_too_large"),
    ("headers-too-large-still-arriving", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 40_000, 431,
     "request_header_fields_too_large"),
    ("form-body", POST + b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 2\r\n"
     b"Connection: close\r\n\r\n{}", 415, "unsupported_media_type"),
    ("text-plain-body", POST + b"Content-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}", 415,
     "unsupported_media_type"),
]


@pytest.mark.parametrize("case,request_bytes,status,code", RAW_CASES, ids=[c[0] for c in RAW_CASES])
async def test_strict_framing_and_headers(
    case: str, request_bytes: bytes, status: int, code: str, engine: Any, tiny_mixtral_dir: str
) -> None:
    async with running_gateway([InProcessEngineClient(engine)], tiny_mixtral_dir) as (_, server):
        got, _, body = await _raw(server.port, request_bytes)
        assert (got, body["error"]["code"]) == (status, code), body
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH) as http:  # and it goes on serving
            ok = await http.post("/v1/completions", content=BODY, headers={"content-type": "application/json"})
            assert ok.status_code == 200


async def test_401_challenges_and_ready_details_need_a_key(engine: Any, tiny_mixtral_dir: str) -> None:
    async with running_gateway([InProcessEngineClient(engine)], tiny_mixtral_dir) as (_, server):
        async with httpx.AsyncClient(base_url=server.url) as http:
            missing = await http.get("/v1/models")
            assert missing.status_code == 401 and missing.headers["www-authenticate"] == 'Bearer realm="hintserve"'
            wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
            assert wrong.headers["www-authenticate"] == 'Bearer realm="hintserve", error="invalid_token"'
            assert (await http.get("/ready")).json() == {"status": "ready"}  # probes: the bare status
            assert (await http.get("/ready", headers={"Authorization": "Bearer nope"})).json() == {"status": "ready"}
            detailed = (await http.get("/ready", headers=AUTH)).json()
            assert detailed["engines"][0]["address"] == "in-process"


@pytest.mark.parametrize(
    "headers,status",
    [
        ({}, 200),
        ({"Host": "localhost:8000"}, 200),
        ({"Host": "[::1]:8000", "Origin": "http://localhost:3000"}, 200),
        ({"Host": "evil.example"}, 403),  # DNS rebinding: a foreign name resolved to 127.0.0.1
        ({"Host": "127.0.0.1.evil.example"}, 403),
        ({"Origin": "https://evil.example"}, 403),  # a web page the user visits
        ({"Origin": "null"}, 403),  # a sandboxed page or a file
    ],
    ids=["plain", "localhost", "loopback-origin", "foreign-host", "lookalike-host", "foreign-origin", "null-origin"],
)
async def test_without_auth_on_loopback_host_and_origin_must_be_loopback(
    headers: dict[str, str], status: int, engine: Any, tiny_mixtral_dir: str
) -> None:
    async with running_gateway([InProcessEngineClient(engine)], tiny_mixtral_dir, api_keys=None) as (_, server):
        async with httpx.AsyncClient(base_url=server.url) as http:
            r = await http.post("/v1/completions", content=BODY, headers={"content-type": "application/json", **headers})
            assert r.status_code == status, r.text
            if status == 403:
                assert r.json()["error"]["code"] in ("host_not_allowed", "origin_not_allowed")


async def test_grpc_ids_are_bounded_before_they_are_echoed(engine: Any) -> None:
    server, port = await serve_engine(engine, "127.0.0.1", 0)
    try:
        async with EngineClient(f"127.0.0.1:{port}") as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.stub.Abort(engine_pb2.AbortRequest(request_id="x" * (1 << 20)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.value.details()) < 200
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.stub.Abort(engine_pb2.AbortRequest(request_id="unknown"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await stop_server(server, grace=0.5)


async def test_engine_grpc_token(engine: Any, tiny_mixtral_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a token every RPC but Health needs it; the gateway's clients send HINTSERVE_ENGINE_TOKEN."""
    server, port = await serve_engine(engine, "127.0.0.1", 0, token="engine-secret")
    try:
        async with EngineClient(f"127.0.0.1:{port}", token="wrong") as stranger:
            assert await stranger.health()  # probes need no token
            for call in (stranger.stats(), stranger.model_info(), stranger.abort("x")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await anext(stranger.generate("r", [5, 6, 7]))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        monkeypatch.setenv("HINTSERVE_ENGINE_TOKEN", "engine-secret")
        backend = EngineClient(f"127.0.0.1:{port}")
        async with running_gateway([backend], tiny_mixtral_dir) as (_, gateway):
            async with httpx.AsyncClient(base_url=gateway.url, headers=AUTH) as http:
                ok = await http.post("/v1/completions", content=BODY, headers={"content-type": "application/json"})
                assert ok.status_code == 200, ok.text
    finally:
        await stop_server(server, grace=0.5)


@pytest.mark.parametrize(
    "argv,env,says",
    [
        (["--host", "0.0.0.0"], {}, "is not loopback: set HINTSERVE_ENGINE_TOKEN"),
        (["--host", "127.0.0.1", "--no-auth"], {"HINTSERVE_ENGINE_TOKEN": "t"}, "--no-auth contradicts"),
    ],
    ids=["public-without-token", "no-auth-and-token"],
)
def test_engine_refuses_a_public_port_without_a_token(
    argv: list[str], env: dict[str, str], says: str, tiny_mixtral_dir: str, capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services import cli

    monkeypatch.delenv("HINTSERVE_ENGINE_TOKEN", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["engine", "--model", tiny_mixtral_dir, "--port", "0", *argv]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
