"""`hintserve predictor train --trace DIR --out FILE`: fit an ExpertMLP on a trace and save it.

The training loop itself is `services/predictor/predictors/expert_mlp_training.py`, shared with the evaluation's `fit`.
"""

from __future__ import annotations

from typing import Any

from services.predictor.predictors.expert_mlp import ExpertMLPPredictor
from services.predictor.predictors.expert_mlp_training import train_expert_mlp
from services.predictor.traces import load_traces


def train_from_trace(trace_path: str, out: str, max_epochs: int = 20, max_seconds: float = 50.0,
                     holdout: float = 0.1, seed: int = 0, first_width: int = 2048) -> dict[str, Any]:
    trace = load_traces(trace_path)
    pred = ExpertMLPPredictor(trace.num_layers, trace.num_experts, trace.top_k, first_width=first_width)
    report = train_expert_mlp(pred, trace.requests, max_epochs, max_seconds, holdout, seed, progress=True)
    pred.save(out)
    return report
