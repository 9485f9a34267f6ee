"""OffloadSettings: every offload knob resolved once from an EngineConfig, the one input of offload setup.

The expert cache size is resolved here, once, in slots of whole experts; budgets in GB are decimal
(1 GB = 1e9 bytes), as `--link-gbps` and `hintserve simulate` count them. The simulator builds these
settings directly, without an EngineConfig. To add a knob: a field here (with a default), read in
`from_config`, used in setup.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from services.engine.config import EngineConfig
from services.engine.models.geometry import ExpertGeometry, expert_bytes, total_experts
from services.engine.offload.cost_model import DEFAULT_HOST_RATIO
from services.engine.offload.policies import OffloadPolicy, get_policy

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
    def from_config(cls, config: EngineConfig) -> PredictorSettings | None:
        """None unless the policy has a "hints" prefetcher and a predictor (its own, or --predictor)."""
        policy = get_policy(config.offload_policy)
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
class OffloadSettings:
    policy: OffloadPolicy
    slots: int  # device expert cache, in experts
    expert_bytes: int
    eviction: str
    prefetch_distance: int  # MoE layers ahead the local prefetchers look
    routing_trace: str | None = None  # recorded routing for the oracle / belady / static policies
    predictor: PredictorSettings | None = None  # None: hints prefetchers run without a predictor link
    device: str = "cpu"
    link: str = "emulated"  # emulated | native (CUDA copy engine)
    link_bytes_per_second: float | None = None  # emulated link; None: from link_ratio
    link_ratio: float = DEFAULT_LINK_RATIO  # emulated: one expert's transfer = R x one expert's compute
    host_ratio: float = DEFAULT_HOST_RATIO  # emulated host: one expert on the host = R x on the device
    host_threads: int = 1  # host expert executor worker threads
    link_reference_bytes: int = 0  # the expert that R x compute moves: unquantized (bf16 under --expert-dtype)

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.expert_bytes

    @classmethod
    def from_config(
        cls, config: EngineConfig, spec: ExpertGeometry, dtype: torch.dtype, stored_bytes: int | None = None
    ) -> OffloadSettings:
        """`dtype`: the run dtype; `stored_bytes`: one expert as stored (packed int8/int4, bf16), which sets the
        slot count; default unquantized in `dtype`."""
        policy = get_policy(config.offload_policy)
        size = stored_bytes or expert_bytes(spec, dtype)
        reference = expert_bytes(spec, dtype if config.expert_dtype == "auto" else torch.bfloat16)
        if policy.name == "resident":
            slots = total_experts(spec)
        elif policy.pinned == "nothing":
            slots = 0  # every expert computed on the host
        else:
            slots = resolve_slots(
                spec, size, experts=config.expert_cache_experts,
                cache_bytes=None if config.expert_cache_gb is None else int(config.expert_cache_gb * GB),
                fraction=config.expert_cache_fraction,
            )
        return cls(
            policy=policy,
            slots=slots,
            expert_bytes=size,
            eviction=config.eviction or policy.eviction,
            prefetch_distance=config.prefetch_distance or policy.prefetch_distance,
            routing_trace=config.routing_trace,
            predictor=PredictorSettings.from_config(config),
            device=config.device,
            link=config.link,
            link_bytes_per_second=None if config.link_gbps is None else config.link_gbps * GB,
            link_ratio=config.link_ratio or DEFAULT_LINK_RATIO,
            host_ratio=config.host_ratio or DEFAULT_HOST_RATIO,
            host_threads=config.host_threads or 1,
            link_reference_bytes=reference,
        )


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
