"""The skip-gate (Mixtral-Offloading, ProMoE section 4; our engine's `speculative` prefetcher) as a Predictor.

Layer t's router applied to the hidden state entering the last routed layer (the input embedding at the
iteration start): softmax(W_router[t] rms_norm(x, post_attention_norm[t])), mean over the iteration's tokens.
Needs the model's router and post-attention norm weights (read from the checkpoint) and traces recorded
with layer inputs.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import torch

from services.common.iteration_context import PredictionQuery
from services.predictor.predictors.base import Predictor
from services.predictor.predictors.common import hidden_at

_ROUTER_NAMES = ("model.layers.{i}.block_sparse_moe.gate.weight", "model.layers.{i}.mlp.gate.weight")


def load_router_weights(model_dir: str, layer_ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """(router [E, H] per traced layer, post_attention_layernorm [H] per traced layer, rms eps) in float32."""
    import json

    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    wanted = {n.format(i=i) for i in layer_ids for n in _ROUTER_NAMES}
    wanted |= {f"model.layers.{i}.post_attention_layernorm.weight" for i in layer_ids}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in wanted & set(f.keys()):
                tensors[name] = f.get_tensor(name).float()
    routers, norms = [], []
    for i in layer_ids:
        router = next((tensors[n.format(i=i)] for n in _ROUTER_NAMES if n.format(i=i) in tensors), None)
        if router is None:
            raise KeyError(f"{model_dir}: no router weight for layer {i}")
        routers.append(router)
        norms.append(tensors[f"model.layers.{i}.post_attention_layernorm.weight"])
    with open(os.path.join(model_dir, "config.json")) as f:
        eps = float(json.load(f).get("rms_norm_eps", 1e-6))
    return routers, norms, eps


def check_weights(model_dir: str, recorded_hash: str) -> None:
    """Hidden states recorded with other weights would silently mislead the skip-gate: refuse them."""
    from services.predictor.traces import model_fingerprint

    if recorded_hash and model_fingerprint(model_dir) != recorded_hash:
        raise ValueError(f"the weights in {model_dir} changed since this trace was recorded; re-collect it")


class SpeculativePredictor(Predictor):
    name = "speculative"
    requires_layer_inputs = True
    requires_model = True

    def __init__(self, num_layers: int, num_experts: int, top_k: int, model_dir: str = "",
                 layer_ids: list[int] | None = None) -> None:
        super().__init__(num_layers, num_experts, top_k)
        if not model_dir:
            raise ValueError("the speculative predictor needs the model directory (router weights)")
        self.model_dir = model_dir
        self.routers, self.norms, self.eps = load_router_weights(model_dir, layer_ids or list(range(num_layers)))

    @classmethod
    def from_trace(cls, trace, **kwargs) -> SpeculativePredictor:  # trace: services.predictor.traces.TraceSet
        model = kwargs.pop("model_dir", "") or trace.model
        check_weights(model, trace.model_hash)
        return cls(trace.num_layers, trace.num_experts, trace.top_k, model_dir=model, layer_ids=trace.layer_ids)

    def predict_from_hidden(self, hidden: np.ndarray | torch.Tensor, target: int) -> np.ndarray:
        x = torch.as_tensor(hidden, dtype=torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norms[target]
        return torch.softmax(x @ self.routers[target].T, dim=-1).mean(0).numpy()

    def predict(self, query: PredictionQuery) -> np.ndarray:
        hidden = hidden_at(query.current, query.current.layers_seen - 1)
        if hidden is None:
            return np.full(self.num_experts, 1.0 / self.num_experts, np.float32)
        return self.predict_from_hidden(hidden, query.target_layer)
