"""The fused MoE path for resident dense experts: one sort by expert, two grouped GEMMs, no Python loop.

The per-expert path (`moe.moe_forward` calling `expert_forward` once per active expert) stays for offload
providers and non-dense weight formats; this path runs when a layer's experts are stacked in memory
(`ExpertProvider.stacked_experts`). On CUDA it never reads a tensor back to the host, so it is also what a
CUDA graph can capture. On the CPU, when the stack also holds oneDNN-prepacked experts (fp32, see
`packed_linear`), the two GEMMs run per expert on the packed weights instead: `torch._grouped_mm` calls MKL's
GEMM per group, 1.7x slower at 32 decode rows and 3x slower on a 2048-token prefill than the packed kernels.
Batches up to NATIVE_MAX_TOKENS on one fp32 thread go to the native kernel (`cpu_kernels`): the whole layer
in one call, each active expert's weights streamed once per 8 of its rows. Per layer of the demo model on an
AVX-512 EPYC, cold: 1.7x the packed path at 16 tokens, 1.5x at 32 to 128, 1.1x at 512; at 1024 oneDNN's
blocking wins (1.04x).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TypeGuard

import torch
import torch.nn.functional as F

from services.engine import cpu_kernels
from services.engine.expert_provider import ExpertWeights, StoredWeights
from services.engine.models.moe import record_routing
from services.engine.models.packed_linear import PackedLinear, bucket_floor, padded_rows
from services.engine.models.router import Routing
from services.engine.step_context import StepContext

NATIVE_MAX_TOKENS = 512
SPLIT_PADDING = 16


@dataclass
class StackedExperts:
    """One layer's experts in the layout grouped GEMMs read: x[rows, H] @ w13[e] and act[rows, I] @ w2[e]."""

    w13: torch.Tensor  # [experts, hidden, 2 * intermediate]: gate columns then up columns
    w2: torch.Tensor  # [experts, intermediate, hidden]
    # CPU fp32: each expert's two GEMMs, also prepacked for oneDNN (a second copy of the weights); else empty.
    packed: list[tuple[PackedLinear, PackedLinear]] = field(default_factory=list)

    @classmethod
    def stack(cls, experts: list[ExpertWeights], pack: bool = False) -> StackedExperts:
        stacked = cls(
            torch.stack([w.gate_up.t() for w in experts]).contiguous(),
            torch.stack([w.down.t() for w in experts]).contiguous(),
        )
        if pack:
            stacked.packed = [(PackedLinear(w.gate_up, None, True), PackedLinear(w.down, None, True))
                              for w in (stacked.expert(e) for e in range(len(experts)))]
        return stacked

    @functools.cached_property
    def native(self) -> bool:
        """Whether the native CPU kernel takes these experts (fp32 on the CPU, widths in 16s)."""
        return (self.w13.dtype == torch.float32 and self.w13.device.type == "cpu"
                and cpu_kernels.widths_supported(self.w2.shape[2], self.w2.shape[1]))

    @property
    def packed_bytes(self) -> int:
        return sum(a.extra_bytes + b.extra_bytes for a, b in self.packed)

    def expert(self, e: int) -> ExpertWeights:
        """Expert `e` as the per-expert path wants it: views into the stack, no second copy of the weights."""
        return ExpertWeights(self.w13[e].t(), self.w2[e].t())


def stackable(experts: list[StoredWeights]) -> TypeGuard[list[ExpertWeights]]:
    """Plain dense experts of one shape and dtype (quantized or subclassed formats keep the per-expert path)."""
    first = experts[0]
    if not isinstance(first, ExpertWeights):
        return False
    return all(
        type(w) is ExpertWeights
        and w.gate_up.shape == first.gate_up.shape
        and w.down.shape == first.down.shape
        and w.gate_up.dtype == first.gate_up.dtype == w.down.dtype
        and w.gate_up.dtype.is_floating_point
        for w in experts
    )


