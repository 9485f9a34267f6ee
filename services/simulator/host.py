"""Host profiles: the CPU and DRAM that compute host-placed experts, priced like the device (roofline).

Decode on the host is memory-bound: an expert's bytes over the DRAM bandwidth a multi-threaded GEMV
sustains (75% of the channels' peak, what STREAM reaches on desktop and server parts). That usable share is
all the DRAM gives anyone: the link's copies from pinned memory read the same DRAM, and share it with the host's
math (offload/memory_bus.py; `dram_bytes_per_second`). Prefill is bound by
the cores' vector (or AMX) throughput. Peaks: DDR4-3200 is 25.6 GB/s per channel, DDR5-4800 38.4, DDR5-5600
44.8; fp32 FMA throughput = cores x clock x FLOPs per cycle (AVX2: 32, AVX-512: 64; AMX bf16: 1024).
"""

from __future__ import annotations

from dataclasses import dataclass

HOST_MEMORY_EFFICIENCY = 0.75
HOST_FLOP_EFFICIENCY = 0.5
# The engine's host path per MoE layer with host work: its jobs handed to the workers in one go, gathered and
# merged, at one token: what `hintserve bench offload` measures (offload/host_path.py; the saved figure is
# bench/results/offload_grid_one_dram.json's host_path: 3.6 us in the saved run on a quiet 2-vCPU Zen 4 guest,
# 1.4 us in a run on the same code an hour before it, 5.5 us on a Xeon guest, 27 us in an earlier Zen 4 guest's
# and 32 us on a shared two-core machine under other load; a test holds this to the saved figure within a
# factor of 1.5). Paid on the compute side.
HOST_PATH_S = 3.6e-6


@dataclass(frozen=True)
class HostProfile:
    name: str
    description: str
    memory_gbps: float  # DRAM peak, GB/s
    cores: int
    tflops: float  # peak of the host's fastest path for expert math, TFLOP/s
    dram_share: float = HOST_MEMORY_EFFICIENCY  # of the peak, what all the DRAM's readers together get

    @property
    def dram_bytes_per_second(self) -> float:
        return self.memory_gbps * 1e9 * self.dram_share

    def expert_seconds(self, expert_bytes: int, expert_params: int, tokens: int) -> float:
        memory = expert_bytes / (self.memory_gbps * 1e9 * HOST_MEMORY_EFFICIENCY)
        compute = 2 * tokens * expert_params / (self.tflops * 1e12 * HOST_FLOP_EFFICIENCY)
        return max(memory, compute)


HOSTS: dict[str, HostProfile] = {
    h.name: h
    for h in (
        HostProfile("ddr4-dual", "desktop, 8 cores AVX2 at 3.5 GHz, dual-channel DDR4-3200", 51.2, 8, 0.9),
        HostProfile("ddr4-quad", "workstation, 16 cores AVX2 at 3.5 GHz, quad-channel DDR4-3200", 102.4, 16, 1.8),
        HostProfile("ddr5-dual", "desktop, 16 cores AVX-512 at 3.0 GHz, dual-channel DDR5-5600", 89.6, 16, 3.1),
        HostProfile("xeon-amx", "Xeon 4th gen, 32 cores AMX bf16 at 2.0 GHz, 8-channel DDR5-4800", 307.2, 32, 65.5),
    )
}


def get_host(name: str) -> HostProfile:
    if name not in HOSTS:
        raise ValueError(f"unknown host {name!r}; choose from: {', '.join(HOSTS)}")
    return HOSTS[name]
