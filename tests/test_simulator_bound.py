"""The physical bound (simulator/bound.py): the link's copies spread over the run, the host's work inside its layer."""

from __future__ import annotations

import pytest

from services.simulator.bound import Side, Visits, physical_bound

LINK, HOST, DRAM = Side(1 / 25, 1e9), Side(1 / 38.4, 1e9), 38.4e9  # 1 GB experts; the host alone fills the DRAM


def _visits(count: int, fixed: float, experts: float, misses: int) -> Visits:
    visits = Visits([], [], [], [])
    for _ in range(count):
        visits.add(fixed, experts, experts / 2, misses)
    return visits


def test_transfer_only_hides_what_the_device_time_covers_and_waits_for_the_rest() -> None:
    # 10 misses; 0.1 s of device time carries 2.5 of them over the link, the other 7.5 take 0.04 s each.
    b = physical_bound(_visits(10, 0.0, 0.01, 1), 10, LINK, None, DRAM, 60e-6)
    assert b.seconds == pytest.approx(0.1 + 7.5 / 25, rel=1e-6)
    assert b.device_seconds == pytest.approx(0.1) and b.miss_layers == 10 and b.tpot_ms == pytest.approx(40.0)
    assert physical_bound(_visits(10, 0.0, 0.5, 1), 10, LINK, None, DRAM, 60e-6).seconds == pytest.approx(5.0)


def test_host_work_stays_inside_its_layer() -> None:
    """A long layer without misses, then a short one with six: the run-wide bound let the host's work overlap
    the long layer (max(0.101, 6 / 38.4) s); confined to its layer, only the link's copies can (2.5 misses),
    and the host computes the other 3.5 after it."""
    sync = 60e-6
    visits = Visits([], [], [], [])
    visits.add(0.099, 0.001, 0.0005, 0)
    visits.add(0.0, 0.001, 0.0005, 6)
    b = physical_bound(visits, 1, LINK, HOST, DRAM, sync).seconds
    run_wide = max(0.101, 6 / 38.4) + sync
    plan = 0.1 + 0.001 + 3.5 / 38.4 + sync  # a feasible schedule: the bound is no slower
    assert run_wide + 0.03 < b <= plan + 1e-9
    assert b == pytest.approx(plan, rel=0.02)


def test_long_layers_hide_the_misses() -> None:
    # 70 ms layers with one miss each: the link carries 1.75 misses a layer, so no miss waits; the host only
    # takes the share of the missed expert (a split) that evens its time with the device's rest of it.
    b = physical_bound(_visits(10, 0.06, 0.01, 1), 10, LINK, HOST, DRAM, 60e-6)
    share = 0.01 / (0.005 + HOST.seconds)
    assert b.seconds == pytest.approx(10 * (0.06 + share * HOST.seconds + 60e-6), rel=1e-6)
    assert physical_bound(_visits(10, 0.06, 0.01, 1), 10, LINK, None, DRAM, 60e-6).seconds == pytest.approx(0.7)
