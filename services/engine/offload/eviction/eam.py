"""MoE-Infinity's request-level EAM cache priority with the initial-layer bias (seed 004, section 5.2).

Each running request accumulates an expert activation matrix (EAM: activations per layer and expert since
the request began). An expert's priority is its activation count summed over the running requests'
EAMs, scaled up for initial layers, which prefetching serves worst; the lowest priority is evicted.
"""

from __future__ import annotations

import torch

from services.engine.offload.eviction.base import EvictionPolicy, Key
from services.engine.step_context import StepContext


class EAMEviction(EvictionPolicy):
    name = "eam"

    def __init__(self, num_layers: int, num_experts: int, initial_layer_bias: float = 1.0) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.bias = initial_layer_bias
        self.request_eams: dict[str, torch.Tensor] = {}  # request id -> [layers, experts] counts
        self._batch_eam = torch.zeros(num_layers, num_experts)

    def on_step_end(self, ctx: StepContext) -> None:
        ids = ctx.request_ids
        live = set(ids)
        for rid in [r for r in self.request_eams if r not in live]:
            del self.request_eams[rid]  # finished or preempted: its EAM no longer guides the cache
        token_request = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor(ctx.seq_lens))
        step_eam = torch.zeros(len(ids), self.num_layers, self.num_experts)
        for layer, experts in ctx.selected_experts.items():
            k = experts.shape[1]
            flat = token_request.repeat_interleave(k) * self.num_experts + experts.flatten().cpu()
            counts = torch.bincount(flat, minlength=len(ids) * self.num_experts).float()
            step_eam[:, layer] = counts.view(len(ids), self.num_experts)
        for i, rid in enumerate(ids):
            eam = self.request_eams.get(rid)
            self.request_eams[rid] = step_eam[i] if eam is None else eam + step_eam[i]
        self._batch_eam = sum(self.request_eams.values(), torch.zeros(self.num_layers, self.num_experts))

    def priority(self, key: Key) -> float:
        layer, expert = key
        layer_weight = 1.0 + self.bias * (self.num_layers - layer) / self.num_layers
        return float(self._batch_eam[layer, expert]) * layer_weight

    def victim(self, candidates: list[Key], ctx: StepContext | None, layer_now: int) -> Key:
        return min(candidates, key=self.priority)
