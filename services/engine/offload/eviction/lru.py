"""Least recently used over every layer's slots at once (`lru-global`; Mixtral-Offloading keeps one LRU per
layer: layer_lru.py)."""

from __future__ import annotations

from collections import OrderedDict

from services.engine.offload.eviction.base import EvictionPolicy, Key
from services.engine.step_context import StepContext


class LRUEviction(EvictionPolicy):
    name = "lru-global"

    def __init__(self) -> None:
        self._recency: OrderedDict[Key, None] = OrderedDict()

    def on_access(self, key: Key, ctx: StepContext) -> None:
        self._recency[key] = None
        self._recency.move_to_end(key)

    def on_insert(self, key: Key) -> None:
        self._recency[key] = None
        self._recency.move_to_end(key)

    def on_evict(self, key: Key) -> None:
        self._recency.pop(key, None)

    def victim(self, candidates: list[Key], ctx: StepContext | None, layer_now: int) -> Key:
        allowed = set(candidates)
        for key in self._recency:
            if key in allowed:
                return key
        return candidates[0]
