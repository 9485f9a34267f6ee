"""Next-use eviction: keep the experts most likely to be asked for soonest; let a prefetch in only if it
is worth more than what it would displace.

Decoding visits the MoE layers in a fixed cycle, so an expert of layer j is next asked for in `hops`
layers, with probability q: a prefetcher's prediction for that visit when there is one, else the
expert's recent use rate at its layer (an EMA of "used at this visit", which captures that consecutive
tokens reuse experts). Its value is q / hops, FineMoE's prefetch priority p / (l - l_now) applied to the
cache; the lowest value is evicted. On a link-bound decode the bytes moved set the step time, and a
misprediction that flushes an expert the next token reuses costs a whole transfer, so a prefetch is
admitted only when its own value beats its victim's (Belady's rule for prefetching, in expectation).
"""

from __future__ import annotations

from services.engine.offload.eviction.base import EvictionPolicy, Key
from services.engine.step_context import StepContext

_RATE_FLOOR = 0.01  # an expert never seen still has some chance of being asked for


class NextUseEviction(EvictionPolicy):
    name = "next-use"

    def __init__(self, num_layers: int, num_experts: int, decay: float = 0.5) -> None:
        self.num_layers = num_layers
        self.decay = decay
        self.rate = [[0.0] * num_experts for _ in range(num_layers)]
        self.predicted: dict[Key, float] = {}  # probability of use at the key's next visit

    def on_layer_routed(self, layer: int, mean_probs: list[float], ctx: StepContext) -> None:
        row = self.rate[layer]
        keep = 1.0 - self.decay
        for expert in range(len(row)):
            row[expert] *= keep
        for key in [k for k in self.predicted if k[0] == layer]:
            del self.predicted[key]  # predictions were for this visit

    def on_access(self, key: Key, ctx: StepContext) -> None:
        layer, expert = key
        self.rate[layer][expert] += self.decay

    def on_prediction(self, key: Key, probability: float) -> None:
        self.predicted[key] = max(probability, self.predicted.get(key, 0.0))

    def value(self, key: Key, layer_now: int) -> float:
        """Probability of use at the next visit per layer until that visit."""
        layer, expert = key
        hops = (layer - layer_now - 1) % self.num_layers + 1
        q = self.predicted.get(key)
        if q is None:
            q = self.rate[layer][expert]
        return max(q, _RATE_FLOOR) / hops

    def victim(self, candidates: list[Key], ctx: StepContext | None, layer_now: int) -> Key:
        return min(candidates, key=lambda k: self.value(k, layer_now))

    def admit(self, key: Key, victim: Key, ctx: StepContext | None, layer_now: int) -> bool:
        return self.value(key, layer_now) > self.value(victim, layer_now)
