"""The skip-gate (Mixtral-Offloading, ProMoE): layer t's router applied to an earlier layer's hidden state.

The residual stream changes slowly across layers, so the future router applied to today's hidden state
guesses the future experts well (84-94% top-2 hit one layer ahead on the trained demo model). One
implementation for the engine's `speculative` prefetcher and the predictor's `speculative` predictor: the
family's own post-attention norm and router rule (softmax, DeepSeek's grouped top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.models.attention import rms_norm
from services.engine.models.checkpoint import Checkpoint
from services.engine.models.router import Routing, route
from services.engine.models.spec import ModelSpec, load_hf_config, spec_from_config
from services.engine.models.weights import NonExpertWeights, WeightReader, load_router


@dataclass(frozen=True)
class GateWeights:
    post_attention_norm: torch.Tensor  # [hidden]
    router: torch.Tensor  # [num_experts, hidden]
    router_bias: torch.Tensor | None  # DeepSeek-V3's selection bias


class SkipGate:
    def __init__(self, spec: ModelSpec, gates: dict[int, GateWeights]) -> None:
        self.spec = spec
        self.gates = gates  # model layer -> its gate weights

    def route(self, hidden: torch.Tensor, target: int) -> Routing:
        """What layer `target`'s router would pick for `hidden` ([tokens, hidden], any earlier layer's input)."""
        w = self.gates[target]
        x = rms_norm(hidden, w.post_attention_norm, self.spec.rms_norm_eps)
        return route(self.spec, x, w.router, w.router_bias)

    @classmethod
    def from_weights(cls, spec: ModelSpec, weights: NonExpertWeights) -> SkipGate:
        """From a loaded model's non-expert weights (the engine's prefetcher)."""
        return cls(spec, {
            i: GateWeights(layer.post_attention_norm, layer.router, layer.router_bias)
            for i, layer in enumerate(weights.layers) if layer.router is not None
        })

    @classmethod
    def load(cls, model_dir: str, layers: list[int], dtype: torch.dtype = torch.float32) -> SkipGate:
        """Only the named layers' routers and post-attention norms, read from the checkpoint (the predictor)."""
        spec = spec_from_config(load_hf_config(model_dir))
        reader = WeightReader(Checkpoint(model_dir), dtype, "cpu")
        gates = {}
        for i in layers:
            router, bias = load_router(reader, i)
            gates[i] = GateWeights(reader.tensor(f"model.layers.{i}.post_attention_layernorm.weight"), router, bias)
        return cls(spec, gates)
