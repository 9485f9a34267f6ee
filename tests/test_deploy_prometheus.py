"""deploy/prometheus and the dashboard's PromQL against the real Prometheus (Debian's package; .ci/run
installs it): promtool checks the config and every expression, and a real Prometheus on loopback scrapes a
live `hintserve serve` with the config's jobs pointed at it, then answers queries for our series."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.deploy_files import PROMETHEUS_CONFIG, dashboard_exprs
from tests.live_processes import LiveProcess, free_port, hintserve, poll

API_KEY = "prometheus-test-key"
# Free ports reported back; the policy whose series (offload, hints) the dashboard shows.
SERVE_FLAGS = "--port 0 --metrics-port 0 --offload-policy hintserve --expert-cache-gb 0.004"


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian: apt-get install prometheus; .ci/run does it)")
    return path


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_binary("promtool"), *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_config() -> None:
    result = _promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    # promtool parses a rules file's expressions: one recording rule per dashboard query.
    exprs = dashboard_exprs()
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:q{i}", "expr": e} for i, (_, e) in enumerate(exprs)],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0 and f"{len(exprs)} rules found" in result.stdout, (
        result.stdout + result.stderr
    )
    # Not vacuous: a broken expression is refused.
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "r:x", "expr": "sum(rate(x[1m])"}]}]})
    )
    assert _promtool("check", "rules", str(path)).returncode != 0


def _loopback_config(targets: dict[str, str], tmp_path: Path) -> Path:
    """deploy/prometheus/prometheus.yml with each job's DNS discovery replaced by its loopback target; jobs
    without a target here are left out (serve embeds the predictor: it has no endpoint of its own)."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert {job["job_name"] for job in config["scrape_configs"]} == {"gateway", "engine", "predictor"}
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] in targets:
            job.pop("dns_sd_configs")
            job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
            jobs.append(job)
    config["scrape_configs"] = jobs
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")  # a fast first scrape
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = _promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    return path


@pytest.fixture(scope="module")
def serve(demo_model_dir: str) -> Iterator[SimpleNamespace]:
    _binary("prometheus")  # skip before loading a model for nothing
    process = LiveProcess(
        "serve",
        hintserve("serve", "--model", demo_model_dir, *SERVE_FLAGS.split()),
        env={"HINTSERVE_API_KEYS": API_KEY},
    )
    try:
        metrics = process.wait_for_line(r"engine metrics at http://([\d.]+:\d+)/metrics").group(1)
        api = process.wait_for_line(r"with the OpenAI API at http://([\d.]+:\d+)/v1").group(1)
        yield SimpleNamespace(api=api, engine_metrics=metrics)
    finally:
        assert process.stop(timeout_s=30) == 0, process.output()


def _query(base: str, promql: str) -> dict:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_real_prometheus_scrapes_a_live_serve(serve: SimpleNamespace, tmp_path: Path) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{serve.api}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    for _ in range(2):
        client.completions.create(
            model="demo-moe", prompt="def reverse(xs):", max_tokens=8, extra_body={"ignore_eos": True}
        )

    config = _loopback_config({"gateway": serve.api, "engine": serve.engine_metrics}, tmp_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    prometheus = LiveProcess(
        "prometheus",
        [
            _binary("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        cwd=tmp_path,
    )
    try:
        prometheus.wait_for_line(r"Server is ready to receive web requests", timeout_s=60)

        def generated() -> list:
            return _query(base, 'hintserve_generation_tokens_total{job="gateway"}')["data"]["result"]

        series = poll(generated, "Prometheus to scrape the gateway", timeout_s=30)
        assert float(series[0]["value"][1]) == 16 and series[0]["metric"]["model_name"] == "demo-moe"
        engine = poll(
            lambda: _query(base, 'hintserve_engine_generation_tokens_total{job="engine",engine=""}')["data"][
                "result"
            ],
            "Prometheus to scrape the engine",
            timeout_s=30,
        )
        assert float(engine[0]["value"][1]) == 16
        up = {r["metric"]["job"]: r["value"][1] for r in _query(base, "up")["data"]["result"]}
        assert up == {"gateway": "1", "engine": "1"}
        # The real server evaluates every dashboard query (the predictor's own series are absent here).
        for title, expr in dashboard_exprs():
            assert _query(base, expr)["status"] == "success", (title, expr)
    finally:
        assert prometheus.stop() == 0, prometheus.output()
