"""The prefetch gate: a prefetcher's guesses charged for what they cost and credited for what they save."""

from __future__ import annotations

import pytest

from services.engine.step_context import Phase, StepContext


def test_prefetch_gate_skips_a_prefetcher_whose_guesses_cost_more_than_they_save() -> None:
    from services.engine.offload.prefetch.base import GuessTracker, Prefetcher, PrefetchRequest
    from services.engine.offload.prefetch_gate import PrefetchGate

    now = [0.0]

    class Guesser(Prefetcher):
        def __init__(self, seconds: float, precision: float) -> None:
            self.seconds, self.tracker, self.calls = seconds, GuessTracker(precision), 0

        def plan(self, layer, ctx):
            self.calls += 1
            now[0] += self.seconds
            return [PrefetchRequest(1, 0, 1.0), PrefetchRequest(1, 1, 1.0)]

    gate = PrefetchGate(saving_per_hit=1.0, probe_every=4, clock=lambda: now[0])
    ctx = StepContext(Phase.DECODE, ["r"], 1)
    slow, useful = Guesser(seconds=3.0, precision=0.5), Guesser(seconds=0.1, precision=0.5)
    for _ in range(10):
        gate.plan(slow, 0, ctx, lambda r: True, room=2)  # costs 3, saves 2 x 0.5 x 1 = 1
        gate.plan(useful, 0, ctx, lambda r: True, room=2)  # costs 0.1, saves 1
    assert useful.calls == 10
    assert slow.calls == 2  # asked once, skipped 4 times, probed again, skipped the rest
    assert gate.skipped_total == 8
    for _ in range(20):
        gate.plan(slow, 0, ctx, lambda r: True, room=2)
    assert slow.calls == 3  # the probe that found it still losing doubled the wait: 8 skipped, then 16


def test_prefetch_gate_charges_its_prefetchers_for_the_hot_set_the_reserve_displaced() -> None:
    """Slots kept free for guesses come out of the hot set: a miss on an expert the whole budget would have
    held is debited to the prefetchers being asked, which stops one whose guesses bring fewer hits."""
    from services.engine.offload.eviction.hot_set import HotSetEviction
    from services.engine.offload.prefetch.base import GuessTracker, Prefetcher, PrefetchRequest
    from services.engine.offload.prefetch_gate import PrefetchGate

    ctx = StepContext(Phase.DECODE, ["r"], 1)
    eviction = HotSetEviction(slots=3, reserve=1)
    for key, uses in (((0, 0), 5), ((0, 1), 4), ((0, 2), 3), ((0, 3), 1)):
        for _ in range(uses):
            eviction.on_access(key, ctx)
    eviction.on_step_end(ctx)
    assert eviction.hot == {(0, 0), (0, 1)} and eviction.reserved == {(0, 2)}

    class Guesser(Prefetcher):
        tracker, calls = GuessTracker(precision=1.0), 0

        def plan(self, layer, ctx):
            self.calls += 1
            return [PrefetchRequest(1, 0, 1.0)]

    gate, guesser = PrefetchGate(saving_per_hit=1.0, issue_cost=0.1, probe_every=4), Guesser()
    calls = []
    for _ in range(60):
        if gate.plan(guesser, 0, ctx, lambda r: True, room=1):
            gate.credit(id(guesser), 1.0)  # its guess was used...
            gate.charge_reserve(2.0)  # ...and the reserve's slot cost two hits
        calls.append(guesser.calls)
    assert gate.share(guesser) == 0.0 and not gate.asking()
    assert calls[-1] - calls[29] <= 2  # asked until its average value fell below the cost, then probed only


def test_prefetch_gate_skips_precise_guesses_that_displace_as_many_hits_as_they_bring() -> None:
    from services.engine.offload.prefetch.base import GuessTracker, Prefetcher, PrefetchRequest
    from services.engine.offload.prefetch_gate import PrefetchGate

    now = [0.0]

    class Guesser(Prefetcher):
        def __init__(self) -> None:
            self.tracker, self.calls = GuessTracker(precision=1.0), 0

        def plan(self, layer, ctx):
            self.calls += 1
            now[0] += 0.5
            return [PrefetchRequest(1, 0, 1.0), PrefetchRequest(1, 1, 1.0)]

    gate = PrefetchGate(saving_per_hit=1.0, probe_every=4, clock=lambda: now[0])
    ctx = StepContext(Phase.DECODE, ["r"], 1)
    displacing, useful = Guesser(), Guesser()
    for _ in range(40):
        for guesser, net_hits in ((displacing, 0.0), (useful, 2.0)):
            if gate.plan(guesser, 0, ctx, lambda r: True, room=2):
                gate.credit(id(guesser), 2.0)  # both guesses used on the device...
                gate.credit(id(guesser), net_hits - 2.0)  # ...less the hits their evictions cost
    assert useful.calls == 40 and gate.share(useful) == pytest.approx(1.0)
    assert gate.share(displacing) < 0.1 and displacing.calls < 15  # promised 2 hits a plan, brought none
