"""An offload policy's engine objects, built for the simulator by the engine's own assembler.

offload/assembler.py builds the eviction policy, the prefetchers, the cache and the provider from
OffloadSettings, as it does for the engine; only the store, the link, the transfer engine's clock and the
host are simulated (the parts given here). A policy that needs something the trace does not hold is reported
as not simulable, with the reason, instead of being approximated.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from services.common.messages import Shape
from services.engine.expert_format import ExpertLayout
from services.engine.expert_provider import StoredWeights
from services.engine.offload.assembler import OffloadParts, assemble_provider
from services.engine.offload.host_store import Key
from services.engine.offload.hybrid_provider import HybridExpertProvider
from services.engine.offload.hybrid_setup import is_hybrid
from services.engine.offload.memory_bus import MemoryBus
from services.engine.offload.policies import OffloadPolicy
from services.engine.offload.prefetch.hints import HintPrefetcher
from services.engine.offload.provider import OffloadedExpertProvider
from services.engine.offload.routing_trace import TraceFile
from services.engine.offload.settings import OffloadSettings
from services.engine.offload.split_experts import split_prices
from services.engine.offload.stats import OffloadStats
from services.engine.offload.transfer_engine import TransferEngine
from services.engine.step_context import StepContext
from services.simulator.hardware import CostModel
from services.simulator.hint_link import SimPredictorLink
from services.simulator.host_timeline import SimHostExecutor, placement_costs
from services.simulator.timeline import SimClock, SimLink, SimTransferEngine
from services.simulator.workload import Workload

# The cache's slot storage holds no weights in a simulation: three numbers per slot, split into the same
# two chunks (gate/up, down) the engine's layout has; the bytes each chunk costs come from the model spec.
PLACEHOLDER_LAYOUT = ExpertLayout(1, 1)


PLACEHOLDER_WEIGHTS = PLACEHOLDER_LAYOUT.views(torch.zeros(PLACEHOLDER_LAYOUT.numel))


class _PlaceholderBuffers(Mapping[Key, torch.Tensor]):
    """Every expert's host buffer is the one placeholder (nothing is iterated: no expert is copied for real)."""

    def __init__(self) -> None:
        self.flat = torch.zeros(PLACEHOLDER_LAYOUT.numel)

    def __getitem__(self, key: Key) -> torch.Tensor:
        return self.flat

    def __iter__(self) -> Iterator[Key]:
        return iter(())

    def __len__(self) -> int:
        return 0


@dataclass
class SimStore:
    """Stands in for HostExpertStore (an ExpertStore): the provider reads its layout, buffers and expert size."""

    expert_bytes: int
    layout: ExpertLayout = PLACEHOLDER_LAYOUT
    buffers: _PlaceholderBuffers = field(default_factory=_PlaceholderBuffers)

    def weights(self, key: Key) -> StoredWeights:
        return PLACEHOLDER_WEIGHTS  # the simulated host executor prices a job by its tokens only


@dataclass
class SimOffload:
    provider: OffloadedExpertProvider
    transfers: SimTransferEngine
    hint_link: SimPredictorLink | None
    # Who watches the simulated steps, as ModelRunner's observers watch the engine's.
    host: SimHostExecutor | None = None  # hybrid policies: the host's timeline
    step_observers: list[Callable[[StepContext], None]] = field(default_factory=list)
    layer_observers: dict[int, list[Callable[[int, StepContext], None]]] = field(default_factory=dict)


@functools.cache
def _router_model(model_dir: str):
    """The engine's spec and non-expert weights (routers, norms) of a checkpoint, for the skip-gate."""
    from services.engine.models.checkpoint import Checkpoint
    from services.engine.models.spec import load_hf_config, spec_from_config
    from services.engine.models.weights import WeightReader, load_non_expert_weights

    spec = spec_from_config(load_hf_config(model_dir))
    reader = WeightReader(Checkpoint(model_dir), torch.float32, "cpu")
    return spec, load_non_expert_weights(reader, spec)


