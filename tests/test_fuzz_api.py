"""Fuzzing the OpenAI endpoints (hypothesis): whatever the body, never a 5xx, and the engine still serves.

The strategies come from the gateway's own /openapi.json: every request-body field is fuzzed with values of
the right type at and beyond their bounds, values of the wrong type, lone surrogates and deep nesting; raw
byte bodies too. hypothesis rather than schemathesis: it is already a dependency, and targeted strategies
for the classes of bad input that once broke the engine (ids out of vocabulary, integers beyond int32/int64,
surrogates, recursion) find them in a few hundred examples, within the suite's time budget.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.engine_client import InProcessEngineClient
from tests.test_gateway_support import API_KEY, MODEL, running_gateway, started_engine

AUTH = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
PATHS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}
BASE = {
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
}
EXAMPLES = 150  # per test; the two tests together take about a minute on 2 busy cores


class LiveGateway:
    """An engine and a gateway on a loopback port, run by an event loop on their own thread, so that
    hypothesis (synchronous) can drive them with plain HTTP."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.url = ""
        self.engine: Any = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with started_engine(self.model_dir, max_num_seqs=8) as engine:
            async with running_gateway([InProcessEngineClient(engine)], self.model_dir) as (_, server):
                self.engine, self.url = engine, server.url
                self._ready.set()
                await self._stop.wait()

    def __enter__(self) -> LiveGateway:
        self._thread.start()
        assert self._ready.wait(120), "gateway did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture(scope="module")
def live(tiny_mixtral_dir: str) -> Iterator[tuple[LiveGateway, httpx.Client, dict[str, Any]]]:
    with LiveGateway(tiny_mixtral_dir) as gateway, httpx.Client(base_url=gateway.url, timeout=60) as http:
        yield gateway, http, http.get("/openapi.json").json()["components"]["schemas"]


_INTS = st.one_of(
    st.integers(-3, 8),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**20, 999_999]),
)
_WEIRD = st.one_of(
    st.none(),
    st.booleans(),
    _INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    # fp32's edges: beyond its max a value overflows the sampler's tensors, below its smallest normal a divisor
    st.sampled_from([3.4028234663852886e38, 3.5e38, 1e39, 1e308, -1e308, 1e-46, 1.1754943508222875e-38]),
    st.sampled_from(["", "yes", "2", "a\ud800", "\udfff", "\x00", "Hi", "POST", "stop"]),
    st.text(max_size=8),
    st.lists(_INTS, max_size=4),
    st.lists(st.sampled_from(["a", "\ud800", ""]), max_size=3),
    st.just([[1, 2], [3]]),
    st.just({"include_usage": "yes"}),
    st.just([{"role": "user", "content": "a\ud800"}]),
    st.just([{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    st.integers(1, 60).map(lambda d: json.loads("[" * d + "]" * d)),
)


@st.composite
def bodies(draw: st.DrawFn, schemas: dict[str, Any]) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(PATHS)))
    fields = sorted(schemas[PATHS[path]]["properties"]) + ["stop_token_ids", "logprobs", "tools", "unknown"]
    body = dict(BASE[path])
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        body[name] = draw(_WEIRD)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8 and not draw(st.booleans()):
        body["max_tokens"] = 8  # keep most valid requests short: fuzzing time goes to parsing, not decoding
    return path, json.dumps(body).encode()


def _check(http: httpx.Client, path: str, content: bytes) -> None:
    response = http.post(path, content=content, headers=AUTH)
    assert response.status_code < 500, (path, content[:300], response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"]


def _engine_still_serves(gateway: LiveGateway, http: httpx.Client) -> None:
    assert gateway.engine.is_running
    ok = http.post("/v1/completions", content=json.dumps(BASE["/v1/completions"]), headers=AUTH)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def test_fuzzed_fields_never_5xx(live: tuple[LiveGateway, httpx.Client, dict[str, Any]]) -> None:
    gateway, http, schemas = live

    @_SETTINGS
    @given(bodies(schemas))
    def run(case: tuple[str, bytes]) -> None:
        _check(http, *case)

    run()
    _engine_still_serves(gateway, http)


def test_fuzzed_raw_bodies_never_5xx(live: tuple[LiveGateway, httpx.Client, dict[str, Any]]) -> None:
    gateway, http, _ = live
    prefix = b'{"model": "' + MODEL.encode() + b'", "prompt": '

    depths = st.one_of(st.integers(1, 100), st.sampled_from([999, 1000, 5000, 20_000]))
    nested = st.tuples(depths, st.sampled_from([b"[", b'{"a":'])).map(lambda t: t[1] * t[0])

    @_SETTINGS
    @given(st.sampled_from(sorted(PATHS)), st.one_of(st.binary(max_size=64), nested), st.booleans())
    def run(path: str, raw: bytes, as_prompt: bool) -> None:
        _check(http, path, prefix + raw + b"}" if as_prompt else raw)

    run()
    _engine_still_serves(gateway, http)
