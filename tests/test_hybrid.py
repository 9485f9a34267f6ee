"""Hybrid expert execution: host-computed misses, placements, static pinned sets, knobs, counters."""

from __future__ import annotations

import math
import random

import pytest
import torch

from services import cli
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.offload.cost_model import DEFAULT_HOST_RATIO, PlacementCosts
from services.engine.offload.placement import CostPlacement
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.sampling_params import SamplingParams
from services.engine.step_context import Phase, StepContext
from tests.tiny_models import VOCAB

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
HYBRID = ("cpu-experts", "n-cpu-moe", "ktransformers", "fiddler", "hintserve")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 17)]


@pytest.fixture(scope="module")
def reference(tiny_mixtral_dir, tmp_path_factory):
    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir))
    trace = RoutingTrace(engine.spec.num_layers)
    engine.runner.step_observers.append(trace)
    expected = engine.generate(_prompts(), GREEDY)
    engine.close()
    path = str(tmp_path_factory.mktemp("trace") / "trace.json")
    trace.save(path)
    return tiny_mixtral_dir, expected, path


@pytest.fixture
def separate_memories(monkeypatch):
    """The emulated host and link each with a memory of its own: on one DRAM, which the host's GEMV alone fills,
    a split never beats the host (memory_bus.py), and the split mechanics would go untested."""
    from services.engine.offload import memory_bus

    monkeypatch.setattr(memory_bus, "EMULATED_DRAM_OVER_HOST", float("inf"))


@pytest.fixture
def splits_despite_the_budget(monkeypatch):
    """Staging whenever some decode miss would split, whatever the cache slots it takes are worth: the tiny
    model's budgets are a handful of slots, each worth more than its splits (split_experts.split_pays), and the
    split mechanics would go untested."""
    from services.engine.offload import hybrid_setup

    pays = hybrid_setup.split_pays
    monkeypatch.setattr(hybrid_setup, "split_pays", lambda *args: pays(*args[:5]))


def _run(reference, policy: str, **kw):
    model_dir, expected, trace = reference
    engine = LLMEngine(EngineConfig(model=model_dir, offload_policy=policy, routing_trace=trace, **kw))
    try:
        tokens = engine.generate(_prompts(), GREEDY)
        return tokens, expected, engine.model.experts, engine.stats()
    finally:
        engine.close()


@pytest.mark.parametrize("policy", HYBRID)
@pytest.mark.parametrize("threads", [1, 2])
def test_host_computed_experts_keep_tokens(reference, policy: str, threads: int) -> None:
    # A slow link: Fiddler's rule sends misses to the host.
    tokens, expected, provider, stats = _run(reference, policy, expert_cache_fraction=0.25, link_ratio=100.0,
                                             host_ratio=4.0, host_threads=threads)
    assert tokens == expected
    assert provider.stats.host_experts > 0
    assert stats["offload_host_compute_experts_total"] == provider.stats.host_experts
    assert stats["offload_host_compute_tokens_total"] >= provider.stats.host_experts
    assert stats["offload_host_compute_busy_seconds_total"] > 0


def test_cpu_experts_moves_nothing_and_holds_no_expert_on_the_device(reference) -> None:
    tokens, expected, provider, stats = _run(reference, "cpu-experts", host_ratio=2.0)
    assert tokens == expected
    assert provider.device_bytes == 0
    assert provider.stats.bytes_demand == provider.stats.bytes_prefetch == 0
    assert provider.stats.host_experts == provider.stats.accesses


def test_static_placements_pin_their_sets(reference) -> None:
    _, _, trace = reference
    _, _, provider, _ = _run(reference, "ktransformers", expert_cache_fraction=0.5)
    hot = RoutingTrace.load(trace).hot_set(provider.cache.num_slots)
    assert provider.pinned == hot and provider.stats.bytes_demand == 0
    _, _, provider, _ = _run(reference, "n-cpu-moe", expert_cache_fraction=0.5)
    layers = sorted({layer for layer, _ in provider.pinned})
    num_layers = provider.stats.num_layers  # every layer of the tiny Mixtral is MoE
    assert layers == list(range(num_layers - len(layers), num_layers))  # whole layers, from the last back
    assert len(provider.pinned) == len(layers) * len(provider.pinned) // len(layers)
    assert provider.stats.bytes_demand == 0


