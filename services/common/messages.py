"""Protobuf <-> predictor types: validated conversion of shapes and iteration contexts, hint selection."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.iteration_context import IterationContext
from services.common.protos import predictor_pb2 as pb


class InvalidInput(ValueError):
    """A message whose shapes or values do not fit (gRPC INVALID_ARGUMENT)."""


# Bounds on what a message may declare (Redis is a trust boundary): well above every supported model
# (DeepSeek-V3: 61 layers x 256 experts, hidden 7168), far below what would exhaust memory. A context
# carries two num_layers x num_experts float32 matrices, and predictors keep state of that size per model.
MAX_LAYERS = 512
MAX_EXPERTS = 4096
MAX_CELLS = 1 << 18  # num_layers x num_experts
MAX_HIDDEN = 1 << 16
MAX_NAME_CHARS = 256  # model names and request ids


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
        if not self.model or len(self.model) > MAX_NAME_CHARS:
            raise InvalidInput(f"shape.model must name the model in 1 to {MAX_NAME_CHARS} characters")
        if (self.num_layers > MAX_LAYERS or self.num_experts > MAX_EXPERTS or self.hidden_size > MAX_HIDDEN
                or self.num_layers * self.num_experts > MAX_CELLS):
            raise InvalidInput(
                f"shape {self.num_layers} layers x {self.num_experts} experts, hidden {self.hidden_size}, is over "
                f"the bounds ({MAX_LAYERS} layers, {MAX_EXPERTS} experts, {MAX_CELLS} cells, hidden {MAX_HIDDEN})"
            )
        if self.num_layers < 1 or self.num_experts < 1 or self.hidden_size < 0:
            raise InvalidInput(
                f"shape needs num_layers >= 1, num_experts >= 1, hidden_size >= 0; got {self.num_layers}, "
                f"{self.num_experts}, {self.hidden_size}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise InvalidInput(f"shape.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")


def _floats(data: bytes, what: str, rid: str) -> np.ndarray:
    if len(data) % 4:
        raise InvalidInput(f"context {rid!r}: {what} is not float32 data ({len(data)} bytes)")
    return np.frombuffer(data, dtype="<f4").astype(np.float32)  # a writable copy: predictors may keep it


def _matrix(data: bytes, shape: Shape, what: str, rid: str) -> np.ndarray:
    size = shape.num_layers * shape.num_experts
    if not data and what == "counts":
        return np.zeros((shape.num_layers, shape.num_experts), np.float32)  # optional for tools
    arr = _floats(data[: 4 * size + 4], what, rid)  # never copy more than the shape allows (+1: to say so)
    if arr.size != size:
        raise InvalidInput(
            f"context {rid!r}: {what} has {arr.size} values, expected num_layers x num_experts = "
            f"{shape.num_layers} x {shape.num_experts} = {size}"
        )
    if not np.isfinite(arr).all():
        raise InvalidInput(f"context {rid!r}: {what} holds NaN or infinite values")
    return arr.reshape(shape.num_layers, shape.num_experts)


def to_context(msg: pb.IterationContext, shape: Shape) -> IterationContext:
    """Validated conversion; raises InvalidInput naming the field."""
    rid = msg.request_id
    if not rid or len(rid) > MAX_NAME_CHARS:
        raise InvalidInput(f"context.request_id must have 1 to {MAX_NAME_CHARS} characters")
    if msg.iteration < 0 or not 0 <= msg.layers_seen <= shape.num_layers:
        raise InvalidInput(
            f"context {rid!r}: iteration must be >= 0 and layers_seen in [0, {shape.num_layers}], "
            f"got {msg.iteration} and {msg.layers_seen}"
        )
    emb = _floats(msg.embedding[: 4 * shape.hidden_size + 4], "embedding", rid)
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


def f32(arr: np.ndarray) -> bytes:
    return np.ascontiguousarray(arr, dtype="<f4").tobytes()


def from_context(ctx: IterationContext) -> pb.IterationContext:
    return pb.IterationContext(
        request_id=ctx.request_id,
        iteration=ctx.iteration,
        layers_seen=ctx.layers_seen,
        num_tokens=ctx.num_tokens,
        probs=f32(ctx.probs),
        counts=f32(ctx.counts),
        embedding=f32(ctx.embedding),
    )


def select_experts(
    scores: np.ndarray, top_k: int, mass: float, max_experts: int
) -> tuple[list[list[int]], list[list[float]], np.ndarray]:
    """Per row of `scores` ([targets, experts]): the fewest experts whose predicted mass reaches `mass`,
    at least top_k and at most max_experts (FineMoE's similarity-aware threshold, applied to any scores),
    their probabilities, and a confidence (the predicted top-k mass). Vectorised: one call per context."""
    s = np.clip(np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=0.0), 0.0, None)
    s = np.atleast_2d(s)
    num_experts = s.shape[1]
    total = s.sum(axis=1, keepdims=True)
    p = np.where(total > 0, s / np.where(total > 0, total, 1.0), 1.0 / num_experts)
    order = np.argsort(-p, axis=1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=1)
    cumulative = np.cumsum(ranked, axis=1)
    n = (cumulative < mass - 1e-9).sum(axis=1) + 1
    n = np.clip(n, min(top_k, num_experts), min(max_experts, num_experts))
    experts = [order[i, : n[i]].tolist() for i in range(len(n))]
    probs = [ranked[i, : n[i]].tolist() for i in range(len(n))]
    return experts, probs, cumulative[:, min(top_k, num_experts) - 1]
