"""The engine's per-layer host path, measured: what handing a layer's experts to the host costs beyond their math.

The MoE layer's own code (models.moe.moe_forward) runs with a provider that places every expert on the host
executor (offload/host_executor.py): submit, the worker's run, gather, merge. The experts are tiny (16 x 16), so
their math is next to nothing and what is left is the path itself: its cost per layer, less the same layer
with the experts computed in place (the device path), is what a hybrid policy pays per layer with host work
(the simulator's `HOST_PATH_S`, the physical bound's sync cost).
"""

from __future__ import annotations

import statistics
import time

import torch

from services.engine.expert_provider import ExpertProvider, ExpertWeights, HostResult, LayerPlan
from services.engine.models.moe import moe_forward
from services.engine.models.router import Routing
from services.engine.offload.host_executor import HostExecutor
from services.engine.offload.stats import OffloadStats
from services.engine.step_context import Phase, StepContext

WIDTH = 16  # hidden and intermediate of the tiny experts (the native kernel's unit)
EXPERTS, TOP_K = 8, 2


class _TinyProvider(ExpertProvider):
    """Every expert of the layer on the host (`executor` set) or computed in place (None)."""

    def __init__(self, executor: HostExecutor | None) -> None:
        self.executor = executor
        self.weights = [ExpertWeights(torch.full((2 * WIDTH, WIDTH), 0.01), torch.full((WIDTH, WIDTH), 0.01))
                        for _ in range(EXPERTS)]

    def begin_layer(self, layer: int, experts: list[int], ctx: StepContext, tokens=None) -> LayerPlan:
        return LayerPlan([], list(experts)) if self.executor is not None else LayerPlan(list(experts))

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self.weights[expert]

    def host_forward(self, layer: int, expert: int, x: torch.Tensor) -> HostResult:
        assert self.executor is not None  # begin_layer places experts on the host only with one
        return self.executor.submit(self.weights[expert], x)

    def dispatched(self, layer: int, ctx: StepContext) -> None:
        if self.executor is not None:
            self.executor.flush()  # as the hybrid provider hands the layer's jobs over

    @property
    def device_bytes(self) -> int:
        return 0


def _layer_seconds(provider: _TinyProvider, tokens: int, repeats: int) -> float:
    """Median seconds of one MoE layer of `tokens` tokens, each routed to TOP_K experts."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, WIDTH, generator=gen)
    probs = torch.softmax(torch.randn(tokens, EXPERTS, generator=gen), dim=-1)
    weights, experts = probs.topk(TOP_K, dim=-1)
    ctx = StepContext(phase=Phase.DECODE, request_ids=["r"], num_tokens=tokens)
    samples = []
    for i in range(repeats + repeats // 10):
        start = time.perf_counter()
        moe_forward(x, 0, Routing(weights, experts, probs), provider, ctx)
        if i >= repeats // 10:  # the first tenth warms the threads up
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_host_path(tokens: int, repeats: int = 400, threads: int = 1) -> dict[str, float]:
    """Per MoE layer of `tokens` tokens: seconds with every expert on the host, in place, and the host path's
    own cost (the difference), with `threads` host worker threads."""
    executor = HostExecutor(threads, OffloadStats(1))
    try:
        host = _layer_seconds(_TinyProvider(executor), tokens, repeats)
    finally:
        executor.shutdown()
    device = _layer_seconds(_TinyProvider(None), tokens, repeats)
    return {"tokens": tokens, "host_layer_s": host, "device_layer_s": device, "host_path_s": max(0.0, host - device)}
