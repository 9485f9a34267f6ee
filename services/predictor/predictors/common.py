"""Small helpers shared by the predictors (not a predictor itself)."""

from __future__ import annotations

import numpy as np

from services.common.iteration_context import IterationContext

EPS = 1e-9


def row_normalise(x: np.ndarray) -> np.ndarray:
    """Each row sums to 1 (all-zero rows stay zero)."""
    s = x.sum(axis=-1, keepdims=True)
    return np.divide(x, s, out=np.zeros_like(x, dtype=np.float32), where=s > 0)


def unit(x: np.ndarray) -> np.ndarray:
    """x / ||x|| along the last axis (zero vectors stay zero)."""
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, n, out=np.zeros_like(x, dtype=np.float32), where=n > 0)


def topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest scores, best first (ties: lower expert id first)."""
    return np.argsort(-scores, kind="stable")[:k]


def fewest_above(probs: np.ndarray, delta: float, k: int) -> np.ndarray:
    """FineMoE's similarity-aware rule: the fewest experts whose mass reaches delta, at least k (best first)."""
    order = np.argsort(-probs, kind="stable")
    mass = np.cumsum(probs[order]) / max(float(probs.sum()), EPS)
    n = int(np.searchsorted(mass, min(delta, 1.0) - 1e-6) + 1)
    return order[: min(len(order), max(k, n))]


def semantic_key(current: IterationContext, previous: IterationContext | None) -> np.ndarray:
    """What is known about an iteration at its start: the input embedding; for traces without embeddings
    (the real Mixtral/Qwen logs) the previous iteration's expert map stands in (zeros if there is none)."""
    if current.embedding.size:
        return current.embedding.astype(np.float32)
    if previous is not None:
        return previous.probs.ravel().astype(np.float32)
    return np.zeros(current.probs.size, np.float32)


def hidden_at(it: IterationContext, layer: int) -> np.ndarray | None:
    """Token hidden states entering MoE layer `layer` ([tokens, H]); layer -1 = the input embedding."""
    inputs = getattr(it, "layer_inputs", None)
    if layer < 0:
        # Mean embedding of the iteration (exact for a decode step; a prefill's mean is an approximation).
        return it.embedding[None, :].astype(np.float32) if it.embedding.size else None
    if inputs is None:
        return None
    return inputs[:, layer].astype(np.float32)
