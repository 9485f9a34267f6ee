"""Prefetchers by name: adding one is one file and one line here."""

from __future__ import annotations

from services.engine.offload.prefetch.affinity import AffinityPrefetcher
from services.engine.offload.prefetch.base import Prefetcher, PrefetchRequest
from services.engine.offload.prefetch.next_layer import NextLayerPrefetcher
from services.engine.offload.prefetch.oracle import OraclePrefetcher
from services.engine.offload.prefetch.speculative import SpeculativePrefetcher

PREFETCHERS: dict[str, type[Prefetcher]] = {
    "layer": NextLayerPrefetcher,
    "speculative": SpeculativePrefetcher,
    "oracle": OraclePrefetcher,
    "affinity": AffinityPrefetcher,
}

__all__ = ["PREFETCHERS", "Prefetcher", "PrefetchRequest"]
