"""Ours: a learned log-linear blend of the predictors that measurably carry signal.

Each component c scores the target layer's experts; its log-probabilities log p_c are combined as
softmax(sum_c w_c log p_c) (a product of experts), with separate weights per phase (nothing of the iteration routed
yet: per target layer 0..3+; some layers routed: per distance 1..4+), plus a confidence term for the map search
(similarity x log p), so a near-exact trajectory match dominates and a weak one defers to the skip-gate /
learned gate (near layers), the request's previous token or the affinity chain. The weights are fitted on
out-of-fold predictions: components are fitted on one half of the training requests and replayed online on
the other, then refitted on everything. Components that need hidden states drop out (constant features)
when a query has none.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from services.common.iteration_context import IterationContext, PredictionQuery, RequestTrace
from services.common.request_history import RequestHistory
from services.predictor.predictors.base import Predictor
from services.predictor.predictors.common import fewest_above, hidden_at
from services.predictor.predictors.expert_map import ExpertMapPredictor
from services.predictor.predictors.learned_gate import LearnedGatePredictor
from services.predictor.predictors.popularity_affinity import PopularityAffinityPredictor
from services.predictor.predictors.previous_token import PreviousTokenPredictor
from services.predictor.predictors.speculative import SpeculativePredictor, check_weights

MAX_BUCKET = 4
HIDDEN_COMPONENTS = ("learned-gate", "speculative")


class HintServePredictor(Predictor):
    name = "hintserve"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, model_dir: str = "",
                 layer_ids: list[int] | None = None, hidden: bool = False, gate_steps: int = 300,
                 folds: int = 4, seed: int = 0) -> None:
        super().__init__(num_layers, num_experts, top_k)
        self.model_dir, self.layer_ids, self.hidden, self.seed = model_dir, layer_ids, hidden, seed
        self.gate_steps, self.folds = gate_steps, folds
        self.components = self._make_components()
        self.weights = np.zeros((2, MAX_BUCKET, self.num_features), np.float32)
        self.weights[:, :, 0] = 1.0  # before fitting: the map search alone

    @classmethod
    def from_trace(cls, trace, **kwargs) -> HintServePredictor:  # trace: services.predictor.traces.TraceSet
        hidden = trace.has_layer_inputs
        if hidden and trace.model:
            check_weights(trace.model, trace.model_hash)
        return cls(trace.num_layers, trace.num_experts, trace.top_k, model_dir=trace.model if hidden else "",
                   layer_ids=trace.layer_ids, hidden=hidden, **kwargs)

    def _make_components(self) -> dict[str, Predictor]:
        L, E, k = self.num_layers, self.num_experts, self.top_k
        comps: dict[str, Predictor] = {
            # FineMoE's single best map, searched on trajectory + 0.2 x context similarity (better on the
            # real Mixtral/Qwen traces, neutral on the demo model) ...
            "expert-map": ExpertMapPredictor(L, E, k, context_weight=0.2),
            # ... and a soft top-8 average of maps (better at-least-one on the sparse top-k-only logs).
            "map-knn": ExpertMapPredictor(L, E, k, top_m=8, temperature=0.02, context_weight=0.2),
            "previous-token": PreviousTokenPredictor(L, E, k),
            "popularity-affinity": PopularityAffinityPredictor(L, E, k),
        }
        if self.hidden:
            comps["learned-gate"] = LearnedGatePredictor(L, E, k, steps=self.gate_steps, seed=self.seed)
            if self.model_dir:
                comps["speculative"] = SpeculativePredictor(L, E, k, self.model_dir, self.layer_ids)
        return comps

    @property
    def num_features(self) -> int:
        return len(self.components) + 1  # + the map search's similarity-weighted log p

    # ---- features ----
    def features(self, query: PredictionQuery) -> np.ndarray:
        """[E, F]: log p of each component, then similarity x log p of the map search."""
        cols = []
        has_hidden = hidden_at(query.current, query.current.layers_seen - 1) is not None
        sim = 0.0
        for name, comp in self.components.items():
            if name in HIDDEN_COMPONENTS and not has_hidden:
                cols.append(np.zeros(self.num_experts, np.float32))  # constant: no effect on the softmax
                continue
            if name == "expert-map" and isinstance(comp, ExpertMapPredictor):  # the search says how similar
                scores, sim = comp.scored(query)
            else:
                scores = comp.predict(query)
            p = np.maximum(np.asarray(scores, np.float64), 0.0)
            cols.append(np.log(p / max(p.sum(), 1e-12) + 1e-4))
        cols.append(max(sim, 0.0) * cols[0])
        return np.stack(cols, 1).astype(np.float32)

    @staticmethod
    def bucket(query: PredictionQuery) -> tuple[int, int]:
        """(phase, index): with nothing routed yet the query does not depend on the distance, only on the
        target layer, so phase 0 is keyed by target layer; phase 1 by distance (both capped)."""
        if query.current.layers_seen == 0:
            return 0, min(query.target_layer, MAX_BUCKET - 1)
        return 1, min(query.distance, MAX_BUCKET) - 1

    def predict(self, query: PredictionQuery) -> np.ndarray:
        phase, d = self.bucket(query)
        logits = self.features(query) @ self.weights[phase, d]
        e = np.exp(logits - logits.max())
        return (e / e.sum()).astype(np.float32)

    def plan(self, query: PredictionQuery, mass: float = 0.9) -> tuple[np.ndarray, np.ndarray, float]:
        """Prefetch set: the fewest experts holding `mass` of the blend (at least top-k), priority p/hops."""
        p = self.predict(query)
        experts = fewest_above(p, mass, self.top_k)[: 2 * self.top_k]
        return experts, p[experts] / query.distance, float(p[experts].sum())

    def observe(self, iteration: IterationContext) -> None:
        for comp in self.components.values():
            comp.observe(iteration)

    # ---- training ----
    def fit(self, requests: list[RequestTrace]) -> None:
        samples: dict[tuple[int, int], tuple[list, list]] = {}
        for train, held in self._folds(requests):
            self.components = self._make_components()
            for comp in self.components.values():
                comp.fit(train)
            for request in held:
                history = RequestHistory()
                for it in request.iterations:
                    if it.iteration > 0:
                        self._collect(it, history, samples)
                    self.observe(it)
                    history.append(it)
        for (phase, d), (xs, ys) in samples.items():
            self.weights[phase, d] = _fit_weights(np.stack(xs), np.stack(ys), self.weights[phase, d])
        self.components = self._make_components()
        for comp in self.components.values():
            comp.fit(requests)

    def _collect(self, it: IterationContext, history: RequestHistory, samples: dict) -> None:
        from services.predictor.eval import masked

        for d in range(1, MAX_BUCKET + 1):
            for t in range(self.num_layers):
                q = PredictionQuery(history, masked(it, max(0, t - d + 1)), t)
                xs, ys = samples.setdefault(self.bucket(q), ([], []))
                xs.append(self.features(q))
                ys.append((it.counts[t] > 0).astype(np.float32))

    def _folds(self, requests: list[RequestTrace]) -> list[tuple[list, list]]:
        """K folds by request (components see (K-1)/K of the data, close to the final fit); with fewer than
        4 requests, each request's first and second half of iterations as two pseudo-requests."""
        if len(requests) < 4:
            a, b = [], []
            for r in requests:
                half = len(r.iterations) // 2
                a.append(RequestTrace(f"{r.request_id}#a", r.iterations[:half], r.source))
                b.append(RequestTrace(f"{r.request_id}#b", r.iterations[half:], r.source))
            return [(a, b), (b, a)]
        order = np.random.default_rng(self.seed).permutation(len(requests))
        folds = np.array_split(order, min(self.folds, len(requests) // 2))
        return [([requests[i] for i in order if i not in set(f)], [requests[i] for i in f]) for f in folds]

    # ---- persistence ----
    def snapshot(self) -> dict[str, Any]:
        return {"weights": self.weights.copy(), "components": {n: c.snapshot() for n, c in self.components.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.weights = np.asarray(state["weights"], np.float32)
        for name, comp_state in state["components"].items():
            if name in self.components:
                self.components[name].restore(comp_state)


def _fit_weights(x: np.ndarray, y: np.ndarray, init: np.ndarray, l2: float = 1e-3) -> np.ndarray:
    """Non-negative weights w ranking each sample's used experts above its unused ones: a pairwise logistic
    loss on x @ w (it targets the top-k hit directly). w = softplus(v) >= 0: a product of experts never
    rewards disagreeing with a component, which keeps the blend stable when components get more data."""
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.float32))
    pairs = yt[:, :, None] * (1 - yt[:, None, :])  # [N, E, E]: (used i, unused j)
    start = torch.from_numpy(np.maximum(init, 1e-3).astype(np.float32))
    v = (start.expm1().log()).clone().requires_grad_(True)  # softplus^-1
    opt = torch.optim.LBFGS([v], max_iter=100, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        w = nn.functional.softplus(v)
        s = xt @ w
        margin = nn.functional.softplus(s[:, None, :] - s[:, :, None])  # loss when unused j outranks used i
        loss = (margin * pairs).sum((1, 2)).mean() + l2 * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return nn.functional.softplus(v).detach().numpy().astype(np.float32)
