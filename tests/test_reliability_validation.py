"""Issue 13's repros at the edge: each gets a 400 / INVALID_ARGUMENT naming the field, and the engine keeps
serving (a request after them still completes)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import pytest
import torch

from services.common.protos import engine_pb2
from services.engine.grpc_client import EngineClient
from services.engine.grpc_server import serve_engine, stop_server
from services.engine.sampler import sample
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence
from services.gateway.engine_client import InProcessEngineClient
from tests.test_gateway_support import API_KEY, MODEL, running_gateway, started_engine

AUTH = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}

# (path, body, the field the 400 must name); bodies are JSON text so lone surrogates survive.
REPROS = [
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [999999], "min_tokens": 1}, "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "top_k": 10**20, "temperature": 1}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [2**70], "min_tokens": 1}, "stop_token_ids.0"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [2147483647], "min_tokens": 1}, "stop_token_ids"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "a\ud800"}]},
        "messages[0].content",
    ),
    ("/v1/completions", {**COMPLETION, "prompt": "a\ud800"}, "prompt"),
    ("/v1/completions", {**COMPLETION, "stop": "a\ud800"}, "stop"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "stream": "yes"}, "stream"),
    ("/v1/completions", {**COMPLETION, "n": "2"}, "n"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2**40}, "max_tokens"),
]


def _deep(depth: int) -> bytes:
    return b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.fixture
async def gateways(tiny_mixtral_dir: str) -> AsyncIterator[SimpleNamespace]:
    """One engine behind two gateways: in-process and over gRPC (which needs every int to fit int32)."""
    async with started_engine(tiny_mixtral_dir, max_num_seqs=4) as engine:
        grpc_server, port = await serve_engine(engine, "127.0.0.1", 0)
        async with (
            running_gateway([InProcessEngineClient(engine)], tiny_mixtral_dir) as (_, local),
            running_gateway([EngineClient(f"127.0.0.1:{port}")], tiny_mixtral_dir) as (_, remote),
        ):
            yield SimpleNamespace(engine=engine, urls=[local.url, remote.url], port=port)
        await stop_server(grpc_server, grace=0.5)


async def _still_serves(http: httpx.AsyncClient, engine: Any) -> None:
    assert engine.is_running
    ok = await http.post("/v1/completions", content=json.dumps(COMPLETION), headers=AUTH)
    assert ok.status_code == 200, ok.text


async def test_repros_get_400_naming_the_field(gateways: SimpleNamespace) -> None:
    for url in gateways.urls:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for path, body, param in REPROS:
                r = await http.post(path, content=json.dumps(body), headers=AUTH)
                assert r.status_code == 400, (url, body, r.text)
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error"
                assert error["param"] == param, (body, error)
            deep = await http.post("/v1/completions", content=_deep(5000), headers=AUTH)
            assert deep.status_code == 400 and deep.json()["error"]["code"] == "invalid_json"
            await _still_serves(http, gateways.engine)


@pytest.mark.parametrize(
    "fields",
    [
        {"stop_token_ids": [2147483647], "min_tokens": 1},
        {"request_id": "x" * (1 << 20)},
        {"prompt": [5, 2147483647]},
    ],
    ids=["stop-id-out-of-vocab", "request-id-1MB", "prompt-id-out-of-vocab"],
)
async def test_grpc_invalid_argument_and_engine_keeps_serving(
    gateways: SimpleNamespace, fields: dict
) -> None:
    sampling = {k: v for k, v in fields.items() if k in ("stop_token_ids", "min_tokens")}
    request = engine_pb2.GenerateRequest(
        request_id=fields.get("request_id", "r"), sampling=engine_pb2.SamplingParams(max_tokens=4, **sampling)
    )
    request.token_ids.ids.extend(fields.get("prompt", [5, 6, 7]))
    async with EngineClient(f"127.0.0.1:{gateways.port}") as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.stub.Generate(request):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(err.value.details()) < 200  # names the problem, never echoes a 1 MB id
        assert await client.health()
        outs = [o async for o in client.generate("after", [5, 6, 7], SamplingParams(max_tokens=3))]
        assert outs[-1].finished


def test_sampler_clamps_what_admission_would_refuse() -> None:
    """Defence in depth: values that slipped past validation cannot raise inside the batch."""
    vocab = 32
    bad = SamplingParams(temperature=1.0, top_k=10**20, min_tokens=2, stop_token_ids=[10**9], seed=1)
    seqs = [Sequence("bad", [1, 2], bad, 16), Sequence("ok", [1, 2], SamplingParams(temperature=0.0), 16)]
    tokens = sample(torch.randn(2, vocab), seqs, (2**40,), torch.Generator().manual_seed(0))
    assert all(0 <= t < vocab for t in tokens)


# Every numeric request field at the fp32 / int32 / int64 edges and beyond (issue 30: repetition_penalty 3.5e38
# passed both validators and overflowed the sampler's fp32 tensor: a 500).
NUMERIC_FIELDS = [
    "temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens", "n", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "stop_token_ids", "max_completion_tokens", "prompt",
]
EDGES: list[Any] = [
    0, -0.0, 1, -1, 1e-46, 1e-40, 1.1754943508222875e-38, 3.4028234663852886e38, 3.5e38, 1e39, 1e308,
    -1e308, float("inf"), float("-inf"), float("nan"), 2**31 - 1, 2**31, -(2**31) - 1, 2**63, 2**64,
]


def _edge_body(field: str, value: Any) -> tuple[str, bytes]:
    if field == "max_completion_tokens":
        path, body = "/v1/chat/completions", {**CHAT, "max_tokens": 2}
    else:
        path, body = "/v1/completions", {**COMPLETION, "max_tokens": 2}
    body[field] = [value] if field in ("stop_token_ids", "prompt") else value
    return path, json.dumps(body).encode()  # inf / nan as JSON's Infinity / NaN, as a lax client sends them


async def test_every_numeric_field_at_the_edges_is_never_a_5xx(gateways: SimpleNamespace) -> None:
    for url in gateways.urls:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for field in NUMERIC_FIELDS:
                for value in EDGES:
                    path, body = _edge_body(field, value)
                    r = await http.post(path, content=body, headers=AUTH)
                    assert r.status_code in (200, 400), (url, field, value, r.status_code, r.text[:300])
                    if r.status_code == 400:
                        error = r.json()["error"]
                        named = (error["param"] or "").split(".")[0].split("[")[0]
                        # A huge max_tokens is a context-length error, which names the prompt (as OpenAI).
                        allowed = ("prompt", "messages") if error["code"] == "context_length_exceeded" else (field,)
                        assert named in allowed, (url, field, value, error)
            await _still_serves(http, gateways.engine)


@pytest.mark.parametrize("name", ["temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty"])
def test_engine_validator_admits_only_floats_the_sampler_can_hold(name: str) -> None:
    """Straight into SamplingParams (the engine's validator for gRPC and in-process callers): each edge
    value is refused naming the field, or the sampler runs with it and picks a token in the vocabulary."""
    vocab = 32
    for value in EDGES:
        params = SamplingParams(temperature=1.0, seed=3)
        setattr(params, name, value)
        try:
            params.validate(vocab)
        except ValueError as exc:
            assert getattr(exc, "param", None) == name, (name, value, exc)
            continue
        seq = Sequence("edge", [1, 2, 3], params, 16)
        logits = torch.randn(1, vocab) * 30
        [token] = sample(logits, [seq], (0,), torch.Generator().manual_seed(0))
        assert 0 <= token < vocab, (name, value)
