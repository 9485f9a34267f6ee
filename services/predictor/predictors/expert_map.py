"""FineMoE's expert-map store and search (seed 003 sections 4.1-4.4).

An expert map is one iteration's router distribution over all layers. The store keeps up to C maps (prefill
and decode maps apart) with their semantic keys (the iteration's input embedding, randomly projected to
`sem_dim` so a search costs C x sem_dim, not C x hidden). For a target layer t with s layers of the current
iteration observed: s == 0 (t before the prefetch distance) -> semantic search (cosine of keys, eq. 4);
s > 0 -> trajectory search (cosine over the observed layers' probabilities, eq. 5). The best map's row t is
the prediction; `plan` turns it into FineMoE's prefetch set: delta = clip(1 - score, 0, 1), the fewest
experts whose mass reaches delta (at least top-k), priority p / (t - l_now). Inserting dedups by RDY =
d/L sem + (L-d)/L traj: a near-duplicate (RDY >= dedup_threshold) or, when full, the most redundant map is
replaced. All searches are single numpy mat-vecs over contiguous arrays (see `hintserve predictor bench-search`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from services.common.iteration_context import IterationContext, PredictionQuery
from services.common.request_history import RequestHistory
from services.predictor.predictors.base import Predictor
from services.predictor.predictors.common import fewest_above, semantic_key, unit


class MapStore:
    """C maps [C, L*E] with cumulative per-layer squared norms (prefix cosine in O(C)) and semantic keys."""


    def __init__(self, capacity: int, num_layers: int, num_experts: int, sem_dim: int) -> None:
        self.capacity, self.L, self.E = capacity, num_layers, num_experts
        self.maps = np.zeros((capacity, num_layers * num_experts), np.float32)
        self.sq_cum = np.zeros((num_layers + 1, capacity), np.float32)  # [s, c] = ||map c's first s layers||^2
        self.sem = np.zeros((capacity, sem_dim), np.float32)  # unit semantic keys
        self.size = 0
        self.map_sum = np.zeros(num_layers * num_experts, np.float64)

    def put(self, slot: int, probs: np.ndarray, sem: np.ndarray) -> None:
        if slot < self.size:
            self.map_sum -= self.maps[slot]
        flat = probs.astype(np.float32).ravel()
        self.maps[slot] = flat
        self.sq_cum[1:, slot] = np.cumsum((probs.astype(np.float32) ** 2).sum(1))
        self.sem[slot] = sem
        self.map_sum += flat
        self.size = max(self.size, slot + 1)

    def trajectory(self, observed: np.ndarray, first: int = 0) -> np.ndarray:
        """Cosine of each stored map's layers [first, s) with the observed [s, E] probabilities (eq. 5)."""
        s = observed.shape[0]
        q = observed[first:].astype(np.float32).ravel()
        # A column block of the row-major store: BLAS reads it in place (row stride = L*E), only s-first layers.
        dots = self.maps[: self.size, first * self.E: s * self.E] @ q
        sq = self.sq_cum[s, : self.size] - self.sq_cum[first, : self.size] if first else self.sq_cum[s, : self.size]
        return dots / np.maximum(np.sqrt(np.maximum(sq, 0.0)) * float(np.linalg.norm(q)), 1e-12)

    def semantic(self, key: np.ndarray) -> np.ndarray:
        """Cosine of each stored semantic key with `key` (unit) (eq. 4)."""
        return self.sem[: self.size] @ key


