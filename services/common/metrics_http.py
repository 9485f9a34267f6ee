"""A Prometheus /metrics HTTP endpoint on a daemon thread, and the flags that turn it on.

One helper for every process that has no HTTP server of its own (the engine speaks gRPC, the predictor
reads a Redis stream); the gateway serves /metrics on its API port instead.
"""

from __future__ import annotations

import argparse

from prometheus_client import CollectorRegistry, start_http_server


class MetricsEndpoint:
    """`registry` served at http://host:port/metrics until `close()`."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server, self._thread = start_http_server(port, host, registry=registry)
        self.host = host
        self.port: int = self._server.server_port  # the bound port (0 picked a free one)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def add_metrics_args(parser: argparse._ActionsContainer, default_port: int, what: str) -> None:
    """`--metrics-host` / `--metrics-port` (0 picks a free port, -1 turns the endpoint off)."""
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", help=f"address of the {what} /metrics endpoint"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=default_port,
        help=f"Prometheus /metrics of the {what}; 0 picks a free port, -1 turns it off (default {default_port})",
    )


def check_metrics_port(port: int) -> None:
    if not -1 <= port <= 65535:
        raise ValueError(f"--metrics-port must be in [-1, 65535], got {port}")
