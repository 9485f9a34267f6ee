"""loadgen against real OpenAI-compatible servers on loopback: a small FastAPI app on uvicorn that streams
`max_tokens` chunks with a controlled delay, and `hintserve serve` when the gateway has it."""

from __future__ import annotations

import argparse
import asyncio
import csv
import importlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loadgen import cli
from loadgen.replay import ReplayConfig, arun_replay, run_replay

FAIL_OUTPUT_LEN = 7  # the fake server answers 500 to requests asking for this many tokens
VLLM_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput") + tuple(
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p90", "p99"))


class FakeServer:
    """A streaming /v1/completions endpoint in its own thread. Its socket listens before uvicorn starts, so
    clients can connect at once (the kernel queues them): no readiness wait needed."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.delay_s = 0.005  # between tokens: stands in for decode time
        self.count_tokens: Callable[[str], int] = lambda text: len(text.split())
        self.on_request: Callable[[int], None] | None = None
        self.in_flight = self.peak = 0
        app = FastAPI()
        app.post("/v1/completions")(self.completions)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    async def completions(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        if self.on_request:
            self.on_request(len(self.bodies))
        n = body["max_tokens"]
        if n == FAIL_OUTPUT_LEN:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        prompt_tokens = self.count_tokens(body["prompt"])

        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def stream():
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                for i in range(n):
                    await asyncio.sleep(self.delay_s)
                    yield event({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
                yield event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
                    yield event({"choices": [], "usage": usage})
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    def reset(self) -> None:
        self.bodies.clear()
        self.delay_s, self.on_request, self.peak = 0.005, None, 0
        self.count_tokens = lambda text: len(text.split())

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def server(fake_server: FakeServer) -> FakeServer:
    fake_server.reset()
    return fake_server


def write_trace(path: Path, rows: list[tuple[float, int, int]]) -> str:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{t},{i},{o}" for t, i, o in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_replay_tokens_metrics_and_outputs(server: FakeServer, tmp_path: Path) -> None:
    rows = [(0.0, 12, 5), (0.1, 30, 1), (0.15, 8, 20), (0.3, 50, 3)]
    cfg = ReplayConfig(url=server.url, model="fake", trace=write_trace(tmp_path / "t.csv", rows), speedup=2.0,
                       prompts="synthetic", goodput=["ttft:10000", "e2el:10000"], json_path=str(tmp_path / "r.json"),
                       csv_path=str(tmp_path / "r.csv"), plot_path=str(tmp_path / "r.png"))
    result = run_replay(cfg)
    assert (result["completed"], result["failed"], result["num_prompts"]) == (4, 0, 4)
    assert result["total_output_tokens"] == 29 and result["total_input_tokens"] == 100
    assert result["output_len_mismatches"] == 0 and result["prompt_len_mismatches"] == 0
    assert [b["max_tokens"] for b in server.bodies] == [5, 1, 20, 3]
    assert all(b["ignore_eos"] and b["stream"] and b["stream_options"]["include_usage"] for b in server.bodies)
    assert 0 < result["mean_ttft_ms"] < result["mean_e2el_ms"] and result["p99_ttft_ms"] <= result["p99_e2el_ms"]
    assert result["mean_tpot_ms"] >= 4.0 and result["mean_itl_ms"] >= 4.0  # the server sleeps 5 ms per token
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["duration"] >= 0.15  # the last arrival, 0.3 s / speedup 2
    saved = json.loads((tmp_path / "r.json").read_text())
    assert all(k in saved for k in VLLM_KEYS)
    assert saved["completed"] == 4 and len(saved["ttfts"]) == 4
    with open(tmp_path / "r.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(r["completion_tokens"]) for r in table] == [5, 1, 20, 3]
    assert all(float(r["start_s"]) >= float(r["arrival_s"]) for r in table)
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_exact_prompt_lengths_end_to_end(server: FakeServer, tiny_mixtral_dir: str, tmp_path: Path) -> None:
    from loadgen.prompts import load_tokenizer

    tok = load_tokenizer(tiny_mixtral_dir)
    server.count_tokens = lambda text: len(tok(text)["input_ids"])
    rows = [(0.0, 3, 2), (0.0, 17, 2), (0.0, 400, 2), (0.0, 900, 200)]
    cfg = ReplayConfig(url=server.url, model="fake", tokenizer=tiny_mixtral_dir, trace=write_trace(tmp_path / "t.csv",
                       rows), max_context=512, prompts="synthetic")
    result = run_replay(cfg)
    assert result["completed"] == 4 and result["prompt_len_mismatches"] == 0
    assert result["input_lens"] == [3, 17, 400, 312] and result["output_lens"] == [2, 2, 2, 200]


def test_errors_are_counted_not_fatal(server: FakeServer, tmp_path: Path) -> None:
    rows = [(0.0, 5, 3), (0.0, 5, FAIL_OUTPUT_LEN), (0.0, 5, 4), (0.0, 5, FAIL_OUTPUT_LEN)]
    cfg = ReplayConfig(url=server.url, model="fake", trace=write_trace(tmp_path / "t.csv", rows), prompts="synthetic")
    result = run_replay(cfg)
    assert (result["completed"], result["failed"]) == (2, 2)
    assert result["error_counts"] == {"HTTP 500": 2} and "injected failure" in result["error_samples"][0]

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    result = run_replay(ReplayConfig(url=dead, model="fake", trace=cfg.trace, prompts="synthetic"))
    assert (result["completed"], result["failed"]) == (0, 4)
    assert result["error_counts"] == {"ConnectError": 4} and result["mean_ttft_ms"] == 0.0


def test_speedup_and_duration_bound_the_run(server: FakeServer, tmp_path: Path) -> None:
    rows = [(float(t), 4, 2) for t in range(10)]
    cfg = ReplayConfig(url=server.url, model="fake", trace=write_trace(tmp_path / "t.csv", rows), speedup=20.0,
                       duration=0.2, prompts="synthetic", csv_path=str(tmp_path / "r.csv"))
    result = run_replay(cfg)
    assert result["num_prompts"] == result["completed"] == len(server.bodies) == 4  # sent at 0, .05, .1, .15 s
    with open(tmp_path / "r.csv") as f:
        starts = [(float(r["arrival_s"]), float(r["start_s"])) for r in csv.DictReader(f)]
    assert [a for a, _ in starts] == pytest.approx([0.0, 0.05, 0.1, 0.15])
    assert all(s >= a for a, s in starts)
    assert 0.15 <= result["duration"] < 5.0


def test_poisson_with_max_concurrency(server: FakeServer) -> None:
    cfg = ReplayConfig(url=server.url, model="fake", workload="poisson", rate=float("inf"), num_requests=6,
                       input_len=4, output_len=3, max_concurrency=2, prompts="synthetic")
    result = run_replay(cfg)
    assert result["completed"] == 6 and result["total_output_tokens"] == 18
    assert result["max_concurrent_requests"] == 2 and server.peak <= 2


async def test_stop_gives_partial_report(server: FakeServer, tmp_path: Path) -> None:
    """The stop event (Ctrl-C in the CLI) ends the run: in-flight requests are cancelled, the rest reported."""
    server.delay_s = 30.0  # nothing finishes on its own
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    server.on_request = lambda n: loop.call_soon_threadsafe(stop.set) if n == 2 else None
    rows = [(0.0, 4, 3), (0.0, 4, 3), (100.0, 4, 3)]
    cfg = ReplayConfig(url=server.url, model="fake", trace=write_trace(tmp_path / "t.csv", rows), prompts="synthetic",
                       json_path=str(tmp_path / "r.json"))
    result = await arun_replay(cfg, stop)
    assert result["interrupted"] and result["cancelled"] == 2 and result["failed"] == result["completed"] == 0
    assert result["duration"] < 30.0 and json.loads((tmp_path / "r.json").read_text())["interrupted"]


def test_cli_poisson_prints_vllm_table(server: FakeServer, tmp_path: Path, capsys) -> None:
    code = cli.main(["poisson", "--url", server.url + "/v1", "--model", "fake", "--rate", "50", "--num-requests",
                     "3", "--input-len", "6", "--output-len", "4", "--prompts", "synthetic", "--no-progress",
                     "--goodput", "ttft:5000", "tpot:1000", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0 and "Serving Benchmark Result" in out and "Request goodput (req/s):" in out
    assert "Successful requests:                     3" in out
    assert json.loads((tmp_path / "r.json").read_text())["total_output_tokens"] == 12


def _gateway_has_serve() -> bool:
    try:
        module = importlib.import_module("services.gateway.cli")
    except ImportError:
        return False
    sub = argparse.ArgumentParser().add_subparsers()
    try:
        module.register(sub)
    except Exception:
        return False
    return "serve" in sub.choices


@pytest.mark.skipif(not _gateway_has_serve(), reason="services.gateway has no `serve` command yet")
def test_replay_against_hintserve_serve(tiny_mixtral_dir: str, tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    import httpx

    from tests.conftest import REPO_ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", tiny_mixtral_dir, "--port",
                             str(port)], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:  # readiness: the server answers /v1/models (polling a condition, bounded)
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                models = httpx.get(url + "/v1/models", timeout=2)
                if models.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "hintserve serve did not come up in 90 s"
            time.sleep(0.2)
        rows = [(0.0, 5, 4), (0.05, 20, 6), (0.1, 40, 3)]
        model = models.json()["data"][0]["id"]
        cfg = ReplayConfig(url=url, model=model, tokenizer=tiny_mixtral_dir, trace=write_trace(tmp_path / "t.csv", rows),
                           speedup=1.0, prompts="synthetic", count_special_tokens=False, request_timeout=60)
        result = run_replay(cfg)
        assert (result["completed"], result["failed"]) == (3, 0), result["error_samples"]
        assert result["output_lens"] == [4, 6, 3] and result["prompt_len_mismatches"] == 0
        assert 0 < result["mean_ttft_ms"] < result["mean_e2el_ms"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
