"""Does the simulator agree with the real engine? Run both on the same routing and compare TPOT.

The engine runs in-process on a checkpoint (the demo model) with an emulated link, which costs real
wall-clock time. A resident reference run records the routing (with every token's MoE-block inputs, so
the skip-gate can be simulated faithfully) and measures this machine's compute: one expert's single-token
SwiGLU (the engine's own --link-ratio unit) and, from the resident TPOT, everything else per layer. The
simulator then replays the recorded trace with those prices and the link exactly as the engine had it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from services.bench.offload_bench import _run as run_engine_requests
from services.bench.prompts import prompt_ids
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.offload.link import emulation_unit
from services.engine.offload.policies import get_policy
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.sampling_params import SamplingParams
from services.engine.trace_recorder import TraceRecorder
from services.predictor.traces import TraceSet, model_fingerprint
from services.simulator.hardware import MeasuredCost
from services.simulator.model_specs import spec_from_model_dir
from services.simulator.sim import simulate
from services.simulator.workload import Workload


@dataclass
class Agreement:
    policy: str
    engine_tpot_ms: float
    sim_tpot_ms: float
    sim_hit_rate: float

    @property
    def tpot_error(self) -> float:
        return self.sim_tpot_ms / self.engine_tpot_ms - 1.0


def _engine(
    model_dir: str, batch: int, offload_policy: str = "resident", expert_cache_experts: int | None = None,
    link_gbps: float | None = None, routing_trace: str | None = None,
) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, max_num_seqs=batch, offload_policy=offload_policy,
                                  expert_cache_experts=expert_cache_experts, link_gbps=link_gbps,
                                  routing_trace=routing_trace))


# Blocking fetches, early demand overlapping resident compute, perfect prefetch, and the skip-gate
# prefetching from recorded hidden states.
POLICIES = ("ondemand", "lru", "oracle", "speculative")


def compare_with_engine(
    model_dir: str,
    policies: tuple[str, ...] = POLICIES,
    link_gbps: float = 0.1,  # one demo expert (1.57 MB in fp32) takes 15.7 ms, about 250x its compute
    cache_experts: int = 12,  # a quarter of the demo model's 48 experts
    prompts: int = 2,
    new_tokens: int = 16,
    batch: int = 1,
    prompt_len: int = 32,
) -> tuple[list[Agreement], dict]:
    """Engine and simulator TPOT per policy on the same prompts; also returns the measured prices.

    The slow link makes transfers dominate each step, so the comparison measures the offload model rather
    than this shared 2-core machine's compute noise; what the simulator leaves out, the engine's thread
    hand-offs around each blocking fetch (about 1 ms each on a loaded machine), stays a few percent."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    reference = _engine(model_dir, batch)
    try:
        ids = prompt_ids(reference.tokenizer, prompts, prompt_len)
        recorder = TraceRecorder(reference.spec.num_experts, keep_layer_inputs=True)
        steps = RoutingTrace(reference.spec.num_layers)
        reference.runner.step_observers += [recorder, steps]
        reference.runner.keep_layer_inputs = True
        _, _, resident_tpot, _ = run_engine_requests(reference, ids, params)
        espec = reference.spec
        expert_s = emulation_unit(
            espec.hidden_size, espec.moe_intermediate_size, reference.runner.model.w.embed.dtype
        )
    finally:
        reference.close()
    trace = TraceSet(
        recorder.requests([f"bench-{i}" for i in range(len(ids))]),
        len(recorder.layer_ids),
        espec.num_experts,
        espec.top_k,
        recorder.layer_ids,
        source="engine",
        model=os.path.abspath(model_dir),
        model_hash=model_fingerprint(model_dir),
    )
    spec = spec_from_model_dir(model_dir)
    workload = Workload(trace, spec, batch)
    steps_path = os.path.join(tempfile.mkdtemp(prefix="hintserve-sim-"), "routing.json")
    steps.save(steps_path)
    # Batch 1: each layer computes its top-k experts once per token.
    experts_per_token = espec.top_k * espec.num_moe_layers
    layer_s = max(0.0, resident_tpot - experts_per_token * expert_s) / espec.num_layers
    cost = MeasuredCost(link_gbps * 1e9, layer_s, expert_s)
    rows = []
    for name in policies:
        engine = _engine(
            model_dir,
            batch,
            offload_policy=name,
            expert_cache_experts=cache_experts,
            link_gbps=link_gbps,
            routing_trace=steps_path,
        )
        try:
            _, _, tpot, _ = run_engine_requests(engine, ids, params)
        finally:
            engine.close()
        result = simulate(workload, get_policy(name), cost, cache_experts, steps_path)
        rows.append(Agreement(name, tpot * 1e3, result.tpot_ms or 0.0, result.hit_rate))
    prices = {
        "resident_tpot_ms": resident_tpot * 1e3,
        "expert_ms": expert_s * 1e3,
        "layer_ms": layer_s * 1e3,
        "link_gbps": link_gbps,
        "cache_experts": cache_experts,
        "prompts": prompts,
        "new_tokens": new_tokens,
        "prompt_len": prompt_len,
    }
    return rows, prices