@pytest.mark.parametrize("policy", ["ktransformers", "fiddler", "hintserve"])
def test_a_budget_for_every_expert_holds_them_all_and_computes_as_resident(reference, policy: str) -> None:
    """A static hot set takes the experts its trace never saw too while the budget lasts, the cache fills
    whole when built, and nothing runs on the host or the link (test_offload_cached_batch: the resident view)."""
    tokens, expected, provider, _ = _run(reference, policy, expert_cache_fraction=1.0, link_ratio=30.0)
    assert tokens == expected
    experts = {(layer, e) for layer in range(provider.stats.num_layers) for e in range(len(provider._matrix_of))}
    assert {slot.key for slot in provider.cache.slots} == experts
    assert provider.resident.holding == (provider.cache.native is not None)  # the tiny widths are not native
    assert provider.stats.host_experts == 0 and provider.stats.bytes_demand == provider.stats.bytes_prefetch == 0
    assert sum(provider.stats.misses) == 0 and sum(provider.stats.hits) > 0


def test_fiddler_rule_fetches_when_the_host_is_slow(reference) -> None:
    tokens, expected, provider, _ = _run(reference, "fiddler", expert_cache_fraction=0.25, link_ratio=2.0,
                                         host_ratio=1000.0)
    assert tokens == expected
    assert provider.stats.host_experts == 0 and provider.stats.bytes_demand > 0


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


@pytest.mark.parametrize(
    "args, message",
    [(["--host-ratio", "0"], "host_ratio must be positive"), (["--host-ratio", "-2"], "host_ratio must be positive"),
     (["--host-threads", "0"], "host_threads must be at least 1")],
)
def test_bad_host_knobs_exit_2(tiny_mixtral_dir, capsys, args, message) -> None:
    argv = ["generate", "--prompt", "hi", "--model", tiny_mixtral_dir, "--offload-policy", "fiddler", *args]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize("policy", ["cpu-experts", "n-cpu-moe"])
def test_host_executor_computes_quantized_experts(tiny_mixtral_dir, policy: str) -> None:
    # expert_forward is the one entry point: int8 experts compute on the host exactly as on the device.
    resident = LLMEngine(EngineConfig(model=tiny_mixtral_dir, expert_dtype="int8"))
    expected = resident.generate(_prompts(), GREEDY)
    resident.close()
    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir, expert_dtype="int8", offload_policy=policy,
                                    link_ratio=100.0, host_ratio=2.0))
    try:
        assert engine.generate(_prompts(), GREEDY) == expected
        assert engine.model.experts.stats.host_experts > 0
    finally:
        engine.close()


def test_cost_placement_weighs_a_transfer_by_what_is_left_of_it() -> None:
    costs = PlacementCosts(device_first=1.0, device_per_token=0.0, host_first=10.0, host_per_token=10.0, link=12.0)
    decode = StepContext(Phase.DECODE, ["r"], 1)
    placement = CostPlacement(costs, stream_prefill=False)
    # Nearly landed: waiting (2 + 1) beats the host (10); barely started: the host (10) beats 11 + 1.
    assert placement.place([3], {3: 1}, decode, 0.0, landing={3: 2.0}) == ([3], [], [])
    assert placement.place([3], {3: 1}, decode, 0.0, landing={3: 11.0}) == ([], [3], [])
    # An expert already on the link adds nothing to the link's queue: the next miss is not delayed by it.
    assert placement.place([3, 5], {3: 1, 5: 1}, decode, 9.0, landing={3: 2.0}) == ([3, 5], [], [])


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
    import random

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


def test_hintserve_keeps_its_prefetches_within_the_link_slack(reference) -> None:
    from services.engine.offload.hybrid_provider import HybridExpertProvider

    model_dir, expected, trace = reference
    engine = LLMEngine(EngineConfig(model=model_dir, offload_policy="hintserve", routing_trace=trace,
                                    expert_cache_fraction=0.5, link_ratio=100.0, host_ratio=4.0))
    provider = engine.model.experts
    assert isinstance(provider, HybridExpertProvider) and provider.prefetch_depth > 0
    on_link: list[int] = []
    issue = provider._issue_prefetches

    def counted(requests, ctx, limit=None):
        issue(requests, ctx, limit)
        on_link.append(sum(1 for t, _ in provider._prefetches if not t.event.is_ready()))

    provider._issue_prefetches = counted
    try:
        assert engine.generate(_prompts(), GREEDY) == expected
    finally:
        engine.close()
    assert on_link and max(on_link) <= provider.prefetch_depth
    assert provider.stats.prefetches_issued > 0 and provider.stats.host_experts > 0


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


