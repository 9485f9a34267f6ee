"""The expert cache size and policy `hintserve doctor` recommends, and why, as flags to copy.

How it decides (the same rule the docs' decision table states):
1. No CUDA device: the engine runs on the CPU and every weight lives in host memory, so the policy is
   `resident`; offload policies there only emulate a GPU (benchmarks). The model must fit in available memory
   at the run dtype (float32 on CPU).
2. CUDA: the device holds the non-expert weights, the KV/activation reserve `hintserve simulate` sizes its
   caches with (services/simulator/sweep.py) and as many experts as the rest of its memory allows. All experts fit: `resident`. Otherwise the expert cache is that remainder and the
   policy is `hintserve`, which computes each miss wherever it finishes first: on the host (priced by the
   simulator's host model at the bandwidth measured here), over the link (measured here), or split between
   them. A cache smaller than one token's experts (top-k) cannot hold a layer's working set: then
   `cpu-experts` (every routed expert on the host) is the honest choice.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from services.doctor.model_check import ModelFacts

HOST_HEADROOM = 0.9  # of available host memory the weights may take


@dataclass(frozen=True)
class Recommendation:
    flags: str
    policy: str
    expert_cache_gb: float | None
    host_expert_ms: float | None  # one expert, one token, on the host
    link_expert_ms: float | None  # one expert over the link
    why: str
    fits: bool

    def as_dict(self) -> dict:
        return asdict(self)


def host_expert_seconds(model: ModelFacts, host_gbps: float, cores: int, avx512: bool) -> float:
    """One expert on one token on this host, priced as the simulator prices hosts (services/simulator/host.py),
    with the measured copy bandwidth as what the cores sustain."""
    from services.simulator.host import HOST_MEMORY_EFFICIENCY, HostProfile

    flops_per_cycle = 64 if avx512 else 32  # fp32 FMA lanes x 2, at an assumed 3 GHz
    host = HostProfile("this machine", "measured by hintserve doctor", host_gbps / HOST_MEMORY_EFFICIENCY,
                       cores, cores * 3e9 * flops_per_cycle / 1e12)
    params = model.expert_bytes // 2  # bf16-equivalent; only the memory term matters at one token
    return host.expert_seconds(model.expert_bytes, params, 1)


def recommend(model: ModelFacts, device_gb: float | None, host_available_gb: float, host_gbps: float,
              link_gbps: float | None, cores: int = 1, avx512: bool = False) -> Recommendation:
    host_ms = host_expert_seconds(model, host_gbps, cores, avx512) * 1e3 if host_gbps > 0 else None
    model_flag = f"--model {model.path}"
    if device_gb is None:
        fp32_gb = model.total_bytes * (2 if model.format in ("bf16", "fp16") else 1) / 1e9
        fits = fp32_gb <= HOST_HEADROOM * host_available_gb
        why = (f"no CUDA device: the engine runs on the CPU with every weight in host memory "
               f"({fp32_gb:.2f} GB at float32 against {host_available_gb:.1f} GB available"
               f"{'' if fits else ': does not fit'}); offload policies on a CPU only emulate a GPU")
        return Recommendation(f"{model_flag} --offload-policy resident", "resident", None, host_ms, None, why, fits)
    link_ms = model.expert_bytes / (link_gbps * 1e9) * 1e3 if link_gbps else None
    from services.simulator.sweep import DEVICE_RESERVE_GB

    budget_gb = device_gb - DEVICE_RESERVE_GB - model.non_expert_bytes / 1e9
    device = "--device cuda"
    if budget_gb <= 0:
        why = (f"the non-expert weights ({model.non_expert_bytes / 1e9:.1f} GB) and the reserve leave no room "
               f"for experts on a {device_gb:.1f} GB device")
        return Recommendation(f"{model_flag} {device}", "none", None, host_ms, link_ms, why, False)
    if model.all_experts_bytes / 1e9 <= budget_gb:
        why = f"all experts ({model.all_experts_bytes / 1e9:.2f} GB) fit in the {budget_gb:.1f} GB left on the device"
        return Recommendation(f"{model_flag} {device} --offload-policy resident", "resident", None, host_ms,
                              link_ms, why, True)
    slots = int(budget_gb * 1e9 // model.expert_bytes)
    cache_gb = math.floor(slots * model.expert_bytes / 1e7) / 100  # rounded down: the engine counts whole slots
    prices = (f"one expert costs {host_ms:.2f} ms on the host and {link_ms:.2f} ms over the link"
              if host_ms and link_ms else "host and link were priced where measured")
    if slots < max(1, model.top_k):
        why = (f"only {slots} expert(s) fit beside the non-expert weights, fewer than one token uses "
               f"(top-{model.top_k}): every routed expert runs on the host")
        return Recommendation(f"{model_flag} {device} --offload-policy cpu-experts", "cpu-experts", 0.0, host_ms,
                              link_ms, why, True)
    why = (f"{slots} of {model.moe_layers * model.experts_per_layer} experts fit in {cache_gb} GB; {prices}; "
           f"`hintserve` keeps a hot set there and computes each miss on whichever side finishes first")
    size = f"--expert-cache-gb {cache_gb}" if cache_gb > 0 else f"--expert-cache-experts {slots}"
    flags = f"{model_flag} {device} --link native --offload-policy hintserve {size}"
    return Recommendation(flags, "hintserve", cache_gb, host_ms, link_ms, why, True)
