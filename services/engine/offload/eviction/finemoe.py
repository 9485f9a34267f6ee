"""FineMoE's eviction priority 1 / (p * freq) (seed 003, section 4.5): evict the least likely, least visited.

p is the expert's latest probability, from the router or from a prefetcher's prediction (the searched map);
freq its cache visit count. Recency is deliberately ignored: layer-wise sequential use defeats LRU.
"""

from __future__ import annotations

from collections import Counter

from services.engine.offload.eviction.base import EvictionPolicy, Key
from services.engine.step_context import StepContext

_PROB_FLOOR = 1e-3  # an unseen expert still has some chance; keeps 1/(p*freq) finite


class FineMoEEviction(EvictionPolicy):
    name = "finemoe"

    def __init__(self) -> None:
        self.visits: Counter[Key] = Counter()
        self.probability: dict[Key, float] = {}

    def on_access(self, key: Key, ctx: StepContext) -> None:
        self.visits[key] += 1

    def on_layer_routed(self, layer: int, mean_probs: list[float], ctx: StepContext) -> None:
        for expert, p in enumerate(mean_probs):
            self.probability[(layer, expert)] = p

    def on_prediction(self, key: Key, probability: float) -> None:
        self.probability[key] = max(probability, self.probability.get(key, 0.0))

    def priority(self, key: Key) -> float:
        p = max(self.probability.get(key, _PROB_FLOOR), _PROB_FLOOR)
        return 1.0 / (p * max(self.visits[key], 1))

    def victim(self, candidates: list[Key], ctx: StepContext | None, layer_now: int) -> Key:
        return max(candidates, key=self.priority)