@pytest.mark.usefixtures("separate_memories", "splits_despite_the_budget")
def test_split_experts_keep_tokens_and_free_their_staging(reference) -> None:
    # Host and link close in price: hintserve splits misses (gate/up on the host, down over the link).
    tokens, expected, provider, stats = _run(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=30.0,
                                             host_ratio=20.0)
    assert tokens == expected
    assert provider.stats.host_split_experts > 0
    assert stats["offload_host_compute_split_experts_total"] == provider.stats.host_split_experts
    assert len(provider.staging._free) == len(provider.staging.buffers)  # every staging buffer back


def test_a_splitting_policy_pays_for_its_staging_out_of_the_cache_budget() -> None:
    from services.engine.offload.hybrid_setup import hybrid_slots
    from services.engine.offload.policies import get_policy
    from services.engine.offload.split_experts import split_prices

    third = split_prices((200, 100), dense=True)
    # Eight down matrices of a third of an expert each: three slots' worth.
    assert hybrid_slots(get_policy("hintserve"), 55, [], third, staging=8) == 52
    assert hybrid_slots(get_policy("fiddler"), 55, [], third, staging=8) == 55
    assert hybrid_slots(get_policy("hintserve"), 55, [], None, staging=8) == 55  # packed: no split


def test_split_staging_fills_the_slots_it_costs() -> None:
    from services.engine.offload.split_experts import split_prices, staging_buffers, staging_slots

    third = split_prices((200, 100), dense=True)
    # Top-2 down matrices cost a whole slot, which holds three: the third is free, and a batch uses it.
    assert staging_buffers(2, third) == 3 and staging_slots(3, third) == 1
    assert staging_buffers(8, third) == 9 and staging_slots(9, third) == 3
    assert staging_buffers(2, None) == 0


def test_no_staging_where_no_decode_miss_would_split() -> None:
    """The staging costs a cache slot: the placement must split some decode step's miss. At a 30x link (this
    machine's unit, 15.6x host) a one-token miss splits; at 100x the down matrix alone outlasts two whole
    experts on the host, so batch 1 (two misses a layer at most) never splits, while batch 4 piles enough on
    the host that its third miss does."""
    from services.engine.offload.split_experts import split_pays, split_prices

    third = split_prices((200, 100), dense=True)
    unit, per_token = 52e-6, 5.7e-6
    costs = lambda link: PlacementCosts(unit, per_token, 15.6 * unit, 15.6 * per_token, link * unit)  # noqa: E731
    assert split_pays(third, costs(30), max_tokens=1, top_k=2, num_experts=8)
    assert not split_pays(third, costs(100), max_tokens=1, top_k=2, num_experts=8)
    assert split_pays(third, costs(100), max_tokens=4, top_k=2, num_experts=8)
    assert not split_pays(None, costs(30), max_tokens=16, top_k=2, num_experts=8)  # a packed expert never splits


def test_a_split_is_staged_only_where_it_saves_more_than_the_slots_it_takes() -> None:
    """The staging's slot against the splits: on one DRAM that the host's math fills alone (the emulated host) a
    split gains little, and a small cache's slot is worth more holding an expert; with memories of their own
    the splits win, until the budget holds every expert and nothing misses."""
    from services.engine.offload.split_experts import split_pays, split_prices

    third = split_prices((200, 100), dense=True)
    unit, per_token, size = 52e-6, 5.7e-6, 786432.0

    def costs(dram: float) -> PlacementCosts:  # host 15.6x, link 30x the device, as the emulated grid prices them
        return PlacementCosts(unit, per_token, 15.6 * unit, 15.6 * per_token, 30 * unit, dram=dram,
                              host_bytes=size, link_bytes=size)

    one_dram = costs(size / (15.6 * unit))
    for batch in (4, 16):
        assert split_pays(third, one_dram, batch, 2, 8)  # some miss would split...
        for slots in (4, 12, 24):  # ...but not enough to pay for a slot of 10-50% of 48 experts
            assert not split_pays(third, one_dram, batch, 2, 8, moe_layers=6, slots=slots)
    for slots in (4, 12, 47):  # a one-token miss splits on memories of their own, and saves more than a slot
        assert split_pays(third, costs(float("inf")), 1, 2, 8, moe_layers=6, slots=slots)
    for slots in (48, 60):  # a budget for every expert never misses: nothing to split, however cheap
        assert not split_pays(third, costs(float("inf")), 1, 2, 8, moe_layers=6, slots=slots)


