"""OffloadSettings: every offload knob resolved once from an EngineConfig, before the model loads.

The policy is looked up and every name validated here, once; what depends on the checkpoint (the cache's
slots, the expert's bytes) is sized from these settings by `cache_slots` once its geometry is known. Budgets
in GB are decimal (1 GB = 1e9 bytes), as `--link-gbps` and `hintserve simulate` count them. The simulator
builds these settings directly, without an EngineConfig. To add a knob: a field here (with a default), read
in `from_config`, used by the assembler (offload/assembler.py) or the engine's parts (offload/setup.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.engine.config import EngineConfig
from services.engine.expert_format import DEFAULT_GROUP_SIZE
from services.engine.models.geometry import ExpertGeometry, total_experts
from services.engine.offload.cost_model import DEFAULT_HOST_RATIO
from services.engine.offload.eviction import EVICTION_POLICIES
from services.engine.offload.policies import OffloadPolicy, get_policy
from services.engine.offload.routing_trace import TraceFile

GB = 1e9  # bytes; one unit for cache budgets and link bandwidths everywhere
DEFAULT_CACHE_FRACTION = 0.25
DEFAULT_LINK_RATIO = 30.0


@dataclass(frozen=True)
class PredictorSettings:
    """The predictor behind a policy's "hints" prefetcher and how to reach it."""

    name: str  # registry name or module:Class
    model_name: str  # the model as the predictor service knows it (the context batches' shape)
    redis_url: str | None = None  # None: an embedded predictor service on an in-process broker
    engine_id: str | None = None  # None: generated

    @classmethod
    def from_config(cls, config: EngineConfig, policy: OffloadPolicy) -> PredictorSettings | None:
        """None unless the policy has a "hints" prefetcher and a predictor (its own, or --predictor)."""
        name = config.predictor or policy.predictor
        if "hints" not in policy.prefetchers or not name or name == "none":
            return None
        if policy.placement != "device" and not config.redis_url and not config.predictor:
            # Hybrid decode is bound by the host's cores; an embedded predictor would run on them. Such a
            # policy takes hints from a predictor service elsewhere (--redis-url), or from one asked for.
            return None
        model_name = os.path.basename(os.path.normpath(config.model))
        return cls(name, model_name, config.redis_url, config.engine_id)


@dataclass(frozen=True)
class CacheBudget:
    """The device expert cache asked for: the first of these given wins (default: a quarter of all experts)."""

    experts: int | None = None
    bytes: int | None = None
    fraction: float | None = None


@dataclass(frozen=True)
class OffloadSettings:
    policy: OffloadPolicy
    eviction: str
    prefetch_distance: int  # MoE layers ahead the local prefetchers look
    routing_trace: TraceFile = TraceFile()  # recorded routing for the oracle / belady / static policies
    predictor: PredictorSettings | None = None  # None: hints prefetchers run without a predictor link
    cache: CacheBudget = field(default_factory=CacheBudget)
    expert_dtype: str = "auto"  # services/engine/expert_format.py
    expert_group_size: int = DEFAULT_GROUP_SIZE
    device: str = "cpu"
    link: str = "emulated"  # emulated | native (CUDA copy engine)
    link_bytes_per_second: float | None = None  # emulated link; None: from link_ratio
    link_ratio: float = DEFAULT_LINK_RATIO  # emulated: one expert's transfer = R x one expert's compute
    host_ratio: float = DEFAULT_HOST_RATIO  # emulated host: one expert on the host = R x on the device
    host_threads: int = 1  # host expert executor worker threads
    max_tokens: int = 32  # sequences in one decode step at most: what a split expert is planned for

    @property
    def offloads(self) -> bool:
        return self.policy.name != "resident"

    @classmethod
    def from_config(cls, config: EngineConfig) -> OffloadSettings:
        policy = get_policy(config.offload_policy)
        eviction = config.eviction or policy.eviction
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {eviction!r}; choose from: {', '.join(EVICTION_POLICIES)}")
        return cls(
            policy=policy,
            eviction=eviction,
            prefetch_distance=config.prefetch_distance or policy.prefetch_distance,
            routing_trace=TraceFile(config.routing_trace),
            predictor=PredictorSettings.from_config(config, policy),
            cache=CacheBudget(
                config.expert_cache_experts,
                None if config.expert_cache_gb is None else int(config.expert_cache_gb * GB),
                config.expert_cache_fraction,
            ),
            expert_dtype=config.expert_dtype,
            expert_group_size=config.expert_group_size,
            device=config.device,
            link=config.link,
            link_bytes_per_second=None if config.link_gbps is None else config.link_gbps * GB,
            link_ratio=config.link_ratio or DEFAULT_LINK_RATIO,
            host_ratio=config.host_ratio or DEFAULT_HOST_RATIO,
            host_threads=config.host_threads or 1,
            max_tokens=config.max_num_seqs,
        )

    def cache_slots(self, geometry: ExpertGeometry, expert_bytes: int) -> int:
        """The device cache in whole experts of `expert_bytes` (as stored) each."""
        if not self.offloads:
            return total_experts(geometry)
        if self.policy.pinned == "nothing":
            return 0  # every expert computed on the host
        return resolve_slots(geometry, expert_bytes, self.cache.experts, self.cache.bytes, self.cache.fraction)


def resolve_slots(
    geometry: ExpertGeometry,
    expert_bytes: int,
    experts: int | None = None,
    cache_bytes: int | None = None,
    fraction: float | None = None,
) -> int:
    """Cache slots from whichever is given first (experts, a byte budget, a fraction of all experts; default a
    quarter): at least one layer's top-k, at most every expert."""
    total = total_experts(geometry)
    if experts is not None:
        slots = experts
    elif cache_bytes is not None:
        slots = cache_bytes // expert_bytes
    else:
        slots = round(total * (fraction or DEFAULT_CACHE_FRACTION))
    if slots < geometry.top_k:
        raise ValueError(
            f"expert cache of {slots} slots is smaller than one layer's top-k ({geometry.top_k}); "
            f"each expert takes {expert_bytes / 1e6:.2f} MB"
        )
    return min(slots, total)
