"""DuoServe's ExpertMLP (seed 000 section 4.2): a 7-layer MLP over the activation path so far.

Input s = [h, p_t, a]: h = the experts selected at the layers already routed in this iteration (a multi-hot
[L, E], zero for the layers not yet seen; the paper zero-pads the flattened index list to a fixed length, the
multi-hot holds the same information in a form an MLP can use), p_t = layer t's popularity, a = the affinity
row reaching layer t from the last routed layer (chained for distances > 1), plus one-hots of the target layer
and the distance so one network serves every (layer, distance). Seven fully connected layers narrowing
2048 -> 64 (BatchNorm, ReLU, dropout 0.1) then E logits, trained with BCE (`services/predictor/train.py`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from services.common.iteration_context import IterationContext, PredictionQuery, RequestTrace
from services.predictor.predictors.base import Predictor
from services.predictor.predictors.popularity_affinity import PopularityAffinityPredictor

MAX_DISTANCE = 4  # distances above this share the last one-hot slot


def widths(first: int = 2048, last: int = 64) -> list[int]:
    out = [first]
    while out[-1] // 2 >= last:
        out.append(out[-1] // 2)
    return out  # 2048 -> 64: six hidden layers, plus the output layer = seven FC layers


class ExpertMLP(nn.Module):
    def __init__(self, in_dim: int, num_experts: int, first: int = 2048, last: int = 64, dropout: float = 0.1):
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_dim
        for w in widths(first, last):
            layers += [nn.Linear(prev, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Dropout(dropout)]
            prev = w
        layers.append(nn.Linear(prev, num_experts))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def feature_dim(num_layers: int, num_experts: int) -> int:
    return num_layers * num_experts + 2 * num_experts + num_layers + MAX_DISTANCE


def features(popaff: PopularityAffinityPredictor, it: IterationContext, seen: int, target: int) -> np.ndarray:
    """The state vector s for predicting `target` with `seen` layers of `it` routed."""
    L, E = popaff.num_layers, popaff.num_experts
    x = np.zeros(feature_dim(L, E), np.float32)
    x[: seen * E] = (it.counts[:seen] > 0).ravel()
    o = L * E
    x[o:o + E] = popaff.popularity[target]
    if seen > 0:
        x[o + E:o + 2 * E] = popaff.chain(seen - 1, it.counts[seen - 1] > 0, target)
    o += 2 * E
    x[o + target] = 1.0
    x[o + L + min(target - seen + 1, MAX_DISTANCE) - 1] = 1.0
    return x


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
        from services.predictor.train import train_expert_mlp

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
