"""What a predictor sees: per-request iteration records (expert maps) and the query for the next one.

FineMoE's expert map (seed 003 section 4.1) is the router's full probability distribution per layer;
DuoServe's activation path (seed 000 section 4.1) the selected experts; MoE-Infinity's EAM (seed 004
section 4) the activation counts per layer and expert. One IterationContext carries all three for one
request and one iteration (iteration 0 = prefill, then one per generated token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # request_history builds on IterationContext; the query only names it
    from services.common.request_history import RequestHistory


@dataclass
class IterationContext:
    request_id: str
    iteration: int  # 0 = prefill
    probs: np.ndarray  # [layers, experts] float32: router distribution, mean over the iteration's tokens
    counts: np.ndarray  # [layers, experts] float32: tokens routed to each expert (the iteration's EAM)
    embedding: np.ndarray  # [hidden] float32: mean input embedding of the iteration (semantic key)
    layers_seen: int = -1  # layers of this iteration already routed; -1 = all (a finished iteration)
    num_tokens: int = 1

    def __post_init__(self) -> None:
        if self.layers_seen < 0:
            self.layers_seen = self.probs.shape[0]

    @property
    def num_layers(self) -> int:
        return self.probs.shape[0]

    @property
    def num_experts(self) -> int:
        return self.probs.shape[1]

    def selected(self, layer: int) -> np.ndarray:
        """Expert ids routed at `layer` (any token)."""
        return np.flatnonzero(self.counts[layer] > 0)


@dataclass
class RequestTrace:
    """Every iteration of one request, in order."""

    request_id: str
    iterations: list[IterationContext] = field(default_factory=list)
    source: str = ""  # which trace file or model it came from


@dataclass
class PredictionQuery:
    """Predict `target_layer` of the `current` iteration, knowing its first `current.layers_seen` layers."""

    history: RequestHistory  # this request's earlier iterations: the last one, and the decode counts so far
    current: IterationContext  # probs/counts valid for layers < layers_seen; embedding always valid
    target_layer: int

    @property
    def distance(self) -> int:
        return self.target_layer - self.current.layers_seen + 1


@dataclass
class TracedIteration(IterationContext):
    """An iteration with (optionally) every token's MoE-block inputs and selected experts."""

    layer_inputs: np.ndarray | None = None  # [tokens, layers, hidden] float16
    token_experts: np.ndarray | None = None  # [tokens, layers, top_k] uint8
