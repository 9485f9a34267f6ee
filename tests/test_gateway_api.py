"""The OpenAI API through the real `openai` client against a live gateway (loopback, in-process engine)."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from services.engine.grpc_client import EngineClient
from services.engine.sampling_params import SamplingParams
from services.gateway.engine_client import InProcessEngineClient
from tests.test_gateway_support import (
    API_KEY,
    MODEL,
    cached_tokenizer,
    openai_client,
    running_gateway,
    started_engine,
)

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
PROMPT = "The quick brown fox"
IGNORE_EOS = {"ignore_eos": True}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
async def served(tiny_mixtral_dir: str) -> AsyncIterator[SimpleNamespace]:
    async with started_engine(tiny_mixtral_dir, max_num_seqs=8) as engine:
        async with running_gateway([InProcessEngineClient(engine)], tiny_mixtral_dir) as (gateway, server):
            client = openai_client(server)
            yield SimpleNamespace(
                engine=engine, gateway=gateway, server=server, client=client, dir=tiny_mixtral_dir
            )
            await client.close()


def chat_prompt_ids(model_dir: str, messages: list[dict[str, str]]) -> list[int]:
    tok = cached_tokenizer(model_dir)
    return tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )


async def direct(engine: Any, prompt: Any, **params: Any) -> tuple[str, list[int], str]:
    """What the engine itself generates: the reference for the gateway's answers."""
    outs = [o async for o in engine.generate("direct", prompt, SamplingParams(**params))]
    return (
        "".join(o.delta_text for o in outs),
        [t for o in outs for t in o.delta_token_ids],
        outs[-1].finish_reason,
    )


async def test_chat_non_streaming_matches_engine(served: SimpleNamespace) -> None:
    r = await served.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, extra_body=IGNORE_EOS
    )
    ids = chat_prompt_ids(served.dir, MESSAGES)
    text, _, _ = await direct(served.engine, ids, temperature=0.0, max_tokens=8, ignore_eos=True)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids),
        8,
        len(ids) + 8,
    )
    # max_completion_tokens is OpenAI's newer name for the same thing
    r2 = await served.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=3, temperature=0, extra_body=IGNORE_EOS
    )
    assert r2.usage.completion_tokens == 3


async def test_chat_streaming_with_usage(served: SimpleNamespace) -> None:
    stream = await served.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = [c async for c in stream]
    ids = chat_prompt_ids(served.dir, MESSAGES)
    text, _, _ = await direct(served.engine, ids, temperature=0.0, max_tokens=8, ignore_eos=True)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), 8)
    assert all(c.usage is None for c in chunks[:-1])

    # Without include_usage no chunk carries usage.
    stream = await served.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True, extra_body=IGNORE_EOS
    )
    assert all(c.usage is None and c.choices for c in [c async for c in stream])


async def test_completions_text_token_ids_and_streaming(served: SimpleNamespace) -> None:
    ids = cached_tokenizer(served.dir).encode(PROMPT, add_special_tokens=False)
    text, _, _ = await direct(served.engine, PROMPT, temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt in (PROMPT, [PROMPT], ids, [ids]):
        r = await served.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=IGNORE_EOS
        )
        assert r.object == "text_completion" and r.choices[0].text == text
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
            len(ids),
            6,
            len(ids) + 6,
        )

    stream = await served.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == len(ids)

    # The legacy API's default max_tokens is 16; several prompts give one choice each.
    r = await served.client.completions.create(model=MODEL, prompt=[PROMPT, "hello"], extra_body=IGNORE_EOS)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 32


async def test_raw_sse_framing(served: SimpleNamespace) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient() as http:
        async with http.stream(
            "POST", served.server.url + "/v1/completions", json=body, headers=AUTH
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = (await resp.aread()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


async def test_stop_sequences_and_stop_token_ids(served: SimpleNamespace) -> None:
    base = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    full = (await served.client.completions.create(**base, extra_body=IGNORE_EOS)).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    r = await served.client.completions.create(**base, stop=[stop], extra_body=IGNORE_EOS)
    assert r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16

    _, token_ids, _ = await direct(served.engine, PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True)
    target = token_ids[3]
    r = await served.client.completions.create(
        **base, extra_body={"ignore_eos": True, "stop_token_ids": [target]}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == token_ids.index(target) + 1


async def test_seed_reproducibility_and_n(served: SimpleNamespace) -> None:
    sample = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, extra_body=IGNORE_EOS)
    a = await served.client.chat.completions.create(**sample, seed=7)
    b = await served.client.chat.completions.create(**sample, seed=7)
    c = await served.client.chat.completions.create(**sample, seed=8)
    assert a.choices[0].message.content == b.choices[0].message.content
    many = await served.client.chat.completions.create(**sample, seed=7, n=3)
    texts = [ch.message.content for ch in many.choices]
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert texts[0] == a.choices[0].message.content  # choice i uses seed + i
    assert texts[1] == c.choices[0].message.content
    assert len(set(texts)) == 3
    assert many.usage.completion_tokens == 36
    assert many.usage.prompt_tokens == a.usage.prompt_tokens  # the prompt counts once


async def test_n_streaming(served: SimpleNamespace) -> None:
    stream = await served.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        n=2,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = [c async for c in stream]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 10


async def test_api_key_errors(served: SimpleNamespace) -> None:
    wrong = openai_client(served.server, api_key="not-the-key")
    with pytest.raises(openai.AuthenticationError) as err:
        await wrong.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    await wrong.close()
    async with httpx.AsyncClient(base_url=served.server.url) as http:
        missing = await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT})
        assert missing.status_code == 401
        assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
        assert (await http.get("/v1/models")).status_code == 401
        # Probes and metrics stay open.
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200