@pytest.mark.usefixtures("separate_memories")
def test_hintserve_at_a_slow_link_keeps_its_whole_budget_for_experts(reference) -> None:
    # Batch 1 (max_num_seqs 1) at ratio 100: no split would pay, so no slot goes to staging.
    tokens, expected, provider, _ = _run(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=100.0,
                                         max_num_seqs=1)
    assert tokens == expected
    assert provider.staging is None and provider.stats.host_split_experts == 0
    fast_tokens, _, fast, _ = _run(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=30.0,
                                   max_num_seqs=1)
    assert fast_tokens == expected
    assert fast.staging is not None and len(provider.cache.slots) == len(fast.cache.slots) + 1


def test_on_one_dram_hintserve_splits_nothing(reference) -> None:
    """The emulated host's GEMV takes all the DRAM the link's copies read: a split expert's halves share it and
    finish no sooner than the host alone, so no slot goes to staging (the link ratio that splits on separate
    memories, above)."""
    tokens, expected, provider, _ = _run(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=30.0,
                                         max_num_seqs=1)
    assert tokens == expected and provider.staging is None and provider.stats.host_split_experts == 0
    assert provider.costs.dram < float("inf") and provider.executor.bus is provider.transfers.link.bus


@pytest.mark.usefixtures("separate_memories", "splits_despite_the_budget")
@pytest.mark.parametrize("budget", [2, 3])
def test_hintserve_on_a_cache_its_layer_pins_whole_keeps_tokens(reference, budget: int) -> None:
    # Where it stages at all, the staging takes its share of the smallest budgets (top-k slots) first.
    tokens, expected, provider, _ = _run(reference, "hintserve", expert_cache_experts=budget, link_ratio=30.0,
                                         host_ratio=20.0)
    assert tokens == expected
    assert provider.cache.num_slots == budget - 1


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


def test_hintserve_credits_its_prefetchers_with_what_their_guesses_did(reference) -> None:
    model_dir, expected, trace = reference
    # A slow host: each hit saves far more than the skip-gate's planning costs, so the gate keeps asking.
    engine = LLMEngine(EngineConfig(model=model_dir, offload_policy="hintserve", routing_trace=trace,
                                    expert_cache_fraction=0.5, link_ratio=30.0, host_ratio=200.0))
    provider = engine.model.experts
    credits: list[float] = []
    credit = provider.gate.credit
    provider.gate.credit = lambda issuer, hits: (credits.append(hits), credit(issuer, hits))
    try:
        assert engine.generate(_prompts(), GREEDY) == expected
    finally:
        engine.close()
    used = provider.stats.prefetches_used
    assert credits and 0 < sum(c for c in credits if c > 0) <= used  # only guesses the device computed
    assert sum(1 for c in credits if c < 0) <= provider.stats.evictions  # a debit needs an eviction


def test_host_executor_leaves_the_compute_threads_as_they_were(monkeypatch) -> None:
    """torch.set_num_threads is process-wide (MKL's count among others): a worker that set its own to one
    left the engine's decode attention taking milliseconds per op, so the executor never calls it."""
    from services.engine.expert_provider import ExpertWeights
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    executor = HostExecutor(2, OffloadStats(1))
    weights = ExpertWeights(torch.randn(16, 4), torch.randn(4, 8))
    for _ in range(4):
        executor.submit(weights, torch.randn(3, 4)).result()
    executor.shutdown()
    assert calls == []


