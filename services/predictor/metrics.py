"""The predictor service's Prometheus series, in a registry of its own (several services may share a process in
tests), and the /metrics endpoint that serves them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

from services.common.metrics_http import MetricsEndpoint

_LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.25)


class ServiceMetrics:
    """Prometheus series of one service (own registry: several services may share a process in tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.search_seconds = Histogram(
            "hintserve_predictor_search_seconds", "Observe + predict time per context batch or Search call",
            ["source"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.hints_published = PromCounter(
            "hintserve_predictor_hints_published", "Hints (one per request, iteration, target layer) sent", registry=r
        )
        self.contexts_consumed = PromCounter(
            "hintserve_predictor_contexts_consumed", "Iteration contexts read from the stream", registry=r
        )
        self.contexts_rejected = PromCounter(
            "hintserve_predictor_contexts_rejected", "Stream entries dropped as invalid", ["reason"], registry=r
        )
        self.broker_connected = Gauge(
            "hintserve_predictor_broker_connected", "1 while the broker answers", registry=r
        )
        self.models = Gauge("hintserve_predictor_models", "Models with a predictor state", registry=r)
        self._endpoint: MetricsEndpoint | None = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Starts /metrics on a daemon thread; returns the bound port (0 picks a free one)."""
        self._endpoint = MetricsEndpoint(self.registry, host, port)
        return self._endpoint.port

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
