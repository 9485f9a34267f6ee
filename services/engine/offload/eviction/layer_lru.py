"""Per-layer LRU slots (Mixtral-Offloading, dvmazur/mixtral-offloading src/expert_cache.py: one eviction group
per layer, each with its share of the device slots, least recently used first within the group).

The slots are split evenly among the MoE layers (the remainder to the first ones). A layer at its share evicts
its own least recently used expert; a layer under its share takes a slot from a layer over its share (while the
cache fills, any free slot serves; the shares settle as it does). Demand fetches insert into the layer that
runs (`layer_now`); a prefetch for another layer evicts as its fetching layer would, and the shares settle
again on that layer's next miss.
"""

from __future__ import annotations

import itertools

from services.engine.offload.eviction.base import EvictionPolicy, Key
from services.engine.step_context import StepContext


class LayerLRUEviction(EvictionPolicy):
    name = "lru"

    def __init__(self, slots: int, moe_layers: list[int]) -> None:
        base, extra = divmod(slots, max(1, len(moe_layers)))
        self.share = {layer: base + (i < extra) for i, layer in enumerate(moe_layers)}
        self.held = dict.fromkeys(moe_layers, 0)
        self._clock = itertools.count()
        self._used: dict[Key, int] = {}  # last access or insert

    def on_access(self, key: Key, ctx: StepContext) -> None:
        self._used[key] = next(self._clock)

    def on_insert(self, key: Key) -> None:
        self._used[key] = next(self._clock)
        self.held[key[0]] = self.held.get(key[0], 0) + 1

    def on_evict(self, key: Key) -> None:
        self.held[key[0]] -= 1

    def victim(self, candidates: list[Key], ctx: StepContext | None, layer_now: int) -> Key:
        own = [k for k in candidates if k[0] == layer_now]
        if own and self.held.get(layer_now, 0) >= self.share.get(layer_now, 0):
            pool = own
        else:
            pool = [k for k in candidates if self.held[k[0]] > self.share.get(k[0], 0)] or candidates
        return min(pool, key=lambda k: self._used.get(k, -1))
