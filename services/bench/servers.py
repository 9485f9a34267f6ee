"""Benchmarks that start servers as child processes: a free loopback port and waiting until one is ready."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(ready_url: str, proc: subprocess.Popen, timeout: float, log_path: str | None = None) -> None:
    """Polls `ready_url` until it answers 200; fails as soon as the child exits."""
    see = f"; see {log_path}" if log_path else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready{see}")
        try:
            if httpx.get(ready_url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling a child process's readiness, not synchronising threads
    raise TimeoutError(f"server at {ready_url} not ready after {timeout:.0f} s{see}")


@contextlib.contextmanager
def hintserve_server(model: str, flags: Sequence[str], timeout: float) -> Iterator[str]:
    """`hintserve serve --model model *flags` on a free loopback port, without API keys: its URL once ready;
    stopped on leaving."""
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model", model, "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HINTSERVE_API_KEYS": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/ready", proc, timeout=timeout)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
