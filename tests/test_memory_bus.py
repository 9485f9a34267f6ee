"""The one-DRAM model (offload/memory_bus.py) and the physical bound's offline-optimal misses (simulator/bound.py)."""

from __future__ import annotations

import math

import pytest

from services.engine.offload.memory_bus import MemoryBus, contended_seconds, emulated_dram, fair_rates
from services.simulator.offline_cache import fewest_misses, static_misses


def test_fair_rates_meet_small_demands_and_share_the_rest() -> None:
    assert fair_rates(38.4, [38.4, 25.0]) == pytest.approx([19.2, 19.2])
    assert fair_rates(614.0, [614.0, 25.0]) == pytest.approx([589.0, 25.0])  # a landing copy on device memory
    assert fair_rates(100.0, [10.0, 20.0]) == pytest.approx([10.0, 20.0])  # room for both: each its own
    assert contended_seconds(1.0, 614.0, [25.0]) == pytest.approx(614 / 589)
    assert contended_seconds(1.0, math.inf, [25.0]) == 1.0


def test_host_and_link_together_draw_no_more_than_the_dram() -> None:
    bus = MemoryBus(38.4)
    host = bus.add("host", 38.4, 38.4, 0.0)  # 1 s alone
    link = bus.add("link", 25.0, 25.0, 0.0)  # 1 s alone
    # Both at 19.2 until the link is done (25 / 19.2 s), then the host alone at 38.4.
    assert bus.finish(link) == pytest.approx(25 / 19.2)
    assert bus.finish(host) == pytest.approx(25 / 19.2 + (38.4 - 25) / 38.4)
    # Together they moved 63.4 bytes at 38.4: no sooner than the DRAM allows.
    assert bus.finish(host) >= 63.4 / 38.4 - 1e-9
    queued = bus.add("host", 38.4, 38.4, 0.5)  # behind the first in its lane: the lane runs one job at a time
    assert bus.finish(queued) == pytest.approx(bus.finish(host) + 1.0)


def test_a_job_added_later_only_pushes_finishes_back() -> None:
    bus = MemoryBus(10.0)
    first = bus.add("link", 10.0, 10.0, 0.0)
    assert bus.finish(first) == pytest.approx(1.0)
    bus.add("host", 10.0, 10.0, 0.5)  # from 0.5 both at 5
    assert bus.finish(first) == pytest.approx(1.5)
    assert bus.add("host", 1.0, 1.0, 0.2).ready_at == 0.5  # the past is settled: it starts now


def test_emulated_dram_is_the_host_gemv_or_the_link() -> None:
    assert emulated_dram(100.0, 2.0, 10.0) == 50.0
    assert emulated_dram(100.0, 200.0, 10.0) == 10.0  # a compute-bound host does not slow the link


def _brute_force_misses(seq: list[tuple[int, int]], slots: int) -> int:
    """The fewest misses over every caching decision (admit or bypass, any victim): exhaustive search."""
    best = {frozenset(): 0}
    for key in seq:
        nxt: dict[frozenset, int] = {}
        for cache, misses in best.items():
            options = [(cache, misses)] if key in cache else [(cache, misses + 1)]
            if key not in cache:
                if len(cache) < slots:
                    options.append((cache | {key}, misses + 1))
                else:
                    options += [((cache - {v}) | {key}, misses + 1) for v in cache]
            for c, m in options:
                nxt[c] = min(nxt.get(c, m), m)
        best = nxt
    return min(best.values())


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_fewest_misses_is_the_offline_optimum(slots: int) -> None:
    steps = [[[0, 1]], [[2, 0]], [[1, 3]], [[0, 2]], [[3, 1]], [[0, 1]], [[2, 3]], [[1, 0]]]
    seq = [(layer, e) for s in steps for layer, es in enumerate(s) for e in es]
    assert sum(map(sum, fewest_misses(steps, slots))) == _brute_force_misses(seq, slots)
    # Never more than the best fixed placement, which starts with its experts resident but keeps them.
    hot_from_start = sum(map(sum, static_misses(steps, slots)))
    assert sum(map(sum, fewest_misses(steps, slots))) <= hot_from_start + len(set(seq))
