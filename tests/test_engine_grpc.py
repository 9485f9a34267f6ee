"""The engine's gRPC API end to end: a real server on a loopback port and a real (tiny) engine."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common import protos
from services.common.protos import engine_pb2
from services.engine.async_engine import AsyncLLMEngine
from services.engine.config import EngineConfig
from services.engine.grpc_client import EngineClient
from services.engine.grpc_server import serve_engine, stop_server
from services.engine.sampling_params import SamplingParams

PROMPT = "The quick brown fox"


@pytest.fixture
async def engine(tiny_mixtral_dir: str) -> AsyncIterator[Any]:
    # The core on a thread: these tests are about the gRPC boundary, and a spawned core process cost each one
    # 4 s of start-up (test_engine_process.py covers the process and its deaths).
    eng = AsyncLLMEngine(EngineConfig(model=tiny_mixtral_dir, max_num_seqs=4), core_in_thread=True)
    await eng.start()
    yield eng
    await eng.shutdown()


@pytest.fixture
async def client(engine: Any) -> AsyncIterator[EngineClient]:
    server, port = await serve_engine(engine, "127.0.0.1", 0)
    async with EngineClient(f"127.0.0.1:{port}") as c:
        await c.wait_ready()
        yield c
    await stop_server(server, grace=1.0)


def _request(request_id: str = "", prompt: str | list[int] = PROMPT, **sampling: Any) -> Any:
    req = engine_pb2.GenerateRequest(request_id=request_id, sampling=engine_pb2.SamplingParams(**sampling))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


async def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    """Poll `predicate()` until true; yields to the loop between polls so the engine keeps stepping."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.01)


async def _collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [out async for out in stream]


def test_protos_regenerate_only_when_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proto_dir = tmp_path / "protos"
    proto_dir.mkdir()
    shutil.copy(protos.find_proto_dir() / "engine.proto", proto_dir)
    out = tmp_path / "generated"
    monkeypatch.setattr(protos, "GENERATED_DIR", out)
    monkeypatch.setattr(protos, "find_proto_dir", lambda: proto_dir)

    assert protos.ensure_generated() == ["engine"]
    grpc_module = out / "engine_pb2_grpc.py"
    assert "from . import engine_pb2 as" in grpc_module.read_text()  # no bare-name import
    assert not list(out.glob(".protoc-*"))  # temp dir cleaned up
    old = os.stat(out / "engine_pb2.py").st_mtime_ns
    os.utime(proto_dir / "engine.proto", ns=(old - 10**9, old - 10**9))
    protos.ensure_generated()
    assert os.stat(out / "engine_pb2.py").st_mtime_ns == old  # up to date: not regenerated
    os.utime(proto_dir / "engine.proto", ns=(old + 10**9, old + 10**9))
    protos.ensure_generated()
    assert os.stat(out / "engine_pb2.py").st_mtime_ns > old  # proto newer: regenerated


async def test_generate_streams_text_prompt(client: EngineClient) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = await _collect(client.generate("text-1", PROMPT, params))
    assert len(outs) >= 2  # streamed, not one blob
    assert all(o.request_id == "text-1" for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length"
    ids = [t for o in outs for t in o.delta_token_ids]
    assert len(ids) == outs[-1].completion_tokens == 8
    assert outs[-1].prompt_tokens > 0


async def test_greedy_over_grpc_equals_in_process(engine: Any, client: EngineClient) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    local = await _collect(engine.generate("local", PROMPT, params))
    remote = await _collect(client.generate("remote", PROMPT, params))
    local_ids = [t for o in local for t in o.delta_token_ids]
    remote_ids = [t for o in remote for t in o.delta_token_ids]
    assert remote_ids == local_ids
    assert "".join(o.delta_text for o in remote) == "".join(o.delta_text for o in local)

    # A token-id prompt with the same ids generates the same continuation.
    prompt_ids = list(range(5, 5 + local[-1].prompt_tokens))
    by_ids_local = await _collect(engine.generate("local-ids", prompt_ids, params))
    by_ids_remote = await _collect(client.generate("remote-ids", prompt_ids, params))
    assert by_ids_remote[-1].prompt_tokens == len(prompt_ids)
    assert [t for o in by_ids_remote for t in o.delta_token_ids] == [
        t for o in by_ids_local for t in o.delta_token_ids
    ]


async def test_penalties_over_grpc_equal_in_process(engine: Any, client: EngineClient) -> None:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        ignore_eos=True,
        frequency_penalty=1.0,
        presence_penalty=-0.5,
        repetition_penalty=1.4,
    )
    plain_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def token_ids(stream: AsyncIterator[Any]) -> list[int]:
        return [t for o in await _collect(stream) for t in o.delta_token_ids]

    local = await token_ids(engine.generate("local", PROMPT, params))
    assert await token_ids(client.generate("remote", PROMPT, params)) == local
    assert await token_ids(client.generate("plain", PROMPT, plain_params)) != local  # the penalties act


