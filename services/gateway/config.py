"""Gateway settings (CLI flags map one to one onto these fields)."""

from __future__ import annotations

import os
from dataclasses import dataclass

STREAM_IDLE_TIMEOUT_ENV = "HINTSERVE_STREAM_IDLE_TIMEOUT_S"
DEFAULT_STREAM_IDLE_TIMEOUT_S = 30.0


def env_seconds(name: str, default: float) -> float:
    """A duration from the environment variable `name` (unset or empty: `default`); ValueError if not a number."""
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"  # listen address; authentication may be off only on loopback
    port: int = 8000
    model_name: str | None = None  # None: the name the engines report (their model directory's name)
    tokenizer: str | None = None  # model directory for the chat template and token counts
    # None: authentication off (only ever by explicit choice: --no-auth, or `serve` on loopback w/o keys).
    api_keys: list[str] | None = None
    admin_key: str | None = None  # None: the admin endpoints answer 403
    max_queue: int = 256
    max_concurrency_per_engine: int = 64  # requests in flight on one engine at most
    batch_window_ms: float = 2.0
    max_batch: int = 32  # a batch window closes early once this many requests have arrived
    max_body_bytes: int = 1 << 20
    max_n: int = 16
    health_interval_s: float = 2.0  # engine health probes (and --discover-engines look-ups) every this often
    drain_timeout_s: float = 30.0  # SIGTERM: how long streams may run on before they are cut
    request_read_timeout_s: float = 30.0  # a request's headers and body must arrive within this
    # A request without output this long, on an engine whose step counters do not move either, is cut; 0: off.
    stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S

    def validate(self) -> None:
        """Raises ValueError with a one-line message naming the flag."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_concurrency_per_engine < 1:
            raise ValueError(
                f"--max-concurrency-per-engine must be >= 1, got {self.max_concurrency_per_engine}"
            )
        if not 0 <= self.batch_window_ms <= 1000:
            raise ValueError(f"--batch-window-ms must be in [0, 1000], got {self.batch_window_ms}")
        if self.max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_n < 1:
            raise ValueError(f"--max-n must be >= 1, got {self.max_n}")
        if self.health_interval_s <= 0:
            raise ValueError(f"--health-interval-s must be > 0, got {self.health_interval_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout-s must be >= 0, got {self.drain_timeout_s}")
        if self.request_read_timeout_s <= 0:
            raise ValueError(f"--request-read-timeout-s must be > 0, got {self.request_read_timeout_s}")
        if not 0 <= self.stream_idle_timeout_s <= 86400:
            raise ValueError(f"--stream-idle-timeout-s must be in [0, 86400], got {self.stream_idle_timeout_s}")
        if self.api_keys is not None and not self.api_keys:
            raise ValueError("authentication is on but no API key is configured")


def parse_engine_addresses(value: str) -> list[str]:
    """`host:port,host:port` -> addresses; ValueError on anything else."""
    addresses = [a.strip() for a in value.split(",") if a.strip()]
    if not addresses:
        raise ValueError("--engines needs at least one host:port")
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"--engines: {address!r} is not host:port")
    if len(set(addresses)) != len(addresses):
        raise ValueError("--engines lists an address twice")
    return addresses
