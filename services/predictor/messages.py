"""Protobuf <-> predictor types: validated conversion of shapes and iteration contexts, hint selection."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.protos import predictor_pb2 as pb
from services.predictor.context import IterationContext


class InvalidInput(ValueError):
    """A message whose shapes or values do not fit (gRPC INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Shape:
    model: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int = 0

    @classmethod
    def from_pb(cls, msg: pb.ModelShape) -> Shape:
        shape = cls(msg.model, msg.num_layers, msg.num_experts, msg.top_k, msg.hidden_size)
        shape.validate()
        return shape

    def to_pb(self) -> pb.ModelShape:
        return pb.ModelShape(
            model=self.model, num_layers=self.num_layers, num_experts=self.num_experts, top_k=self.top_k,
            hidden_size=self.hidden_size,
        )

    def validate(self) -> None:
        if not self.model:
            raise InvalidInput("shape.model must name the model")
        if self.num_layers < 1 or self.num_experts < 1 or self.hidden_size < 0:
            raise InvalidInput(
                f"shape needs num_layers >= 1, num_experts >= 1, hidden_size >= 0; got {self.num_layers}, "
                f"{self.num_experts}, {self.hidden_size}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise InvalidInput(f"shape.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")


def _matrix(values, shape: Shape, what: str, rid: str) -> np.ndarray:
    size = shape.num_layers * shape.num_experts
    arr = np.asarray(values, dtype=np.float32)
    if arr.size == 0 and what == "counts":
        return np.zeros((shape.num_layers, shape.num_experts), np.float32)  # optional for tools
    if arr.size != size:
        raise InvalidInput(
            f"context {rid!r}: {what} has {arr.size} values, expected num_layers x num_experts = "
            f"{shape.num_layers} x {shape.num_experts} = {size}"
        )
    if not np.isfinite(arr).all():
        raise InvalidInput(f"context {rid!r}: {what} holds NaN or infinite values")
    return arr.reshape(shape.num_layers, shape.num_experts)


def to_context(msg: pb.IterationContext, shape: Shape) -> IterationContext:
    rid = msg.request_id
    if not rid:
        raise InvalidInput("context.request_id must not be empty")
    if msg.iteration < 0 or not 0 <= msg.layers_seen <= shape.num_layers:
        raise InvalidInput(
            f"context {rid!r}: iteration must be >= 0 and layers_seen in [0, {shape.num_layers}], "
            f"got {msg.iteration} and {msg.layers_seen}"
        )
    emb = np.asarray(msg.embedding, dtype=np.float32)
    if emb.size != shape.hidden_size:
        raise InvalidInput(f"context {rid!r}: embedding has {emb.size} values, expected {shape.hidden_size}")
    return IterationContext(
        request_id=rid,
        iteration=msg.iteration,
        probs=_matrix(msg.probs, shape, "probs", rid),
        counts=_matrix(msg.counts, shape, "counts", rid),
        embedding=emb,
        layers_seen=msg.layers_seen,
        num_tokens=max(1, msg.num_tokens),
    )


def from_context(ctx: IterationContext) -> pb.IterationContext:
    return pb.IterationContext(
        request_id=ctx.request_id,
        iteration=ctx.iteration,
        layers_seen=ctx.layers_seen,
        num_tokens=ctx.num_tokens,
        probs=ctx.probs.ravel().tolist(),
        counts=ctx.counts.ravel().tolist(),
        embedding=ctx.embedding.ravel().tolist(),
    )


def select_experts(
    scores: np.ndarray, top_k: int, mass: float, max_experts: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """(experts, probabilities, confidence): the fewest experts whose predicted mass reaches `mass`,
    at least top_k and at most max_experts (FineMoE's similarity-aware threshold, applied to any scores).
    Confidence is the predicted top-k mass."""
    s = np.clip(np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=0.0), 0.0, None)
    total = s.sum()
    p = s / total if total > 0 else np.full(s.shape, 1.0 / s.size)
    order = np.argsort(-p, kind="stable")
    cumulative = np.cumsum(p[order])
    n = int(np.searchsorted(cumulative, mass - 1e-9)) + 1
    n = min(max(n, top_k), max_experts, s.size)
    chosen = order[:n]
    return chosen, p[chosen], float(cumulative[min(top_k, s.size) - 1])
