"""Offload policies users pick with --offload-policy: eviction + prefetchers + phase rules.

Each reproduces a system our users compare against; adding one is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.offload.provider import PhaseRules


@dataclass(frozen=True)
class OffloadPolicy:
    name: str
    description: str
    eviction: str = "lru-global"
    prefetchers: tuple[str, ...] = ()
    rules: PhaseRules = field(default_factory=PhaseRules)
    needs_trace: bool = False  # replays a routing trace recorded from an identical earlier run
    predictor: str | None = None  # the predictor service's model behind the "hints" prefetcher
    prefetch_distance: int = 2  # MoE layers ahead the local prefetchers look (--prefetch-distance overrides)
    min_confidence: float = 0.0  # skip-gate: fetch only experts some token's guess gives this probability
    placement: str = "device"  # misses: device (fetch all) | host (compute all there) | cost (Fiddler's rule)
    pinned: str = ""  # experts on the device for good: nothing | late-layers | hot (see offload/hybrid_setup.py)
    prefetch_floor: float = 0.0  # hybrid: prefetch only guesses this likely; the rest stay on the host
    prefetch_depth: int = 0  # hybrid: prefetches on the link at once (0: no limit)
    split_experts: bool = False  # cost placement may split a miss: gate/up on the host, down over the link


POLICIES: dict[str, OffloadPolicy] = {
    p.name: p
    for p in (
        OffloadPolicy("resident", "no offload: every expert on the device (the speed bound)"),
        OffloadPolicy(
            "ondemand",
            "fetch after the router, block on each expert, keep nothing (HF Accelerate, DuoServe's ACC)",
            rules=PhaseRules(early_demand=False, keep_cache=False),
        ),
        OffloadPolicy("layer", "fetch every expert of the next layer (DeepSpeed-Inference / MoESys)",
                      prefetchers=("layer",)),
        OffloadPolicy("lru", "per-layer LRU slots (each MoE layer its share of the cache), all misses queued right "
                      "after the router, resident experts computed first (Mixtral-Offloading)", eviction="lru"),
        OffloadPolicy("lru-global", "one LRU over every layer's slots, all misses queued right after the router",
                      eviction="lru-global"),
        OffloadPolicy("speculative", "per-layer LRU slots + the next layers' routers applied to this layer's "
                      "hidden state (Mixtral-Offloading's speculative expert loading)",
                      eviction="lru", prefetchers=("speculative",)),
        OffloadPolicy("duoserve", "prefill streamed through top-k slots + decode affinity prefetch (DuoServe)",
                      prefetchers=("affinity",), rules=PhaseRules(stream_prefill=True)),
        OffloadPolicy("oracle", "perfect prefetch + Belady replacement from a recorded routing trace (the bound)",
                      eviction="belady", prefetchers=("oracle",), needs_trace=True),
        OffloadPolicy("belady", "no prefetch, Belady's optimal eviction from a recorded trace (the caching bound)",
                      eviction="belady", needs_trace=True),
        OffloadPolicy("moe-infinity", "EAM cache priority + prefetch hints from the predictor's EAMC (MoE-Infinity)",
                      eviction="eam", prefetchers=("hints",), predictor="eamc"),
        OffloadPolicy("promoe", "per-layer LRU slots + stride prefetch, demand chunks overtake prefetches (ProMoE; "
                      "the skip-gate stands in for its learned per-layer predictor, which needs training per model)",
                      eviction="lru", prefetchers=("speculative",)),
        OffloadPolicy("finemoe", "1/(p*freq) eviction + prefetch hints from the predictor's expert maps (FineMoE)",
                      eviction="finemoe", prefetchers=("hints",), predictor="expert-map"),
        OffloadPolicy("hintserve-transfer", "hintserve before hybrid execution: every miss fetched",
                      eviction="next-use", prefetchers=("speculative", "hints"), predictor="expert-map"),
        OffloadPolicy("cpu-experts", "every routed expert computed on the host, none moved (llama.cpp "
                      "-ot exps=CPU)", placement="host", pinned="nothing"),
        OffloadPolicy("n-cpu-moe", "the first MoE layers' experts on the host, the last ones resident as the "
                      "budget allows (llama.cpp --n-cpu-moe)", placement="host", pinned="late-layers"),
        OffloadPolicy("ktransformers", "static hot set by measured frequency on the device, the rest computed "
                      "on the host (KTransformers)", placement="host", pinned="hot", needs_trace=True),
        OffloadPolicy("fiddler", "hot set by measured frequency + LRU slots; each miss computed on the host "
                      "when that beats fetching it (Fiddler)", placement="cost", pinned="hot", needs_trace=True),
        OffloadPolicy("hintserve", "ours: a hot set learned online stays on the device (KTransformers without "
                      "a recorded trace); the skip-gate and predictor hints prefetch their likely guesses into the "
                      "link's slack, into slots outside the hot set; each remaining miss computed on the host "
                      "when that beats fetching or waiting for it (Fiddler's rule, weighing what is on the link); "
                      "whole fetches stream through top-k slots beside the hot set",
                      eviction="hot-set", prefetchers=("speculative", "hints"), predictor="expert-map",
                      placement="cost", prefetch_floor=0.8, prefetch_depth=2, split_experts=True),
    )
}


def get_policy(name: str) -> OffloadPolicy:
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown offload policy {name!r}; choose from: {', '.join(POLICIES)}")
    return policy
