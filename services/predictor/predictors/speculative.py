"""The skip-gate (Mixtral-Offloading, ProMoE section 4; our engine's `speculative` prefetcher) as a Predictor.

Layer t's router applied to the hidden state entering the last routed layer (the input embedding at the
iteration start), by the engine's own SkipGate (services/engine/models/skip_gate.py: the family's norm and
router rule), probabilities averaged over the iteration's tokens. Needs the model's router and
post-attention norm weights (read from the checkpoint) and traces recorded with layer inputs.
"""

from __future__ import annotations

import numpy as np
import torch

from services.common.iteration_context import PredictionQuery
from services.engine.models.skip_gate import SkipGate
from services.predictor.predictors.base import Predictor
from services.predictor.predictors.common import hidden_at


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
        self.layer_ids = layer_ids or list(range(num_layers))  # model layer of each traced layer
        self.gate = SkipGate.load(model_dir, self.layer_ids)

    @classmethod
    def from_trace(cls, trace, **kwargs) -> SpeculativePredictor:  # trace: services.predictor.traces.TraceSet
        model = kwargs.pop("model_dir", "") or trace.model
        check_weights(model, trace.model_hash)
        return cls(trace.num_layers, trace.num_experts, trace.top_k, model_dir=model, layer_ids=trace.layer_ids)

    def predict_from_hidden(self, hidden: np.ndarray | torch.Tensor, target: int) -> np.ndarray:
        """`target`: a traced layer's index."""
        x = torch.as_tensor(hidden, dtype=torch.float32)
        return self.gate.route(x, self.layer_ids[target]).probs.mean(0).numpy()

    def predict(self, query: PredictionQuery) -> np.ndarray:
        hidden = hidden_at(query.current, query.current.layers_seen - 1)
        if hidden is None:
            return np.full(self.num_experts, 1.0 / self.num_experts, np.float32)
        return self.predict_from_hidden(hidden, query.target_layer)
