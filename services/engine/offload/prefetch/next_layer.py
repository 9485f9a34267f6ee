"""Fetch every expert of the next MoE layer (DeepSpeed-Inference / MoESys style)."""

from __future__ import annotations

from services.engine.offload.prefetch.base import Prefetcher, PrefetchRequest, targets
from services.engine.step_context import StepContext


class NextLayerPrefetcher(Prefetcher):
    name = "layer"

    def __init__(self, num_experts: int, moe_layers: tuple[bool, ...]) -> None:
        self.num_experts = num_experts
        self.moe_layers = moe_layers

    def plan(self, layer: int, ctx: StepContext) -> list[PrefetchRequest]:
        requests = []
        for _, target, next_step in targets(layer, 1, self.moe_layers):
            requests += [PrefetchRequest(target, e, 1.0, next_step) for e in range(self.num_experts)]
        return requests
