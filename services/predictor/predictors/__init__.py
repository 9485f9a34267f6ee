"""Predictor registry: name -> class (imported lazily, so listing names does not load torch).

Adding a predictor = one file in this package + one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

from services.predictor.predictors.base import Predictor

PREDICTORS: dict[str, str] = {
    "random": "random_baseline:RandomPredictor",
    "previous-token": "previous_token:PreviousTokenPredictor",
    "popularity-affinity": "popularity_affinity:PopularityAffinityPredictor",
    "expert-mlp": "expert_mlp:ExpertMLPPredictor",
    "eamc": "eamc:EAMCPredictor",
    "expert-map": "expert_map:ExpertMapPredictor",
    "learned-gate": "learned_gate:LearnedGatePredictor",
    "speculative": "speculative:SpeculativePredictor",
    "hintserve": "hintserve:HintServePredictor",
}


def predictor_class(name: str) -> type[Predictor]:
    if name not in PREDICTORS:
        raise ValueError(f"unknown predictor {name!r}; choose from: {', '.join(PREDICTORS)}")
    module, cls = PREDICTORS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def create_predictor(name: str, trace: Any, **kwargs: Any) -> Predictor:
    """A predictor sized for `trace` (a TraceSet: layers, experts, top-k, layer ids, model directory)."""
    return predictor_class(name).from_trace(trace, **kwargs)


def unavailable_reason(name: str, trace: Any) -> str | None:
    """Why `name` cannot run on `trace` (no layer inputs, no model weights), or None."""
    cls = predictor_class(name)
    if getattr(cls, "requires_layer_inputs", False) and not trace.has_layer_inputs:
        return "needs a trace recorded with layer inputs (hintserve trace collect --layer-inputs)"
    if getattr(cls, "requires_model", False) and not trace.model:
        return "needs the model's weights (a trace recorded by our engine)"
    return None