class ExpertMapPredictor(Predictor):
    name = "expert-map"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, capacity: int = 2000, distance: int = 2,
                 dedup_threshold: float = 0.995, sem_dim: int = 128, top_m: int = 1, window: int = 0,
                 context_weight: float = 0.0, temperature: float = 0.0, seed: int = 0) -> None:
        super().__init__(num_layers, num_experts, top_k)
        self.capacity, self.distance, self.dedup_threshold = capacity, distance, dedup_threshold
        self.sem_dim, self.top_m, self.window, self.seed = sem_dim, top_m, window, seed
        # Extensions (0 = FineMoE as published): blend the semantic score into trajectory search, and
        # average the top_m maps with weights exp((sim - best) / temperature) instead of a plain mean.
        self.context_weight, self.temperature = context_weight, temperature
        self.stores = {phase: MapStore(capacity, num_layers, num_experts, sem_dim) for phase in ("prefill", "decode")}
        self._projection: np.ndarray | None = None
        self._key_cache: tuple[np.ndarray | None, np.ndarray] | None = None
        self._last: OrderedDict[str, IterationContext] = OrderedDict()  # previous iteration per request

    # ---- keys ----
    def _project(self, key: np.ndarray) -> np.ndarray:
        if self._projection is None or self._projection.shape[0] != key.size:
            rng = np.random.default_rng(self.seed)  # fixed: keys stay comparable across restarts
            self._projection = rng.standard_normal((key.size, self.sem_dim)).astype(np.float32)
        return unit(key.astype(np.float32) @ self._projection)

    def _sem_key(self, it: IterationContext, previous: IterationContext | None) -> np.ndarray:
        # Every target layer of an iteration shares its key: project once per (embedding, previous map).
        source = it.embedding if it.embedding.size else (previous.probs if previous is not None else None)
        if self._key_cache is not None and self._key_cache[0] is source and source is not None:
            return self._key_cache[1]
        key = self._project(semantic_key(it, previous))
        self._key_cache = (source, key)
        return key

    @staticmethod
    def _phase(it: IterationContext) -> str:
        return "prefill" if it.iteration == 0 else "decode"

    # ---- store ----
    def observe(self, iteration: IterationContext) -> None:
        previous = self._last.pop(iteration.request_id, None)
        self._last[iteration.request_id] = iteration
        if len(self._last) > 4096:
            self._last.popitem(last=False)
        self.insert(iteration, self._sem_key(iteration, previous))

    def insert(self, iteration: IterationContext, sem: np.ndarray) -> int:
        store = self.stores[self._phase(iteration)]
        slot = store.size
        if store.size:
            d, L = self.distance, self.num_layers
            rdy = d / L * store.semantic(sem) + (L - d) / L * store.trajectory(iteration.probs)
            best = int(np.argmax(rdy))
            if rdy[best] >= self.dedup_threshold or store.size == store.capacity:
                slot = best  # the most redundant map makes room (or is refreshed by its near-duplicate)
        store.put(slot, iteration.probs, sem)
        return slot

    def __len__(self) -> int:
        return sum(s.size for s in self.stores.values())

    # ---- search ----
    def search(self, query: PredictionQuery) -> tuple[np.ndarray, float]:
        """(searched probabilities for the target layer [E], similarity score)."""
        cur, t, s = query.current, query.target_layer, query.current.layers_seen
        store = self.stores[self._phase(cur)]
        E = self.num_experts
        if store.size == 0:
            return np.full(E, 1.0 / E, np.float32), 0.0
        prev = query.history.last
        if s == 0:
            sims = store.semantic(self._sem_key(cur, prev))
        else:
            sims = store.trajectory(cur.probs[:s], max(0, s - self.window) if self.window else 0)
            if self.context_weight:
                sims = (1 - self.context_weight) * sims + self.context_weight * store.semantic(self._sem_key(cur, prev))
        if self.top_m == 1:
            best = int(np.argmax(sims))
            return store.maps[best, t * E:(t + 1) * E].copy(), float(sims[best])
        m = min(self.top_m, len(sims))
        best_m = np.argpartition(-sims, m - 1)[:m]
        top = float(sims[best_m].max())
        if self.temperature > 0:
            w = np.exp((sims[best_m] - top) / self.temperature)
        else:
            w = np.maximum(sims[best_m], 0.0) + 1e-6
        return (w @ store.maps[best_m, t * E:(t + 1) * E]) / w.sum(), top

    def scored(self, query: PredictionQuery) -> tuple[np.ndarray, float]:
        """(prediction scores [E], similarity of the searched map)."""
        probs, score = self.search(query)
        store = self.stores[self._phase(query.current)]
        t, E = query.target_layer, self.num_experts
        # The store's mean map orders the experts the searched map gave no mass (top-2-only logs).
        prior = store.map_sum[t * E:(t + 1) * E] / max(store.size, 1)
        return probs + 1e-3 * prior.astype(np.float32), score

    def predict(self, query: PredictionQuery) -> np.ndarray:
        return self.scored(query)[0]

    def plan(self, query: PredictionQuery) -> tuple[np.ndarray, np.ndarray, float]:
        """FineMoE's prefetch set for the target: (experts best first, priorities p/(t - l_now), score)."""
        probs, score = self.search(query)
        delta = float(np.clip(1.0 - score, 0.0, 1.0))
        experts = fewest_above(probs, delta, self.top_k)
        hops = query.target_layer - (query.current.layers_seen - 1)  # l - l_now, l_now = last routed layer
        return experts, probs[experts] / hops, score

    # ---- persistence ----
    def snapshot(self) -> dict[str, Any]:
        state: dict[str, Any] = {"capacity": self.capacity, "sem_dim": self.sem_dim, "seed": self.seed}
        for phase, st in self.stores.items():
            state[f"{phase}_maps"] = st.maps[: st.size].copy()
            state[f"{phase}_sem"] = st.sem[: st.size].copy()
        return state

    def restore(self, state: dict[str, Any]) -> None:
        self.capacity, self.sem_dim = int(state["capacity"]), int(state["sem_dim"])
        self.seed = int(state.get("seed", self.seed))
        self._projection = None
        for phase in ("prefill", "decode"):
            st = MapStore(self.capacity, self.num_layers, self.num_experts, self.sem_dim)
            maps, sem = np.asarray(state[f"{phase}_maps"]), np.asarray(state[f"{phase}_sem"])
            for i in range(len(maps)):
                st.put(i, maps[i].reshape(self.num_layers, self.num_experts), sem[i])
            self.stores[phase] = st


