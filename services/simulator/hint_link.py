"""The predictor link on the simulated clock: the engine's context encoding, the service's PredictorHub
run in-process, and hints landing in the same HintPrefetcher a fixed latency after their context left.

It watches the simulated steps as PredictorLink watches the model runner's (layer and step observers): a
partial context after the first MoE layer's router in decode steps, the finished iteration at the end of
every step. The hub
observes contexts (the predictor learns online, as the engine's embedded predictor does) and answers with
hints, which the step loop hands to the prefetcher once the clock has passed their arrival time.
"""

from __future__ import annotations

from services.common.messages import Shape
from services.common.protos import predictor_pb2 as pb
from services.engine.offload.prefetch.hints import HintPrefetcher
from services.engine.step_context import StepContext
from services.engine.step_records import encode_step
from services.predictor.hub import PredictorHub, resolve_predictor
from services.simulator.timeline import SimClock


class SimPredictorLink:
    def __init__(
        self,
        hints: HintPrefetcher,
        predictor: str,
        shape: Shape,
        clock: SimClock,
        latency_s: float,
        partial_layers: tuple[int, ...],
    ) -> None:
        self.hints = hints
        self.shape = shape
        self.clock = clock
        self.latency_s = latency_s
        self.partial_layers = set(partial_layers)
        self.predictor = predictor
        self.hub = PredictorHub(resolve_predictor(predictor), predictor)
        self._in_flight: list[tuple[float, list[pb.Hint]]] = []  # (arrival time, hints), oldest first

    def attach(self, runner) -> SimPredictorLink:
        """Watches the steps of `runner` (anything with ModelRunner's step_observers and layer_observers)."""
        runner.step_observers.append(self.observe)
        for layer in sorted(self.partial_layers):
            runner.layer_observers.setdefault(layer, []).append(self.observe_layer)
        return self

    def observe_layer(self, layer: int, ctx: StepContext) -> None:
        if layer in self.partial_layers and not ctx.is_prefill:  # as PredictorLink: decode steps only
            self._publish(ctx, layer + 1)

    def observe(self, ctx: StepContext) -> None:
        self._publish(ctx, self.shape.num_layers)

    def _publish(self, ctx: StepContext, layers_seen: int) -> None:
        batch = pb.ContextBatch(
            engine_id="simulator",
            shape=self.shape.to_pb(),
            step=ctx.step_index,
            contexts=encode_step(ctx, layers_seen, self.shape),
            predictor=self.predictor,
        )
        self._in_flight.append((self.clock.now + self.latency_s, self.hub.handle(batch)))

    def deliver(self) -> None:
        """Hands over every hint batch that has arrived by now."""
        while self._in_flight and self._in_flight[0][0] <= self.clock.now:
            _, hints = self._in_flight.pop(0)
            self.hints.submit(hints)
