"""The compose layout run natively: Redis (the one on 127.0.0.1:6379), predictor, engine and gateway as
separate processes talking gRPC and Redis, started with the flags and env vars docker-compose.yml gives
them. A chat request goes through, hints reach the engine, and every series the Grafana dashboard selects
is exported by these processes' /metrics endpoints."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import redis

from tests.deploy_files import compose_with_example_env, dashboard_exprs, parse_command
from tests.live_processes import LiveProcess, hintserve, poll, sample_value, scrape
from tests.promql_selectors import Matcher, Selector, satisfied, selectors

REDIS_URL = "redis://127.0.0.1:6379/0"
API_KEY = "deploy-test-key"


def _native_command(service: str, changes: dict[str, str | bool | None]) -> list[str]:
    """The service's compose command with these flags set (a value, True for a switch) or dropped (None):
    container addresses become the loopback defaults, fixed ports become 0 (the service reports its own)."""
    words = compose_with_example_env()["services"][service]["command"][1:]
    out, i = [], 0
    while i < len(words):
        if words[i] in changes:
            i += 2  # every flag compose passes here takes a value
        else:
            out.append(words[i])
            i += 1
    for flag, value in changes.items():
        if value is True:
            out.append(flag)
        elif value is not None:
            out += [flag, str(value)]
    return hintserve(*out)


@pytest.fixture(scope="module")
def layout(demo_model_dir: str) -> Iterator[SimpleNamespace]:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    engine_id = f"deploy-{uuid.uuid4().hex[:8]}"  # its own hint channel and predictor group
    predictor = LiveProcess(
        "predictor",
        _native_command(
            "predictor",
            {
                "--grpc-host": None,
                "--metrics-host": None,
                "--snapshot-dir": None,
                "--grpc-port": "0",
                "--metrics-port": "0",
                "--engine-id": engine_id,
                "--skip-backlog": True,
                # Generous: on a loaded 2-core machine a context may wait; it must still be answered.
                "--max-context-age-ms": "10000",
            },
        ),
        env={"HINTSERVE_REDIS_URL": REDIS_URL},
    )
    # The engine's knobs through the same env vars as in compose, sized for a CPU (no GPU here).
    engine_env = {
        k: str(v) for k, v in compose_with_example_env()["services"]["engine"]["environment"].items()
    }
    engine_env.update(
        HINTSERVE_DEVICE="cpu",
        HINTSERVE_LINK="emulated",
        HINTSERVE_EXPERT_CACHE_GB="0.004",
        HINTSERVE_REDIS_URL=REDIS_URL,
        HINTSERVE_ENGINE_ID=engine_id,
    )
    engine = LiveProcess(
        "engine",
        _native_command(
            "engine",
            {
                "--host": None,
                "--metrics-host": None,
                "--model": demo_model_dir,
                "--port": "0",
                "--metrics-port": "0",
            },
        ),
        env=engine_env,
    )
    processes = [predictor, engine]
    try:
        predictor_metrics = predictor.wait_for_line(r"metrics (http://\S+/metrics)").group(1)
        engine_port = engine.wait_for_line(r"engine serving \S+ on [\d.]+:(\d+)").group(1)
        engine_metrics = engine.wait_for_line(r"engine metrics at (http://\S+/metrics)").group(1)
        gateway = LiveProcess(
            "gateway",
            _native_command(
                "gateway",
                {
                    "--host": None,
                    "--engines": f"127.0.0.1:{engine_port}",
                    "--tokenizer": demo_model_dir,
                    "--port": "0",
                },
            ),
            # The engine token as compose hands it to both (the engine got it with the compose env above).
            env={"HINTSERVE_API_KEYS": API_KEY, "HINTSERVE_ENGINE_TOKEN": engine_env["HINTSERVE_ENGINE_TOKEN"]},
        )
        processes.append(gateway)
        gateway_url = gateway.wait_for_line(r"gateway serving .* at (http://\S+)/v1 \(1/1").group(1)
        yield SimpleNamespace(
            gateway_url=gateway_url,
            metrics={
                "gateway": f"{gateway_url}/metrics",
                "engine": engine_metrics,
                "predictor": predictor_metrics,
            },
            model=parse_command(compose_with_example_env()["services"]["gateway"]["command"]).model_name,
            processes=processes,
        )
    finally:
        codes = {p.name: p.stop() for p in reversed(processes)}
        assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="module")
def chatted(layout: SimpleNamespace) -> SimpleNamespace:
    """Chat through the gateway until the engine has received hints from the predictor."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{layout.gateway_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    replies = []

    def chat_until_hinted() -> bool:
        reply = client.chat.completions.create(
            model=layout.model,
            messages=[{"role": "user", "content": "Write a function that reverses a list."}],
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},  # long enough for hints to flow
        )
        replies.append(reply)
        return sample_value(layout.metrics["engine"], "hintserve_engine_offload_hints_received_total") > 0

    poll(chat_until_hinted, "hints delivered to the engine", timeout_s=120, every_s=0)
    layout.replies = replies
    return layout


def test_chat_through_the_layout_delivers_hints(chatted: SimpleNamespace) -> None:
    reply = chatted.replies[0]
    assert reply.model == chatted.model and reply.choices[0].message.content
    assert reply.usage.completion_tokens == 24
    engine, predictor = chatted.metrics["engine"], chatted.metrics["predictor"]
    assert sample_value(engine, "hintserve_engine_predictor_link_connected") == 1
    assert sample_value(engine, "hintserve_engine_predictor_hint_batches_received_total") > 0
    assert sample_value(predictor, "hintserve_predictor_hints_published_total") > 0
    assert sample_value(predictor, "hintserve_predictor_broker_connected") == 1


def test_every_dashboard_selector_matches_a_live_series(chatted: SimpleNamespace) -> None:
    series = [sample for url in chatted.metrics.values() for sample in scrape(url)]
    missing = sorted(
        {
            f"{title}: {selector}"
            for title, expr in dashboard_exprs()
            for selector in selectors(expr)
            if not satisfied(selector, series)
        }
    )
    assert not missing, "dashboard selectors no live series satisfies:\n" + "\n".join(missing)
    assert len({s for _, expr in dashboard_exprs() for s in selectors(expr)}) >= 30
    assert not satisfied(Selector("hintserve_engine_num_running", (Matcher("engine", "=", "nope"),)), series)