@functools.cache
def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs here (CPU: every float dtype; CUDA: bf16 on sm90+ only; torch 2.8 on:
    an older torch, which `torch>=2.4` admits, has no such op and the experts run one matmul pair each)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    x = torch.zeros(4, 16, dtype=dtype, device=device)
    w = torch.zeros(2, 16, 16, dtype=dtype, device=device)
    try:
        torch._grouped_mm(x, w, offs=torch.tensor([1, 4], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def fused_moe_forward(
    x: torch.Tensor, layer: int, routing: Routing, stacked: StackedExperts, ctx: StepContext
) -> torch.Tensor:
    """x: [tokens, hidden] -> [tokens, hidden]; the same sum as `moe_forward`, computed in grouped GEMMs."""
    weights, experts, _ = routing
    record_routing(layer, routing, ctx)
    tokens, top_k = experts.shape
    if tokens <= NATIVE_MAX_TOKENS and stacked.native and cpu_kernels.usable(x):
        return cpu_kernels.moe_swiglu(x, experts, weights, stacked.w13, stacked.w2)
    if tokens == 1 and stacked.packed:  # a one-sequence decode step: no sort, gather or scatter for one row
        return _packed_one_token(x, weights, experts, stacked.packed)
    flat_experts = experts.flatten()
    order = torch.argsort(flat_experts, stable=True)  # assignments grouped by expert, tokens ascending
    # scatter_add_, not bincount: CUDA's bincount reads the largest id back to size its output (a host sync
    # that a CUDA graph cannot capture)
    counts = torch.zeros(stacked.w13.shape[0], dtype=torch.int64, device=x.device)
    ends = torch.cumsum(counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts)), 0, dtype=torch.int32)
    rows = x.index_select(0, order // top_k).to(stacked.w13.dtype)  # bf16 experts (fp32 activations): bf16 math
    if stacked.packed:
        y = _packed_experts(rows, ends, stacked.packed)
    else:
        gate_up = torch._grouped_mm(rows, stacked.w13, offs=ends)
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, stacked.w2, offs=ends)
    y = (y * weights.flatten().index_select(0, order)[:, None]).to(x.dtype)  # as moe_forward weighs (fp32 promotes)
    # Back to (token, k) order, then each token's k outputs summed. Gathers, not scatters or advanced indexing:
    # on CPU index_select moves [4096, 256] rows 2-8x faster than index_copy_ or x[idx] (index_add_: slower).
    return y.index_select(0, torch.argsort(order)).view(tokens, top_k, -1).sum(dim=1)


def _packed_experts(rows: torch.Tensor, ends: torch.Tensor, packed: list[tuple[PackedLinear, PackedLinear]]):
    """rows grouped by expert (group e ends at ends[e]) -> each group through its expert's SwiGLU.

    A group that padding would grow by SPLIT_PADDING rows or more runs as a bucket-sized part and the rest:
    a prefill's ~500-row groups padded ~6% on average, all of it GEMM work."""
    y = torch.empty_like(rows)
    start = 0
    for expert, end in zip(packed, ends.tolist()):
        while end > start:
            count = end - start
            part = count if padded_rows(count) - count < SPLIT_PADDING else bucket_floor(count)
            y[start : start + part] = _packed_swiglu(expert, rows[start : start + part])
            start += part
    return y


def _packed_one_token(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, packed: list[tuple[PackedLinear, PackedLinear]]
) -> torch.Tensor:
    """x: [1, hidden] through its top-k experts in rank order: the values the sorted path computes for it."""
    out = None
    for expert, weight in zip(experts[0].tolist(), weights[0].tolist()):
        y = _packed_swiglu(packed[expert], x) * weight
        out = y if out is None else out.add_(y)
    assert out is not None  # top-k >= 1: every token has an expert
    return out


def _packed_swiglu(expert: tuple[PackedLinear, PackedLinear], x: torch.Tensor) -> torch.Tensor:
    """moe.swiglu on one expert's prepacked gate/up and down GEMMs."""
    gate_up, down = expert
    gate, up = gate_up(x).chunk(2, dim=-1)
    return down(F.silu(gate) * up)
