"""Builds the expert provider OffloadSettings ask for: resident, or offloaded with a policy."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from services.engine.config import EngineConfig
from services.engine.expert_provider import ExpertProvider
from services.engine.models.geometry import ExpertGeometry
from services.engine.models.spec import ModelSpec
from services.engine.models.weights import NonExpertWeights, WeightReader
from services.engine.offload.cost_model import PlacementCosts, measure_costs
from services.engine.offload.eviction import EVICTION_POLICIES, EvictionPolicy
from services.engine.offload.expert_cache import ExpertCache
from services.engine.offload.host_executor import HostExecutor
from services.engine.offload.host_store import HostExpertStore
from services.engine.offload.hybrid_provider import HybridExpertProvider
from services.engine.offload.hybrid_setup import (
    hybrid_slots,
    is_hybrid,
    make_placement,
    pinned_experts,
    planned_split,
)
from services.engine.offload.link import EmulatedLink, Link, emulation_unit
from services.engine.offload.memory_bus import MemoryBus, emulated_dram
from services.engine.offload.prefetch import (
    AffinityPrefetcher,
    NextLayerPrefetcher,
    OraclePrefetcher,
    Prefetcher,
    SpeculativePrefetcher,
)
from services.engine.offload.prefetch.hints import HintPrefetcher, HintStats
from services.engine.offload.provider import OffloadedExpertProvider
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.offload.settings import OffloadSettings
from services.engine.offload.split_experts import layout_split_prices, staging_buffers
from services.engine.offload.stats import OffloadStats
from services.engine.offload.transfer_engine import TransferEngine
from services.engine.quant.layout import config_expert_layout

log = logging.getLogger(__name__)


def make_link(settings: OffloadSettings, spec: ExpertGeometry, dtype: torch.dtype) -> Link:
    if settings.link == "native":
        from services.engine.offload.cuda_link import CudaLink

        return CudaLink(settings.device)
    if settings.link_bytes_per_second is not None:
        return EmulatedLink(settings.link_bytes_per_second)
    ratio = settings.link_ratio
    per_expert = ratio * emulation_unit(spec.hidden_size, spec.moe_intermediate_size, dtype)
    log.info("emulated link: %.3f ms per expert (ratio %.1f)", per_expert * 1e3, ratio)
    # Bandwidth from the unquantized expert, so a packed one moves its fewer bytes faster (a fair comparison).
    return EmulatedLink((settings.link_reference_bytes or settings.expert_bytes) / per_expert)


def _one_dram(costs: PlacementCosts, link: EmulatedLink, reference: int, stored: int) -> PlacementCosts:
    """The emulated host's math and the emulated link's copies on one DRAM (offload/memory_bus.py), sized as the
    emulated host's GEMV; the emulated host prices an expert as the reference (unquantized) one, whose bytes the
    link's rate counts, the link moves the stored ones."""
    link.bus = MemoryBus(emulated_dram(reference, costs.host(1), link.bytes_per_second))
    return replace(costs, dram=link.bus.capacity, host_bytes=reference, link_bytes=stored)


def _trace(settings: OffloadSettings, policy_name: str) -> RoutingTrace:
    if not settings.routing_trace or not os.path.isfile(settings.routing_trace):
        raise ValueError(
            f"policy {policy_name!r} replays a recorded routing trace: pass --routing-trace FILE "
            "(record one with the resident policy on the same prompts)"
        )
    return RoutingTrace.load(settings.routing_trace)


