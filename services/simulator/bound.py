"""The physical bound of a decode run: what no offload policy can beat on this hardware, cache and routing.

Every routed expert the cache does not hold when its layer runs is read from the host's DRAM once: computed
there, or copied over the link into a slot. The fewest such misses any placement of the cache can have is the
optimal offline caching with bypass (Belady's rule: a miss evicts the resident expert used farthest ahead, or
stays uncached when it is used later than all of them); a load counts like a host read, since both move one
expert out of DRAM. Those bytes move at most at min(DRAM, host kernel rate + link rate) when the host computes
misses, or at the link rate when it does not (misses_per_second: where the two sides read different bytes per
miss, as the emulated host does for packed experts, the side that reads fewer goes first); the device's own work
(the resident run) overlaps them at best:

    bound = min(max(D, B / link), max(D, B / min(DRAM, host + link)) + sync * L)

with D the decode time with every expert resident, B the missed bytes, L the layer visits with a miss and sync
the engine's measured per-layer cost of handing jobs to the host and merging their results. Per layer the
max would be tighter, but prefetches overlap a layer's misses with earlier layers' device time, so only the
run-wide max is a bound.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from services.engine.offload.routing_trace import RoutingTrace
from services.engine.step_context import Phase
from services.simulator.hardware import CostModel
from services.simulator.host import HOST_PATH_S
from services.simulator.workload import Workload


@dataclass(frozen=True)
class Bound:
    seconds: float  # the decode run's
    device_seconds: float  # D: every expert resident
    miss_bytes: float  # B
    miss_layers: int  # L
    steps: int

    @property
    def tpot_ms(self) -> float:
        return self.seconds * 1e3 / max(1, self.steps)


def fewest_misses(steps: list[list[list[int]]], slots: int) -> list[list[int]]:
    """Per step and layer, the misses of the optimal offline cache of `slots` experts with bypass, over the
    routing `steps` ([step][layer] -> experts used), from an empty cache."""
    seq = [(s, layer, e) for s, layers in enumerate(steps) for layer, experts in enumerate(layers) for e in experts]
    next_use = [math.inf] * len(seq)
    seen: dict[tuple[int, int], int] = {}
    for i in range(len(seq) - 1, -1, -1):
        key = seq[i][1:]
        next_use[i] = seen.get(key, math.inf)
        seen[key] = i
    misses = [[0] * len(layers) for layers in steps]
    cached: dict[tuple[int, int], float] = {}  # key -> its next use
    farthest: list[tuple[float, tuple[int, int]]] = []  # (-next use, key), stale entries skipped
    for i, (s, layer, e) in enumerate(seq):
        key, nxt = (layer, e), next_use[i]
        if key in cached:
            cached[key] = nxt
            heapq.heappush(farthest, (-nxt, key))
            continue
        misses[s][layer] += 1
        if nxt == math.inf or slots <= 0:
            continue  # never used again: computed where it lives, not cached
        if len(cached) >= slots:
            while cached.get(farthest[0][1]) != -farthest[0][0]:
                heapq.heappop(farthest)
            if -farthest[0][0] <= nxt:
                continue  # every resident expert is needed sooner: bypass
            del cached[heapq.heappop(farthest)[1]]
        cached[key] = nxt
        heapq.heappush(farthest, (-nxt, key))
    return misses


@dataclass(frozen=True)
class Side:
    """One way a miss is served: `seconds` per miss alone, `dram_bytes` it reads from the host's DRAM."""

    seconds: float
    dram_bytes: float


def misses_per_second(link: Side, host: Side | None, dram: float) -> float:
    """The most misses per second the link and the host together serve with `dram` bytes/s between them: each
    side at most at its own rate, the side that reads fewer bytes per miss first (the optimum of that linear
    program); host None: the link alone."""
    left, rate = dram, 0.0
    for side in sorted([link] + ([host] if host is not None else []), key=lambda s: s.dram_bytes):
        take = min(1.0 / side.seconds, left / side.dram_bytes)
        rate += take
        left -= take * side.dram_bytes
    return rate


def physical_bound(
    device_seconds: float, misses: int, miss_bytes: float, miss_layers: int, steps: int, link: Side,
    host: Side | None, dram: float, sync_seconds: float,
) -> Bound:
    """max(device, misses at the link's rate), or with the host beside it, at both sides' rate on the shared DRAM
    plus the host path's sync per layer visit with a miss; whichever is faster. `host` None: nothing computed
    on the host in this configuration."""
    best = max(device_seconds, misses / misses_per_second(link, None, dram))
    if host is not None:
        hybrid = max(device_seconds, misses / misses_per_second(link, host, dram)) + sync_seconds * miss_layers
        best = min(best, hybrid)
    return Bound(best, device_seconds, miss_bytes, miss_layers, steps)


def static_misses(steps: list[list[list[int]]], slots: int) -> list[list[int]]:
    """Per step and layer, the misses of the best fixed placement: the `slots` experts the run uses most,
    resident from the start (KTransformers' hot set, measured on the run itself). Not a bound: a cache that
    follows the traffic can beat it; it is the figure a static placement could reach."""
    hot = RoutingTrace(len(steps[0]) if steps else 0, steps).hot_set(slots)
    return [[sum(1 for e in experts if (layer, e) not in hot) for layer, experts in enumerate(layers)]
            for layers in steps]


def simulated_bounds(
    workload: Workload, cost: CostModel, slots: int | None, warmup_steps: int = 0
) -> tuple[Bound, Bound]:
    """(the bound, the best static placement's figure) of a simulated run's decode steps (from the
    `warmup_steps`-th on) with a cache of `slots` experts, empty at the start as the policies' are for the bound
    (None: every expert resident from the start)."""
    spec = workload.spec
    steps = workload.routing_trace().steps
    counted = [s for s in workload.steps if s.phase is Phase.DECODE and s.index >= warmup_steps]
    device = 0.0
    for step in counted:
        ctx, shape = workload.context(step), step.shape
        device += cost.head_seconds(shape)
        for layer in range(spec.num_layers):
            device += cost.layer_seconds(layer, shape)
            if spec.moe_layers[layer]:
                device += sum(cost.expert_seconds(n) for n in workload.route(step, layer, ctx).values())
    size = spec.expert_bytes
    link, host = Side(size / cost.link_bytes_per_second, size), Side(cost.host_expert_seconds(1), size)
    dram = cost.dram_bytes_per_second(size)

    def bound(misses: list[list[int]] | None) -> Bound:
        per_step = [misses[s.index] if misses is not None else [] for s in counted]
        count = sum(sum(m) for m in per_step)
        miss_layers = sum(1 for m in per_step for n in m if n)
        return physical_bound(device, count, count * size, miss_layers, len(counted), link, host, dram, HOST_PATH_S)

    if slots is None:
        return bound(None), bound(None)
    return bound(fewest_misses(steps, slots)), bound(static_misses(steps, slots))
