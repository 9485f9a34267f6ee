"""Belady's offline optimum: evict the expert whose next use lies farthest in the future (needs the trace)."""

from __future__ import annotations

from services.engine.offload.eviction.base import EvictionPolicy, Key
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.step_context import StepContext


class BeladyEviction(EvictionPolicy):
    name = "belady"

    def __init__(self, trace: RoutingTrace) -> None:
        self.trace = trace

    def victim(self, candidates: list[Key], ctx: StepContext | None, layer_now: int) -> Key:
        step = self.trace.replay_step(ctx)
        return max(candidates, key=lambda k: self.trace.next_use(k, step, layer_now))

    def admit(self, key: Key, victim: Key, ctx: StepContext | None, layer_now: int) -> bool:
        step = self.trace.replay_step(ctx)
        return self.trace.next_use(key, step, layer_now) < self.trace.next_use(victim, step, layer_now)
