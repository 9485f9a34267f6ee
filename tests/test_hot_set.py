"""The hot-set eviction: which experts stay in the cache, and prefetches kept out of the hot set."""

from __future__ import annotations

import random

from services.engine.step_context import Phase, StepContext


def test_hot_set_eviction_learns_the_hot_set_and_keeps_prefetches_out_of_it() -> None:
    from services.engine.offload.eviction.hot_set import HotSetEviction

    eviction = HotSetEviction(slots=3, reserve=1, half_life=4.0)
    ctx = StepContext(Phase.DECODE, ["r"], 1)

    def step(*experts: int) -> None:
        for e in experts:
            eviction.on_access((0, e), ctx)
        eviction.on_step_end(ctx)

    for i in range(12):
        step(1, 2) if i % 4 else step(1, 2, 3)
    assert eviction.hot == {(0, 1), (0, 2)}
    assert eviction.victim([(0, 1), (0, 3), (0, 2)], ctx, 0) == (0, 3)  # outside the hot set first
    assert eviction.admit((0, 5), (0, 3), ctx, 0) and not eviction.admit((0, 5), (0, 1), ctx, 0)
    # A member stays until a newcomer is clearly used more: a near tie does not swap them.
    step(1, 3)
    assert eviction.hot == {(0, 1), (0, 2)}
    # The set follows the traffic: (0, 3) takes over once (0, 2) falls out of use.
    for _ in range(40):
        step(1, 3)
    assert eviction.hot == {(0, 1), (0, 3)}


def test_hot_set_swaps_on_real_differences_in_use_not_on_noise() -> None:
    """Uniform routing: every count differs from the others by chance alone, the signal share stays near 0 and
    the set, once full, never changes (each swap is a copy). Skewed routing: the share is near 1, and the set
    follows a shift in which experts are used."""

    from services.engine.offload.eviction.hot_set import HotSetEviction

    rng = random.Random(0)
    ctx = StepContext(Phase.DECODE, ["r"], 1)

    def run(eviction: HotSetEviction, steps: int, pick, layers: int = 1) -> int:
        swaps = 0
        for _ in range(steps):
            for layer in range(layers):
                for e in pick():
                    eviction.on_access((layer, e), ctx)
            before = set(eviction.hot)
            eviction.on_step_end(ctx)
            swaps += len(eviction.hot - before) if len(before) == eviction.hot_size else 0
        return swaps

    uniform = HotSetEviction(slots=128, reserve=0, half_life=16.0)  # 8 layers of 64 experts, 16 slots a layer
    assert run(uniform, 400, lambda: rng.sample(range(64), 8), layers=8) == 0
    assert uniform.signal_share() < 0.2

    skewed = HotSetEviction(slots=4, reserve=0, half_life=16.0)
    run(skewed, 200, lambda: [0, 1, 2, 3] + rng.sample(range(4, 64), 4))
    assert skewed.hot == {(0, 0), (0, 1), (0, 2), (0, 3)} and skewed.signal_share() > 0.8
    assert run(skewed, 200, lambda: [4, 5, 6, 7] + rng.sample(range(8, 64), 4)) > 0
    assert skewed.hot == {(0, 4), (0, 5), (0, 6), (0, 7)}
