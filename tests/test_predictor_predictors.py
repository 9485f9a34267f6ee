"""Every predictor behind the one interface: shapes, normalisation, snapshot/restore, and the paper rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.iteration_context import IterationContext, PredictionQuery, RequestTrace, TracedIteration
from services.common.request_history import RequestHistory
from services.predictor.eval import masked
from services.predictor.predictors import PREDICTORS, create_predictor, unavailable_reason
from services.predictor.predictors.common import fewest_above
from services.predictor.predictors.eamc import EAMCPredictor
from services.predictor.predictors.expert_map import ExpertMapPredictor, bench_search
from services.predictor.predictors.expert_mlp import ExpertMLPPredictor
from services.predictor.predictors.learned_gate import LearnedGatePredictor
from services.predictor.predictors.popularity_affinity import PopularityAffinityPredictor
from services.predictor.traces import TraceSet

L, E, K, H = 4, 8, 2, 16


def synthetic_trace(requests: int = 12, iterations: int = 10, seed: int = 0, noise: float = 0.1) -> TraceSet:
    """Structured routing: a token's base expert b fixes every layer ({b+l, b+l+3} mod E), so layer l-1
    predicts layer l exactly; b follows the request's topic with some noise. Hidden states encode b."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(requests):
        topic = int(rng.integers(E))
        its = []
        for i in range(iterations):
            b = topic if rng.random() > 0.5 else int(rng.integers(E))
            probs = np.full((L, E), noise / E, np.float32)
            experts = np.array([[(b + lay) % E, (b + lay + 3) % E] for lay in range(L)])
            np.put_along_axis(probs, experts, (1 - noise) / K + noise / E, axis=1)
            counts = np.zeros((L, E), np.float32)
            np.put_along_axis(counts, experts, 1.0, axis=1)
            emb = np.eye(H, dtype=np.float32)[b] + 0.01 * rng.standard_normal(H).astype(np.float32)
            it = TracedIteration(f"r{r}", i + 1, probs, counts, emb)
            it.layer_inputs = np.stack([np.roll(emb, lay) for lay in range(L)])[None].astype(np.float16)
            it.token_experts = experts[None].astype(np.uint8)
            its.append(it)
        out.append(RequestTrace(f"r{r}", its, "synthetic"))
    return TraceSet(out, L, E, K, list(range(L)), source="synthetic")


def _queries(trace: TraceSet, distance: int = 1) -> list[tuple[PredictionQuery, np.ndarray]]:
    out = []
    for request in trace.requests:
        for i, it in enumerate(request.iterations):
            for t in range(L):
                out.append((PredictionQuery(RequestHistory.of(request.iterations[:i]), masked(it, max(0, t - distance + 1)), t),
                            it.counts[t] > 0))
    return out


def _exact(pred, queries) -> float:
    return float(np.mean([actual[np.argsort(-pred.predict(q))[:K]].all() for q, actual in queries]))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny networks: intra-op threads only add overhead on a shared CPU
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trace() -> TraceSet:
    torch.manual_seed(0)
    return synthetic_trace()


SMALL = {"expert-mlp": {"first_width": 128, "max_epochs": 4}, "learned-gate": {"steps": 60, "width": 32},
         "hintserve": {"gate_steps": 40}}
NO_MODEL = [n for n in PREDICTORS if n != "speculative"]


@pytest.mark.parametrize("name", NO_MODEL)
def test_predict_shape_normalisation_and_snapshot_round_trip(name: str, trace: TraceSet) -> None:
    train, test = trace.subset(trace.requests[:8]), trace.requests[8:]
    pred = create_predictor(name, train, **SMALL.get(name, {}))
    pred.fit(train.requests)
    queries = _queries(trace.subset(test), distance=2)[:24]
    scores = np.stack([pred.predict(q) for q, _ in queries])
    assert scores.shape == (len(queries), E)
    assert np.isfinite(scores).all() and (scores >= 0).all()
    if name in ("popularity-affinity", "hintserve", "previous-token", "random") or name == "expert-map":
        sums = scores.sum(1)
        assert name == "random" or np.allclose(sums, 1.0, atol=0.02), sums
    clone = create_predictor(name, train, **SMALL.get(name, {}))
    clone.restore(pred.snapshot())
    again = np.stack([clone.predict(q) for q, _ in queries])
    np.testing.assert_allclose(again, scores, rtol=1e-5, atol=1e-6)
    if name != "random":  # the service scores every layer ahead at once: same answer as one at a time
        q = queries[0][0]
        ahead = list(range(q.target_layer, L))
        one_by_one = np.stack([clone.predict(PredictionQuery(q.history, q.current, t)) for t in ahead])
        np.testing.assert_allclose(clone.predict_layers(q, ahead), one_by_one, rtol=1e-5, atol=1e-6)