def not_simulable(policy: OffloadPolicy, workload: Workload) -> str | None:
    """Why `policy` cannot run faithfully on this trace, or None."""
    trace = workload.trace
    if "speculative" in policy.prefetchers:
        if not workload.has_layer_inputs:
            return (
                "the skip-gate applies later layers' routers to each token's hidden state; the trace has no "
                "hidden states (record one with hintserve trace collect --layer-inputs)"
            )
        if not trace.model or not os.path.isfile(os.path.join(trace.model, "config.json")):
            return "the skip-gate needs the router weights of the model the trace was recorded with"
        from services.predictor.predictors.speculative import check_weights

        try:
            check_weights(trace.model, trace.model_hash)
        except ValueError as exc:
            return str(exc)
    if "affinity" in policy.prefetchers and not workload.has_token_routing:
        return (
            "the affinity prefetcher learns which expert each token takes at the next layer; the trace's "
            "multi-token steps hold per-expert counts only"
        )
    return None


def build_offload(
    policy: OffloadPolicy,
    workload: Workload,
    clock: SimClock,
    link_bytes_per_second: float,
    slots: int,
    trace_path: str,
    prefetch_distance: int | None = None,
    hint_latency_s: float = 2e-3,
    eviction: str | None = None,
    cost: CostModel | None = None,
) -> SimOffload:
    """The engine's assembler (offload/assembler.py) on the simulator's parts: its store, link and host."""
    spec = workload.spec
    # The predictor link is ours (SimPredictorLink), so the engine's is off: no predictor settings.
    settings = OffloadSettings(
        policy=policy,
        eviction=eviction or policy.eviction,
        prefetch_distance=prefetch_distance or policy.prefetch_distance,
        routing_trace=TraceFile(trace_path),
        max_tokens=workload.batch,
    )
    # One DRAM: the link's copies and the host's expert math read it together (offload/memory_bus.py).
    dram = MemoryBus(cost.dram_bytes_per_second(spec.expert_bytes) if cost is not None else math.inf)

    def transfers(stats: OffloadStats) -> SimTransferEngine:
        return SimTransferEngine(SimLink(link_bytes_per_second), stats, clock, spec.expert_chunk_bytes, dram)

    def host(stats: OffloadStats, link: TransferEngine) -> SimHostExecutor:
        assert cost is not None and isinstance(link, SimTransferEngine)  # made above, priced by `cost`
        return SimHostExecutor(cost, clock, stats, link, spec.expert_bytes)

    hybrid = is_hybrid(policy) and cost is not None
    parts = OffloadParts(
        SimStore(spec.expert_bytes), transfers,
        split=split_prices(spec.expert_chunk_bytes, dense=spec.expert_precision.bits >= 16),
        costs=placement_costs(cost, spec.expert_bytes) if hybrid and cost is not None else None,
        make_host=host if hybrid else None,
        clock=lambda: clock.now,  # planning is not priced: the gate sees it free, run after run alike
        router_model=_router_model(workload.trace.model) if "speculative" in policy.prefetchers else None,
    )
    provider = assemble_provider(settings, spec, slots, parts)
    hint_link = None
    hints = [p for p in provider.prefetchers if isinstance(p, HintPrefetcher)]
    if hints and policy.predictor:
        embedding = workload.trace.requests[0].iterations[0].embedding.size if workload.trace.requests else 0
        shape = Shape(spec.name, spec.num_layers, spec.num_experts, spec.top_k, int(embedding))
        first_moe = spec.moe_layers.index(True)
        hint_link = SimPredictorLink(hints[0], policy.predictor, shape, clock, hint_latency_s, (first_moe,))
    sim_transfers = provider.transfers
    assert isinstance(sim_transfers, SimTransferEngine)  # made by transfers() above
    sim_host = provider.executor if isinstance(provider, HybridExpertProvider) else None
    assert sim_host is None or isinstance(sim_host, SimHostExecutor)  # made by host() above
    offload = SimOffload(provider, sim_transfers, hint_link, sim_host)
    if hint_link is not None:
        hint_link.attach(offload)
    return offload
