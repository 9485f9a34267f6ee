"""Asks a prefetcher for guesses only while they save more time than asking costs.

With misses computed on the host, a right guess saves what the miss would have cost there (or split)
minus the device's time, and a guess costs the prefetcher's own planning time on the critical path (the
skip-gate runs later layers' routers), plus `issue_cost` per transfer it starts: compute-side work a copy
takes on this machine (none behind a GPU's copy engine; a real memcpy on the cores an emulated link
shares). On a large model the saving is milliseconds and the cost tens of microseconds; on a tiny one they
are alike, and guessing slows decode. The gate keeps, per prefetcher, averages of that cost and of the time
its guesses are expected to save (new guesses the link can take x the prefetcher's measured precision x the
saving per hit), skips it while the cost is higher, and asks it again every `probe_every` layers so the
averages follow the traffic.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.engine.offload.prefetch.base import Prefetcher, PrefetchRequest
from services.engine.step_context import StepContext

_WEIGHT = 0.1  # of the newest sample in the averages


class PrefetchGate:
    def __init__(
        self, saving_per_hit: float, issue_cost: float = 0.0, probe_every: int = 64,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.saving_per_hit = saving_per_hit
        self.issue_cost = issue_cost
        self.clock = clock
        self.probe_every = probe_every
        self.cost: dict[int, float] = {}  # id(prefetcher) -> seconds per plan
        self.value: dict[int, float] = {}  # id(prefetcher) -> seconds saved per plan, expected
        self._skipped: dict[int, int] = {}
        self.skipped_total = 0

    def plan(
        self, prefetcher: Prefetcher, layer: int, ctx: StepContext, is_new: Callable[[PrefetchRequest], bool],
        room: int,
    ) -> list[PrefetchRequest]:
        key = id(prefetcher)
        if self.cost.get(key, 0.0) > self.value.get(key, float("inf")) and self._skipped.get(key, 0) < self.probe_every:
            self._skipped[key] = self._skipped.get(key, 0) + 1
            self.skipped_total += 1
            return []
        self._skipped[key] = 0
        start = self.clock()
        requests = prefetcher.plan(layer, ctx)
        seconds = self.clock() - start
        issued = min(room, sum(1 for r in requests if is_new(r)))
        self.cost[key] = _average(self.cost.get(key), seconds + issued * self.issue_cost)
        self.value[key] = _average(self.value.get(key), issued * _precision(prefetcher) * self.saving_per_hit)
        return requests


def _precision(prefetcher: Prefetcher) -> float:
    """How often the prefetcher's guesses were then routed to (its own tracker), 1 if it keeps none."""
    tracker = getattr(prefetcher, "tracker", None) or getattr(prefetcher, "calibration", None)
    return tracker.precision if tracker is not None else 1.0


def _average(mean: float | None, sample: float) -> float:
    return sample if mean is None else (1.0 - _WEIGHT) * mean + _WEIGHT * sample
