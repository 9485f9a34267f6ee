"""Engine stats dicts -> Prometheus metric families, one convention for every exporter.

Key convention (shared with the engine and the offload runtime): a key is a bare `name` or
`name{label="value",...}` in Prometheus label syntax. It becomes `hintserve_engine_<name>` with those labels
plus the source's own labels; names ending in `_total` are counters, all others gauges. Hit rates are
exported as hit/query counter pairs (`..._hits_total`, `..._queries_total`), as vLLM does for its prefix
cache, so that rates can be aggregated correctly over time and engines.

Used by the gateway (every pooled engine, labelled `engine="<address>"`) and by the engine's own
`--metrics-port` endpoint (no extra label: Prometheus' `instance` names it).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping

from prometheus_client.metrics_core import Metric

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


class StatsExporter:
    """Turns stats dicts into families; remembers parsed keys (they repeat every scrape) and warns once."""

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[str, dict[str, str]] | None] = {}
        self._warned: set[str] = set()

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

    def families(self, sources: Iterable[tuple[Mapping[str, float], dict[str, str]]]) -> list[Metric]:
        """One family per stat name over all `(stats, extra_labels)` sources."""
        families: dict[str, Metric] = {}
        for stats, extra in sources:
            for key, value in list(stats.items()):
                parsed = self._parse(key)
                if parsed is None:
                    continue
                name, labels = parsed
                kind = "counter" if name.endswith("_total") else "gauge"
                family_name = PREFIX + (name[: -len("_total")] if kind == "counter" else name)
                family = families.get(family_name)
                if family is None:
                    family = Metric(family_name, f"Engine stat {name}", kind)
                    families[family_name] = family
                elif family.type != kind:  # `x` and `x_total` both reported: keep the first
                    self._warn(key, "engine stat %r clashes with a series of another type: not exported")
                    continue
                sample = family_name + "_total" if kind == "counter" else family_name
                family.add_sample(sample, {**labels, **extra}, float(value))
        return list(families.values())
