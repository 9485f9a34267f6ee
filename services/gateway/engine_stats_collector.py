"""Exports each pooled engine's polled `stats()` as Prometheus series, whatever keys the engine reports.

The key convention and the conversion live in services/common/stats_export.py (the engine's own
/metrics endpoint uses the same); here every series gets `engine="<address>"`, plus the gateway's own view
of each engine (healthy, outstanding requests, failovers).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from services.common.stats_export import PREFIX, StatsExporter, parse_stat_key
from services.gateway.engine_pool import EnginePool

__all__ = ["PREFIX", "EngineStatsCollector", "parse_stat_key"]


class EngineStatsCollector(Collector):
    """Reads the pool's cached stats at scrape time (the pool polls them), never the engines directly."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self._exporter = StatsExporter()

    def describe(self) -> list[Metric]:
        return []  # series are only known at scrape time; nothing to check for clashes at registration

    def collect(self) -> Iterator[Metric]:
        engines = list(self.pool.engines)  # discovery may add or drop engines between two awaits
        yield from self._exporter.families((h.stats, {"engine": h.address}) for h in engines)

        healthy = Metric(
            "hintserve_gateway_engine_healthy", "1 if the gateway routes to this engine", "gauge"
        )
        outstanding = Metric(
            "hintserve_gateway_engine_outstanding_requests", "Requests holding a slot on this engine", "gauge"
        )
        failovers = Metric(
            "hintserve_gateway_engine_failovers",
            "Requests moved to another engine after this one failed",
            "counter",
        )
        for handle in engines:
            labels = {"engine": handle.address}
            healthy.add_sample(healthy.name, labels, 1.0 if handle.healthy else 0.0)
            outstanding.add_sample(outstanding.name, labels, float(handle.outstanding))
            failovers.add_sample(failovers.name + "_total", labels, float(handle.failures))
        yield from (healthy, outstanding, failovers)
