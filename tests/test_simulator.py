"""The simulator: spec arithmetic against published figures, the copy-engine timeline, the step loop's
exact arithmetic on small specs, policies on the real Mixtral trace, and the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from services.cli import main
from services.common.iteration_context import IterationContext, RequestTrace
from services.engine.offload.memory_bus import MemoryBus
from services.engine.offload.policies import POLICIES, get_policy
from services.engine.offload.stats import OffloadStats
from services.engine.offload.transfer_engine import Transfer
from services.predictor.traces import TraceSet, load_traces, save_traces
from services.simulator.calibration import (
    MISMATCHES,
    promoe_ds1_run,
    promoe_figures,
    spec_figures,
    uniform_trace,
)
from services.simulator.hardware import MeasuredCost, RooflineCost, get_hardware
from services.simulator.model_specs import MODEL_SPECS, MoEModelSpec, gqa_attention
from services.simulator.policy_driver import not_simulable
from services.simulator.sim import simulate
from services.simulator.sweep import run_sweep
from services.simulator.timeline import SimClock, SimEvent, SimLink, SimTransferEngine
from services.simulator.workload import Workload
from tests.conftest import SHARED_DIR

MIXTRAL_TRACE = SHARED_DIR / "data" / "routing" / "mixtral-speculative-moe" / "humaneval_2_routing.jsonl"
SMALL = MoEModelSpec(
    "small", "4 layers, 8 experts, top-2", 64, 4, 8, 2, 128, 100, gqa_attention(64, 4, 4, 16)
)


def _mixtral_trace():
    if not MIXTRAL_TRACE.is_file():
        pytest.skip("../shared/data/routing (real Mixtral trace) not present")
    return load_traces(str(MIXTRAL_TRACE))


def _trace_file(tmp_path, workload: Workload) -> str:
    path = str(tmp_path / "routing.json")
    workload.routing_trace().save(path)
    return path


# ---- calibration against the papers ----
def test_spec_arithmetic_matches_published_figures() -> None:
    for f in spec_figures():
        assert abs(f.error) < 0.10, (
            f"{f.source}: {f.what} published {f.published} {f.unit}, ours {f.simulated:.3f}"
        )


def test_known_mismatches_are_real() -> None:
    """The two figures we do not reproduce are off for the reasons MISMATCHES gives, not by our arithmetic."""
    mix4, mix = MODEL_SPECS["mixtral-8x7b-4bit"], MODEL_SPECS["mixtral-8x7b"]
    assert len(MISMATCHES) == 2
    # 2.15 GB fits neither reading of "4-bit": AWQ attention (1.22 GB) nor fp16 non-expert weights (3.21 GB).
    assert mix4.non_expert_bytes / 1e9 < 2.15 * 0.9 and mix.non_expert_bytes / 1e9 > 2.15 * 1.1
    assert mix.expert_params == 3 * 4096 * 14336 and abs(340e6 / 2 / 0.17e9 - 1) < 0.01


def test_promoe_ds1_traffic_fetch_time_and_tpot() -> None:
    result = promoe_ds1_run()
    assert 0.45 < result.hit_rate < 0.55  # LRU over half the experts, i.i.d. routing: hits ~ the cache rate
    for f in promoe_figures(result):
        assert abs(f.error) < 0.10, f"{f.what}: published {f.published} {f.unit}, simulated {f.simulated:.2f}"
    assert 0.8 < result.blocking_ms_per_token / result.tpot_ms < 0.9  # ProMoE: fetching is 85.6% of TPOT


# ---- the copy engine ----
def _transfer(engine: SimTransferEngine, key, demand: bool, priority: float = 1.0) -> Transfer:
    chunks = [(torch.zeros(1), torch.zeros(1))] * 2
    return Transfer(key, chunks, engine.link.new_event(), demand, priority, (0, 0))


def test_copy_engine_orders_demand_first_and_between_chunks() -> None:
    clock = SimClock()
    engine = SimTransferEngine(SimLink(1000.0), OffloadStats(1), clock, (2000, 1000), MemoryBus(math.inf))  # 2 s, 1 s
    prefetch = _transfer(engine, (0, 1), demand=False)
    engine.submit(prefetch)
    clock.now = 0.5  # the prefetch's first chunk is on the link
    assert not engine.cancel(prefetch)  # started: too late to cancel
    demand = _transfer(engine, (0, 2), demand=True)
    engine.submit(demand)
    engine.wait_for(demand.event)  # waits for one chunk (2 s), then its own 3 s
    assert clock.now == pytest.approx(5.0) and clock.blocked == pytest.approx(4.5)
    engine.wait_for(prefetch.event)
    assert prefetch.event.done_at == pytest.approx(6.0)
    assert engine.stats.bytes_demand == 3000 and engine.stats.bytes_prefetch == 3000


def test_copy_engine_cancels_and_promotes_queued_transfers() -> None:
    clock = SimClock()
    engine = SimTransferEngine(SimLink(1000.0), OffloadStats(1), clock, (1000, 1000), MemoryBus(math.inf))
    first, stale, late = (
        _transfer(engine, (0, e), demand=False, priority=p) for e, p in ((1, 3.0), (2, 2.0), (3, 1.0))
    )
    for t in (first, stale, late):
        engine.submit(t)
    assert engine.cancel(stale)
    engine.promote(late)
    assert not late.event.is_ready()
    engine.wait_for(late.event)
    assert clock.now == pytest.approx(3.0)  # first's running chunk (1 s), then the promoted one overtakes
    engine.wait_for(first.event)
    assert clock.now == pytest.approx(4.0)
    assert isinstance(stale.event, SimEvent) and stale.event.done_at is None  # cancelled: never moved


# ---- the step loop's arithmetic ----
def test_resident_and_ondemand_tpot_are_exact_sums(tmp_path) -> None:
    trace = uniform_trace(SMALL, 20)
    workload = Workload(trace, SMALL)
    cost = MeasuredCost(link_bytes_per_second=SMALL.expert_bytes / 0.004, layer_s=0.001, expert_s=0.0002)
    path = _trace_file(tmp_path, workload)
    resident = simulate(workload, get_policy("resident"), cost, 0, path)
    ondemand = simulate(workload, get_policy("ondemand"), cost, 8, path)
    per_layer = 0.001 + 2 * 0.0002
    assert resident.tpot_ms == pytest.approx(4 * per_layer * 1e3)
    # ondemand: every expert fetched when asked for, compute blocked for the whole transfer
    assert ondemand.tpot_ms == pytest.approx(4 * (per_layer + 2 * 0.004) * 1e3)
    assert ondemand.hit_rate == 0.0 and ondemand.gb_moved_per_token == pytest.approx(
        8 * SMALL.expert_bytes / 1e9
    )
    assert ondemand.peak_memory_gb < resident.peak_memory_gb


def test_prefetching_overlaps_transfers_with_compute(tmp_path) -> None:
    workload = Workload(uniform_trace(SMALL, 30, seed=1), SMALL)
    path = _trace_file(tmp_path, workload)
    cost = MeasuredCost(SMALL.expert_bytes / 0.002, layer_s=0.003, expert_s=0.0005)
    lru = simulate(workload, get_policy("lru"), cost, 8, path)
    oracle = simulate(workload, get_policy("oracle"), cost, 8, path)
    belady = simulate(workload, get_policy("belady"), cost, 8, path)
    assert oracle.hit_rate > 0.99 and oracle.tpot_ms < lru.tpot_ms  # all but the cold first layer
    assert belady.hit_rate >= lru.hit_rate
    assert oracle.link_busy_share > lru.link_busy_share


def test_prefill_steps_batches_and_ttft(tmp_path) -> None:
    rng = np.random.default_rng(0)

    def iteration(rid: str, it: int, tokens: int) -> IterationContext:
        counts = np.zeros((4, 8), np.float32)
        for layer in range(4):
            for _ in range(tokens):
                counts[layer, rng.choice(8, 2, replace=False)] += 1
        return IterationContext(
            rid, it, counts / counts.sum(1, keepdims=True), counts, np.zeros(0, np.float32), num_tokens=tokens
        )

    requests = [
        RequestTrace(f"r{i}", [iteration(f"r{i}", 0, 5)] + [iteration(f"r{i}", t, 1) for t in range(1, 6)])
        for i in range(3)
    ]
    workload = Workload(TraceSet(requests, 4, 8, 2, [0, 1, 2, 3]), SMALL, batch=2)
    phases = [(s.phase.value, len(s.iterations)) for s in workload.steps]
    assert phases[:2] == [("prefill", 2), ("decode", 2)] and ("prefill", 1) in phases
    ctx = workload.context(workload.steps[0])
    workload.route(workload.steps[0], 2, ctx)
    assert ctx.selected_experts[2].shape == (10, 2) and ctx.router_probs[2].shape == (10, 8)
    cost = RooflineCost(SMALL, get_hardware("a5000-pcie4"))
    result = simulate(workload, get_policy("lru"), cost, 12, _trace_file(tmp_path, workload))
    assert result.ttft_ms and result.prefill_hit_rate is not None and result.decode_tokens == 15
    assert not_simulable(get_policy("duoserve"), workload)  # prefill counts only: no per-token pairing


# ---- the real Mixtral trace ----
def test_mixtral_on_a5000_policies(tmp_path) -> None:
    trace = _mixtral_trace()
    trace = trace.subset(trace.requests[:1])  # HumanEval/0, 83 tokens: keeps the test fast
    spec = MODEL_SPECS["mixtral-8x7b"]
    workload = Workload(trace, spec)
    names = ["resident", "ondemand", "lru", "lru-global", "oracle", "speculative", "finemoe"]
    rows, skipped = run_sweep(
        workload,
        [POLICIES[n] for n in names],
        [20.0],
        RooflineCost(spec, get_hardware("a5000-pcie4")),
        progress=False,
    )
    by = {r["policy"]: r for r in rows}
    assert {s["policy"] for s in skipped} == {"speculative"} and "hidden state" in skipped[0]["reason"]
    assert by["ondemand"]["gb_moved_per_token"] == pytest.approx(64 * spec.expert_bytes / 1e9)
    link_s = 64 * spec.expert_bytes / 25e9  # link-bound: 22.5 GB per token at 25 GB/s
    assert by["ondemand"]["tpot_ms"] == pytest.approx(by["resident"]["tpot_ms"] + link_s * 1e3, rel=0.01)
    assert by["oracle"]["hit_rate"] > 0.99 and by["oracle"]["tpot_ms"] < by["lru"]["tpot_ms"]
    # 56 slots hold less than one token's 64 experts: cyclic layer order makes one global LRU evict each expert
    # just before its layer comes round again; Mixtral-Offloading's per-layer slots (1-2 a layer) keep some, and
    # FineMoE's predictor hints (learned online) hit more.
    assert by["lru-global"]["hit_rate"] == 0.0 and by["lru"]["hit_rate"] > 0.1 and by["finemoe"]["hit_rate"] > 0.2
    assert by["lru"]["tpot_ms"] < by["lru-global"]["tpot_ms"]
    assert math.isclose(by["lru"]["cache_gb"], 56 * spec.expert_bytes / 1e9)


# ---- the command line ----
def test_cli_writes_rows_table_plot_and_rejects_bad_input(tmp_path, capsys) -> None:
    trace_dir = str(tmp_path / "trace")
    save_traces(uniform_trace(SMALL, 12), trace_dir)
    out = tmp_path / "sim.json"
    base = ["simulate", "--model-spec", "mixtral-8x7b", "--trace", trace_dir]
    assert main(base) == 2  # 4 traced layers for a 32-layer model: one-line error
    assert "error: trace covers layers [0, 1, 2, 3]" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "none")]) == 2
    assert main(["simulate", "--model-spec", "gpt-5", "--trace", trace_dir]) == 2
    assert main(["simulate", "--trace", trace_dir, "--cache-gb", "-1"]) == 2
    assert main(["simulate", "--engine-check", str(tmp_path)]) == 2  # no checkpoint there
    assert main(["simulate", "--trace", trace_dir, "--eviction", "fifo"]) == 2
    assert main(["simulate", "--model-spec", "qwen1.5-moe-a2.7b", "--trace", str(MIXTRAL_TRACE)]) == 2
    capsys.readouterr()
    # A model directory spec is allowed too; here the small spec is registered for the duration of the test.
    MODEL_SPECS["small"] = SMALL
    try:
        # Static hot sets counted on warm-up steps need some.
        assert main(["simulate", "--model-spec", "small", "--trace", trace_dir, "--hot-set-from", "warmup"]) == 2
        assert "give --warmup-steps N" in capsys.readouterr().err
        assert (
            main(
                [
                    "simulate",
                    "--model-spec",
                    "small",
                    "--trace",
                    trace_dir,
                    "--policies",
                    "resident,lru,oracle",
                    "--cache-gb",
                    "0.0005,0.001",
                    "--json",
                    str(out),
                    "--plot",
                    str(tmp_path / "sim.png"),
                    "--quiet",
                ]
            )
            == 0
        )
    finally:
        del MODEL_SPECS["small"]
    printed = capsys.readouterr().out
    assert "| policy | cache GB | TPOT ms |" in printed
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["hot_set_from"] == "trace" and "counted on the whole trace" in result["setting"]
    assert {r["policy"] for r in rows} == {"resident", "lru", "oracle"} and len(rows) == 5
    for key in (
        "policy",
        "cache_gb",
        "tpot_ms",
        "ttft_ms",
        "hit_rate",
        "gb_moved_per_token",
        "bytes_moved",
        "blocking_ms_per_token",
        "peak_memory_gb",
    ):
        assert key in rows[0]
    assert (tmp_path / "sim.png").stat().st_size > 1000 and (tmp_path / "sim.md").is_file()
    assert main(["simulate", "--calibration"]) == 0 and "ProMoE section 3" in capsys.readouterr().out