def test_host_executor_hands_a_layer_over_at_once_and_returns_every_result_or_error() -> None:
    """The layer's jobs go to the workers in one hand-off per worker; each result (or the error its math raised)
    comes back to the gathering thread, in whatever order it gathers them, and shutdown ends the workers."""
    from services.engine.expert_provider import ExpertWeights
    from services.engine.models.moe import expert_forward
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    executor = HostExecutor(2, OffloadStats(1))
    weights = ExpertWeights(torch.randn(16, 4), torch.randn(4, 8))
    broken = ExpertWeights(torch.randn(16, 5), torch.randn(4, 8))  # the wrong width: its math raises
    for _ in range(3):
        xs = [torch.randn(n, 4) for n in (1, 2, 3, 4, 5)]
        jobs = [executor.submit(weights, x) for x in xs]
        failing = executor.submit(broken, torch.randn(1, 4))
        executor.flush()
        for x, job in reversed(list(zip(xs, jobs))):
            assert torch.allclose(job.result(), expert_forward(x, weights), atol=1e-5)
        with pytest.raises(RuntimeError):
            failing.result()
    executor.shutdown()
    assert not any(worker.is_alive() for worker in executor._workers)


def test_a_layer_all_on_the_host_runs_on_the_gathering_thread(monkeypatch) -> None:
    """With nothing else to do, the gathering thread runs the layer's host jobs itself: no worker is woken
    (wake=False), while a layer with device work hands its jobs to the workers to overlap them."""
    import threading

    from services.engine.expert_provider import ExpertWeights
    from services.engine.offload import host_executor
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    ran_on: list[str] = []
    ran = threading.Event()
    real = host_executor.expert_forward

    def recorded(x, w, *rest):
        ran_on.append(threading.current_thread().name)
        ran.set()
        return real(x, w, *rest)

    monkeypatch.setattr(host_executor, "expert_forward", recorded)
    executor = HostExecutor(1, OffloadStats(1))
    weights = ExpertWeights(torch.randn(16, 4), torch.randn(4, 8))
    try:
        jobs = [executor.submit(weights, torch.randn(2, 4)) for _ in range(3)]
        executor.flush(wake=False)
        for job in jobs:
            job.result()
        assert ran_on == [threading.current_thread().name] * 3
        ran_on.clear()
        ran.clear()
        job = executor.submit(weights, torch.randn(2, 4))
        executor.flush()
        assert ran.wait(timeout=30)  # the woken worker runs it (the gatherer would only once it asks)
        job.result()
        assert ran_on == ["hintserve-host-0"]
    finally:
        executor.shutdown()


def test_the_host_path_is_measured_all_on_the_host_and_beside_device_experts() -> None:
    from services.engine.offload.host_path import measure_host_path

    path = measure_host_path(1, repeats=20)
    assert path["host_path_s"] >= 0 and path["mixed_path_s"] >= 0
    assert path["host_layer_s"] > 0 and path["mixed_layer_s"] > 0 and path["device_layer_s"] > 0


@pytest.mark.parametrize("mixed", [False, True], ids=["all-on-host", "beside-device-experts"])
def test_host_experts_the_gathering_thread_runs_go_into_the_layer_output_in_place(monkeypatch, mixed: bool) -> None:
    """With every expert on the host no worker is woken: the gathering thread runs each job through its sink,
    the layer's own native call, and never into rows of its own; the output is the device path's."""
    from services.engine import cpu_kernels
    from services.engine.cpu_threads import intra_op_threads
    from services.engine.expert_provider import ExpertWeights
    from services.engine.models.moe import moe_forward
    from services.engine.models.router import Routing
    from services.engine.offload import host_path
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    if cpu_kernels.library() is None:
        pytest.skip("no C compiler: no native call to add in place")
    gen = torch.Generator().manual_seed(0)
    width = host_path.WIDTH
    weights = [ExpertWeights(torch.randn(2 * width, width, generator=gen), torch.randn(width, width, generator=gen))
               for _ in range(host_path.EXPERTS)]
    x = torch.randn(5, width, generator=gen)
    probs = torch.softmax(torch.randn(5, host_path.EXPERTS, generator=gen), dim=-1)
    routing = Routing(*probs.topk(host_path.TOP_K, dim=-1), probs)
    ctx = StepContext(phase=Phase.DECODE, request_ids=["r"], num_tokens=5)
    general = []
    run = HostExecutor._run
    monkeypatch.setattr(HostExecutor, "_run", lambda self, *args: general.append(1) or run(self, *args))
    executor = HostExecutor(1, OffloadStats(1))
    try:
        outputs = []
        for on_host in (executor, None):
            provider = host_path._TinyProvider(on_host, mixed=mixed)
            provider.weights = weights
            with torch.no_grad(), intra_op_threads(1):  # the kernels run on one torch thread
                outputs.append(moe_forward(x, 0, routing, provider, ctx))
    finally:
        executor.shutdown()
    torch.testing.assert_close(outputs[0], outputs[1])
    if not mixed:
        assert general == []  # every job in place