async def test_empty_request_id_gets_generated(client: EngineClient) -> None:
    outs = await _collect(client.generate("", PROMPT, SamplingParams(max_tokens=2, seed=1)))
    assert outs[0].request_id
    assert len({o.request_id for o in outs}) == 1


@pytest.mark.parametrize(
    "request_kwargs",
    [
        {"temperature": -1.0},
        {"max_tokens": 0},
        {"top_p": 0.0},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -3.0},
        {"repetition_penalty": 0.0},  # set explicitly: not the unset default of 1
        {"prompt": ""},
        {"prompt": []},
    ],
    ids=[
        "temperature",
        "max_tokens",
        "top_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "empty-text",
        "empty-ids",
    ],
)
async def test_invalid_arguments(client: EngineClient, request_kwargs: dict[str, Any]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _collect(client.stub.Generate(_request("bad", **request_kwargs)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details()


async def test_prompt_over_context_length(client: EngineClient) -> None:
    max_len = (await client.model_info())["max_model_len"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _collect(client.stub.Generate(_request("long", [10] * (max_len + 1))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context length" in err.value.details()


async def test_cancel_stream_aborts_and_frees_kv_blocks(engine: Any, client: EngineClient) -> None:
    call = client.stub.Generate(_request("cancel-me", max_tokens=400, ignore_eos=True, temperature=0.0))
    first = await call.read()
    assert not first.finished
    assert engine.stats()["kv_blocks_used"] > 0
    call.cancel()
    await _wait_for(lambda: engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_running"] == 0)
    assert engine.stats()['requests_finished_total{reason="abort"}'] == 1  # aborted, not run to completion
    # The engine forgot the request: aborting it again over gRPC is NOT_FOUND.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.abort("cancel-me")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_client_generator_closed_early_aborts(engine: Any, client: EngineClient) -> None:
    stream = client.generate("close-me", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    async for out in stream:
        assert not out.finished
        break
    await stream.aclose()
    await _wait_for(lambda: engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_running"] == 0)
    assert engine.stats()['requests_finished_total{reason="abort"}'] == 1


async def test_abort_rpc(engine: Any, client: EngineClient) -> None:
    stream = client.generate("abort-me", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    first = await anext(stream)
    assert not first.finished
    await client.abort("abort-me")
    rest = await _collect(stream)
    assert sum(len(o.delta_token_ids) for o in [first, *rest]) < 400
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    await _wait_for(lambda: engine.stats()["kv_blocks_used"] == 0)
    assert engine.stats()['requests_finished_total{reason="abort"}'] == 1

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.abort("no-such-request")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_duplicate_request_id_already_exists(engine: Any, client: EngineClient) -> None:
    stream = client.generate("dup", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    await anext(stream)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _collect(client.generate("dup", PROMPT, SamplingParams(max_tokens=2)))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    await stream.aclose()
    # Once the first stream is gone and the engine has processed its abort, the id can be reused. (Reusing it
    # before then races with the engine's abort output, which is delivered by request id.)
    await _wait_for(lambda: engine.stats().get('requests_finished_total{reason="abort"}') == 1)
    outs = await _collect(client.generate("dup", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True)))
    assert outs[-1].finish_reason == "length"


async def test_health_model_info_stats(engine: Any, client: EngineClient) -> None:
    assert await client.health()
    info = await client.model_info()
    expected = engine.model_info()
    assert info["model_type"] == expected["model_type"] == "mixtral"
    for key in ("num_layers", "num_experts", "top_k", "max_model_len", "vocab_size"):
        assert info[key] == expected[key] > 0
    assert info["dtype"] and info["device"]

    await _collect(client.generate("s", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)))
    stats_reply = await client.stub.Stats(engine_pb2.StatsRequest())
    counters = dict(stats_reply.counters)
    assert set(engine.stats()) <= set(counters)
    assert counters["kv_blocks_capacity"] > 0
    assert stats_reply.num_running == 0 and stats_reply.num_waiting == 0


async def test_container_healthcheck_probes_the_engine(client: EngineClient) -> None:
    from services.common.healthcheck import check_engine

    assert await check_engine(client.address, 5.0) is None
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    assert await check_engine(dead, 0.5)  # unhealthy, with a reason
