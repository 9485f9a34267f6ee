"""Gateway settings (CLI flags map one to one onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass


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
