"""Cost placement: which experts the host computes, which the link fetches, and which split between them."""

from __future__ import annotations

import math
import random

import pytest

from services.engine.offload.cost_model import DEFAULT_HOST_RATIO, PlacementCosts
from services.engine.offload.placement import CostPlacement
from services.engine.step_context import Phase, StepContext


def test_cost_placement_balances_host_and_link() -> None:
    costs = PlacementCosts(device_first=1.0, device_per_token=0.0, host_first=10.0, host_per_token=10.0, link=12.0)
    decode = StepContext(Phase.DECODE, ["r"], 1)
    placement = CostPlacement(costs, stream_prefill=False)
    # One token each: host 10 < link 12 + device 1, then the host is busy: 20 > 13, so the second is fetched.
    assert placement.place([3, 5], {3: 1, 5: 1}, decode, 0.0) == ([5], [3], [])
    # Many tokens: the host takes 10 per token, fetching wins.
    assert placement.place([3], {3: 8}, decode, 0.0) == ([3], [], [])
    # A backlog on the host moves the miss to the link.
    assert placement.place([3], {3: 1}, decode, 5.0) == ([3], [], [])
    prefill = StepContext(Phase.PREFILL, ["r"], 8)
    assert CostPlacement(costs, stream_prefill=True).place([3], {3: 1}, prefill, 0.0) == ([3], [], [])


def test_default_host_ratio_is_the_a5000_ddr4_arithmetic() -> None:
    from services.simulator.hardware import RooflineCost, get_hardware
    from services.simulator.host import get_host
    from services.simulator.model_specs import MODEL_SPECS

    cost = RooflineCost(MODEL_SPECS["mixtral-8x7b"], get_hardware("a5000-pcie4"), get_host("ddr4-dual"))
    assert cost.host_expert_seconds(1) / cost.expert_seconds(1) == pytest.approx(DEFAULT_HOST_RATIO, abs=0.05)


def test_cost_placement_weighs_a_transfer_by_what_is_left_of_it() -> None:
    costs = PlacementCosts(device_first=1.0, device_per_token=0.0, host_first=10.0, host_per_token=10.0, link=12.0)
    decode = StepContext(Phase.DECODE, ["r"], 1)
    placement = CostPlacement(costs, stream_prefill=False)
    # Nearly landed: waiting (2 + 1) beats the host (10); barely started: the host (10) beats 11 + 1.
    assert placement.place([3], {3: 1}, decode, 0.0, landing={3: 2.0}) == ([3], [], [])
    assert placement.place([3], {3: 1}, decode, 0.0, landing={3: 11.0}) == ([], [3], [])
    # An expert already on the link adds nothing to the link's queue: the next miss is not delayed by it.
    assert placement.place([3, 5], {3: 1, 5: 1}, decode, 9.0, landing={3: 2.0}) == ([3, 5], [], [])


def test_cost_placement_splits_an_expert_when_both_sides_are_close() -> None:
    from services.engine.offload.placement import SplitPrices

    costs = PlacementCosts(device_first=1.0, device_per_token=0.0, host_first=9.0, host_per_token=9.0, link=14.0)
    decode = StepContext(Phase.DECODE, ["r"], 1)
    third = SplitPrices(host=2 / 3, link=1 / 3, device=1 / 3)
    placement = CostPlacement(costs, stream_prefill=False, split=third)
    # Split: max(6, 4.67) + 0.33 beats the host's 9 and the link's 15; the second split queues behind it.
    assert placement.place([3], {3: 1}, decode, 0.0, split_room=2) == ([], [], [3])
    assert placement.place([3, 5], {3: 1, 5: 1}, decode, 0.0, split_room=2) == ([], [], [3, 5])
    # No more splits than the staging has room for: the next expert goes to whichever side is sooner
    # behind the split (the host, 6 + 9 = 15, against the link's 4.67 + 14 + 1).
    assert placement.place([3, 5], {3: 1, 5: 1}, decode, 0.0, split_room=1) == ([], [5], [3])
    assert placement.place([3], {3: 1}, decode, 0.0) == ([], [3], [])  # no staging: no split
    # An expert already on the link is waited for, never split; without split prices nothing splits.
    assert placement.place([3], {3: 1}, decode, 0.0, landing={3: 1.0}, split_room=2) == ([3], [], [])
    assert CostPlacement(costs, stream_prefill=False).place([3], {3: 1}, decode, 0.0, split_room=2) == ([], [3], [])


def test_only_dense_experts_split() -> None:
    from services.engine.expert_format import ExpertLayout
    from services.engine.offload.split_experts import layout_split_prices, split_prices

    assert layout_split_prices(ExpertLayout(4, 8)) == (2 / 3, 1 / 3, 1 / 3)
    assert split_prices((200, 100), dense=False) is None


def test_cost_placement_decides_as_its_projections_do_without_most_of_them(monkeypatch) -> None:
    """A miss whose host finish at worst beats the other sides at best skips the bus projections: the same
    placements as projecting every miss, over random prices on one DRAM (and none), backlogs and landings."""
    from services.engine.offload.placement import SplitPrices

    rng = random.Random(5)
    decode = StepContext(Phase.DECODE, ["r"], 1)
    projected = {"fast": 0, "every miss": 0}
    for case in range(400):
        dram = rng.choice([math.inf, rng.uniform(0.5, 3.0)])
        costs = PlacementCosts(device_first=rng.uniform(0.1, 2), device_per_token=rng.uniform(0, 0.5),
                               host_first=rng.uniform(1, 20), host_per_token=rng.uniform(0, 10),
                               link=rng.uniform(1, 40), dram=dram, host_bytes=1.0, link_bytes=1.0)
        split = SplitPrices(2 / 3, 1 / 3, 1 / 3) if case % 2 else None
        misses = rng.sample(range(16), rng.randint(1, 8))
        tokens = {e: rng.randint(1, 6) for e in misses}
        landing = {e: rng.uniform(0, 30) for e in misses if rng.random() < 0.2}
        args = (misses, tokens, decode, rng.uniform(0, 30), rng.uniform(0, 30), landing, rng.randint(0, 3))
        placement = CostPlacement(costs, stream_prefill=False, split=split)
        calls: list[int] = []
        monkeypatch.setattr(placement, "_finish", lambda h, lk, f=placement._finish, c=calls: c.append(1) or f(h, lk))
        fast = placement.place(*args)
        projected["fast"] += len(calls)
        calls.clear()
        monkeypatch.setattr(placement, "_worst", lambda job: math.inf)  # no miss settled by the bounds
        assert placement.place(*args) == fast, case
        projected["every miss"] += len(calls)
    assert projected["fast"] < 0.8 * projected["every miss"], projected
