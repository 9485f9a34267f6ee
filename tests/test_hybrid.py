"""Hybrid expert execution end to end: each policy's engine against the resident one's tokens, placements,
static pinned sets, knobs, counters."""

from __future__ import annotations

import pytest

from services import cli
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.step_context import Phase, StepContext
from tests.hybrid_runs import GREEDY, HYBRID, prompts, run_policy


@pytest.mark.parametrize("policy", HYBRID)
@pytest.mark.parametrize("threads", [1, 2])
def test_host_computed_experts_keep_tokens(reference, policy: str, threads: int) -> None:
    # A slow link: Fiddler's rule sends misses to the host.
    tokens, expected, provider, stats = run_policy(reference, policy, expert_cache_fraction=0.25, link_ratio=100.0,
                                                   host_ratio=4.0, host_threads=threads)
    assert tokens == expected
    assert provider.stats.host_experts > 0
    assert stats["offload_host_compute_experts_total"] == provider.stats.host_experts
    assert stats["offload_host_compute_tokens_total"] >= provider.stats.host_experts
    assert stats["offload_host_compute_busy_seconds_total"] > 0


def test_cpu_experts_moves_nothing_and_holds_no_expert_on_the_device(reference) -> None:
    tokens, expected, provider, stats = run_policy(reference, "cpu-experts", host_ratio=2.0)
    assert tokens == expected
    assert provider.device_bytes == 0
    assert provider.stats.bytes_demand == provider.stats.bytes_prefetch == 0
    assert provider.stats.host_experts == provider.stats.accesses


def test_static_placements_pin_their_sets(reference) -> None:
    _, _, trace = reference
    _, _, provider, _ = run_policy(reference, "ktransformers", expert_cache_fraction=0.5)
    hot = RoutingTrace.load(trace).hot_set(provider.cache.num_slots)
    assert provider.pinned == hot and provider.stats.bytes_demand == 0
    _, _, provider, _ = run_policy(reference, "n-cpu-moe", expert_cache_fraction=0.5)
    layers = sorted({layer for layer, _ in provider.pinned})
    num_layers = provider.stats.num_layers  # every layer of the tiny Mixtral is MoE
    assert layers == list(range(num_layers - len(layers), num_layers))  # whole layers, from the last back
    assert len(provider.pinned) == len(layers) * len(provider.pinned) // len(layers)
    assert provider.stats.bytes_demand == 0


@pytest.mark.parametrize("policy", ["ktransformers", "fiddler", "hintserve"])
def test_a_budget_for_every_expert_holds_them_all_and_computes_as_resident(reference, policy: str) -> None:
    """A static hot set takes the experts its trace never saw too while the budget lasts, the cache fills
    whole when built, and nothing runs on the host or the link (test_offload_cached_batch: the resident view)."""
    tokens, expected, provider, _ = run_policy(reference, policy, expert_cache_fraction=1.0, link_ratio=30.0)
    assert tokens == expected
    experts = {(layer, e) for layer in range(provider.stats.num_layers) for e in range(len(provider._matrix_of))}
    assert {slot.key for slot in provider.cache.slots} == experts
    assert provider.resident.holding == (provider.cache.native is not None)  # the tiny widths are not native
    assert provider.stats.host_experts == 0 and provider.stats.bytes_demand == provider.stats.bytes_prefetch == 0
    assert sum(provider.stats.misses) == 0 and sum(provider.stats.hits) > 0


def test_fiddler_rule_fetches_when_the_host_is_slow(reference) -> None:
    tokens, expected, provider, _ = run_policy(reference, "fiddler", expert_cache_fraction=0.25, link_ratio=2.0,
                                               host_ratio=1000.0)
    assert tokens == expected
    assert provider.stats.host_experts == 0 and provider.stats.bytes_demand > 0


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
    expected = resident.generate(prompts(), GREEDY)
    resident.close()
    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir, expert_dtype="int8", offload_policy=policy,
                                    link_ratio=100.0, host_ratio=2.0))
    try:
        assert engine.generate(prompts(), GREEDY) == expected
        assert engine.model.experts.stats.host_experts > 0
    finally:
        engine.close()


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
        assert engine.generate(prompts(), GREEDY) == expected
    finally:
        engine.close()
    assert on_link and max(on_link) <= provider.prefetch_depth
    assert provider.stats.prefetches_issued > 0 and provider.stats.host_experts > 0


@pytest.mark.usefixtures("separate_memories")
def test_hintserve_at_a_slow_link_keeps_its_whole_budget_for_experts(reference) -> None:
    # Batch 1 (max_num_seqs 1) at ratio 100: no split would pay, so no slot goes to staging.
    tokens, expected, provider, _ = run_policy(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=100.0,
                                               max_num_seqs=1)
    assert tokens == expected
    assert provider.staging is None and provider.stats.host_split_experts == 0
    fast_tokens, _, fast, _ = run_policy(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=30.0,
                                         max_num_seqs=1)
    assert fast_tokens == expected
    assert fast.staging is not None and len(provider.cache.slots) == len(fast.cache.slots) + 1


def test_on_one_dram_hintserve_splits_nothing(reference) -> None:
    """The emulated host's GEMV takes all the DRAM the link's copies read: a split expert's halves share it and
    finish no sooner than the host alone, so no slot goes to staging (the link ratio that splits on separate
    memories, above)."""
    tokens, expected, provider, _ = run_policy(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=30.0,
                                               max_num_seqs=1)
    assert tokens == expected and provider.staging is None and provider.stats.host_split_experts == 0
    assert provider.costs.dram < float("inf") and provider.executor.bus is provider.transfers.link.bus


@pytest.mark.usefixtures("separate_memories", "splits_despite_the_budget")
@pytest.mark.parametrize("budget", [2, 3])
def test_hintserve_on_a_cache_its_layer_pins_whole_keeps_tokens(reference, budget: int) -> None:
    # Where it stages at all, the staging takes its share of the smallest budgets (top-k slots) first.
    tokens, expected, provider, _ = run_policy(reference, "hintserve", expert_cache_experts=budget, link_ratio=30.0,
                                               host_ratio=20.0)
    assert tokens == expected
    assert provider.cache.num_slots == budget - 1


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
        assert engine.generate(prompts(), GREEDY) == expected
    finally:
        engine.close()
    used = provider.stats.prefetches_used
    assert credits and 0 < sum(c for c in credits if c > 0) <= used  # only guesses the device computed
    assert sum(1 for c in credits if c < 0) <= provider.stats.evictions  # a debit needs an eviction


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
    tokens, expected, _, _ = run_policy(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=100.0,
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
        assert engine.generate(prompts(), GREEDY) == expected
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
        assert engine.generate(prompts(), GREEDY) == expected
        provider = engine.model.experts
        assert provider.quiet and provider.stats.quiet_steps > 0
        assert engine.stats()["offload_quiet_steps_total"] == provider.stats.quiet_steps
        planned.clear()
        quiet = provider.stats.quiet_steps
        assert engine.generate(prompts(), GREEDY) == expected  # every expert still cached: nobody asked
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
        assert engine.generate(prompts(), GREEDY) == expected
        assert planned and provider.stats.misses and sum(provider.stats.misses) > 0
    finally:
        engine.close()
