"""The predictor keeps each request's history in compact arrays: measured bytes per request, and the same answers."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

from services.common.iteration_context import IterationContext
from services.common.messages import Shape
from services.common.request_history import RequestHistory
from services.predictor.hub import PredictorHub, resolve_predictor

# A realistic request on a mid-size MoE: 24 layers x 64 experts, top-2, hidden 2048; 64 prompt tokens, 512 decoded.
LAYERS, EXPERTS, TOP_K, HIDDEN = 24, 64, 2, 2048
PROMPT, DECODED = 64, 512
REQUESTS = 8


def _iteration(rng: np.random.Generator, rid: str, iteration: int, tokens: int) -> IterationContext:
    probs = rng.dirichlet(np.ones(EXPERTS), size=LAYERS).astype(np.float32)
    counts = np.zeros((LAYERS, EXPERTS), np.float32)
    for _ in range(tokens):
        for layer in range(LAYERS):
            counts[layer, rng.choice(EXPERTS, TOP_K, replace=False)] += 1
    return IterationContext(rid, iteration, probs, counts, rng.standard_normal(HIDDEN).astype(np.float32),
                            num_tokens=tokens)


def test_a_realistic_request_holds_at_most_16_kb() -> None:
    rng = np.random.default_rng(0)
    shape = Shape("m", LAYERS, EXPERTS, TOP_K, HIDDEN)
    hub = PredictorHub(resolve_predictor("previous-token"), "previous-token")
    state = hub.model(shape)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for r in range(REQUESTS):
            for step in range(DECODED + 1):
                ctx = _iteration(rng, f"r{r}", step, PROMPT if step == 0 else 1)
                hub.observe(state, ctx)
            del ctx  # only what the hub keeps counts
        gc.collect()
        per_request = (tracemalloc.get_traced_memory()[0] - before) / REQUESTS
    finally:
        tracemalloc.stop()
    array_bytes = [h.nbytes for h in state.histories.values()]
    print(f"bytes held per request: {per_request:.0f} (array data {array_bytes[0]})")
    assert len(array_bytes) == REQUESTS
    assert per_request <= 16 * 1024


def test_history_answers_as_the_iterations_it_replaces() -> None:
    rng = np.random.default_rng(1)
    iterations = [_iteration(rng, "r", i, 5 if i == 0 else 1) for i in range(80)]
    window = 64
    history = RequestHistory.of(iterations, window)
    kept = iterations[-window:]
    expected = np.sum([it.counts for it in kept if it.iteration > 0], axis=0)
    np.testing.assert_array_equal(history.decode_counts(), expected)
    last = history.last
    assert last is not None and last.iteration == 79
    np.testing.assert_array_equal(last.probs, iterations[-1].probs)
    np.testing.assert_array_equal(last.counts, iterations[-1].counts)
    assert RequestHistory.of(iterations[:1]).decode_counts() is None  # the prefill alone: no decode sum
    fractional = iterations[1]
    fractional.counts = fractional.counts * 0.5  # counts the index list cannot say are kept whole
    np.testing.assert_array_equal(RequestHistory.of([fractional]).decode_counts(), fractional.counts)
