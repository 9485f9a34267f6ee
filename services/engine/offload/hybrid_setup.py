"""Builds the hybrid parts of a policy: which experts stay on the device for good, the placement of misses,
the host executor. Shared by the engine (offload/setup.py) and the simulator (simulator/policy_driver.py)."""

from __future__ import annotations

from services.engine.offload.cost_model import PlacementCosts
from services.engine.offload.host_store import Key
from services.engine.offload.placement import CostPlacement, HostPlacement, Placement, SplitPrices
from services.engine.offload.policies import OffloadPolicy
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.offload.split_experts import split_pays, staging_slots


def is_hybrid(policy: OffloadPolicy) -> bool:
    return policy.placement != "device"


def pinned_experts(policy: OffloadPolicy, spec, slots: int, trace: RoutingTrace | None) -> list[Key]:
    """The experts a static placement keeps on the device (`spec`: the engine's ModelSpec or a simulator spec).

    nothing: none (llama.cpp -ot exps=CPU). late-layers: whole MoE layers from the last one back, as many
    as the budget holds (llama.cpp --n-cpu-moe N keeps the first N layers' experts on the CPU). hot: the most
    used experts of a recorded run (KTransformers, Fiddler); a policy that also fetches leaves top-k slots
    free for its fetches."""
    if policy.pinned in ("", "nothing"):
        return []
    if policy.pinned == "late-layers":
        moe = [layer for layer, is_moe in enumerate(spec.moe_layers) if is_moe]
        on_device = moe[len(moe) - min(len(moe), slots // spec.num_experts):]
        return [(layer, e) for layer in on_device for e in range(spec.num_experts)]
    if policy.pinned == "hot":
        if trace is None:
            raise ValueError(f"policy {policy.name!r} pins the most used experts: pass --routing-trace FILE")
        size = slots - (spec.top_k if policy.placement == "cost" else 0)
        return sorted(trace.hot_set(size))
    raise ValueError(f"unknown pinned set {policy.pinned!r}")


def planned_split(
    policy: OffloadPolicy, split: SplitPrices | None, costs: PlacementCosts, max_tokens: int, spec
) -> SplitPrices | None:
    """The split prices a policy places with: None where it does not split, or where its placement never
    would in a decode step of up to `max_tokens` sequences (split_experts.split_pays), so no staging takes a
    slot of its budget. `spec`: the engine's ModelSpec or a simulator spec."""
    if not policy.split_experts or not split_pays(split, costs, max_tokens, spec.top_k, spec.num_experts):
        return None
    return split


def hybrid_slots(
    policy: OffloadPolicy, slots: int, pinned: list[Key], split: SplitPrices | None = None, staging: int = 0
) -> int:
    """Device slots a hybrid policy allocates: a host-only placement needs no more than its pinned set; one
    that splits experts gives up the slots its `staging` down-matrix buffers take, so every policy holds the
    same expert bytes for the same budget."""
    if policy.placement == "host":
        return len(pinned)
    if policy.split_experts and split is not None:
        return max(0, slots - staging_slots(staging, split))
    return slots


def make_placement(
    policy: OffloadPolicy, costs: PlacementCosts | None, split: SplitPrices | None = None
) -> Placement:
    """`split`: what a split expert costs each side, where the expert format can split (None: it cannot)."""
    if policy.placement == "host":
        return HostPlacement()
    if policy.placement == "cost":
        assert costs is not None
        return CostPlacement(costs, policy.rules.stream_prefill, split if policy.split_experts else None)
    raise ValueError(f"unknown placement {policy.placement!r}")
