"""A real cluster on loopback for the fault suite and the soak: a private redis-server, the predictor, two
engines and a gateway, each its own process; and a load helper that tells success, clear error and hang apart.

Never the system Redis on 6379: the faults kill and restart the Redis, so it is our own, on a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.live_processes import LiveProcess, free_port, hintserve, poll

API_KEY = "fault-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}  # /ready lists the engines only to key holders
MODEL = "demo-moe"


@dataclass
class Outcome:
    """What the requests of one phase got: ok, a clear error (JSON error or SSE error event), or a hang."""

    sent: int = 0
    ok: int = 0
    clear_errors: int = 0
    unclear: list[str] = field(default_factory=list)  # 5xx without an error body, broken streams, timeouts
    errors: list[str] = field(default_factory=list)  # what each clear error said, for the assertion messages

    def add(self, other: Outcome) -> None:
        self.sent += other.sent
        self.ok += other.ok
        self.clear_errors += other.clear_errors
        self.unclear += other.unclear
        self.errors += other.errors

    def as_dict(self) -> dict[str, object]:
        return {"sent": self.sent, "ok": self.ok, "failed_clearly": self.clear_errors, "unclear": self.unclear}


def stream_once(url: str, max_tokens: int, timeout_s: float = 90.0) -> Outcome:
    """One streamed chat completion; ok only with a finish_reason and [DONE]."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Tell me a story {uuid.uuid4().hex[:6]}"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    out = Outcome(sent=1)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout_s) as r:
            if r.status_code != 200:
                error = json.loads(r.read()).get("error", {})
                if error.get("message"):
                    out.clear_errors += 1
                    out.errors.append(f"HTTP {r.status_code}: {error['message']}")
                else:
                    out.unclear.append(f"HTTP {r.status_code} without an error body")
                return out
            finished, done, error = False, False, None
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                elif chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    finished = True
            if done and finished and error is None:
                out.ok += 1
            elif done and error is not None and error.get("message"):
                out.clear_errors += 1
                out.errors.append(f"stream error: {error['message']}")
            else:
                out.unclear.append(f"stream ended without finish or error (done={done})")
    except httpx.TimeoutException:
        out.unclear.append("timed out (hang)")
    except httpx.TransportError as exc:  # the connection was refused or cut: a clear failure to the client
        out.clear_errors += 1
        out.errors.append(f"transport: {exc!r}")
    return out


def load(url: str, requests: int, concurrency: int, max_tokens: int = 24) -> Outcome:
    total = Outcome()
    with ThreadPoolExecutor(concurrency) as pool:
        for result in pool.map(lambda _: stream_once(url, max_tokens), range(requests)):
            total.add(result)
    return total


