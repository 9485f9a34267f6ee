"""Hardware profiles and the compute cost model: how long each piece of a step takes on one GPU.

A kernel's time is the larger of its memory traffic over achievable memory bandwidth and its FLOPs over
achievable tensor throughput, plus a fixed launch cost; decode is memory-bound, prefill compute-bound.
Peak figures are the vendors' dense fp16 tensor rates (fp32 accumulate, what PyTorch uses) and memory
bandwidths; the link figure is what pinned host-to-device copies achieve, not the PCIe line rate
(PCIe 4.0 x16: 32 GB/s raw, about 25 GB/s measured; PCIe 5.0 x16: about 50 GB/s).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from services.engine.offload.memory_bus import emulated_dram
from services.simulator.host import HostProfile, get_host
from services.simulator.model_specs import MoEModelSpec

MEMORY_EFFICIENCY = 0.8  # share of peak DRAM bandwidth a GEMV-bound kernel sustains
FLOP_EFFICIENCY = 0.6  # share of peak tensor throughput a prefill GEMM sustains
KERNEL_LAUNCH_S = 5e-6
KERNELS_PER_LAYER = 8  # norms, QKV, rotary, attention, output projection, router, top-k, residual adds
KERNELS_PER_EXPERT = 3  # gate/up GEMM, activation, down GEMM


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    link_gbps: float  # host-to-device copy bandwidth, GB/s
    memory_gbps: float  # device memory bandwidth, GB/s
    tflops: float  # dense fp16 tensor throughput, TFLOP/s
    memory_gb: float  # device memory

    def with_link(self, gbps: float) -> HardwareProfile:
        return replace(self, name=f"{self.name}@{gbps:g}GB/s", link_gbps=gbps)


HARDWARE: dict[str, HardwareProfile] = {
    h.name: h
    for h in (
        HardwareProfile("2080-pcie3", "NVIDIA RTX 2080 8 GB, PCIe 3.0 x16", 12.0, 448.0, 40.3, 8.0),
        HardwareProfile("a5000-pcie4", "NVIDIA RTX A5000 24 GB, PCIe 4.0 x16", 25.0, 768.0, 111.1, 24.0),
        HardwareProfile("3090-pcie4", "NVIDIA RTX 3090 24 GB, PCIe 4.0 x16", 25.0, 936.0, 71.0, 24.0),
        HardwareProfile("4090-pcie4", "NVIDIA RTX 4090 24 GB, PCIe 4.0 x16", 25.0, 1008.0, 165.2, 24.0),
        HardwareProfile("a100-pcie4", "NVIDIA A100 80 GB PCIe, PCIe 4.0 x16", 25.0, 1935.0, 312.0, 80.0),
        HardwareProfile(
            "h100-pcie4", "NVIDIA H100 80 GB PCIe in a PCIe 4.0 x16 host", 25.0, 2039.0, 756.0, 80.0
        ),
        HardwareProfile("h100-pcie5", "NVIDIA H100 80 GB PCIe, PCIe 5.0 x16", 50.0, 2039.0, 756.0, 80.0),
    )
}


def get_hardware(name: str) -> HardwareProfile:
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; choose from: {', '.join(HARDWARE)}")
    return HARDWARE[name]


@dataclass(frozen=True)
class StepShape:
    """What a step computes: its tokens, the KV positions it reads, the (query, key) pairs it attends."""

    tokens: int
    requests: int
    kv_tokens: int  # cached positions read, summed over requests
    attended: int  # query-key pairs: decode sum(context); a prefill of n tokens n(n+1)/2


class CostModel(Protocol):
    """Seconds of compute for each piece of a step (the compute timeline's prices)."""

    @property
    def link_bytes_per_second(self) -> float: ...

    @property
    def device_memory_bytes_per_second(self) -> float:
        """What the device's kernels and landing copies share (inf: not shared)."""
        ...

    def layer_seconds(self, layer: int, step: StepShape) -> float:
        """Everything of `layer` but its routed experts: attention, router, shared expert or dense MLP."""
        ...

    def expert_seconds(self, tokens: int) -> float:
        """One routed expert applied to `tokens` tokens."""
        ...

    def head_seconds(self, step: StepShape) -> float:
        """Final norm and LM head on the last position of each request."""
        ...

    def host_expert_seconds(self, tokens: int) -> float:
        """One routed expert applied to `tokens` tokens on the host, where its weights live."""
        ...

    def dram_bytes_per_second(self, expert_bytes: int) -> float:
        """What the host's DRAM gives its expert math and the link's copies together (experts of `expert_bytes`)."""
        ...


def _kernel_seconds(bytes_read: float, flops: float, hw: HardwareProfile, kernels: int) -> float:
    memory = bytes_read / (hw.memory_gbps * 1e9 * MEMORY_EFFICIENCY)
    compute = flops / (hw.tflops * 1e12 * FLOP_EFFICIENCY)
    return max(memory, compute) + kernels * KERNEL_LAUNCH_S


@dataclass(frozen=True)
class RooflineCost:
    """Prices from the model's bytes and FLOPs on a hardware profile."""

    spec: MoEModelSpec
    hw: HardwareProfile
    host: HostProfile = field(default_factory=lambda: get_host("ddr4-dual"))

    @property
    def link_bytes_per_second(self) -> float:
        return self.hw.link_gbps * 1e9

    def dram_bytes_per_second(self, expert_bytes: int) -> float:
        return self.host.dram_bytes_per_second

    @property
    def device_memory_bytes_per_second(self) -> float:
        return self.hw.memory_gbps * 1e9 * MEMORY_EFFICIENCY

    def layer_seconds(self, layer: int, step: StepShape) -> float:
        s = self.spec
        bytes_read = s.layer_non_expert_bytes(layer) + step.kv_tokens * s.kv_bytes_per_token
        flops = 2 * step.tokens * (s.layer_linear_params(layer) + s.layer_fp16_params(layer))
        flops += 4 * step.attended * s.hidden_size  # QK^T and PV over every head (query width ~ hidden)
        return _kernel_seconds(bytes_read, flops, self.hw, KERNELS_PER_LAYER)

    def expert_seconds(self, tokens: int) -> float:
        return _kernel_seconds(
            self.spec.expert_bytes, 2 * tokens * self.spec.expert_params, self.hw, KERNELS_PER_EXPERT
        )

    def host_expert_seconds(self, tokens: int) -> float:
        return self.host.expert_seconds(self.spec.expert_bytes, self.spec.expert_params, tokens)

    def head_seconds(self, step: StepShape) -> float:
        return _kernel_seconds(
            self.spec.head_bytes, 2 * step.requests * self.spec.embedding_params, self.hw, 2
        )


@dataclass(frozen=True)
class MeasuredCost:
    """Prices measured on a real machine (the engine-agreement test): a fixed cost per layer, per expert
    and token, and per step; the link exactly as the engine's emulated link was configured."""

    link_bytes_per_second: float
    layer_s: float
    expert_s: float  # one expert on one token
    expert_token_s: float = 0.0  # each further token of the same expert
    head_s: float = 0.0
    host_ratio: float = 15.6  # the engine's emulated host (DEFAULT_HOST_RATIO), over expert_seconds
    # The device is the engine's real CPU compute, not a shared model: its kernels are not slowed.
    device_memory_bytes_per_second: float = float("inf")

    def dram_bytes_per_second(self, expert_bytes: int) -> float:
        # as the emulated engine sizes it
        return emulated_dram(expert_bytes, self.host_expert_seconds(1), self.link_bytes_per_second)

    def host_expert_seconds(self, tokens: int) -> float:
        return self.host_ratio * self.expert_seconds(tokens)

    def layer_seconds(self, layer: int, step: StepShape) -> float:
        return self.layer_s

    def expert_seconds(self, tokens: int) -> float:
        return self.expert_s + self.expert_token_s * max(0, tokens - 1)

    def head_seconds(self, step: StepShape) -> float:
        return self.head_s
