"""Exports each engine's polled `stats()` as Prometheus series, whatever keys the engine reports.

Key convention (shared with the engine and the offload runtime): a key is a bare `name` or
`name{label="value",...}` in Prometheus label syntax. It becomes `hintserve_engine_<name>` with those labels
plus `engine="<address>"`; names ending in `_total` are counters, all others gauges. Hit rates are exported
as hit/query counter pairs (`..._hits_total`, `..._queries_total`), as vLLM does for its prefix cache, so
that rates can be aggregated correctly over time and engines.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from services.gateway.engine_pool import EnginePool

log = logging.getLogger(__name__)

PREFIX = "hintserve_engine_"
_KEY = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$", re.DOTALL)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)', re.DOTALL)
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_stat_key(key: str) -> tuple[str, dict[str, str]] | None:
    """`'expert_hits_total{layer="3"}'` -> `('expert_hits_total', {'layer': '3'})`; None if malformed."""
    match = _KEY.match(key.strip())
    if match is None:
        return None
    name, body = match.group(1), match.group(2)
    labels: dict[str, str] = {}
    if body and body.strip():
        pos = 0
        while pos < len(body):
            label = _LABEL.match(body, pos)
            if label is None or label.end() == pos:
                return None
            value = re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], label.group(2))
            labels[label.group(1)] = value
            pos = label.end()
    return name, labels


class EngineStatsCollector(Collector):
    """Reads the pool's cached stats at scrape time (the pool polls them), never the engines directly."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self._parsed: dict[str, tuple[str, dict[str, str]] | None] = {}  # keys repeat every scrape
        self._warned: set[str] = set()

    def describe(self) -> list[Metric]:
        return []  # series are only known at scrape time; nothing to check for clashes at registration

    def _parse(self, key: str) -> tuple[str, dict[str, str]] | None:
        if key not in self._parsed:
            parsed = parse_stat_key(key)
            if parsed is None:
                self._warn(key, "malformed engine stat key %r: not exported")
            self._parsed[key] = parsed
        return self._parsed[key]

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, key)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for handle in self.pool.engines:
            for key, value in list(handle.stats.items()):
                parsed = self._parse(key)
                if parsed is None:
                    continue
                name, labels = parsed
                kind = "counter" if name.endswith("_total") else "gauge"
                family_name = PREFIX + (name[: -len("_total")] if kind == "counter" else name)
                family = families.get(family_name)
                if family is None:
                    family = Metric(family_name, f"Engine stat {name} (polled from each engine)", kind)
                    families[family_name] = family
                elif family.type != kind:  # `x` and `x_total` both reported: keep the first
                    self._warn(key, "engine stat %r clashes with a series of another type: not exported")
                    continue
                sample = family_name + "_total" if kind == "counter" else family_name
                family.add_sample(sample, {**labels, "engine": handle.address}, float(value))
        yield from families.values()

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
        for handle in self.pool.engines:
            labels = {"engine": handle.address}
            healthy.add_sample(healthy.name, labels, 1.0 if handle.healthy else 0.0)
            outstanding.add_sample(outstanding.name, labels, float(handle.outstanding))
            failovers.add_sample(failovers.name + "_total", labels, float(handle.failures))
        yield from (healthy, outstanding, failovers)
