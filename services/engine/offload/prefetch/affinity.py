"""DuoServe's popularity vector and inter-layer affinity matrix (seed 000, eq. 2-3), learned online.

popularity[l, e]: how often layer l routes to e. affinity[l, i, j]: how often a token that chose i at layer
l chooses j at the next MoE layer. The next layer's score for expert j is the affinity row mass from this
step's selected experts plus a popularity prior; the top experts are prefetched. No offline training: the
counts accumulate from the engine's own steps (the trained ExpertMLP lives in the predictor service).
"""

from __future__ import annotations

import torch

from services.engine.offload.prefetch.base import Prefetcher, PrefetchRequest, targets
from services.engine.step_context import StepContext


class AffinityPrefetcher(Prefetcher):
    name = "affinity"

    def __init__(self, num_experts: int, top_k: int, moe_layers: tuple[bool, ...], extra: int = 0) -> None:
        layers = len(moe_layers)
        self.moe_layers = moe_layers
        self.num_experts = num_experts
        self.count = top_k + extra
        self.popularity = torch.ones(layers, num_experts)  # Laplace prior: uniform before any data
        self.affinity = torch.ones(layers, num_experts, num_experts)
        self.next_moe_layer = {
            layer: target for layer in range(layers) for _, target, _ in targets(layer, 1, moe_layers)
        }

    def scores(self, layer: int, selected: torch.Tensor) -> torch.Tensor:
        """Probability per expert of the next MoE layer given this layer's selections [tokens, k]."""
        rows = self.affinity[layer][selected.flatten()]
        rows = rows / rows.sum(dim=-1, keepdim=True)
        target = self.next_moe_layer[layer]
        prior = self.popularity[target] / self.popularity[target].sum()
        return 0.9 * rows.mean(dim=0) + 0.1 * prior

    def plan(self, layer: int, ctx: StepContext) -> list[PrefetchRequest]:
        selected = ctx.selected_experts.get(layer)
        if selected is None:
            return []
        probs = self.scores(layer, selected.cpu())
        _, target, next_step = targets(layer, 1, self.moe_layers)[0]
        chosen = torch.topk(probs, min(self.count * max(1, selected.shape[0]), self.num_experts)).indices
        return [PrefetchRequest(target, int(e), float(probs[e]), next_step, float(probs[e])) for e in chosen.tolist()]

    def on_step_end(self, ctx: StepContext) -> None:
        E = self.num_experts
        for layer, experts in ctx.selected_experts.items():
            experts = experts.cpu()
            self.popularity[layer] += torch.bincount(experts.flatten(), minlength=E).float()
            target = self.next_moe_layer[layer]
            following = ctx.selected_experts.get(target)
            if following is None or target <= layer:
                continue
            pairs = experts[:, :, None] * E + following.cpu()[:, None, :]
            self.affinity[layer] += torch.bincount(pairs.flatten(), minlength=E * E).float().view(E, E)
