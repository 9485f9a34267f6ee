"""The offload runtime end to end: every policy token-identical to resident, accounting, config errors."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.offload.policies import POLICIES
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 23, 11)]


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def reference(request, tiny_model_dirs, tmp_path_factory):
    """Resident outputs and the routing trace they produced (for oracle and belady)."""
    model_dir = tiny_model_dirs[request.param]
    engine = LLMEngine(EngineConfig(model=model_dir))
    trace = RoutingTrace(engine.spec.num_layers)
    engine.runner.step_observers.append(trace)
    expected = engine.generate(_prompts(), GREEDY)
    path = str(tmp_path_factory.mktemp("trace") / "trace.json")
    trace.save(path)
    return model_dir, expected, path


def _engine(model_dir: str, trace: str, policy: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, offload_policy=policy, routing_trace=trace, **kw))


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "resident"])
@pytest.mark.parametrize(
    "cache", [{"expert_cache_experts": 2}, {"expert_cache_fraction": 0.25}, {"expert_cache_fraction": 0.5}],
    ids=["top-k-slots", "25%", "50%"],
)
def test_every_policy_is_token_identical_to_resident(reference, policy: str, cache: dict) -> None:
    model_dir, expected, trace = reference
    engine = _engine(model_dir, trace, policy, link_gbps=1.0, **cache)
    try:
        assert engine.generate(_prompts(), GREEDY) == expected
        stats = engine.model.experts.stats
        assert stats.accesses > 0
        pinned_for_good = getattr(engine.model.experts, "pinned", set())  # static placements
        assert all(s.pins == 0 for s in engine.model.experts.cache.slots if s.key not in pinned_for_good), (
            "slots left pinned"
        )
        assert engine.block_manager.num_used == 0
    finally:
        engine.close()


@pytest.mark.parametrize("link", [{"link_gbps": 0.5}, {"link_ratio": 50.0}], ids=["gbps", "ratio"])
def test_link_settings_keep_tokens(reference, link: dict) -> None:
    model_dir, expected, trace = reference
    engine = _engine(model_dir, trace, "speculative", expert_cache_fraction=0.25, **link)
    try:
        assert engine.generate(_prompts(), GREEDY) == expected
        assert engine.model.experts.stats.blocking_seconds > 0
    finally:
        engine.close()


def test_counters_are_exported_with_labels(reference) -> None:
    model_dir, _, trace = reference
    engine = _engine(model_dir, trace, "speculative", expert_cache_fraction=0.5, link_ratio=2.0)
    try:
        engine.generate(_prompts(), GREEDY)
        stats = engine.stats()
        s = engine.model.experts.stats
        assert stats['offload_expert_queries_total{layer="0"}'] > 0 or not engine.spec.moe_layers[0]
        moved = stats['offload_bytes_moved_total{kind="demand"}'] + stats['offload_bytes_moved_total{kind="prefetch"}']
        # Whole matrices (a down matrix is a third of an expert): a prefetch for the next step may still be
        # between its two chunks when generate() returns.
        assert moved > 0 and moved % (s.expert_bytes // 3) == 0
        assert 0 < stats["offload_prefetch_precision"] <= 1 and 0 < stats["offload_prefetch_recall"] <= 1
        assert s.prefetches_used <= s.prefetches_issued
        assert stats["device_bytes"] > 0
    finally:
        engine.close()


def test_ondemand_keeps_nothing_and_blocks(reference) -> None:
    model_dir, _, trace = reference
    engine = _engine(model_dir, trace, "ondemand", expert_cache_fraction=0.5, link_ratio=5.0)
    try:
        engine.generate(_prompts(), GREEDY)
        s = engine.model.experts.stats
        assert s.hit_rate() == 0.0 and s.blocking_seconds > 0
        assert s.bytes_demand == s.accesses * s.expert_bytes
    finally:
        engine.close()


def test_duoserve_prefill_streams_through_top_k_slots(reference) -> None:
    model_dir, _, trace = reference
    engine = _engine(model_dir, trace, "duoserve", expert_cache_fraction=0.5, link_ratio=2.0)
    try:
        long_prompt = [(7 * i) % (VOCAB - 3) + 3 for i in range(64)]  # routes to every expert
        engine.generate([long_prompt], SamplingParams(temperature=0.0, max_tokens=1))
        assert engine.model.experts.stats.peak_slots_in_use == engine.spec.top_k
    finally:
        engine.close()


def test_config_errors_fail_at_start(reference) -> None:
    model_dir, _, _ = reference
    with pytest.raises(ValueError, match="smaller than one layer's top-k"):
        LLMEngine(EngineConfig(model=model_dir, offload_policy="lru", expert_cache_experts=1))
    with pytest.raises(ValueError, match="unknown offload policy"):
        LLMEngine(EngineConfig(model=model_dir, offload_policy="nope"))
    with pytest.raises(ValueError, match="routing-trace"):
        LLMEngine(EngineConfig(model=model_dir, offload_policy="oracle"))
    with pytest.raises(ValueError, match="native needs a CUDA"):
        EngineConfig(model=model_dir, link="native").validate()


def test_abort_mid_decode_releases_pins(reference) -> None:
    model_dir, _, trace = reference
    engine = _engine(model_dir, trace, "speculative", expert_cache_fraction=0.25, link_ratio=2.0)
    try:
        engine.add_request("a", _prompts()[1], GREEDY)
        for _ in range(3):
            engine.step()
        engine.abort_request("a")
        assert not engine.has_unfinished() and engine.block_manager.num_used == 0
        assert all(s.pins == 0 for s in engine.model.experts.cache.slots)
    finally:
        engine.close()


def test_policy_prefetch_distance_and_skip_gate_confidence(reference) -> None:
    from services.engine.offload.prefetch.speculative import SpeculativePrefetcher

    model_dir, _, trace = reference
    engine = _engine(model_dir, trace, "promoe")
    overridden = _engine(model_dir, trace, "promoe", prefetch_distance=3)
    try:
        gate = next(p for p in engine.model.experts.prefetchers if isinstance(p, SpeculativePrefetcher))
        assert (gate.distance, gate.min_confidence) == (2, 0.0)  # the policy's own defaults
        assert next(p for p in overridden.model.experts.prefetchers).distance == 3
        contexts = []
        engine.runner.step_observers.append(contexts.append)
        engine.runner.keep_layer_inputs = True  # the planning below reads layer 0's input
        engine.generate(_prompts()[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        ctx, layer = contexts[-1], 0
        assert gate.plan(layer, ctx), "an unfiltered skip-gate always guesses"
        gate.min_confidence = 1.01  # no guess is ever that sure: nothing is fetched
        assert gate.plan(layer, ctx) == []
    finally:
        engine.close()
        overridden.close()
