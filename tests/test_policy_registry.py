"""Every registered name runs: each offload policy in the simulator and in `bench offload`, each eviction in
the simulator. Policies, evictions and prefetchers are resolved through one registry each (issue 29), so
adding one is one file and one registry line, and this test then runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.bench.offload_bench import run_offload_bench
from services.engine.offload.eviction import EVICTION_POLICIES
from services.engine.offload.policies import POLICIES, get_policy
from services.engine.offload.prefetch import PREFETCHERS
from services.simulator.hardware import MeasuredCost
from services.simulator.model_specs import spec_from_model_dir
from services.simulator.sweep import run_sweep
from services.simulator.workload import Workload

PROMPTS = ["The quick brown fox", "def add(a, b):"]


@pytest.fixture(scope="module")
def workload(tiny_mixtral_dir: str) -> Workload:
    """A few decode steps of the tiny model, one request at a time (per-token routing) with hidden states."""
    from services.predictor.traces import collect_traces

    trace = collect_traces(tiny_mixtral_dir, PROMPTS, max_tokens=3, batch=1, layer_inputs=True, progress=False)
    return Workload(trace, spec_from_model_dir(tiny_mixtral_dir))


def _sweep(workload: Workload, policies: list[str], eviction: str | None = None) -> tuple[list[dict], list[dict]]:
    spec = workload.spec
    cost = MeasuredCost(spec.expert_bytes / 0.004, layer_s=0.001, expert_s=0.0002, host_ratio=10.0)
    half = spec.all_experts_bytes / 2 / 1e9
    return run_sweep(workload, [get_policy(p) for p in policies], [half], cost, eviction=eviction, progress=False)


def test_every_policy_and_prefetcher_runs_in_the_simulator(workload: Workload) -> None:
    rows, skipped = _sweep(workload, list(POLICIES))
    assert not skipped
    assert {r["policy"] for r in rows} == set(POLICIES)
    assert all(r["tpot_ms"] > 0 for r in rows)
    assert {p for policy in POLICIES.values() for p in policy.prefetchers} == set(PREFETCHERS)


@pytest.mark.parametrize("eviction", list(EVICTION_POLICIES))
def test_every_eviction_runs_in_the_simulator(workload: Workload, eviction: str) -> None:
    rows, skipped = _sweep(workload, ["lru"], eviction)
    assert not skipped and len(rows) == 1 and rows[0]["tpot_ms"] > 0


def test_every_policy_runs_in_bench_offload(tiny_mixtral_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    run_offload_bench(tiny_mixtral_dir, list(POLICIES), [0.5], [2.0], [1], str(out), new_tokens=3)
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows.keys() == set(POLICIES)
    assert all(r["tokens_identical_to_resident"] for r in rows.values())
