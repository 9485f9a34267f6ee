"""Skip-gate speculation (Mixtral-Offloading, ProMoE): apply layer l+t's router to layer l's hidden state.

The residual stream changes slowly across layers, so the future router applied to today's hidden state
guesses the future experts well (84-94% top-2 hit one layer ahead on the trained demo model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.models.attention import rms_norm
from services.engine.models.spec import ModelSpec
from services.engine.models.weights import NonExpertWeights
from services.engine.offload.prefetch.base import Prefetcher, PrefetchRequest, targets
from services.engine.step_context import StepContext


class SpeculativePrefetcher(Prefetcher):
    name = "speculative"

    def __init__(self, spec: ModelSpec, weights: NonExpertWeights, distance: int = 2, extra: int = 0) -> None:
        self.spec = spec
        self.weights = weights
        self.distance = distance
        self.top_k = spec.top_k + extra  # extra > 0 trades link bandwidth for recall

    def scores(self, layer: int, target: int, ctx: StepContext) -> torch.Tensor:
        """Mean predicted router probability per expert of `target`, from `layer`'s input hidden state."""
        w = self.weights.layers[target]
        x = rms_norm(ctx.layer_inputs[layer], w.post_attention_norm, self.spec.rms_norm_eps)
        return torch.softmax(F.linear(x, w.router).float(), dim=-1)  # type: ignore[arg-type]

    def plan(self, layer: int, ctx: StepContext) -> list[PrefetchRequest]:
        requests = []
        for hops, target, next_step in targets(layer, self.distance, self.spec.moe_layers):
            probs = self.scores(layer, target, ctx)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices.unique().tolist()
            mean = probs.mean(dim=0)
            requests += [PrefetchRequest(target, e, float(mean[e]) / hops, next_step) for e in chosen]
        return requests
