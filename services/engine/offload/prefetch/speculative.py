"""Skip-gate speculation (Mixtral-Offloading, ProMoE): apply layer l+t's router to layer l's hidden state
(services/engine/models/skip_gate.py) and prefetch what it picks."""

from __future__ import annotations

import torch

from services.engine.models.skip_gate import SkipGate
from services.engine.models.spec import ModelSpec
from services.engine.models.weights import NonExpertWeights
from services.engine.offload.prefetch.base import GuessTracker, Prefetcher, PrefetchRequest, targets
from services.engine.step_context import StepContext


class SpeculativePrefetcher(Prefetcher):
    name = "speculative"

    def __init__(
        self, spec: ModelSpec, weights: NonExpertWeights, distance: int = 2, extra: int = 0,
        min_confidence: float = 0.0,
    ) -> None:
        self.spec = spec
        self.gate = SkipGate.from_weights(spec, weights)
        self.distance = distance
        self.top_k = spec.top_k + extra  # extra > 0 trades link bandwidth for recall
        # Guesses below this probability for every token are left out: on a link-bound decode a wrong
        # prefetch costs a whole transfer, and the experts the cache misses are the hard-to-guess ones.
        self.min_confidence = min_confidence
        # Precision of the guesses, measured against the router once the step has run: turns a guess into
        # the probability the eviction policy weighs it with.
        self.tracker: GuessTracker = GuessTracker(precision=0.8)
        self._targets: dict[int, list[tuple[int, int, bool]]] = {}  # layer -> targets(...), which never change

    def guess(self, layer: int, target: int, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [tokens, k], scores [tokens, experts]) `target`'s router would pick from `layer`'s input:
        the family's own rule (softmax or DeepSeek's grouped top-k), widened by `extra` experts if asked."""
        routing = self.gate.route(ctx.layer_inputs[layer], target)
        if self.top_k == self.spec.top_k:
            return routing.experts, routing.probs
        return torch.topk(routing.probs, self.top_k, dim=-1).indices, routing.probs

    def plan(self, layer: int, ctx: StepContext) -> list[PrefetchRequest]:
        plan = self._targets.get(layer)
        if plan is None:
            plan = self._targets[layer] = targets(layer, self.distance, self.spec.moe_layers)
        # Per target: each expert's votes (tokens choosing it), mean score and best score, read back to
        # Python in one transfer; small-tensor ops and unique() cost more than the routers themselves.
        rows: list[torch.Tensor] = []
        for _, target, _ in plan:
            chosen, probs = self.guess(layer, target, ctx)
            # scatter_add_, not bincount: CUDA's bincount reads the largest id back first, a second host sync
            flat = chosen.flatten()
            votes = probs.new_zeros(probs.shape[-1]).scatter_add_(0, flat, torch.ones_like(flat, dtype=probs.dtype))
            rows += (votes, probs.mean(dim=0), probs.amax(dim=0))
        table = torch.stack(rows).tolist()
        requests = []
        miss = 1.0 - self.tracker.precision
        for i, (hops, target, next_step) in enumerate(plan):
            votes, mean, best = table[3 * i : 3 * i + 3]
            for e, n in enumerate(votes):
                if not n or best[e] < self.min_confidence:
                    continue
                p_used = 1.0 - miss ** int(n)  # some token of the batch routes to e
                requests.append(PrefetchRequest(target, e, mean[e] / hops, next_step, p_used))
                if not next_step:
                    self.tracker.guess(target, e)
        return requests

    def on_step_end(self, ctx: StepContext) -> None:
        self.tracker.step_end(ctx)
