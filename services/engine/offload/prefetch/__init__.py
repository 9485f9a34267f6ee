"""Prefetchers by name: adding one is one file and one line here.

Each entry builds its prefetcher from PrefetchInputs, taking what it needs (the docs read the names from
here too)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.engine.models.geometry import ExpertGeometry
from services.engine.models.spec import ModelSpec
from services.engine.models.weights import NonExpertWeights
from services.engine.offload.prefetch.affinity import AffinityPrefetcher
from services.engine.offload.prefetch.base import Prefetcher, PrefetchRequest
from services.engine.offload.prefetch.hints import HintPrefetcher
from services.engine.offload.prefetch.next_layer import NextLayerPrefetcher
from services.engine.offload.prefetch.oracle import OraclePrefetcher
from services.engine.offload.prefetch.speculative import SpeculativePrefetcher
from services.engine.offload.routing_trace import TraceFile
from services.engine.offload.stats import OffloadStats


@dataclass(frozen=True)
class PrefetchInputs:
    """What a prefetcher may be built from."""

    policy: str  # the offload policy's name (for its errors)
    siblings: tuple[str, ...]  # every prefetcher the policy runs, this one too
    geometry: ExpertGeometry
    distance: int  # MoE layers ahead the local prefetchers look
    min_confidence: float  # skip-gate: fetch only experts some token's guess gives this probability
    trace: TraceFile  # the recorded routing (oracle)
    stats: OffloadStats | None = None
    # The checkpoint's spec and routers and norms, where a prefetcher runs them (the skip-gate); None elsewhere.
    router_model: tuple[ModelSpec, NonExpertWeights] | None = None

    def routers(self) -> tuple[ModelSpec, NonExpertWeights]:
        if self.router_model is None:
            raise ValueError(f"policy {self.policy!r} runs the skip-gate: it needs the checkpoint's routers")
        return self.router_model


def _hints(i: PrefetchInputs) -> HintPrefetcher:
    """Fed by the predictor link (services/engine/predictor_link.py) once the engine has its runner. Beside a
    local skip-gate, hints serve only the layers beyond its reach."""
    near = i.distance if "speculative" in i.siblings else 0
    return HintPrefetcher(i.geometry.moe_layers, i.stats, min_hops=near + 1)


PREFETCHERS: dict[str, Callable[[PrefetchInputs], Prefetcher]] = {
    "layer": lambda i: NextLayerPrefetcher(i.geometry.num_experts, i.geometry.moe_layers),
    "speculative": lambda i: SpeculativePrefetcher(*i.routers(), i.distance, min_confidence=i.min_confidence),
    "oracle": lambda i: OraclePrefetcher(i.trace.load(i.policy), i.geometry.moe_layers, i.distance),
    "affinity": lambda i: AffinityPrefetcher(i.geometry.num_experts, i.geometry.top_k, i.geometry.moe_layers),
    "hints": _hints,
}


def make_prefetcher(name: str, inputs: PrefetchInputs) -> Prefetcher:
    build = PREFETCHERS.get(name)
    if build is None:
        raise ValueError(f"unknown prefetcher {name!r}; choose from: {', '.join(PREFETCHERS)}")
    return build(inputs)


__all__ = ["PREFETCHERS", "PrefetchInputs", "Prefetcher", "PrefetchRequest", "make_prefetcher"]
