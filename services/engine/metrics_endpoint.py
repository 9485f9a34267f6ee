"""The engine's own Prometheus endpoint (`--metrics-port`): its stats, read at scrape time.

The same series the gateway re-exports for every pooled engine (`hintserve_engine_*`), so Prometheus can
scrape engines directly (several gateways, or none); deploy/prometheus/prometheus.yml then drops the
gateway's copies so no series is counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from services.common.metrics_http import MetricsEndpoint
from services.common.stats_export import StatsExporter


class EngineStatsSource(Collector):
    """Calls `stats()` on each scrape (engine stats are safe to read from another thread)."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats
        self._exporter = StatsExporter()

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self._exporter.families([(self._stats(), {})])


def serve_engine_metrics(stats: Callable[[], dict[str, float]], host: str, port: int) -> MetricsEndpoint:
    registry = CollectorRegistry()
    registry.register(EngineStatsSource(stats))
    return MetricsEndpoint(registry, host, port)
