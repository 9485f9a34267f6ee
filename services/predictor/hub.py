"""The predictor service's core: one Predictor per model, each request's history, contexts in, hints out.

Shared by the stream loop (service.py) and the gRPC API (server.py); both run on one event loop, so the
hub needs no locks. Finished iterations are observed (the map store / EAMC learn from them) and answered
with hints for the request's next iteration; partial ones (the engine publishes a few layers into a step)
are answered with hints for their remaining layers.
"""

from __future__ import annotations

import importlib
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from services.common.iteration_context import IterationContext, PredictionQuery
from services.common.messages import InvalidInput, Shape, select_experts, to_context
from services.common.protos import predictor_pb2 as pb
from services.common.request_history import RequestHistory
from services.predictor.predictors.base import Predictor

PredictorFactory = Callable[[Shape], Predictor]


class UnknownModel(LookupError):
    """Search for a model the service has never seen (gRPC NOT_FOUND)."""


class CapacityExceeded(RuntimeError):
    """Too many models or live requests tracked (gRPC RESOURCE_EXHAUSTED)."""


def resolve_predictor(name: str) -> PredictorFactory:
    """A registry name (services/predictor/predictors) or `package.module:Class`, as a factory of shapes."""
    if ":" in name:
        module, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(module), attr, None)
        if cls is None:
            raise ValueError(f"--predictor {name!r}: {module} has no {attr}")
    else:
        from services.predictor.predictors import predictor_class

        try:
            cls = predictor_class(name)  # ValueError names the registered ones
        except (ImportError, AttributeError) as exc:  # registered, but its file has not landed
            raise ValueError(f"predictor {name!r} is not available: {exc}") from exc
    return lambda shape: cls(shape.num_layers, shape.num_experts, shape.top_k)


@dataclass
class Selection:
    mass: float = 0.9  # hint the fewest experts covering this predicted probability mass ...
    max_experts: int = 0  # ... but at most this many (0: 2 x top_k)
    horizon: int = 0  # predict at most this many layers ahead (0: all)


@dataclass
class ModelState:
    shape: Shape
    predictor: Predictor
    # request id -> its finished iterations, compact; LRU order, least recently touched first
    histories: OrderedDict[str, RequestHistory] = field(default_factory=OrderedDict)
    touched: dict[str, float] = field(default_factory=dict)


