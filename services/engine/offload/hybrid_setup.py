"""The hybrid parts of a policy: which experts stay on the device for good, the split plan, the slots left,
the placement of misses; each named by the policy and resolved through its registry here. Used by the one
assembler (offload/assembler.py) the engine and the simulator share."""

from __future__ import annotations

from collections.abc import Callable

from services.engine.models.geometry import ExpertGeometry
from services.engine.offload.cost_model import PlacementCosts
from services.engine.offload.host_store import Key
from services.engine.offload.placement import CostPlacement, HostPlacement, Placement, SplitPrices
from services.engine.offload.policies import OffloadPolicy
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.offload.split_experts import split_pays, staging_slots


def is_hybrid(policy: OffloadPolicy) -> bool:
    return policy.placement != "device"


def _nothing(policy: OffloadPolicy, geometry: ExpertGeometry, slots: int, trace: RoutingTrace | None) -> list[Key]:
    return []


def _late_layers(
    policy: OffloadPolicy, geometry: ExpertGeometry, slots: int, trace: RoutingTrace | None
) -> list[Key]:
    moe = [layer for layer, is_moe in enumerate(geometry.moe_layers) if is_moe]
    on_device = moe[len(moe) - min(len(moe), slots // geometry.num_experts):]
    return [(layer, e) for layer in on_device for e in range(geometry.num_experts)]


def _hot(policy: OffloadPolicy, geometry: ExpertGeometry, slots: int, trace: RoutingTrace | None) -> list[Key]:
    if trace is None:
        raise ValueError(f"policy {policy.name!r} pins the most used experts: pass --routing-trace FILE")
    size = slots - (geometry.top_k if policy.placement == "cost" else 0)
    hot = trace.hot_set(size)
    # A budget past the experts the trace saw takes the unseen ones too: a free slot saves nothing.
    unseen = [(layer, e) for layer, is_moe in enumerate(geometry.moe_layers) if is_moe
              for e in range(geometry.num_experts) if (layer, e) not in hot]
    hot.update(unseen[: max(0, size - len(hot))])
    return sorted(hot)


# A policy's `pinned` names one: the experts on the device for good. nothing: none (llama.cpp -ot exps=CPU).
# late-layers: whole MoE layers from the last one back, as many as the budget holds (llama.cpp --n-cpu-moe N
# keeps the first N layers' experts on the CPU). hot: the most used experts of a recorded run (KTransformers,
# Fiddler), then unseen ones while the budget lasts; a policy that also fetches leaves top-k slots free for its
# fetches.
PINNED_SETS: dict[str, Callable[[OffloadPolicy, ExpertGeometry, int, RoutingTrace | None], list[Key]]] = {
    "": _nothing,
    "nothing": _nothing,
    "late-layers": _late_layers,
    "hot": _hot,
}


def pinned_experts(
    policy: OffloadPolicy, geometry: ExpertGeometry, slots: int, trace: RoutingTrace | None
) -> list[Key]:
    """The experts a static placement keeps on the device (`geometry`: the engine's ModelSpec or a simulator
    spec), by the policy's PINNED_SETS entry."""
    pick = PINNED_SETS.get(policy.pinned)
    if pick is None:
        raise ValueError(f"unknown pinned set {policy.pinned!r}; choose from: {', '.join(PINNED_SETS)}")
    return pick(policy, geometry, slots, trace)


def planned_split(
    policy: OffloadPolicy, split: SplitPrices | None, costs: PlacementCosts, max_tokens: int,
    geometry: ExpertGeometry, slots: int | None = None,
) -> SplitPrices | None:
    """The split prices a policy places with: None where it does not split, or where splitting in a decode step
    of up to `max_tokens` sequences would not save what the staging's share of the `slots` budget would
    (split_experts.split_pays), so no staging takes a slot of it."""
    if not policy.split_experts or not split_pays(split, costs, max_tokens, geometry.top_k, geometry.num_experts,
                                                  geometry.num_moe_layers, slots):
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


def _cost_placement(policy: OffloadPolicy, costs: PlacementCosts | None, split: SplitPrices | None) -> Placement:
    if costs is None:
        raise ValueError(f"policy {policy.name!r} weighs each miss's sides: it needs their prices")
    return CostPlacement(costs, policy.rules.stream_prefill, split if policy.split_experts else None)


# A policy's `placement` names one (device: no placement, every miss fetched).
PLACEMENTS: dict[str, Callable[[OffloadPolicy, PlacementCosts | None, SplitPrices | None], Placement]] = {
    "host": lambda policy, costs, split: HostPlacement(),
    "cost": _cost_placement,
}


def make_placement(
    policy: OffloadPolicy, costs: PlacementCosts | None, split: SplitPrices | None = None
) -> Placement:
    """`split`: what a split expert costs each side, where the expert format can split (None: it cannot)."""
    build = PLACEMENTS.get(policy.placement)
    if build is None:
        raise ValueError(f"unknown placement {policy.placement!r}; choose from: {', '.join(PLACEMENTS)}")
    return build(policy, costs, split)
