"""Real service processes for the deploy tests: start one, wait (with a deadline) for the line that says it
is listening, scrape its /metrics, stop it; every wait polls with a deadline instead of sleeping blindly."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO_ROOT

T = TypeVar("T")
Series = list[tuple[str, dict[str, str]]]


class LiveProcess:
    """A subprocess whose stderr and stdout lines are collected by a reader thread."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path = REPO_ROOT
    ) -> None:
        self.name = name
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, name=f"{name}-output", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for_line(self, pattern: str, timeout_s: float = 120.0) -> re.Match[str]:
        """The first output line matching `pattern`; fails with the output if the process exits or time runs out."""
        regex, deadline, seen = re.compile(pattern), time.monotonic() + timeout_s, 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if match := regex.search(line):
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self.proc.poll() is not None or left <= 0:
                    raise AssertionError(f"{self.name}: no line matching {pattern!r}:\n{self.output()}")
                self._changed.wait(min(left, 0.5))

    def output(self) -> str:
        return "".join(self.lines[-60:])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def hintserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def free_port() -> int:
    """For programs that cannot bind port 0 and report it (Prometheus)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> Series:
    """(sample name, labels) of every sample at a /metrics URL."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return [
        (s.name, dict(s.labels)) for family in text_string_to_metric_families(text) for s in family.samples
    ]


def sample_value(url: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` with these labels at a /metrics URL (0 if none)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k, "") == v for k, v in labels.items())
    )


def poll(check: Callable[[], T | None], what: str, timeout_s: float = 60.0, every_s: float = 0.2) -> T:
    """Calls `check` until it returns something truthy, or fails after `timeout_s` saying `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)  # polling interval, not synchronisation: the deadline decides
