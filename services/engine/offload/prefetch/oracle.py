"""A perfect prefetcher: replays the routing recorded from a previous identical run (the prediction bound)."""

from __future__ import annotations

from services.engine.offload.prefetch.base import Prefetcher, PrefetchRequest, targets
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.step_context import StepContext


class OraclePrefetcher(Prefetcher):
    name = "oracle"

    def __init__(self, trace: RoutingTrace, moe_layers: tuple[bool, ...], distance: int = 2) -> None:
        self.trace = trace
        self.moe_layers = moe_layers
        self.distance = distance

    def plan(self, layer: int, ctx: StepContext) -> list[PrefetchRequest]:
        step = self.trace.replay_step(ctx)
        requests = []
        for hops, target, next_step in targets(layer, self.distance, self.moe_layers):
            experts = self.trace.experts(step + int(next_step), target)
            requests += [PrefetchRequest(target, e, 1.0 / hops, next_step, 1.0) for e in experts]
        return requests
