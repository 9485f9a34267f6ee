"""ExpertMLP's network and its input vector (DuoServe section 4.2); the predictor and its training share them."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from services.common.iteration_context import IterationContext
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
