"""Every policy at every cache budget on one workload: the rows `hintserve simulate` reports."""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, replace

from tqdm import tqdm

from services.engine.offload.hybrid_setup import is_hybrid
from services.engine.offload.policies import OffloadPolicy
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.offload.settings import GB, resolve_slots
from services.simulator.bound import Bound, simulated_bounds
from services.simulator.hardware import CostModel, HardwareProfile
from services.simulator.model_specs import MoEModelSpec
from services.simulator.policy_driver import not_simulable
from services.simulator.sim import simulate
from services.simulator.workload import Workload

DEVICE_RESERVE_GB = 1.0  # device memory kept for the KV cache and activations when sizing expert caches


def default_budgets_gb(spec: MoEModelSpec, hw: HardwareProfile) -> list[float]:
    """An eighth, a quarter, half and all of what the device has left after the non-expert weights and a
    1 GB reserve (KV cache, activations), capped at the size of all experts."""
    free = min(hw.memory_gb - spec.non_expert_bytes / 1e9 - DEVICE_RESERVE_GB, spec.all_experts_bytes / 1e9)
    if free <= 0:
        raise ValueError(
            f"{spec.name}'s non-expert weights ({spec.non_expert_bytes / 1e9:.1f} GB) leave no room for "
            f"experts on {hw.name} ({hw.memory_gb:g} GB)"
        )
    return [round(free * f, 1) for f in (0.125, 0.25, 0.5, 1.0)]


def slots_for(spec: MoEModelSpec, cache_gb: float) -> int:
    """The engine's cache sizing (at least top-k, at most every expert) for a budget in GB (1e9 bytes)."""
    return resolve_slots(spec, spec.expert_bytes, cache_bytes=int(cache_gb * GB))


def run_sweep(
    workload: Workload,
    policies: list[OffloadPolicy],
    budgets_gb: list[float],
    cost: CostModel,
    hw: HardwareProfile | None = None,
    prefetch_distance: int | None = None,
    hint_latency_s: float = 2e-3,
    warmup_steps: int = 0,
    eviction: str | None = None,
    progress: bool = True,
    hot_set_steps: int | None = None,
) -> tuple[list[dict], list[dict]]:
    """(rows, not simulable): one row per policy and budget (`resident` once, with every expert). Static hot
    sets (policies pinning "hot") are counted on the first `hot_set_steps` steps, a calibration run before
    the measured one as KTransformers profiles offline; None: on the whole trace, the measured steps too."""
    spec = workload.spec
    runnable, skipped = [], []
    notes: dict[str, str] = {}
    for policy in policies:
        reason = not_simulable(policy, workload)
        if reason and is_hybrid(policy) and "speculative" in policy.prefetchers:
            # Placement is what a hybrid policy is about: run it on its other predictors, and say so.
            policy = replace(policy, prefetchers=tuple(p for p in policy.prefetchers if p != "speculative"))
            reason = not_simulable(policy, workload)
            notes[policy.name] = "without its skip-gate (the trace has no hidden states)"
        if reason:
            skipped.append({"policy": policy.name, "reason": reason})
        else:
            runnable.append(policy)
    runs = [(p, None) if p.name == "resident" else (p, b) for p in runnable for b in budgets_gb]
    runs = list(dict.fromkeys(runs))
    path = os.path.join(tempfile.mkdtemp(prefix="hintserve-sim-"), "routing.json")
    trace = workload.routing_trace()
    trace.save(path)  # what the oracle and Belady replay, as in the engine
    hot_set_path = path
    if hot_set_steps is not None:
        hot_set_path = os.path.join(os.path.dirname(path), "calibration.json")
        RoutingTrace(trace.num_layers, trace.steps[:hot_set_steps]).save(hot_set_path)
    rows = []
    bounds: dict[float | None, tuple[Bound, Bound]] = {}  # per budget: one configuration, every policy
    for policy, budget in tqdm(runs, desc="simulate", unit="run", disable=not progress):
        slots = slots_for(spec, budget) if budget is not None else 0
        if budget not in bounds:
            bounds[budget] = simulated_bounds(workload, cost, slots if budget is not None else None, warmup_steps)
        result = simulate(
            workload, policy, cost, slots, hot_set_path if policy.pinned == "hot" else path, prefetch_distance,
            hint_latency_s, eviction, warmup_steps,
            bounds[budget],
        )
        row = asdict(result)
        row["note"] = notes.get(policy.name, "")
        if hw is not None and result.peak_memory_gb > hw.memory_gb:
            row["note"] = f"needs {result.peak_memory_gb:.1f} GB; {hw.name} has {hw.memory_gb:g} GB"
        rows.append(row)
    return rows, skipped
