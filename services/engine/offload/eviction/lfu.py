"""Least frequently used: MoE-Infinity's visit counts (ties broken by recency)."""

from __future__ import annotations

from collections import Counter

from services.engine.offload.eviction.base import EvictionPolicy, Key
from services.engine.step_context import StepContext


class LFUEviction(EvictionPolicy):
    name = "lfu"

    def __init__(self) -> None:
        self.visits: Counter[Key] = Counter()
        self._last_access: dict[Key, int] = {}
        self._tick = 0

    def on_access(self, key: Key, ctx: StepContext) -> None:
        self._tick += 1
        self.visits[key] += 1
        self._last_access[key] = self._tick

    def victim(self, candidates: list[Key], ctx: StepContext | None, layer_now: int) -> Key:
        return min(candidates, key=lambda k: (self.visits[k], self._last_access.get(k, 0)))