def test_a_one_token_layer_hands_its_host_experts_the_token_itself() -> None:
    """Batch-1 decode: every routed expert's one row is x, handed over as it is (no gather copy per expert)."""
    from services.engine.models.moe import moe_forward
    from services.engine.models.router import Routing
    from services.engine.offload import host_path
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    handed: list[torch.Tensor] = []

    class Recording(host_path._TinyProvider):
        def host_forward(self, layer, expert, x, sink=None):
            handed.append(x)
            return super().host_forward(layer, expert, x, sink)

    executor = HostExecutor(1, OffloadStats(1))
    try:
        for tokens in (1, 3):
            handed.clear()
            x = torch.randn(tokens, host_path.WIDTH)
            probs = torch.softmax(torch.randn(tokens, host_path.EXPERTS), dim=-1)
            routing = Routing(*probs.topk(host_path.TOP_K, dim=-1), probs)
            ctx = StepContext(phase=Phase.DECODE, request_ids=["r"], num_tokens=tokens)
            moe_forward(x, 0, routing, Recording(executor), ctx)
            assert handed and all((rows is x) == (tokens == 1) for rows in handed)
    finally:
        executor.shutdown()


def test_emulated_host_jobs_end_at_their_finish_on_one_virtual_clock() -> None:
    """A job is ready when the emulated host would have finished it, queued behind the jobs before it, and
    the thread gathering it gets it then, not a worker's wake-up later."""
    import time

    from services.engine.expert_provider import ExpertWeights
    from services.engine.models.moe import expert_forward
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    executor = HostExecutor(2, OffloadStats(1), emulated_seconds=lambda tokens: 0.004)
    weights = ExpertWeights(torch.randn(32, 16), torch.randn(16, 16))
    x = torch.randn(3, 16)
    # First, so the expert's code path is warm: its first call in a process (kernels loaded, torch's lazy
    # set-up) took 3-6 ms on a Xeon guest, longer than the emulated 4 ms, and the job ended late.
    reference = expert_forward(x, weights)
    try:
        start = time.perf_counter()
        first, second = executor.submit(weights, x), executor.submit(weights, x, activation=True, share=0.5)
        first_result = first.result()
        first_done = time.perf_counter()
        second.result()
        second_done = time.perf_counter()
    finally:
        executor.shutdown()
    assert torch.allclose(first_result, reference, atol=1e-5)
    # Late by at most 10 ms: a KVM guest's sleeps ended 1-2 ms late now and then (seen on a Xeon guest), and
    # 3.5 ms once on a Zen 4 guest while the other test worker ran mypy (2 of 21 runs there)
    assert first.ready_at <= first_done < first.ready_at + 10e-3
    assert second.ready_at == pytest.approx(first.ready_at + 0.002)  # queued behind the first, half its time
    assert second.ready_at <= second_done < second.ready_at + 10e-3
    assert 0.004 <= first.ready_at - start < 0.005


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="timer slack is Linux's")
def test_emulated_holds_sleep_without_timer_slack() -> None:
    """An emulated host job or transfer ends on the thread that waits for it, which sleeps most of the way:
    Linux ends a sleep up to 50 us late by default, so that thread's slack becomes 1 ns."""
    import ctypes
    import threading
    import time

    from services.engine.offload.link import hold_until

    prctl = ctypes.CDLL(None).prctl
    seen: list[int] = []

    def hold() -> None:
        prctl(29, 50_000, 0, 0, 0)  # PR_SET_TIMERSLACK: Linux's default, whatever this thread inherited
        hold_until(time.perf_counter() + 0.002)
        seen.append(prctl(30, 0, 0, 0, 0))  # PR_GET_TIMERSLACK, in ns

    holder = threading.Thread(target=hold)
    holder.start()
    holder.join()
    assert seen == [1]


