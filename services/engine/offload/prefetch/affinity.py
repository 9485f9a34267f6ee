"""DuoServe's decode prefetch from popularity and inter-layer affinity (seed 000, eq. 2-3), learned online.

The counts (services/engine/offload/popularity_affinity.py) grow from every token of the engine's own steps:
popularity[l, e] how often layer l routes to e, affinity[l, i, j] how often a token that chose i at layer l
chooses j at the next MoE layer. The next layer's score for expert j is the affinity row mass from this
step's selected experts plus a popularity prior; the top experts are prefetched. No offline training (the
trained ExpertMLP lives in the predictor service).
"""

from __future__ import annotations

import torch

from services.engine.offload.popularity_affinity import PopularityAffinity
from services.engine.offload.prefetch.base import Prefetcher, PrefetchRequest, targets
from services.engine.step_context import StepContext


class AffinityPrefetcher(Prefetcher):
    name = "affinity"

    def __init__(self, num_experts: int, top_k: int, moe_layers: tuple[bool, ...], extra: int = 0) -> None:
        layers = len(moe_layers)
        self.moe_layers = moe_layers
        self.num_experts = num_experts
        self.count = top_k + extra
        # One link per model layer: to its next MoE layer (the last wraps to the next step's first).
        self.stats = PopularityAffinity(layers, num_experts, num_links=layers)
        self.next_moe_layer = {
            layer: target for layer in range(layers) for _, target, _ in targets(layer, 1, moe_layers)
        }

    def scores(self, layer: int, selected: torch.Tensor) -> torch.Tensor:
        """Probability per expert of the next MoE layer given this layer's selections [tokens, k]."""
        counts = torch.from_numpy(self.stats.aff_counts[layer]).float()  # integers: exact in float32
        rows = counts[selected.flatten()]
        rows = rows / rows.sum(dim=-1, keepdim=True)
        target = self.next_moe_layer[layer]
        popularity = torch.from_numpy(self.stats.pop_counts[target]).float()
        prior = popularity / popularity.sum()
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
            self.stats.add_selections(torch.bincount(experts.flatten(), minlength=E).numpy(), layer)
            target = self.next_moe_layer[layer]
            following = ctx.selected_experts.get(target)
            if following is None or target <= layer:
                continue
            pairs = experts[:, :, None] * E + following.cpu()[:, None, :]
            self.stats.add_pairs(torch.bincount(pairs.flatten(), minlength=E * E).view(E, E).numpy(), layer)
