"""A set of request traces (`TraceSet`) and the helpers both the trace file format and the routing loaders use."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.common.iteration_context import IterationContext, RequestTrace


@dataclass
class TraceSet:
    requests: list[RequestTrace]
    num_layers: int
    num_experts: int
    top_k: int
    layer_ids: list[int] = field(default_factory=list)  # model layer index of each traced layer
    source: str = ""
    model: str = ""  # model directory, when recorded by our engine (the skip-gate needs its weights)
    notes: str = ""
    model_hash: str = ""  # fingerprint of the weights the trace was recorded with (see model_fingerprint)

    @property
    def num_iterations(self) -> int:
        return sum(len(r.iterations) for r in self.requests)

    @property
    def has_layer_inputs(self) -> bool:
        return any(getattr(it, "layer_inputs", None) is not None for r in self.requests for it in r.iterations)

    def subset(self, requests: list[RequestTrace]) -> TraceSet:
        return TraceSet(requests, self.num_layers, self.num_experts, self.top_k, self.layer_ids, self.source,
                        self.model, self.notes, self.model_hash)


def iteration_from_routing(request_id: str, iteration: int, experts: np.ndarray, weights: np.ndarray,
                           num_experts: int, embedding: np.ndarray | None = None) -> IterationContext:
    """One decode token from top-k routing ([layers, k] ids and weights): probs row = weights in an E-vector."""
    layers = experts.shape[0]
    probs = np.zeros((layers, num_experts), np.float32)
    counts = np.zeros((layers, num_experts), np.float32)
    rows = np.arange(layers)[:, None]
    probs[rows, experts] = weights
    counts[rows, experts] = 1.0
    emb = np.zeros(0, np.float32) if embedding is None else embedding
    return IterationContext(request_id, iteration, probs, counts, emb)


def merge_traces(traces: list[TraceSet]) -> TraceSet:
    """Several traces of the same model shape as one (request ids prefixed when they collide)."""
    first = traces[0]
    for t in traces[1:]:
        if (t.num_layers, t.num_experts, t.top_k) != (first.num_layers, first.num_experts, first.top_k):
            raise ValueError(f"cannot merge traces of shapes {(first.num_layers, first.num_experts, first.top_k)}"
                             f" and {(t.num_layers, t.num_experts, t.top_k)} (layers, experts, top_k)")
    seen: set[str] = set()
    requests: list[RequestTrace] = []
    for i, t in enumerate(traces):
        for r in t.requests:
            if r.request_id in seen:
                r = RequestTrace(f"{i}:{r.request_id}", r.iterations, r.source)
            seen.add(r.request_id)
            requests.append(r)
    return TraceSet(requests, first.num_layers, first.num_experts, first.top_k, first.layer_ids,
                    "+".join(t.source for t in traces), first.model, first.notes, first.model_hash)