class PredictorHub:
    def __init__(
        self,
        factory: PredictorFactory,
        predictor_name: str = "",
        selection: Selection | None = None,
        max_models: int = 8,
        max_requests: int = 4096,
        history_len: int = 64,  # iterations in a request's decode-count sum (EAMC's request-level EAM)
        request_ttl_s: float = 600.0,
    ) -> None:
        self.factory = factory
        self.predictor_name = predictor_name
        self.selection = selection or Selection()
        self.max_models = max_models
        self.max_requests = max_requests
        self.history_len = history_len
        self.request_ttl_s = request_ttl_s
        self.models: dict[str, ModelState] = {}
        self.counters: Counter[str] = Counter()

    # ---- models ----
    def model(self, shape: Shape, create: bool = True) -> ModelState:
        state = self.models.get(shape.model)
        if state is None:
            if not create:
                raise UnknownModel(f"model {shape.model!r} not seen yet (known: {sorted(self.models)})")
            if len(self.models) >= self.max_models:
                raise CapacityExceeded(f"already serving {self.max_models} models; cannot add {shape.model!r}")
            state = self.models[shape.model] = ModelState(shape, self.factory(shape))
            self.counters["models_created_total"] += 1
        elif (state.shape.num_layers, state.shape.num_experts, state.shape.hidden_size) != (
            shape.num_layers, shape.num_experts, shape.hidden_size,
        ):
            raise InvalidInput(f"model {shape.model!r} is known with shape {state.shape}, got {shape}")
        return state

    def install(self, shape: Shape, predictor: Predictor) -> None:
        """Replaces a model's predictor (restore from a snapshot); histories start empty."""
        if shape.model not in self.models and len(self.models) >= self.max_models:
            raise CapacityExceeded(f"already serving {self.max_models} models; cannot add {shape.model!r}")
        self.models[shape.model] = ModelState(shape, predictor)

    # ---- requests ----
    def _history(self, state: ModelState, rid: str, strict: bool) -> RequestHistory:
        now = time.monotonic()
        history = state.histories.get(rid)
        if history is None:
            if len(state.histories) >= self.max_requests:
                oldest = next(iter(state.histories))
                if strict and now - state.touched[oldest] < self.request_ttl_s:
                    raise CapacityExceeded(f"tracking {self.max_requests} live requests of {state.shape.model!r}")
                del state.histories[oldest], state.touched[oldest]  # the stream must flow: forget the oldest
                self.counters["requests_evicted_total"] += 1
            history = state.histories[rid] = RequestHistory(self.history_len)
        state.histories.move_to_end(rid)
        state.touched[rid] = now
        return history

    def observe(self, state: ModelState, ctx: IterationContext, strict: bool = False) -> RequestHistory:
        """Records a context; finished ones teach the predictor. Returns the request's finished history."""
        history = self._history(state, ctx.request_id, strict)
        if ctx.layers_seen >= state.shape.num_layers:
            last = history.last
            if last is not None and ctx.iteration <= last.iteration:
                history.clear()  # a reused request id, or the engine restarted the request
            state.predictor.observe(ctx)
            history.append(ctx)
            self.counters["iterations_observed_total"] += 1
        return history

    # ---- predictions ----
    def predict(
        self, state: ModelState, current: IterationContext, history: RequestHistory,
        targets: list[int] | None = None,
    ) -> list[pb.Hint]:
        shape, sel = state.shape, self.selection
        if targets is None:
            end = shape.num_layers if not sel.horizon else min(shape.num_layers, current.layers_seen + sel.horizon)
            targets = list(range(current.layers_seen, end))
        max_experts = sel.max_experts or 2 * shape.top_k
        if not targets:
            return []
        scores = state.predictor.predict_layers(PredictionQuery(history, current, targets[0]), targets)
        if scores.shape != (len(targets), shape.num_experts):
            raise RuntimeError(f"predictor returned scores of shape {scores.shape[1:]} for {shape}")
        experts, probs, confidence = select_experts(scores, shape.top_k, sel.mass, max_experts)
        self.counters["predictions_total"] += len(targets)
        rid, it = current.request_id, current.iteration
        return [
            pb.Hint(request_id=rid, iteration=it, layer=layer, experts=e, priorities=p, score=float(c))
            for layer, e, p, c in zip(targets, experts, probs, confidence)
        ]

    def next_query(self, ctx: IterationContext, shape: Shape) -> IterationContext:
        """The following iteration, nothing routed yet; its input embedding is unknown, so the finished
        iteration's stands in (consecutive tokens of a request are semantically close)."""
        zeros = np.zeros((shape.num_layers, shape.num_experts), np.float32)
        return IterationContext(ctx.request_id, ctx.iteration + 1, zeros, zeros.copy(), ctx.embedding, 0)

    def handle(
        self, batch: pb.ContextBatch, predict: bool = True, strict: bool = False, superseded: frozenset[str] = frozenset()
    ) -> list[pb.Hint]:
        """The stream path (and gRPC Observe): observe every context, hint what comes next (except for
        `superseded` requests, whose newer context is already waiting)."""
        shape = Shape.from_pb(batch.shape)
        contexts = [to_context(c, shape) for c in batch.contexts]  # validate all before touching state
        if not contexts and shape.model not in self.models:
            raise InvalidInput(f"an empty context batch cannot add model {shape.model!r}")
        state = self.model(shape)
        hints: list[pb.Hint] = []
        for ctx in contexts:
            history = self.observe(state, ctx, strict)
            self.counters["contexts_total"] += 1
            if not predict or ctx.request_id in superseded:
                continue
            finished = ctx.layers_seen >= shape.num_layers
            current = self.next_query(ctx, shape) if finished else ctx
            hints += self.predict(state, current, history)
        return hints

    def search(self, request: pb.SearchRequest) -> list[pb.Hint]:
        """gRPC Search: hints for one context, using the given history or the observed one."""
        shape = Shape.from_pb(request.shape)
        state = self.model(shape, create=False)
        ctx = to_context(request.context, shape)
        if request.history:
            history = RequestHistory.of(to_context(h, shape) for h in request.history)  # all of it, as given
        else:
            history = state.histories.get(ctx.request_id, RequestHistory())
        targets = list(request.target_layers) or None
        bad = [t for t in targets or () if not 0 <= t < shape.num_layers]
        if bad:
            raise InvalidInput(f"target_layers {bad} outside [0, {shape.num_layers})")
        self.counters["searches_total"] += 1
        return self.predict(state, ctx, history, targets)
