"""One interface for every expert predictor: learn from traces, then score the experts of a future layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from services.common.iteration_context import IterationContext, PredictionQuery, RequestTrace

if TYPE_CHECKING:
    from services.predictor.trace_set import TraceSet


class Predictor(ABC):
    name: str = ""

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k

    @classmethod
    def from_trace(cls, trace: TraceSet, **kwargs: Any) -> Self:
        """One sized for `trace` (layers, experts, top-k); predictors that read more of it (layer ids, the
        model directory) override this."""
        return cls(trace.num_layers, trace.num_experts, trace.top_k, **kwargs)

    def fit(self, requests: list[RequestTrace]) -> None:
        """Offline training; the default observes every iteration in order (online learners)."""
        for request in requests:
            for it in request.iterations:
                self.observe(it)

    def observe(self, iteration: IterationContext) -> None:  # noqa: B027 - optional for offline predictors
        """Online update with a finished iteration (e.g. add its expert map to the store)."""

    @abstractmethod
    def predict(self, query: PredictionQuery) -> np.ndarray:
        """Scores over the experts of `query.target_layer` ([experts], higher = more likely)."""

    def predict_layers(self, query: PredictionQuery, targets: list[int]) -> np.ndarray:
        """Scores for several target layers of one query ([targets, experts]); predictors that can score
        them at once override this (the service asks for every layer still ahead of each context)."""
        return np.stack([self.predict(replace(query, target_layer=t)) for t in targets])

    def snapshot(self) -> dict[str, Any]:
        """State to persist (map store, EAMC); restored with `restore`."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless predictors
        """Inverse of `snapshot`."""
