"""The one assembler of an offloaded expert provider, for the engine and the simulator alike.

From OffloadSettings, the model's geometry and the parts each side supplies (the store, the link's transfer
engine, the host executor, the measured or modelled prices: OffloadParts), it builds the rest the same way
for both: the pinned set, the split plan, the slots, the eviction policy, the prefetchers, the cache and the
provider. The engine's parts are made in offload/setup.py, the simulator's in simulator/policy_driver.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.engine.expert_provider import HostCompute
from services.engine.models.geometry import ExpertGeometry
from services.engine.models.spec import ModelSpec
from services.engine.models.weights import NonExpertWeights
from services.engine.offload.cost_model import PlacementCosts
from services.engine.offload.eviction import EvictionInputs, make_eviction
from services.engine.offload.expert_cache import ExpertCache
from services.engine.offload.host_store import ExpertStore
from services.engine.offload.hybrid_provider import HybridExpertProvider
from services.engine.offload.hybrid_setup import (
    hybrid_slots,
    is_hybrid,
    make_placement,
    pinned_experts,
    planned_split,
)
from services.engine.offload.placement import SplitPrices
from services.engine.offload.prefetch import Prefetcher, PrefetchInputs, make_prefetcher
from services.engine.offload.prefetch.hints import HintStats
from services.engine.offload.provider import Fence, OffloadedExpertProvider
from services.engine.offload.settings import OffloadSettings
from services.engine.offload.split_experts import staging_buffers
from services.engine.offload.stats import OffloadStats
from services.engine.offload.transcode import Transcoder
from services.engine.offload.transfer_engine import TransferEngine


@dataclass
class OffloadParts:
    """What the engine and the simulator each supply; the assembler builds everything else from settings."""

    store: ExpertStore  # every expert in host memory (the simulator's stand-in holds no weights)
    make_transfers: Callable[[OffloadStats], TransferEngine]  # the link's transfer engine, counting in stats
    split: SplitPrices | None = None  # what a split expert costs each side; None: its format cannot split
    costs: PlacementCosts | None = None  # hybrid policies: the prices their placement weighs (measured/modelled)
    make_host: Callable[[OffloadStats, TransferEngine], HostCompute] | None = None  # hybrid: the host executor
    fence: Fence | None = None  # CUDA: a compute-stream event before a slot's contents are replaced
    clock: Callable[[], float] = time.perf_counter  # the hybrid provider's time (the simulator's own clock)
    router_model: tuple[ModelSpec, NonExpertWeights] | None = None  # the skip-gate's routers, where it runs
    # CUDA int4 with a host that computes: the store keeps the CPU kernels' layout, the slots torch's CUDA one.
    transcoder: Transcoder | None = None


def make_prefetchers(
    settings: OffloadSettings, geometry: ExpertGeometry, stats: OffloadStats | None = None,
    router_model: tuple[ModelSpec, NonExpertWeights] | None = None,
) -> list[Prefetcher]:
    policy = settings.policy
    inputs = PrefetchInputs(policy.name, policy.prefetchers, geometry, settings.prefetch_distance,
                            policy.min_confidence, settings.routing_trace, stats, router_model)
    return [make_prefetcher(name, inputs) for name in policy.prefetchers]


def assemble_provider(
    settings: OffloadSettings, geometry: ExpertGeometry, slots: int, parts: OffloadParts
) -> OffloadedExpertProvider:
    """`slots`: the device cache's budget in experts (OffloadSettings.cache_slots); a hybrid policy may give
    some to its split staging."""
    policy = settings.policy
    pinned = pinned_experts(policy, geometry, slots,
                            settings.routing_trace.load(policy.name) if policy.needs_trace else None)
    split, staging = None, 0
    if is_hybrid(policy):
        if parts.costs is None or parts.make_host is None:
            raise ValueError(f"policy {policy.name!r} computes on the host: it needs the placement's prices")
        split = planned_split(policy, parts.split, parts.costs, settings.max_tokens, geometry, slots)
        staging = staging_buffers(geometry.top_k, split)
        slots = hybrid_slots(policy, slots, pinned, split, staging)
    eviction = make_eviction(settings.eviction,
                             EvictionInputs(geometry, slots, policy.prefetch_depth, settings.routing_trace))
    stats_type = HintStats if "hints" in policy.prefetchers else OffloadStats
    store = parts.store
    stats = stats_type(geometry.num_layers, slots_total=slots, expert_bytes=store.expert_bytes)
    transcoder = parts.transcoder
    slot_layout = store.layout if transcoder is None else transcoder.device
    cache = ExpertCache(slots, slot_layout, slot_layout.dtype, settings.device, eviction, transcoder)
    prefetchers = make_prefetchers(settings, geometry, stats, parts.router_model)
    transfers = parts.make_transfers(stats)  # last: the engine's starts its worker thread
    if not is_hybrid(policy):
        provider = OffloadedExpertProvider(store, cache, transfers, prefetchers, policy.rules, stats,
                                           stream_slots=geometry.top_k, fence=parts.fence)
        provider.resident.preload(store.buffers)
        return provider
    assert parts.costs is not None and parts.make_host is not None  # checked above
    provider = HybridExpertProvider(
        store, cache, transfers, prefetchers, policy.rules, stats, stream_slots=geometry.top_k, fence=parts.fence,
        executor=parts.make_host(stats, transfers), placement=make_placement(policy, parts.costs, split),
        pinned=pinned, prefetch_floor=policy.prefetch_floor, prefetch_depth=policy.prefetch_depth,
        split_staging=staging, clock=parts.clock,
    )
    provider.resident.preload(store.buffers)  # after the pinned experts took their slots
    return provider
