"""A pinned hot set: the most popular experts never leave; the remaining slots behave as LRU."""

from __future__ import annotations

from services.engine.offload.eviction.base import Key
from services.engine.offload.eviction.lru import LRUEviction
from services.engine.step_context import StepContext


class StaticEviction(LRUEviction):
    name = "static"

    def __init__(self, hot_set: set[Key] | None = None) -> None:
        super().__init__()
        self.hot_set: set[Key] = set(hot_set or ())

    def victim(self, candidates: list[Key], ctx: StepContext | None, layer_now: int) -> Key:
        cold = [k for k in candidates if k not in self.hot_set]
        return super().victim(cold or candidates, ctx, layer_now)
