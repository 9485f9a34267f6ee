"""Builds the expert provider an EngineConfig asks for: resident, or offloaded with a policy."""

from __future__ import annotations

import logging
import os

import torch

from services.engine.config import EngineConfig
from services.engine.expert_provider import ExpertProvider
from services.engine.models.spec import ModelSpec
from services.engine.models.weights import NonExpertWeights, WeightReader
from services.engine.offload.eviction import EVICTION_POLICIES, EvictionPolicy
from services.engine.offload.expert_cache import ExpertCache
from services.engine.offload.host_store import HostExpertStore
from services.engine.offload.link import EmulatedLink, Link, expert_compute_seconds
from services.engine.offload.policies import OffloadPolicy, get_policy
from services.engine.offload.prefetch import (
    AffinityPrefetcher,
    NextLayerPrefetcher,
    OraclePrefetcher,
    Prefetcher,
    SpeculativePrefetcher,
)
from services.engine.offload.prefetch.hints import HintStats
from services.engine.offload.provider import OffloadedExpertProvider
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.offload.stats import OffloadStats
from services.engine.offload.transfer_engine import TransferEngine

log = logging.getLogger(__name__)

DEFAULT_CACHE_FRACTION = 0.25
DEFAULT_LINK_RATIO = 30.0


def cache_slots(config: EngineConfig, spec: ModelSpec, expert_bytes: int) -> int:
    total = spec.num_moe_layers * spec.num_experts
    if config.expert_cache_experts is not None:
        slots = config.expert_cache_experts
    elif config.expert_cache_gb is not None:
        slots = int(config.expert_cache_gb * (1 << 30) // expert_bytes)
    else:
        slots = round(total * (config.expert_cache_fraction or DEFAULT_CACHE_FRACTION))
    if slots < spec.top_k:
        raise ValueError(
            f"expert cache of {slots} slots is smaller than one layer's top-k ({spec.top_k}); "
            f"each expert takes {expert_bytes / 2**20:.2f} MiB"
        )
    return min(slots, total)


def make_link(config: EngineConfig, spec: ModelSpec, expert_bytes: int, dtype: torch.dtype) -> Link:
    if config.link == "native":
        from services.engine.offload.cuda_link import CudaLink

        return CudaLink(config.device)
    if config.link_gbps is not None:
        return EmulatedLink(config.link_gbps * 1e9)
    ratio = config.link_ratio or DEFAULT_LINK_RATIO
    per_expert = ratio * expert_compute_seconds(spec.hidden_size, spec.moe_intermediate_size, dtype)
    log.info("emulated link: %.3f ms per expert (ratio %.1f)", per_expert * 1e3, ratio)
    return EmulatedLink(expert_bytes / per_expert)


def _trace(config: EngineConfig, policy_name: str) -> RoutingTrace:
    if not config.routing_trace or not os.path.isfile(config.routing_trace):
        raise ValueError(
            f"policy {policy_name!r} replays a recorded routing trace: pass --routing-trace FILE "
            "(record one with the resident policy on the same prompts)"
        )
    return RoutingTrace.load(config.routing_trace)


def make_eviction(name: str, config: EngineConfig, spec: ModelSpec, slots: int) -> EvictionPolicy:
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose from: {', '.join(EVICTION_POLICIES)}")
    if name == "lookahead":
        return EVICTION_POLICIES[name](spec.num_layers)  # type: ignore[call-arg]
    if name in ("eam", "next-use"):
        return EVICTION_POLICIES[name](spec.num_layers, spec.num_experts)  # type: ignore[call-arg]
    if name == "belady":
        return EVICTION_POLICIES[name](_trace(config, name))  # type: ignore[call-arg]
    if name == "static":
        hot = _trace(config, name).hot_set(slots // 2) if config.routing_trace else set()
        return EVICTION_POLICIES[name](hot)  # type: ignore[call-arg]
    return EVICTION_POLICIES[name]()


def make_prefetchers(
    policy: OffloadPolicy, config: EngineConfig, spec: ModelSpec, weights: NonExpertWeights,
    stats: OffloadStats | None = None,
) -> list[Prefetcher]:
    out: list[Prefetcher] = []
    distance = config.prefetch_distance or policy.prefetch_distance
    for name in policy.prefetchers:
        if name == "layer":
            out.append(NextLayerPrefetcher(spec.num_experts, spec.moe_layers))
        elif name == "speculative":
            out.append(SpeculativePrefetcher(spec, weights, distance, min_confidence=policy.min_confidence))
        elif name == "oracle":
            out.append(OraclePrefetcher(_trace(config, policy.name), spec.moe_layers, distance))
        elif name == "affinity":
            out.append(AffinityPrefetcher(spec.num_experts, spec.top_k, spec.moe_layers))
        elif name == "hints":
            from services.engine.predictor_setup import build_hint_prefetcher  # redis, grpc: only when used

            # Beside a local skip-gate, hints serve only the layers beyond its reach.
            near = distance if "speculative" in policy.prefetchers else 0
            out.append(build_hint_prefetcher(config, spec, policy.predictor or "", near, stats))
        else:
            raise ValueError(f"unknown prefetcher {name!r}")
    return out


def build_expert_provider(
    config: EngineConfig, reader: WeightReader, spec: ModelSpec, weights: NonExpertWeights
) -> ExpertProvider:
    from services.engine.models.loader import load_resident_experts

    policy = get_policy(config.offload_policy)
    if policy.name == "resident":
        return load_resident_experts(reader, spec)
    cuda = config.device.startswith("cuda")
    store = HostExpertStore(reader, spec, pin=cuda)
    slots = cache_slots(config, spec, store.expert_bytes)
    eviction = make_eviction(config.eviction or policy.eviction, config, spec, slots)
    stats_type = HintStats if "hints" in policy.prefetchers else OffloadStats
    stats = stats_type(spec.num_layers, slots_total=slots, expert_bytes=store.expert_bytes)
    link = make_link(config, spec, store.expert_bytes, reader.dtype)
    cache = ExpertCache(slots, store.layout, reader.dtype, config.device, eviction)
    fence = None
    if config.link == "native":
        from services.engine.offload.cuda_link import CudaLink

        fence = CudaLink.compute_fence
    return OffloadedExpertProvider(
        store,
        cache,
        TransferEngine(link, stats),
        make_prefetchers(policy, config, spec, weights, stats),
        policy.rules,
        stats,
        stream_slots=spec.top_k,
        fence=fence,
    )
