"""DuoServe's popularity vector and inter-layer affinity matrix (seed 000 section 4.1, eq. 2-3).

popularity[l, i] = share of layer l's selections that picked expert i (eq. 2). affinity[l, i, j] = P(expert j
at layer l+1 | expert i at layer l), from joint selections in consecutive layers (eq. 3). A prediction for
layer t from the last observed layer s-1 chains the affinity rows of its selected experts t-s+1 times; with
nothing observed yet it is the popularity of layer t. Counts carry a Laplace prior and grow online.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.common.iteration_context import IterationContext, PredictionQuery
from services.predictor.predictors.base import Predictor
from services.predictor.predictors.common import row_normalise


class PopularityAffinityPredictor(Predictor):
    name = "popularity-affinity"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, prior_weight: float = 0.05) -> None:
        super().__init__(num_layers, num_experts, top_k)
        self.prior_weight = prior_weight
        self.pop_counts = np.ones((num_layers, num_experts), np.float64)
        self.aff_counts = np.ones((max(num_layers - 1, 0), num_experts, num_experts), np.float64)
        self._cache: tuple[np.ndarray, np.ndarray] | None = None

    def observe(self, iteration: IterationContext) -> None:
        sel = (iteration.counts > 0).astype(np.float64)  # [L, E] selected experts per layer
        self.pop_counts += sel
        if iteration.num_tokens == 1:  # joint selections are per token; a prefill's union would blur them
            self.aff_counts += sel[:-1, :, None] * sel[1:, None, :]
        self._cache = None

    @property
    def popularity(self) -> np.ndarray:
        return self._matrices()[0]

    @property
    def affinity(self) -> np.ndarray:
        return self._matrices()[1]

    def _matrices(self) -> tuple[np.ndarray, np.ndarray]:
        if self._cache is None:
            pop = (self.pop_counts / self.pop_counts.sum(1, keepdims=True)).astype(np.float32)
            aff = (self.aff_counts / self.aff_counts.sum(2, keepdims=True)).astype(np.float32)
            self._cache = (pop, aff)
        return self._cache

    def chain(self, source_layer: int, selected: np.ndarray, target: int) -> np.ndarray:
        """Distribution over `target`'s experts given the selection vector at `source_layer` < target."""
        _, aff = self._matrices()
        v = row_normalise(selected.astype(np.float32))
        for layer in range(source_layer, target):
            v = v @ aff[layer]
        return v

    def predict(self, query: PredictionQuery) -> np.ndarray:
        pop, _ = self._matrices()
        t, s = query.target_layer, query.current.layers_seen
        if s == 0:
            return pop[t].copy()
        v = self.chain(s - 1, query.current.counts[s - 1] > 0, t)
        return (1 - self.prior_weight) * v + self.prior_weight * pop[t]

    def snapshot(self) -> dict[str, Any]:
        return {"pop_counts": self.pop_counts.copy(), "aff_counts": self.aff_counts.copy()}

    def restore(self, state: dict[str, Any]) -> None:
        self.pop_counts = np.array(state["pop_counts"], np.float64)
        self.aff_counts = np.array(state["aff_counts"], np.float64)
        self._cache = None
