"""Asks a prefetcher for guesses only while they save more time than asking costs.

With misses computed on the host, a right guess saves what the miss would have cost there (or split)
minus the device's time, and a guess costs the prefetcher's own planning time on the critical path (the
skip-gate runs later layers' routers), plus `issue_cost` per transfer it starts: compute-side work a copy
takes on this machine (none behind a GPU's copy engine; a real memcpy on the cores an emulated link
shares). On a large model the saving is milliseconds and the cost tens of microseconds; on a tiny one they
are alike, and guessing slows decode.

The gate keeps, per prefetcher, averages of that cost and of the time its guesses are expected to save:
new guesses the link can take x the prefetcher's measured precision x the saving per hit x how much of
that its guesses have really saved. That last factor is measured by the provider, which `credit`s each
guess that the device then computed (ready in time) and debits each miss on an expert a guess evicted, or
one the hot set would have held but for the slots kept free for guesses: a precise guess into a full
cache can still displace as many hits as it brings. The gate skips the prefetcher while the cost is
higher, and asks it again after `probe_every` layers so the averages follow the traffic, twice as long
after each probe that finds it still losing (up to 16x): a probe is a full plan and its copies (about
1 ms on the demo model at batch 1), and a prefetcher that loses keeps losing while the traffic holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.engine.offload.prefetch.base import Prefetcher, PrefetchRequest
from services.engine.step_context import StepContext

_WEIGHT = 0.1  # of the newest sample in the averages
_EVIDENCE = 4.0  # expected hits (decayed) before the realised share replaces the prior of 1
_MAX_BACKOFF = 16  # probes of a losing prefetcher back off to this many times probe_every


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
        self.expected: dict[int, float] = {}  # id(prefetcher) -> hits its guesses promised (decayed sum)
        self.realised: dict[int, float] = {}  # id(prefetcher) -> hits they brought, less those displaced
        self._skipped: dict[int, int] = {}
        self._interval: dict[int, int] = {}  # layers skipped before the next probe
        self.skipped_total = 0

    def plan(
        self, prefetcher: Prefetcher, layer: int, ctx: StepContext, is_new: Callable[[PrefetchRequest], bool],
        room: int,
    ) -> list[PrefetchRequest]:
        if not self.pays:
            self.skipped_total += 1
            return []
        key = id(prefetcher)
        losing = self.cost.get(key, 0.0) > self.value.get(key, float("inf"))
        if losing and self._skipped.get(key, 0) < self._interval.get(key, self.probe_every):
            self._skipped[key] = self._skipped.get(key, 0) + 1
            self.skipped_total += 1
            return []
        if losing and key in self._skipped:  # a probe: each that finds it still losing waits twice as long
            self._interval[key] = min(_MAX_BACKOFF * self.probe_every, 2 * self._interval.get(key, self.probe_every))
        else:
            self._interval[key] = self.probe_every
        self._skipped[key] = 0
        start = self.clock()
        requests = prefetcher.plan(layer, ctx)
        seconds = self.clock() - start
        issued = min(room, sum(1 for r in requests if is_new(r)))
        hits = issued * _precision(prefetcher)
        self.expected[key] = (1.0 - _WEIGHT) * self.expected.get(key, 0.0) + hits
        self.realised[key] = (1.0 - _WEIGHT) * self.realised.get(key, 0.0)
        self.cost[key] = _average(self.cost.get(key), seconds + issued * self.issue_cost)
        self.value[key] = _average(self.value.get(key), hits * self.share(prefetcher) * self.saving_per_hit)
        return requests

    @property
    def pays(self) -> bool:
        """Whether a right guess saves more than its transfer costs. If not, no guess pays, whatever the
        prefetcher's precision, and none is asked for (the emulated one-DRAM host: a copy reads the DRAM for as
        long as the host's math on the expert would, so a prefetch costs the host a miss to save one)."""
        return self.saving_per_hit > self.issue_cost

    def asking(self) -> bool:
        """Whether some prefetcher is being asked (its guesses pay), as of its last plan."""
        return self.pays and (any(cost <= self.value[key] for key, cost in self.cost.items()) or not self.cost)

    def charge_reserve(self, hits: float) -> None:
        """Debits the prefetchers being asked for `hits` the hot set lost to the slots kept free for their
        guesses (a miss on an expert the whole budget would hold), shared among them."""
        keys = [key for key, cost in self.cost.items() if cost <= self.value[key]]
        for key in keys:
            self.credit(key, -hits / len(keys))

    def credit(self, prefetcher_key: int, hits: float) -> None:
        """`hits` (negative: hits lost) a prefetcher's earlier guesses turned out to be worth."""
        self.realised[prefetcher_key] = self.realised.get(prefetcher_key, 0.0) + hits

    def share(self, prefetcher: Prefetcher) -> float:
        """The realised fraction of the hits its guesses promised, from 1 (no evidence yet) to what they
        brought once they have promised a few; never below 0."""
        key = id(prefetcher)
        expected = self.expected.get(key, 0.0)
        realised = self.realised.get(key, 0.0)
        if expected <= 0.0:
            return 1.0
        weight = min(1.0, expected / _EVIDENCE)
        return max(0.0, (1.0 - weight) + weight * realised / expected)


def _precision(prefetcher: Prefetcher) -> float:
    """How often the prefetcher's guesses were then routed to (its own tracker), 1 if it keeps none."""
    return prefetcher.tracker.precision if prefetcher.tracker is not None else 1.0


def _average(mean: float | None, sample: float) -> float:
    return sample if mean is None else (1.0 - _WEIGHT) * mean + _WEIGHT * sample
