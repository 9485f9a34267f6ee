"""The fewest misses a cache of a given size can have on a routing trace, and a fixed placement's misses.

The physical bound (bound.py) charges the first; the second is the figure a static hot set could reach.
"""

from __future__ import annotations

import heapq
import math

from services.engine.offload.routing_trace import RoutingTrace


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


def static_misses(steps: list[list[list[int]]], slots: int) -> list[list[int]]:
    """Per step and layer, the misses of the best fixed placement: the `slots` experts the run uses most,
    resident from the start (KTransformers' hot set, measured on the run itself). Not a bound: a cache that
    follows the traffic can beat it; it is the figure a static placement could reach."""
    hot = RoutingTrace(len(steps[0]) if steps else 0, steps).hot_set(slots)
    return [[sum(1 for e in experts if (layer, e) not in hot) for layer, experts in enumerate(layers)]
            for layers in steps]
