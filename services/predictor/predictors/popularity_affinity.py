"""DuoServe's popularity vector and inter-layer affinity matrix (seed 000 section 4.1, eq. 2-3) as a predictor.

The counts are the engine's PopularityAffinity (services/engine/offload/popularity_affinity.py), fed with each
iteration's selections: popularity[l, i] = share of layer l's selections that picked expert i (eq. 2),
affinity[l, i, j] = P(expert j at layer l+1 | expert i at layer l) (eq. 3). A prediction for layer t from the
last observed layer s-1 chains the affinity rows of its selected experts t-s+1 times; with nothing observed
yet it is the popularity of layer t.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.common.iteration_context import IterationContext, PredictionQuery
from services.engine.offload.popularity_affinity import PopularityAffinity
from services.predictor.predictors.base import Predictor
from services.predictor.predictors.common import row_normalise


class PopularityAffinityPredictor(Predictor):
    name = "popularity-affinity"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, prior_weight: float = 0.05) -> None:
        super().__init__(num_layers, num_experts, top_k)
        self.prior_weight = prior_weight
        self.stats = PopularityAffinity(num_layers, num_experts)

    def observe(self, iteration: IterationContext) -> None:
        sel = (iteration.counts > 0).astype(np.float64)  # [L, E] selected experts per layer
        self.stats.add_selections(sel)
        if iteration.num_tokens == 1:  # joint selections are per token; a prefill's union would blur them
            self.stats.add_pairs(sel[:-1, :, None] * sel[1:, None, :])

    @property
    def popularity(self) -> np.ndarray:
        return self._matrices()[0]

    @property
    def affinity(self) -> np.ndarray:
        return self._matrices()[1]

    def _matrices(self) -> tuple[np.ndarray, np.ndarray]:
        return self.stats.normalised()

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
        return {"pop_counts": self.stats.pop_counts.copy(), "aff_counts": self.stats.aff_counts.copy()}

    def restore(self, state: dict[str, Any]) -> None:
        self.stats = PopularityAffinity(self.num_layers, self.num_experts)
        self.stats.pop_counts = np.array(state["pop_counts"], np.float64)
        self.stats.aff_counts = np.array(state["aff_counts"], np.float64)
