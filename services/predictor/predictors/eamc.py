"""MoE-Infinity's Expert Activation Matrix Collection (seed 004 sections 4-5).

An EAM is an [L, E] matrix of token counts per expert. Each request accumulates a request-level EAM
(decode and prefill kept apart, as the paper traces them separately); the EAMC keeps up to `capacity` of
them. A request's entry is inserted at its first iteration and updated in place afterwards; when the
collection is full the entry most similar (cosine) to the newcomer is replaced, keeping it recent and diverse.
Prediction matches the current iteration-level EAM over the layers seen so far (the request-level EAM at the
iteration start) against the collection, aggregates the `top_m` closest entries (cells summed, rows
normalised) and scales the target row by the layer proximity 1 - (t - l)/L.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.common.iteration_context import IterationContext, PredictionQuery
from services.predictor.predictors.base import Predictor
from services.predictor.predictors.common import row_normalise, unit


class EAMCPredictor(Predictor):
    name = "eamc"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, capacity: int = 1000, top_m: int = 3) -> None:
        super().__init__(num_layers, num_experts, top_k)
        self.capacity = capacity
        self.top_m = top_m
        self._buf = np.zeros((16, num_layers, num_experts), np.float32)  # grows by doubling up to capacity
        self.keys: list[str] = []  # "request/phase" of each entry
        self._slots: dict[str, int] = {}
        self._normed: np.ndarray | None = None  # row-normalised EAMs, cached for matching

    # ---- collection ----
    def observe(self, iteration: IterationContext) -> None:
        phase = "prefill" if iteration.iteration == 0 else "decode"
        key = f"{iteration.request_id}/{phase}"
        slot = self._slots.get(key)
        if slot is not None:  # the request's running EAM grows with every iteration
            self.eams[slot] += iteration.counts
        else:
            self._insert(key, iteration.counts.astype(np.float32))
        self._normed = None

    def _insert(self, key: str, eam: np.ndarray) -> None:
        if len(self.keys) < self.capacity:
            if len(self.keys) == len(self._buf):
                grow = np.zeros((max(16, len(self._buf)), self.num_layers, self.num_experts), np.float32)
                self._buf = np.concatenate([self._buf, grow])
            self._buf[len(self.keys)] = eam
            self._slots[key] = len(self.keys)
            self.keys.append(key)
            return
        sims = self._flat_normed() @ unit(row_normalise(eam).ravel())
        victim = int(np.argmax(sims))  # most similar entry: keeps the collection diverse and recent
        self.eams[victim] = eam
        del self._slots[self.keys[victim]]
        self.keys[victim] = key
        self._slots[key] = victim

    @property
    def eams(self) -> np.ndarray:
        """Request-level EAMs (token counts), one per entry."""
        return self._buf[: len(self.keys)]

    def _flat_normed(self) -> np.ndarray:
        if self._normed is None:
            self._normed = row_normalise(self.eams).reshape(len(self.eams), -1)
        return unit(self._normed)

    # ---- prediction ----
    def match(self, query_eam: np.ndarray, layers: int) -> np.ndarray:
        """Aggregated, row-normalised EAM of the top_m entries closest on the first `layers` rows."""
        E = self.num_experts
        normed = row_normalise(self.eams).reshape(len(self.eams), -1) if self._normed is None else self._normed
        self._normed = normed
        q = row_normalise(query_eam[:layers]).ravel()
        prefix = normed[:, : layers * E]
        sims = prefix @ q / np.maximum(np.linalg.norm(prefix, axis=1) * np.linalg.norm(q), 1e-9)
        best = np.argsort(-sims, kind="stable")[: self.top_m]
        return row_normalise(self.eams[best].sum(0))

    def predict(self, query: PredictionQuery) -> np.ndarray:
        t, s, L = query.target_layer, query.current.layers_seen, self.num_layers
        if len(self.keys) == 0:
            return np.full(self.num_experts, 1.0 / self.num_experts, np.float32)
        if s > 0:
            agg = self.match(query.current.counts, s)
        else:
            decode_counts = query.history.decode_counts()
            if decode_counts is not None:  # iteration start: match the request-level EAM so far
                agg = self.match(decode_counts, L)
            else:  # nothing known about this request: the collection's overall activation
                agg = row_normalise(self.eams.sum(0))
        proximity = 1.0 - (t - max(s - 1, 0)) / L
        return agg[t] * proximity

    def snapshot(self) -> dict[str, Any]:
        return {"eams": self.eams.copy(), "keys": list(self.keys), "capacity": self.capacity}

    def restore(self, state: dict[str, Any]) -> None:
        self._buf = np.array(state["eams"], np.float32).reshape(-1, self.num_layers, self.num_experts).copy()
        self.keys = [str(k) for k in state["keys"]]
        self._slots = {k: i for i, k in enumerate(self.keys)}
        self.capacity = int(state.get("capacity", self.capacity))
        self._normed = None