class Cluster:
    def __init__(
        self, model_dir: str, work: Path, drain_timeout_s: float = 2.0, stream_idle_timeout_s: float = 6.0
    ) -> None:
        self.model_dir = model_dir
        self.work = work
        self.drain_timeout_s = drain_timeout_s
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.engine_ports = [free_port(), free_port()]
        self.processes: dict[str, LiveProcess] = {}
        self.gateway_url = ""

    # ---- processes ----
    def start_redis(self) -> None:
        redis_server = shutil.which("redis-server")
        assert redis_server, "redis-server not installed"
        argv = [redis_server, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.processes["redis"] = LiveProcess("redis", argv)
        self.processes["redis"].wait_for_line(r"Ready to accept connections", 30)

    def start_predictor(self) -> float:
        start = time.monotonic()
        self._launch_predictor()
        self._await_predictor()
        return time.monotonic() - start

    def _launch_predictor(self) -> None:
        argv = hintserve(
            "predictor", "--redis-url", self.redis_url, "--grpc-port", "-1", "--metrics-port", "0",
            "--snapshot-dir", str(self.work / "snapshots"), "--snapshot-interval-s", "5",
            "--consumer", "fault-predictor", "--max-context-age-ms", "10000",
        )
        self.processes["predictor"] = LiveProcess("predictor", argv)

    def _await_predictor(self) -> None:
        self.predictor_metrics = self.processes["predictor"].wait_for_line(r"metrics (http://\S+/metrics)").group(1)

    def start_engine(self, i: int) -> float:
        start = time.monotonic()
        self._launch_engine(i)
        self._await_engine(i)
        return time.monotonic() - start

    def _launch_engine(self, i: int) -> None:
        env = {
            "HINTSERVE_DEVICE": "cpu",
            "HINTSERVE_LINK": "emulated",
            "HINTSERVE_OFFLOAD_POLICY": "hintserve",
            "HINTSERVE_EXPERT_CACHE_GB": "0.004",
            "HINTSERVE_MAX_NUM_SEQS": "32",
            "HINTSERVE_REDIS_URL": self.redis_url,
            "HINTSERVE_ENGINE_ID": f"fault-engine-{i}",
        }
        argv = hintserve("engine", "--model", self.model_dir, "--port", str(self.engine_ports[i]), "--metrics-port", "-1")
        self.processes[f"engine{i}"] = LiveProcess(f"engine{i}", argv, env=env)

    def _await_engine(self, i: int) -> None:
        self.processes[f"engine{i}"].wait_for_line(r"engine serving \S+ on ")

    def start_gateway(self) -> None:
        engines = ",".join(f"127.0.0.1:{p}" for p in self.engine_ports)
        argv = hintserve(
            "gateway", "--engines", engines, "--tokenizer", self.model_dir, "--model-name", MODEL, "--port", "0",
            "--health-interval-s", "2", "--drain-timeout-s", str(self.drain_timeout_s),
            "--stream-idle-timeout-s", str(self.stream_idle_timeout_s),
        )
        self.processes["gateway"] = LiveProcess("gateway", argv, env={"HINTSERVE_API_KEYS": API_KEY})
        self.gateway_url = self.processes["gateway"].wait_for_line(r"gateway serving .* at (http://\S+)/v1 \(2/2").group(1)

    def start(self) -> None:
        """Redis first (the others connect to it), then the predictor and both engines at once: each is mostly
        a Python start-up, and one after another they took 19 s of the suite."""
        self.start_redis()
        self._launch_predictor()
        for i in range(2):
            self._launch_engine(i)
        self._await_predictor()
        for i in range(2):
            self._await_engine(i)
        self.start_gateway()

    def kill(self, name: str) -> None:
        self.processes[name].stop(signal.SIGKILL)

    def process_tree(self, name: str) -> list[int]:
        """The process and its descendants (an engine's core process, multiprocessing's helpers)."""
        pids, i = [self.processes[name].proc.pid], 0
        while i < len(pids):
            for task in Path(f"/proc/{pids[i]}/task").glob("*"):
                with contextlib.suppress(OSError):
                    pids += [int(p) for p in (task / "children").read_text().split()]
            i += 1
        return pids

    def engine_stats(self, i: int) -> dict[str, float]:
        """Engine i's counters, straight from its gRPC Stats (not through the gateway)."""
        from services.engine.grpc_client import EngineClient

        async def ask() -> dict[str, float]:
            async with EngineClient(f"127.0.0.1:{self.engine_ports[i]}") as client:
                return await asyncio.wait_for(client.stats(), 10)

        return asyncio.run(ask())

    def stop(self) -> dict[str, int]:
        order = ["gateway", "engine0", "engine1", "predictor", "redis"]
        return {name: self.processes[name].stop() for name in order if name in self.processes}

    # ---- observations ----
    def healthy_engines(self) -> int:
        ready = httpx.get(f"{self.gateway_url}/ready", headers=AUTH, timeout=10).json()
        return sum(1 for e in ready["engines"] if e["healthy"])

    def wait_healthy_engines(self, n: int, timeout_s: float = 60.0) -> float:
        start = time.monotonic()
        poll(lambda: self.healthy_engines() == n, f"{n} healthy engines", timeout_s, every_s=0.05)
        return time.monotonic() - start

    def predictor_connected(self) -> bool:
        from tests.live_processes import sample_value

        return sample_value(self.predictor_metrics, "hintserve_predictor_broker_connected") == 1.0
