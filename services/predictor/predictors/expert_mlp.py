"""DuoServe's ExpertMLP (seed 000 section 4.2): a 7-layer MLP over the activation path so far.

Input s = [h, p_t, a]: h = the experts selected at the layers already routed in this iteration (a multi-hot
[L, E], zero for the layers not yet seen; the paper zero-pads the flattened index list to a fixed length, the
multi-hot holds the same information in a form an MLP can use), p_t = layer t's popularity, a = the affinity
row reaching layer t from the last routed layer (chained for distances > 1), plus one-hots of the target layer
and the distance so one network serves every (layer, distance). Seven fully connected layers narrowing
2048 -> 64 (BatchNorm, ReLU, dropout 0.1) then E logits, trained with BCE (`expert_mlp_training.py`); the network is `expert_mlp_net.py`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from services.common.iteration_context import PredictionQuery, RequestTrace
from services.predictor.predictors.base import Predictor
from services.predictor.predictors.expert_mlp_net import ExpertMLP, feature_dim, features
from services.predictor.predictors.expert_mlp_training import train_expert_mlp
from services.predictor.predictors.popularity_affinity import PopularityAffinityPredictor


class ExpertMLPPredictor(Predictor):
    name = "expert-mlp"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, first_width: int = 2048,
                 max_epochs: int = 20, max_seconds: float = 40.0, seed: int = 0) -> None:
        super().__init__(num_layers, num_experts, top_k)
        self.first_width, self.max_epochs, self.max_seconds, self.seed = first_width, max_epochs, max_seconds, seed
        self.popaff = PopularityAffinityPredictor(num_layers, num_experts, top_k)
        self.model = ExpertMLP(feature_dim(num_layers, num_experts), num_experts, first_width).eval()
        self.report: dict[str, Any] = {}

    def fit(self, requests: list[RequestTrace]) -> None:
        self.report = train_expert_mlp(self, requests, max_epochs=self.max_epochs, max_seconds=self.max_seconds,
                                       seed=self.seed, progress=False)

    def predict(self, query: PredictionQuery) -> np.ndarray:
        return self.predict_many([query])[0]

    def predict_many(self, queries: list[PredictionQuery]) -> np.ndarray:
        x = np.stack([features(self.popaff, q.current, q.current.layers_seen, q.target_layer) for q in queries])
        with torch.no_grad():
            return torch.sigmoid(self.model(torch.from_numpy(x))).numpy()

    def snapshot(self) -> dict[str, Any]:
        return {"first_width": self.first_width, "popaff": self.popaff.snapshot(),
                "state_dict": {k: v.clone() for k, v in self.model.state_dict().items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.first_width = int(state["first_width"])
        self.popaff.restore(state["popaff"])
        self.model = ExpertMLP(feature_dim(self.num_layers, self.num_experts), self.num_experts, self.first_width)
        self.model.load_state_dict(state["state_dict"])
        self.model.eval()

    def save(self, path: str) -> None:
        torch.save({"shape": [self.num_layers, self.num_experts, self.top_k], **self.snapshot()}, path)

    @classmethod
    def load(cls, path: str) -> ExpertMLPPredictor:
        state = torch.load(path, map_location="cpu", weights_only=False)
        pred = cls(*state["shape"], first_width=int(state["first_width"]))
        pred.restore(state)
        return pred
