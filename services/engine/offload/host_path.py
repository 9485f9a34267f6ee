"""The engine's per-layer host path, measured: what handing a layer's experts to the host costs beyond their math.

The MoE layer's own code (models.moe.moe_forward) runs with a provider that places every expert on the host
executor (offload/host_executor.py): submit, run, gather, merge. The experts are tiny (16 x 16), so their math
is next to nothing and what is left is the path itself: its cost per layer, less the same layer with the
experts computed in place (the device path), is what a hybrid policy pays per layer with host work (the
simulator's `HOST_PATH_S`, the physical bound's sync cost). With every expert on the host the gathering thread
runs them itself, as the hybrid provider has it; `mixed_path_s` is the same with half the layer's experts on
the device, where the host's jobs are handed to a worker thread to overlap them (its wake-up and signal back).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from services.engine.expert_provider import ExpertProvider, ExpertWeights, HostResult, HostSink, LayerPlan
from services.engine.models.moe import moe_forward
from services.engine.models.router import Routing
from services.engine.offload.host_executor import HostExecutor
from services.engine.offload.stats import OffloadStats
from services.engine.step_context import Phase, StepContext

WIDTH = 16  # hidden and intermediate of the tiny experts (the native kernel's unit)
EXPERTS, TOP_K = 8, 2


class _TinyProvider(ExpertProvider):
    """Every expert of the layer on the host (`executor` set; `mixed`: half of them) or computed in place."""

    def __init__(self, executor: HostExecutor | None, mixed: bool = False) -> None:
        self.executor = executor
        self.mixed = mixed
        self.weights = [ExpertWeights(torch.full((2 * WIDTH, WIDTH), 0.01), torch.full((WIDTH, WIDTH), 0.01))
                        for _ in range(EXPERTS)]

    def begin_layer(self, layer: int, experts: list[int], ctx: StepContext, tokens=None) -> LayerPlan:
        if self.executor is None:
            return LayerPlan(list(experts))
        on_device = len(experts) // 2 if self.mixed else 0
        return LayerPlan(list(experts[:on_device]), list(experts[on_device:]))

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self.weights[expert]

    def host_forward(self, layer: int, expert: int, x: torch.Tensor, sink: HostSink | None = None) -> HostResult:
        assert self.executor is not None  # begin_layer places experts on the host only with one
        return self.executor.submit(self.weights[expert], x, sink=sink)

    def dispatched(self, layer: int, ctx: StepContext) -> None:
        if self.executor is not None:
            self.executor.flush(wake=self.mixed)  # as the hybrid provider hands the layer's jobs over

    @property
    def device_bytes(self) -> int:
        return 0


def _layer(provider: _TinyProvider, tokens: int) -> Callable[[], None]:
    """One MoE layer of `tokens` tokens, each routed to TOP_K experts."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, WIDTH, generator=gen)
    probs = torch.softmax(torch.randn(tokens, EXPERTS, generator=gen), dim=-1)
    weights, experts = probs.topk(TOP_K, dim=-1)
    routing = Routing(weights, experts, probs)
    ctx = StepContext(phase=Phase.DECODE, request_ids=["r"], num_tokens=tokens)

    def layer() -> None:
        moe_forward(x, 0, routing, provider, ctx)

    return layer


def _seconds(layer: Callable[[], None], count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        layer()
    return (time.perf_counter() - start) / count


def measure_host_path(tokens: int, repeats: int = 400, threads: int = 1, batch: int = 8) -> dict[str, float]:
    """Per MoE layer of `tokens` tokens: seconds with every expert on the host, with half of them, in place,
    and the host path's own cost in both cases, with `threads` host worker threads. The three run in turn,
    `batch` layers each, round after round, and each cost is the median of its rounds' differences: measured
    one after the other, a machine's drift between them came out larger than the path (0 or less)."""
    executor = HostExecutor(threads, OffloadStats(1))
    try:
        runs = {name: _layer(provider, tokens) for name, provider in (
            ("host", _TinyProvider(executor)), ("mixed", _TinyProvider(executor, mixed=True)),
            ("device", _TinyProvider(None)))}
        for run in runs.values():  # warms the threads up
            _seconds(run, max(1, repeats // 10))
        rounds: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(max(1, repeats // batch)):
            for name, run in runs.items():
                rounds[name].append(_seconds(run, batch))
    finally:
        executor.shutdown()
    median = {name: statistics.median(samples) for name, samples in rounds.items()}

    def path(name: str) -> float:
        return max(0.0, statistics.median(a - b for a, b in zip(rounds[name], rounds["device"])))

    return {"tokens": tokens, "host_layer_s": median["host"], "mixed_layer_s": median["mixed"],
            "device_layer_s": median["device"], "host_path_s": path("host"), "mixed_path_s": path("mixed")}