def make_eviction(settings: OffloadSettings, spec: ExpertGeometry) -> EvictionPolicy:
    name = settings.eviction
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose from: {', '.join(EVICTION_POLICIES)}")
    if name == "lookahead":
        return EVICTION_POLICIES[name](spec.num_layers)  # type: ignore[call-arg]
    if name in ("eam", "next-use"):
        return EVICTION_POLICIES[name](spec.num_layers, spec.num_experts)  # type: ignore[call-arg]
    if name == "lru":  # per-layer shares of the slots
        moe = [layer for layer, is_moe in enumerate(spec.moe_layers) if is_moe]
        return EVICTION_POLICIES[name](settings.slots, moe)  # type: ignore[call-arg]
    if name == "hot-set":  # room beside the hot set: the prefetches on the link (at least one slot)
        reserve = max(1, settings.policy.prefetch_depth)
        return EVICTION_POLICIES[name](settings.slots, reserve)  # type: ignore[call-arg]
    if name == "belady":
        return EVICTION_POLICIES[name](_trace(settings, name))  # type: ignore[call-arg]
    if name == "static":
        hot = _trace(settings, name).hot_set(settings.slots // 2) if settings.routing_trace else set()
        return EVICTION_POLICIES[name](hot)  # type: ignore[call-arg]
    return EVICTION_POLICIES[name]()


def make_prefetchers(
    settings: OffloadSettings, spec: ModelSpec, weights: NonExpertWeights | None,
    stats: OffloadStats | None = None,
) -> list[Prefetcher]:
    """`spec` and `weights` are the checkpoint's: the skip-gate runs its routers (others read the geometry)."""
    policy = settings.policy
    out: list[Prefetcher] = []
    distance = settings.prefetch_distance
    for name in policy.prefetchers:
        if name == "layer":
            out.append(NextLayerPrefetcher(spec.num_experts, spec.moe_layers))
        elif name == "speculative":
            out.append(SpeculativePrefetcher(spec, weights, distance, min_confidence=policy.min_confidence))
        elif name == "oracle":
            out.append(OraclePrefetcher(_trace(settings, policy.name), spec.moe_layers, distance))
        elif name == "affinity":
            out.append(AffinityPrefetcher(spec.num_experts, spec.top_k, spec.moe_layers))
        elif name == "hints":
            # Fed by the predictor link (services/engine/predictor_link.py) once the engine has its runner.
            # Beside a local skip-gate, hints serve only the layers beyond its reach.
            near = distance if "speculative" in policy.prefetchers else 0
            out.append(HintPrefetcher(spec.moe_layers, stats, min_hops=near + 1))
        else:
            raise ValueError(f"unknown prefetcher {name!r}")
    return out


def build_expert_provider(
    config: EngineConfig, reader: WeightReader, spec: ModelSpec, weights: NonExpertWeights
) -> ExpertProvider:
    from services.engine.models.loader import load_resident_experts

    layout = config_expert_layout(config, spec, reader.dtype, reader.ckpt)
    settings = OffloadSettings.from_config(config, spec, reader.dtype, layout.numel * layout.dtype.itemsize)
    if settings.policy.name == "resident":
        return load_resident_experts(reader, spec, layout)
    cuda = settings.device.startswith("cuda")
    store = HostExpertStore(reader, spec, pin=cuda, layout=layout)
    pinned = pinned_experts(settings.policy, spec, settings.slots,
                            _trace(settings, settings.policy.name) if settings.policy.needs_trace else None)
    link = make_link(settings, spec, reader.dtype)
    split, staging, costs = None, 0, None
    if is_hybrid(settings.policy):
        costs = measure_costs(spec.hidden_size, spec.moe_intermediate_size, reader.dtype, settings.device, link,
                              store.expert_bytes, settings.host_ratio)
        log.info("placement costs (ms): device %.3f, host %.3f, link %.3f per expert and token",
                 costs.device(1) * 1e3, costs.host(1) * 1e3, costs.link * 1e3)
        if not cuda and isinstance(link, EmulatedLink):  # the emulated host and link read one DRAM
            costs = _one_dram(costs, link, settings.link_reference_bytes or store.expert_bytes, store.expert_bytes)
        split = layout_split_prices(store.layout)
        split = planned_split(settings.policy, split, costs, config.max_num_seqs, spec)
        staging = staging_buffers(spec.top_k, split)
        settings = replace(settings, slots=hybrid_slots(settings.policy, settings.slots, pinned, split, staging))
    slots = settings.slots
    eviction = make_eviction(settings, spec)
    stats_type = HintStats if "hints" in settings.policy.prefetchers else OffloadStats
    stats = stats_type(spec.num_layers, slots_total=slots, expert_bytes=store.expert_bytes)
    cache = ExpertCache(slots, store.layout, store.dtype, settings.device, eviction)
    fence = None
    if settings.link == "native":
        from services.engine.offload.cuda_link import CudaLink

        fence = CudaLink.compute_fence
    parts = (store, cache, TransferEngine(link, stats), make_prefetchers(settings, spec, weights, stats),
             settings.policy.rules, stats)
    if costs is None:
        return OffloadedExpertProvider(*parts, stream_slots=spec.top_k, fence=fence)
    emulated = (lambda n: costs.host(n)) if not cuda else None
    bus = link.bus if emulated is not None and isinstance(link, EmulatedLink) else None
    return HybridExpertProvider(
        *parts, stream_slots=spec.top_k, fence=fence, pinned=pinned, prefetch_floor=settings.policy.prefetch_floor,
        prefetch_depth=settings.policy.prefetch_depth, split_staging=staging,
        placement=make_placement(settings.policy, costs, split),
        executor=HostExecutor(settings.host_threads, stats, emulated, bus, costs.host_bytes),
    )
