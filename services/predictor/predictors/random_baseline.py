"""Baseline: uniformly random scores, deterministic per (request, iteration, layer)."""

from __future__ import annotations

import zlib

import numpy as np

from services.common.iteration_context import PredictionQuery
from services.predictor.predictors.base import Predictor


class RandomPredictor(Predictor):
    name = "random"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> None:
        super().__init__(num_layers, num_experts, top_k)
        self.seed = seed

    def predict(self, query: PredictionQuery) -> np.ndarray:
        cur = query.current
        key = zlib.crc32(f"{self.seed}/{cur.request_id}/{cur.iteration}/{query.target_layer}".encode())
        return np.random.default_rng(key).random(self.num_experts).astype(np.float32)