async def test_unknown_model_404(served: SimpleNamespace) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await served.client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert err.value.code == "model_not_found"
    assert err.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, ["tools"]),
        ({"tool_choice": "auto", "logit_bias": {"1": 5}}, ["tool_choice", "logit_bias"]),
        ({"response_format": {"type": "json_object"}}, ["response_format"]),
        ({"logprobs": True, "functions": [{"name": "f"}]}, ["logprobs", "functions"]),
        ({"echo": True, "best_of": 2}, ["echo", "best_of"]),
    ],
)
async def test_unsupported_fields_400(
    served: SimpleNamespace, extra: dict[str, Any], named: list[str]
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await served.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=extra
        )
    assert err.value.code == "unsupported_field"
    assert all(name in err.value.message for name in named)


async def test_neutral_values_of_unsupported_fields_are_accepted(served: SimpleNamespace) -> None:
    r = await served.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        frequency_penalty=0,
        presence_penalty=0,
        logprobs=False,
        user="someone",
    )
    assert r.usage.completion_tokens <= 2


async def test_penalties_are_applied(served: SimpleNamespace) -> None:
    penalties = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    _, plain_ids, _ = await direct(served.engine, PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True)
    text, ids, _ = await direct(
        served.engine, PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True, **penalties
    )
    assert ids != plain_ids  # the penalties change the greedy continuation
    r = await served.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        frequency_penalty=penalties["frequency_penalty"],
        presence_penalty=penalties["presence_penalty"],
        extra_body={"ignore_eos": True, "repetition_penalty": penalties["repetition_penalty"]},
    )
    assert r.choices[0].text == text
    r = await served.client.chat.completions.create(  # the range's ends, and a repetition reward
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        frequency_penalty=-2,
        presence_penalty=2,
        extra_body={"repetition_penalty": 0.5},
    )
    assert r.usage.completion_tokens <= 4


@pytest.mark.parametrize(
    "penalty",
    [
        {"frequency_penalty": 2.5},
        {"frequency_penalty": -3},
        {"presence_penalty": 2.01},
        {"repetition_penalty": 0},
        {"repetition_penalty": -1.0},
    ],
)
async def test_out_of_range_penalties_400(served: SimpleNamespace, penalty: dict[str, float]) -> None:
    [(name, value)] = penalty.items()
    for create, prompt in (
        (served.client.chat.completions.create, {"messages": MESSAGES}),
        (served.client.completions.create, {"prompt": PROMPT}),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            await create(model=MODEL, max_tokens=2, extra_body=penalty, **prompt)
        error = err.value.body
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == name


async def test_context_length_exceeded_400(served: SimpleNamespace) -> None:
    long_messages = [{"role": "user", "content": "fox " * 600}]
    with pytest.raises(openai.BadRequestError) as err:
        await served.client.chat.completions.create(model=MODEL, messages=long_messages, max_tokens=2)
    assert err.value.code == "context_length_exceeded" and err.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        await served.client.completions.create(model=MODEL, prompt=[5] * 600, max_tokens=2)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:  # the prompt fits, prompt + max_tokens does not
        await served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=600)
    assert (
        err.value.code == "context_length_exceeded" and "maximum context length is 512" in err.value.message
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"[1, 2]", None),
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "n": 0}, "n"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].role",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "top_p": 0}, "top_p"),
    ],
)
async def test_malformed_and_schema_errors_400(
    served: SimpleNamespace, path: str, body: Any, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=served.server.url) as http:
        r = await http.post(path, content=content, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


async def test_body_over_limit_413(served: SimpleNamespace) -> None:
    limit = served.gateway.config.max_body_bytes
    with pytest.raises(openai.APIStatusError) as err:
        await served.client.completions.create(model=MODEL, prompt="a" * (limit + 1), max_tokens=2)
    assert err.value.status_code == 413 and err.value.code == "request_too_large"

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit counts what arrives
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(limit // 4096 + 1):
            yield b"a" * 4096
        yield b'"}'

    async with httpx.AsyncClient(base_url=served.server.url) as http:
        r = await http.post("/v1/completions", content=chunked(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_models_health_ready_and_unknown_route(served: SimpleNamespace) -> None:
    models = await served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with httpx.AsyncClient(base_url=served.server.url) as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        ready = await http.get("/ready", headers=AUTH)
        assert ready.status_code == 200 and ready.json()["engines"][0]["healthy"] is True
        assert (await http.get("/ready")).json() == {"status": "ready"}  # without a key: the bare status
        missing = await http.get("/v1/nothing-here", headers=AUTH)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


async def test_no_healthy_engine_503(tiny_mixtral_dir: str) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    async with running_gateway([EngineClient(dead)], tiny_mixtral_dir) as (gateway, server):
        client = openai_client(server)
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert err.value.status_code == 503 and err.value.code == "no_healthy_engine"
        assert err.value.response.headers["retry-after"] == "1"
        await client.close()
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.get("/ready")).status_code == 503
