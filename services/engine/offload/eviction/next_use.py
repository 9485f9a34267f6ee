"""Next-use eviction: keep the experts most likely to be asked for soonest; let a prefetch in only if it
is worth more than what it would displace.

Decoding visits the MoE layers in a fixed cycle, so an expert of layer j is next asked for in `hops`
layers, with probability q: a prefetcher's prediction for that visit when there is one, else the chance
that some request of the batch routes to it, from each running request's own routing so far (MoE-Infinity's
request-level activation matrix, as a per-iteration frequency, smoothed towards the layer's recent
batch-wide use for requests that have little history). Its value is q / hops, FineMoE's prefetch priority
p / (l - l_now) applied to the cache; the lowest value is evicted. On a link-bound decode the bytes moved
set the step time, and a misprediction that flushes an expert the next token reuses costs a whole
transfer, so a prefetch is admitted only when its own value beats its victim's (Belady's rule for
prefetching, in expectation).
"""

from __future__ import annotations

import torch

from services.engine.offload.eviction.base import EvictionPolicy, Key
from services.engine.step_context import StepContext

_FLOOR = 0.01  # an expert never seen still has some chance of being asked for
_MAX_REQUESTS = 4096  # request histories kept; the oldest are forgotten first


class NextUseEviction(EvictionPolicy):
    name = "next-use"

    def __init__(self, num_layers: int, num_experts: int, prior_weight: float = 2.0, decay: float = 0.2) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.prior_weight = prior_weight  # pseudo-iterations of the batch-wide rate behind each request
        self.decay = decay
        self.rate = torch.zeros(num_layers, num_experts)  # batch-wide use per step (EMA)
        self.history: dict[str, tuple[torch.Tensor, int]] = {}  # request -> (use frequency sums, iterations)
        self.q = [[0.0] * num_experts for _ in range(num_layers)]  # P(used at the next visit), this batch
        self.predicted: dict[Key, float] = {}  # probability of use at the key's next visit

    def on_layer_routed(self, layer: int, mean_probs: list[float], ctx: StepContext) -> None:
        for key in [k for k in self.predicted if k[0] == layer]:
            del self.predicted[key]  # predictions were for this visit

    def on_prediction(self, key: Key, probability: float) -> None:
        self.predicted[key] = max(probability, self.predicted.get(key, 0.0))

    def on_step_end(self, ctx: StepContext) -> None:
        per_request = self._step_frequencies(ctx)  # [requests, layers, experts]
        self.rate.mul_(1.0 - self.decay).add_(self.decay * (1.0 - (1.0 - per_request).prod(dim=0)))
        prior = self.prior_weight * self.rate
        miss = torch.ones(self.num_layers, self.num_experts)
        for rid, freq in zip(ctx.request_ids, per_request):
            sums, n = self.history.pop(rid, (None, 0))
            sums = freq if sums is None else sums + freq
            self.history[rid] = (sums, n + 1)  # re-inserted: newest last, trimming drops the oldest
            miss *= 1.0 - ((sums + prior) / (n + 1 + self.prior_weight)).clamp(max=1.0)
        while len(self.history) > _MAX_REQUESTS:
            del self.history[next(iter(self.history))]
        self.q = (1.0 - miss).tolist()

    def _step_frequencies(self, ctx: StepContext) -> torch.Tensor:
        """Per request, the fraction of its tokens in this step routed to each expert of each layer."""
        n = len(ctx.request_ids)
        lens = torch.tensor(ctx.seq_lens or [1] * n)
        token_request = torch.repeat_interleave(torch.arange(n), lens)
        out = torch.zeros(n, self.num_layers, self.num_experts)
        for layer, experts in ctx.selected_experts.items():
            experts = experts.cpu()
            flat = token_request.repeat_interleave(experts.shape[1]) * self.num_experts + experts.flatten()
            counts = torch.bincount(flat, minlength=n * self.num_experts).view(n, self.num_experts)
            out[:, layer] = counts.float() / lens[:, None]
        return out.clamp_(max=1.0)

    def value(self, key: Key, layer_now: int) -> float:
        """Probability of use at the next visit per layer until that visit."""
        layer, expert = key
        hops = (layer - layer_now - 1) % self.num_layers + 1
        q = self.predicted.get(key)
        if q is None:
            q = self.q[layer][expert]
        return max(q, _FLOOR) / hops

    def victim(self, candidates: list[Key], ctx: StepContext | None, layer_now: int) -> Key:
        return min(candidates, key=lambda k: self.value(k, layer_now))

    def admit(self, key: Key, victim: Key, ctx: StepContext | None, layer_now: int) -> bool:
        return self.value(key, layer_now) > self.value(victim, layer_now)
