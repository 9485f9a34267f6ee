"""Benchmarks that start servers as child processes: a free loopback port and waiting until one is ready."""

from __future__ import annotations

import socket
import subprocess
import time

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