def test_host_work_starts_before_the_layers_prefetch_planning(reference, monkeypatch) -> None:
    """Prefetch planning (the skip-gate runs later layers' routers) comes after a layer's host and split
    experts are handed to the host, so it never delays their start."""
    from services.engine.offload.hybrid_provider import HybridExpertProvider

    calls: list[tuple[int, str]] = []
    for name in ("host_forward", "host_activation", "_plan"):
        original = getattr(HybridExpertProvider, name)

        def recorded(self, *args, _original=original, _name=name):
            calls.append((args[1] if _name == "_plan" else args[0], "plan" if _name == "_plan" else "host"))
            return _original(self, *args)

        monkeypatch.setattr(HybridExpertProvider, name, recorded)
    tokens, expected, _, _ = _run(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=100.0,
                                  host_ratio=4.0)
    assert tokens == expected
    layers_with_both = 0
    for i, (layer, kind) in enumerate(calls):
        if kind == "host":  # no plan of this layer visit before it
            visit = calls[:i]
            while visit and visit[-1][0] == layer:
                assert visit.pop()[1] == "host", calls[max(0, i - 6) : i + 1]
            layers_with_both += any(c == (layer, "plan") for c in calls[i + 1 : i + 4])
    assert layers_with_both > 0


@pytest.mark.usefixtures("separate_memories", "splits_despite_the_budget")
@pytest.mark.parametrize("host_ratio", [20.0, 12.0])
def test_a_split_experts_longer_half_starts_first(reference, monkeypatch, host_ratio: float) -> None:
    """Each side's clock runs from its own submit, so the longer half of a split is handed over first: at
    20x always the host's gate/up; at 12x against a 30x link the down matrix's transfer for a token or two,
    the host's gate/up for more (its share grows with the tokens, the link's does not)."""
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.transfer_engine import TransferEngine

    order: list[tuple[str, int]] = []
    submit_job, submit_transfer = HostExecutor.submit, TransferEngine.submit

    def job(self, weights, x, activation=False, share=1.0, sink=None):
        if activation:
            order.append(("host", x.shape[0]))
        return submit_job(self, weights, x, activation, share, sink)

    def transfer(self, t):
        if t.chunk_offset == 1:  # a split expert's down matrix
            order.append(("down", 0))
        return submit_transfer(self, t)

    monkeypatch.setattr(HostExecutor, "submit", job)
    monkeypatch.setattr(TransferEngine, "submit", transfer)
    tokens, expected, provider, _ = _run(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=30.0,
                                         host_ratio=host_ratio)
    assert tokens == expected
    assert provider.stats.host_split_experts > 0
    part, costs = provider.split_prices, provider.costs
    for pair in (order[i : i + 2] for i in range(0, len(order), 2)):
        (kind, _), n = pair[0], max(n for _, n in pair)
        assert {k for k, _ in pair} == {"host", "down"}
        assert kind == ("host" if part.host * costs.host(n) >= part.link * costs.link else "down")


def test_hintserve_streams_whole_fetches_beside_its_hot_set(reference) -> None:
    # A fast link and a slow host: decode misses are fetched whole. While the layer holds a slot beside the
    # hot set, they wait to pass through it instead of evicting hot experts up front; the reserve stays at
    # top-k.
    model_dir, expected, trace = reference
    engine = LLMEngine(EngineConfig(model=model_dir, offload_policy="hintserve", routing_trace=trace,
                                    expert_cache_fraction=0.5, link_ratio=2.0, host_ratio=50.0))
    provider, eviction = engine.model.experts, engine.model.experts.cache.eviction
    early_hot_victims, decode_fetches, hot_sizes = [], [], []
    begin, demand, end_step = provider.begin_layer, provider._demand, provider.end_step

    def begin_layer(layer, experts, ctx, tokens=None):
        provider.in_begin = True
        try:
            return begin(layer, experts, ctx, tokens)
        finally:
            provider.in_begin = False

    def counted_demand(expert, victim=None):
        chosen = victim or provider.cache.choose_victim(provider._ctx, provider._layer, True)
        if not provider._ctx.is_prefill:
            decode_fetches.append(expert)
            frees_soon = any(slot.key not in eviction.hot for slot in provider._pinned)
            if provider.in_begin and chosen in eviction.hot and frees_soon:
                early_hot_victims.append(chosen)
        return demand(expert, chosen)

    def recorded_end_step(ctx):
        end_step(ctx)
        hot_sizes.append(eviction.hot_size)

    provider.begin_layer, provider._demand, provider.end_step = begin_layer, counted_demand, recorded_end_step
    try:
        assert engine.generate(_prompts(), GREEDY) == expected
    finally:
        engine.close()
    assert decode_fetches and provider.stats.host_experts == 0
    assert early_hot_victims == []
    assert min(hot_sizes) >= provider.cache.num_slots - max(provider.prefetch_depth, engine.spec.top_k)


