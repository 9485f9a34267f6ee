"""The simulator's host timeline: exact sums for host-only placement, Fiddler's rule both ways, host
profiles, the hybrid calibration figures, and the hybrid policies on the real Mixtral trace."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.engine.offload.policies import POLICIES, get_policy
from services.simulator.calibration import uniform_trace
from services.simulator.hardware import MeasuredCost
from services.simulator.host import HOST_PATH_S, get_host
from services.simulator.host_calibration import hybrid_figures
from services.simulator.model_specs import MODEL_SPECS, MoEModelSpec, gqa_attention
from services.simulator.sim import simulate
from services.simulator.workload import Workload
from tests.test_simulator import _mixtral_trace

SMALL = MoEModelSpec("small", "4 layers, 8 experts, top-2", 64, 4, 8, 2, 128, 100, gqa_attention(64, 4, 4, 16))


def _run(tmp_path, policy: str, cost: MeasuredCost, slots: int = 8):
    workload = Workload(uniform_trace(SMALL, 20, seed=3), SMALL)
    path = str(tmp_path / "routing.json")
    workload.routing_trace().save(path)
    return simulate(workload, get_policy(policy), cost, slots, path)


def test_cpu_experts_tpot_is_the_exact_host_sum(tmp_path) -> None:
    cost = MeasuredCost(SMALL.expert_bytes / 0.004, layer_s=0.001, expert_s=0.0002, host_ratio=10.0)
    r = _run(tmp_path, "cpu-experts", cost)
    # Every expert on the host, one after the other; the device waits for both of each layer, then hands
    # over, gathers and merges them (the engine's measured host path).
    layer = 0.001 + 2 * 10 * 0.0002 + HOST_PATH_S
    assert r.tpot_ms == pytest.approx(4 * layer * 1e3)
    assert r.gb_moved_per_token == 0 and r.host_experts_per_token == pytest.approx(8)
    assert r.host_busy_share == pytest.approx(4 * 2 * 0.002 / (4 * layer))


def test_fiddler_rule_picks_the_faster_side(tmp_path) -> None:
    slow_link = MeasuredCost(SMALL.expert_bytes / 0.05, layer_s=0.001, expert_s=0.0002, host_ratio=5.0)
    r = _run(tmp_path, "fiddler", slow_link)
    assert r.host_experts_per_token > 0 and r.bytes_demand == 0
    slow_host = MeasuredCost(SMALL.expert_bytes / 0.001, layer_s=0.001, expert_s=0.0002, host_ratio=500.0)
    r = _run(tmp_path, "fiddler", slow_host)
    assert r.host_experts_per_token == 0 and r.bytes_demand > 0


def test_host_profiles() -> None:
    ddr4 = get_host("ddr4-dual")
    spec = MODEL_SPECS["mixtral-8x7b"]
    # Decode is memory-bound on the host: 352 MB at 75% of 51.2 GB/s.
    assert ddr4.expert_seconds(spec.expert_bytes, spec.expert_params, 1) == pytest.approx(9.175e-3, rel=1e-3)
    assert get_host("xeon-amx").expert_seconds(spec.expert_bytes, spec.expert_params, 1) < 2e-3
    with pytest.raises(ValueError, match="unknown host"):
        get_host("nope")


def test_new_specs_match_their_published_sizes() -> None:
    qwen3, oss = MODEL_SPECS["qwen3-30b-a3b"], MODEL_SPECS["gpt-oss-20b"]
    assert qwen3.total_params / 1e9 == pytest.approx(30.5, rel=0.01)
    assert qwen3.active_params / 1e9 == pytest.approx(3.3, rel=0.02)
    assert oss.total_params / 1e9 == pytest.approx(20.9, rel=0.01)
    # gpt-oss counts active parameters without the input embedding.
    assert (oss.active_params - oss.embedding_params) / 1e9 == pytest.approx(3.6, rel=0.02)


def test_hybrid_calibration_figures() -> None:
    llama, fiddler_dual, fiddler_quad = hybrid_figures()
    assert abs(llama.error) < 0.15
    assert fiddler_quad.simulated > fiddler_quad.published  # Fiddler's "over 3 tok/s" on a server host
    assert fiddler_dual.simulated < fiddler_quad.simulated


def test_hybrid_policies_on_the_mixtral_trace(tmp_path) -> None:
    from services.simulator.hardware import RooflineCost, get_hardware
    from services.simulator.sweep import run_sweep

    spec = MODEL_SPECS["mixtral-8x7b"]
    trace = _mixtral_trace()
    trace.requests = trace.requests[:1]
    workload = Workload(trace, spec)
    names = ("lru", "cpu-experts", "ktransformers", "hintserve")
    rows, skipped = run_sweep(workload, [get_policy(n) for n in names], [19.7],
                              RooflineCost(spec, get_hardware("a5000-pcie4")), progress=False)
    tpot = {r["policy"]: r["tpot_ms"] for r in rows}
    assert not skipped and set(tpot) == set(names)
    assert tpot["cpu-experts"] < tpot["lru"]  # computing where the weights are beats moving them
    assert tpot["ktransformers"] < tpot["cpu-experts"]
    assert tpot["hintserve"] <= tpot["cpu-experts"]
    assert "skip-gate" in next(r["note"] for r in rows if r["policy"] == "hintserve")


@pytest.mark.parametrize("expert_dtype", ["auto", "int4"])
def test_no_simulated_policy_beats_its_physical_bound(expert_dtype: str) -> None:
    """Transfer-only, host-only and hybrid policies, the trace-replaying bounds included, on the real trace:
    none decodes faster than the bound of its configuration (one DRAM, the offline-optimal cache)."""
    from services.simulator.hardware import RooflineCost, get_hardware
    from services.simulator.model_specs import engine_expert_precision
    from services.simulator.sweep import run_sweep

    spec = MODEL_SPECS["mixtral-8x7b"]
    if expert_dtype != "auto":
        spec = replace(spec, expert_precision=engine_expert_precision(
            expert_dtype, 64, spec.hidden_size, spec.moe_intermediate_size))
    trace = _mixtral_trace()
    trace.requests = trace.requests[:1]
    names = ("resident", "lru", "lru-global", "oracle", "cpu-experts", "ktransformers", "fiddler", "hintserve")
    rows, _ = run_sweep(Workload(trace, spec), [get_policy(n) for n in names if n in POLICIES], [5.0, 19.7],
                        RooflineCost(spec, get_hardware("a5000-pcie4")), progress=False)
    assert len(rows) > 8
    for r in rows:
        assert r["of_bound"] <= 1.0 + 1e-9, (r["policy"], r["cache_gb"], r["tpot_ms"], r["bound_tpot_ms"])
    assert next(r for r in rows if r["policy"] == "resident")["of_bound"] == pytest.approx(1.0)


def test_the_prefetch_gate_times_planning_on_the_simulated_clock(tmp_path) -> None:
    """Planning is not priced in the simulator: timed on the wall clock, the gate's choices (and so the figures)
    moved with this machine's load from run to run."""
    from services.simulator.policy_driver import build_offload
    from services.simulator.timeline import SimClock

    workload = Workload(uniform_trace(SMALL, 20, seed=3), SMALL)
    path = str(tmp_path / "routing.json")
    workload.routing_trace().save(path)
    cost = MeasuredCost(SMALL.expert_bytes / 0.004, layer_s=0.001, expert_s=0.0002, host_ratio=10.0)
    clock = SimClock()
    policy = replace(get_policy("hintserve"), prefetchers=())  # the gate is there whoever it asks
    offload = build_offload(policy, workload, clock, SMALL.expert_bytes / 0.004, 8, path, cost=cost)
    gate = offload.provider.gate
    assert gate is not None
    clock.now = 12.5
    assert gate.clock() == 12.5


