"""Eviction policies by name: adding one is one file and one line here."""

from __future__ import annotations

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

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LayerLRUEviction,
    "lru-global": LRUEviction,
    "lfu": LFUEviction,
    "finemoe": FineMoEEviction,
    "eam": EAMEviction,
    "static": StaticEviction,
    "belady": BeladyEviction,
    "lookahead": LookaheadEviction,
    "next-use": NextUseEviction,
    "hot-set": HotSetEviction,
}

__all__ = ["EVICTION_POLICIES", "EvictionPolicy"]