def bench_search(capacity: int, layers: int = 32, experts: int = 8, hidden: int = 4096, queries: int = 3000,
                 top_k: int = 2, seed: int = 0) -> dict[str, float]:
    """Latency of `predict` (search + prior) on a store filled with `capacity` random Dirichlet maps.

    Queries come in iterations of `layers` target layers sharing one embedding (as the engine asks), each
    with a random number of routed layers; the first query of an iteration pays the key projection.
    """
    import time

    rng = np.random.default_rng(seed)
    pred = ExpertMapPredictor(layers, experts, top_k, capacity=capacity, seed=seed)
    store = pred.stores["decode"]
    for slot in range(capacity):  # direct fill: the dedup path is not what is measured here
        store.put(slot, rng.dirichlet(np.full(experts, 0.3), layers).astype(np.float32),
                  unit(rng.standard_normal(pred.sem_dim).astype(np.float32)))
    lat: dict[str, list[float]] = {"semantic": [], "trajectory": []}
    cpu: list[float] = []  # thread CPU time: what the search costs without this shared machine's preemptions
    for n in range(queries):
        if n % layers == 0:
            probs = rng.dirichlet(np.full(experts, 0.3), layers).astype(np.float32)
            emb = rng.standard_normal(hidden).astype(np.float32)
        seen = int(rng.integers(0, layers))
        cur = IterationContext("bench", 1, probs, probs, emb, layers_seen=seen)
        q = PredictionQuery(RequestHistory(), cur, int(rng.integers(seen, layers)))
        c0, t0 = time.thread_time(), time.perf_counter()
        pred.predict(q)
        lat["semantic" if seen == 0 else "trajectory"].append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.thread_time() - c0) * 1e3)
    every = np.array(lat["semantic"] + lat["trajectory"])
    out = {"capacity": capacity, "queries": queries, "p50_ms": float(np.percentile(every, 50)),
           "p99_ms": float(np.percentile(every, 99)), "mean_ms": float(every.mean()),
           "cpu_p50_ms": float(np.percentile(cpu, 50)), "cpu_p99_ms": float(np.percentile(cpu, 99))}
    for kind, values in lat.items():
        if values:
            out[f"{kind}_p50_ms"] = float(np.percentile(values, 50))
            out[f"{kind}_p99_ms"] = float(np.percentile(values, 99))
    return out
