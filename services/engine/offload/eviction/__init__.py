"""Eviction policies by name: adding one is one file and one line here.

Each entry builds its policy from EvictionInputs, taking what it needs (the CLI choices, the docs and the
simulator read the names from here too)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.engine.models.geometry import ExpertGeometry
from services.engine.offload.eviction.base import EvictionPolicy
from services.engine.offload.eviction.belady import BeladyEviction
from services.engine.offload.eviction.eam import EAMEviction
from services.engine.offload.eviction.finemoe import FineMoEEviction
from services.engine.offload.eviction.hot_set import HotSetEviction
from services.engine.offload.eviction.layer_lru import LayerLRUEviction
from services.engine.offload.eviction.lfu import LFUEviction
from services.engine.offload.eviction.lookahead import LookaheadEviction
from services.engine.offload.eviction.lru import LRUEviction
from services.engine.offload.eviction.next_use import NextUseEviction
from services.engine.offload.eviction.static import StaticEviction
from services.engine.offload.routing_trace import TraceFile


@dataclass(frozen=True)
class EvictionInputs:
    """What an eviction policy may be built from."""

    geometry: ExpertGeometry
    slots: int  # the device cache's
    prefetch_depth: int  # the offload policy's prefetches on the link at once (0: no limit)
    trace: TraceFile  # the recorded routing (belady, static)

    @property
    def moe_layer_ids(self) -> list[int]:
        return [layer for layer, is_moe in enumerate(self.geometry.moe_layers) if is_moe]


EVICTION_POLICIES: dict[str, Callable[[EvictionInputs], EvictionPolicy]] = {
    "lru": lambda i: LayerLRUEviction(i.slots, i.moe_layer_ids),  # per-layer shares of the slots
    "lru-global": lambda i: LRUEviction(),
    "lfu": lambda i: LFUEviction(),
    "finemoe": lambda i: FineMoEEviction(),
    "eam": lambda i: EAMEviction(i.geometry.num_layers, i.geometry.num_experts),
    # No trace: nothing is held for good (a trace path that does not load is an error, as for belady).
    "static": lambda i: StaticEviction(i.trace.load("static").hot_set(i.slots // 2) if i.trace else set()),
    "belady": lambda i: BeladyEviction(i.trace.load("belady")),
    "lookahead": lambda i: LookaheadEviction(i.geometry.num_layers),
    "next-use": lambda i: NextUseEviction(i.geometry.num_layers, i.geometry.num_experts),
    # Room beside the hot set: the prefetches on the link (at least one slot).
    "hot-set": lambda i: HotSetEviction(i.slots, max(1, i.prefetch_depth)),
}


def make_eviction(name: str, inputs: EvictionInputs) -> EvictionPolicy:
    build = EVICTION_POLICIES.get(name)
    if build is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose from: {', '.join(EVICTION_POLICIES)}")
    return build(inputs)


__all__ = ["EVICTION_POLICIES", "EvictionInputs", "EvictionPolicy", "make_eviction"]
