"""Baseline: the experts the previous iteration of this request used at the target layer (request reuse)."""

from __future__ import annotations

import numpy as np

from services.common.iteration_context import PredictionQuery
from services.predictor.predictors.base import Predictor
from services.predictor.predictors.common import row_normalise


class PreviousTokenPredictor(Predictor):
    name = "previous-token"

    def predict(self, query: PredictionQuery) -> np.ndarray:
        return self.predict_layers(query, [query.target_layer])[0]

    def predict_layers(self, query: PredictionQuery, targets: list[int]) -> np.ndarray:
        prev = query.history.last
        if prev is None:
            return np.full((len(targets), self.num_experts), 1.0 / self.num_experts, np.float32)
        # The selected experts first; the previous router distribution orders the rest (recall at budget > k).
        return 0.9 * row_normalise(prev.counts[targets]) + 0.1 * row_normalise(prev.probs[targets])