def test_expert_mlp_beats_popularity_on_structured_trace(trace: TraceSet) -> None:
    train, test = trace.requests[:9], trace.subset(trace.requests[9:])
    pop = PopularityAffinityPredictor(L, E, K)
    pop.fit(train)
    mlp = ExpertMLPPredictor(L, E, K, first_width=256, max_epochs=25, max_seconds=20)
    mlp.fit(train)
    queries = [(q, a) for q, a in _queries(test, distance=1) if q.current.layers_seen > 0]
    popularity_only = float(np.mean([a[np.argsort(-pop.popularity[q.target_layer])[:K]].all() for q, a in queries]))
    assert _exact(mlp, queries) > popularity_only + 0.3
    assert len(mlp.report["epochs"]) >= 1 and mlp.report["heldout_requests"] >= 1


def test_affinity_chain_learns_the_structure(trace: TraceSet) -> None:
    pred = PopularityAffinityPredictor(L, E, K)
    pred.fit(trace.requests[:9])
    queries = [(q, a) for q, a in _queries(trace.subset(trace.requests[9:]), 1) if q.current.layers_seen > 0]
    assert _exact(pred, queries) > 0.95


def test_learned_gate_predicts_from_hidden(trace: TraceSet) -> None:
    gate = LearnedGatePredictor(L, E, K, steps=150, width=32)
    gate.fit(trace.requests[:9])
    it = trace.requests[10].iterations[0]
    scores = gate.predict_from_hidden(it.layer_inputs[:, 0].astype(np.float32), 0, 2)
    assert set(np.argsort(-scores)[:K]) == set(np.flatnonzero(it.counts[2]))


def test_fewest_above_rule() -> None:
    p = np.array([0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0], np.float32)
    assert list(fewest_above(p, 0.0, 2)) == [0, 1]  # score 1 -> delta 0 -> just top-k
    assert list(fewest_above(p, 0.85, 2)) == [0, 1, 2]
    assert len(fewest_above(p, 1.0, 2)) == 5  # score <= 0 -> delta 1 -> every expert with mass


def test_expert_map_delta_rule_priorities_and_semantic_search(trace: TraceSet) -> None:
    pred = ExpertMapPredictor(L, E, K)
    pred.fit(trace.requests)
    it = trace.requests[0].iterations[3]
    q = PredictionQuery(RequestHistory.of(trace.requests[0].iterations[:3]), masked(it, 2), 3)
    experts, prio, score = pred.plan(q)
    assert score > 0.99 and len(experts) == K  # an identical map is stored: delta ~ 0
    assert set(experts) == set(np.flatnonzero(it.counts[3]))
    assert np.allclose(prio, pred.search(q)[0][experts] / 2)  # p / (l - l_now), l_now = layer 1
    semantic = PredictionQuery(RequestHistory(), masked(it, 0), 0)  # nothing routed: search by embedding
    assert set(np.argsort(-pred.predict(semantic))[:K]) == set(np.flatnonzero(it.counts[0]))