def test_hintserve_machinery_goes_quiet_while_the_cache_holds_everything_and_returns_with_misses(
    reference, monkeypatch
) -> None:
    """With every expert cached, no decode step misses: after QUIET_AFTER_STEPS of them the per-step machinery
    (prefetch planning and its gate, hot-set fill and bookkeeping) stops; misses turn it back on. (Without split
    experts, whose staging would take one of the tiny model's 24 slots.)"""
    from dataclasses import replace

    from services.engine.offload.hybrid_provider import HybridExpertProvider
    from services.engine.offload.policies import POLICIES

    monkeypatch.setitem(POLICIES, "hintserve", replace(POLICIES["hintserve"], split_experts=False))

    model_dir, expected, trace = reference
    planned: list[int] = []
    plan = HybridExpertProvider._plan
    monkeypatch.setattr(HybridExpertProvider, "_plan",
                        lambda self, p, layer, ctx: planned.append(layer) or plan(self, p, layer, ctx))
    engine = LLMEngine(EngineConfig(model=model_dir, offload_policy="hintserve", routing_trace=trace,
                                    expert_cache_fraction=1.0, link_ratio=2.0))
    try:
        assert engine.generate(_prompts(), GREEDY) == expected
        provider = engine.model.experts
        assert provider.quiet and provider.stats.quiet_steps > 0
        assert engine.stats()["offload_quiet_steps_total"] == provider.stats.quiet_steps
        planned.clear()
        quiet = provider.stats.quiet_steps
        assert engine.generate(_prompts(), GREEDY) == expected  # every expert still cached: nobody asked
        assert planned == [] and provider.stats.quiet_steps == quiet + GREEDY.max_tokens - 1  # one batch of two
        # A new prompt's prefill that misses leaves it quiet: the next decode step judges by its own misses.
        slot = next(s for s in provider.cache.slots if s.key is not None and s.key not in provider.pinned)
        layer, expert = slot.key
        provider.cache.release(slot)
        prefill = StepContext(Phase.PREFILL, ["new"], 4)
        provider.begin_layer(layer, [expert], prefill, [4])  # a miss, fetched or on the host
        provider.end_layer(layer, prefill)
        provider.end_step(prefill)
        provider.end_step(StepContext(Phase.DECODE, ["old"], 1))
        assert provider.quiet
        for slot in provider.cache.slots:  # the cache loses what it held: misses return
            if slot.key is not None and slot.key not in provider.pinned and slot.pins == 0:
                provider.cache.release(slot)
        assert engine.generate(_prompts(), GREEDY) == expected
        assert planned and provider.stats.misses and sum(provider.stats.misses) > 0
    finally:
        engine.close()


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_a_split_bf16_expert_computes_what_the_whole_one_does(rows: int) -> None:
    """A split expert's down half runs the kernels' projection of its fp32 activation, as the whole expert does
    (torch's bf16 linear rounded the activation to bf16: the grid's bf16 batch-16 hintserve row changed tokens)."""
    from services.engine import cpu_kernels
    from services.engine.cpu_threads import intra_op_threads
    from services.engine.expert_provider import ExpertWeights
    from services.engine.models.moe import expert_activation, expert_down, expert_forward

    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(256, 128, generator=g) / 12).to(torch.bfloat16)
    down = (torch.randn(128, 128, generator=g) / 12).to(torch.bfloat16)
    x = torch.randn(rows, 128, generator=g)
    with intra_op_threads(1):  # the engine core's setting, under which its CPU experts run the kernels
        if not cpu_kernels.usable(x):
            pytest.skip("no native CPU kernels here")
        whole = expert_forward(x, ExpertWeights(gate_up, down))
        assert torch.equal(expert_down(expert_activation(x, gate_up), down, torch.float32), whole)


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