def test_the_simulated_host_path_is_the_engines_measured_one() -> None:
    """HOST_PATH_S is the figure `hintserve bench offload` measured for the engine's host path at one token (a
    shared two-core machine: within a factor of 1.5 of it)."""
    import json
    from pathlib import Path

    saved = Path(__file__).resolve().parents[1] / "bench" / "results" / "offload_grid_one_dram.json"
    measured = json.loads(saved.read_text())["host_path"]["1"]["host_path_s"]
    assert measured / 1.5 <= HOST_PATH_S <= measured * 1.5


def _shifting_trace(calibration: int, measured: int):
    """Every layer routes to experts 0 and 1 for `calibration` tokens, then to 2 and 3."""
    import numpy as np

    from services.predictor.trace_set import RequestTrace, TraceSet, iteration_from_routing

    L, k = SMALL.num_moe_layers, SMALL.top_k
    its = [iteration_from_routing("shift", t + 1, np.tile(np.array([0, 1] if t < calibration else [2, 3]), (L, 1)),
                                  np.full((L, k), 1.0 / k, np.float32), SMALL.num_experts)
           for t in range(calibration + measured)]
    layers = [i for i, moe in enumerate(SMALL.moe_layers) if moe]
    return TraceSet([RequestTrace("shift", its, "synthetic")], L, SMALL.num_experts, k, layers, source="shift")


def test_static_hot_sets_are_counted_on_the_calibration_steps_only() -> None:
    """KTransformers profiles its hot set on a calibration run: counted on the warm-up steps, it holds the
    experts those steps used, not the measured steps' (which the whole trace would give it)."""
    from services.simulator.sweep import run_sweep

    workload = Workload(_shifting_trace(4, 12), SMALL)
    cost = MeasuredCost(SMALL.expert_bytes / 0.004, layer_s=0.001, expert_s=0.0002, host_ratio=10.0)
    budget = 2 * SMALL.num_moe_layers * SMALL.expert_bytes / 1e9  # two slots a layer: exactly one hot pair

    def hit_rate(hot_set_steps: int | None) -> float:
        rows, _ = run_sweep(workload, [get_policy("ktransformers")], [budget], cost, warmup_steps=4,
                            progress=False, hot_set_steps=hot_set_steps)
        return rows[0]["hit_rate"]

    assert hit_rate(None) == pytest.approx(1.0)  # the whole trace: the measured steps' pair, look-ahead
    assert hit_rate(4) == pytest.approx(0.0)  # the calibration steps' pair, which the measured steps never use