def test_expert_map_similarity_aware_threshold() -> None:
    pred = ExpertMapPredictor(L, E, K)
    row = np.array([0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0], np.float32)
    stored = np.tile(row, (L, 1))
    pred.observe(IterationContext("a", 1, stored, (stored > 0.25).astype(np.float32), np.ones(H, np.float32)))
    same = IterationContext("b", 1, stored, stored, np.ones(H, np.float32))
    experts, _, score = pred.plan(PredictionQuery(RequestHistory(), masked(same, 2), 3))
    assert np.isclose(score, 1.0) and list(experts) == [0, 1]  # delta = 0: top-k only
    other = np.zeros((L, E), np.float32)
    other[:, 7] = 1.0
    query = PredictionQuery(RequestHistory(), masked(IterationContext("c", 1, other, other, -np.ones(H, np.float32)), 2), 3)
    experts, _, score = pred.plan(query)
    assert np.isclose(score, 0.0) and list(experts) == [0, 1, 2, 3]  # delta = 1: all the map's mass


def test_expert_map_dedup_and_replacement(trace: TraceSet) -> None:
    pred = ExpertMapPredictor(L, E, K, capacity=3, dedup_threshold=0.99)
    its = trace.requests[0].iterations
    pred.observe(its[0])
    pred.observe(TracedIteration("other", its[0].iteration, its[0].probs.copy(), its[0].counts, its[0].embedding))
    assert len(pred) == 1  # a near-duplicate map refreshes its entry instead of taking a slot
    distinct = {}
    for r in trace.requests:
        for it in r.iterations:
            distinct.setdefault(int(np.argmax(it.embedding)), it)
    for it in list(distinct.values())[:5]:
        pred.observe(it)
    assert len(pred) == 3  # full: the most redundant map is replaced, capacity holds
    state = pred.snapshot()
    clone = ExpertMapPredictor(L, E, K, capacity=3)
    clone.restore(state)
    assert len(clone) == 3 and np.allclose(clone.stores["decode"].maps, pred.stores["decode"].maps)


def test_eamc_replaces_most_similar_entry() -> None:
    pred = EAMCPredictor(2, 4, 1, capacity=2)

    def it(rid: str, pattern: list[int]) -> IterationContext:
        counts = np.zeros((2, 4), np.float32)
        counts[[0, 1], pattern] = 1.0
        return IterationContext(rid, 1, counts / 1.0, counts, np.zeros(0, np.float32))

    pred.observe(it("a", [0, 1]))
    pred.observe(it("b", [2, 3]))
    pred.observe(it("a", [0, 1]))  # the same request accumulates in place
    assert pred.keys == ["a/decode", "b/decode"] and pred.eams[0].sum() == 4
    pred.observe(it("c", [2, 2]))  # closest to b -> replaces b
    assert pred.keys == ["a/decode", "c/decode"]
    q = PredictionQuery(RequestHistory(), masked(it("q", [0, 1]), 1), 1)
    assert int(np.argmax(pred.predict(q))) == 1  # matched a on layer 0 -> a's layer-1 expert
    assert np.isclose(pred.predict(q).sum(), 1.0 - (1 - 0) / 2)  # layer proximity 1 - (t - l)/L


def test_speculative_needs_a_model_and_layer_inputs(trace: TraceSet) -> None:
    assert unavailable_reason("speculative", trace) is not None  # synthetic: no model weights
    no_inputs = TraceSet([RequestTrace("r", [IterationContext("r", 1, *np.zeros((2, L, E), np.float32),
                                                              np.zeros(0, np.float32))])], L, E, K)
    assert "layer inputs" in (unavailable_reason("learned-gate", no_inputs) or "")


def test_bench_search_reports_percentiles() -> None:
    r = bench_search(200, layers=8, experts=8, hidden=64, queries=100)
    assert r["p50_ms"] <= r["p99_ms"] and r["cpu_p50_ms"] > 0 and "semantic_p99_ms" in r


@pytest.mark.parametrize("name", NO_MODEL)
def test_constructible_from_shape_alone(name: str) -> None:
    """The predictor service builds predictors from (layers, experts, top_k) and learns online."""
    from services.predictor.predictors import predictor_class

    pred = predictor_class(name)(L, E, K)
    it = synthetic_trace(requests=1, iterations=2).requests[0].iterations
    pred.observe(it[0])
    assert pred.predict(PredictionQuery(RequestHistory.of([it[0]]), masked(it[1], 1), 2)).shape == (E,)
